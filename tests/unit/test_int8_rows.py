"""int8 rows (the hot window's values): error within half a step of each row's largest entry,
D + 2 bytes a row, rows that are not finite decode as NaN, wrong input refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kakeyaturbo import _core
from kakeyaturbo.hf import int8_rows


def rows(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 40, 64, generator=g)
    # Rows of very different magnitudes, and one channel far larger than the rest (keys'
    # outlier channels): the per-row step must follow each row.
    x *= torch.logspace(-3, 3, 40)[:, None]
    x[..., 7] *= 20
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_within_half_a_step(dtype):
    x = rows().to(dtype)
    held = int8_rows.encode(x)
    assert held.dtype == torch.int8 and held.shape == (*x.shape[:-1], x.shape[-1] + 2)
    got = int8_rows.decode(held)
    assert got.dtype == torch.float32 and got.shape == x.shape
    ref = x.float()
    step = ref.abs().amax(-1, keepdim=True) / 127
    err = (got - ref).abs()
    # Half a step, and the bfloat16 scale (8 bits) may clip the largest entry by as much.
    assert bool((err <= 0.51 * step).all())
    assert float(err.max() / step.max()) > 0.3  # really 8 bits, not exact
    assert torch.equal(int8_rows.round_trip(x), got.to(dtype))


def test_rows_are_independent_and_slice_like_tensors():
    x = rows(1)
    held = int8_rows.encode(x)
    # Slicing, concatenating and selecting rows of the held form decode to the same values.
    parts = torch.cat([held[:, :, :10], held[:, :, 10:]], dim=2)
    assert torch.equal(parts, held)
    assert torch.equal(int8_rows.decode(held[1:, :, 5:9]), int8_rows.decode(held)[1:, :, 5:9])
    assert torch.equal(int8_rows.encode(x[:, :, 3:4]), held[:, :, 3:4])


@pytest.mark.parametrize("encode", [int8_rows.encode, int8_rows.encode_torch])
def test_rows_written_into_slots_of_a_store(encode):
    """A hot window's slots take the rows in place: the same bytes, nothing else written."""
    x = rows(3).permute(2, 0, 1, 3)  # token-major, as the window holds them
    store = torch.full((50, 2, 3, 66), 7, dtype=torch.int8)
    got = encode(x[:30], out=store[10:40])
    assert got.data_ptr() == store[10].data_ptr()
    assert torch.equal(store[10:40], int8_rows.encode(x[:30]))
    assert bool((store[:10] == 7).all()) and bool((store[40:] == 7).all())
    for bad in (
        store[10:41],
        torch.empty(30, 2, 3, 70, dtype=torch.int8)[..., :66],
        store[10:40].float(),
    ):
        with pytest.raises(ValueError, match="int8 rows of"):
            encode(x[:30], out=bad)


def test_no_rows():
    """An empty hot window (a cache's first update) is a tensor of no rows."""
    held = int8_rows.encode(torch.ones(1, 3, 8, 64)[:, :, :0])
    assert held.shape == (1, 3, 0, 66) and held.dtype == torch.int8
    assert int8_rows.decode(held).shape == (1, 3, 0, 64)
    got = int8_rows.decode(torch.cat([held, int8_rows.encode(torch.ones(1, 3, 2, 64))], dim=2))
    torch.testing.assert_close(got, torch.ones(1, 3, 2, 64), rtol=0, atol=0.5 / 127)


def test_zero_and_non_finite_rows():
    x = rows(2)
    x[0, 0, 0] = 0.0
    x[0, 0, 1, 5] = float("inf")
    x[0, 0, 2, 9] = float("nan")
    x[0, 0, 3, 1] = -float("inf")
    got = int8_rows.decode(int8_rows.encode_torch(x))
    assert torch.equal(got[0, 0, 0], torch.zeros(64))
    assert bool(got[0, 0, 1:4].isnan().all())  # visible, as an exact copy would be
    assert bool(got[0, 0, 4:].isfinite().all()) and bool(got[1:].isfinite().all())
    # The codec's encoder (the CPU path) refuses the first row that is not finite by place.
    with pytest.raises(ValueError, match=r"^x: row 1 holds inf at column 5"):
        int8_rows.encode(x)


def test_bad_input_is_refused():
    with pytest.raises(TypeError, match="floating"):
        int8_rows.encode(torch.ones(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="int8"):
        int8_rows.decode(torch.ones(2, 66))
    with pytest.raises(ValueError, match="int8"):
        int8_rows.decode(torch.ones(2, 2, dtype=torch.int8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_codec_encodes_the_bits_of_torch(dtype):
    """On the CPU the codec encodes (one call per decode step); other devices keep the torch
    ops. Both must hold the same bytes, ties to even and clamping included, so a window
    encoded on one decodes alike everywhere."""
    x = rows(3)
    x[0, 0, 0, :4] = torch.tensor([127.0, 2.5, 3.5, -0.5])  # scale 1: ties
    x[0, 0, 0, 4:] = 0.0
    x[0, 0, 1] = 0.0
    x[0, 0, 2] = 1e-41  # a scale that rounds to 0 in bfloat16: codes 0
    x[0, 0, 3, 5], x[0, 0, 4, 9] = float("inf"), float("nan")
    x = x.to(dtype)
    # The codec refuses rows that are not finite (a ValueError naming the row); the torch
    # ops keep them as NaN. Every finite row holds the same bytes either way.
    with pytest.raises(ValueError, match=r"^x: row 3 holds inf at column 5"):
        int8_rows.encode(x)
    x[0, 0, 3:5] = 1.0
    got, want = int8_rows.encode(x), int8_rows.encode_torch(x)
    assert torch.equal(got, want)
    assert got[0, 0, 0, :4].tolist() == [127, 2, 4, 0]
    # A strided view encodes as its values.
    view = x.transpose(1, 2)
    assert torch.equal(int8_rows.encode(view), want.transpose(1, 2))


def test_the_codec_encoder_refuses_bad_input_by_name():
    with pytest.raises(TypeError, match="x: expected a C-contiguous float32"):
        _core.int8_rows_encode(np.ones((2, 4), dtype=np.float64))
    with pytest.raises(TypeError, match="x: expected a C-contiguous float32"):
        _core.int8_rows_encode(np.ones((2, 8), dtype=np.float32)[:, ::2])
    with pytest.raises(TypeError, match="the last not empty"):
        _core.int8_rows_encode(np.ones((2, 0), dtype=np.float32))


# The Triton encoder (fused_int8_rows.py, a GPU's) in Triton's interpreter (set before Triton
# is imported: a fresh process): encode_torch's bytes for rows of every magnitude, exact
# halves, a zero row, subnormal rows, infinities, NaN (its scale any NaN), narrow and odd
# widths, three dtypes; and the check refuses rows that differ by one code.
FUSED = """
import torch
from kakeyaturbo.gpu import fused_int8_rows as fused
from kakeyaturbo.hf.int8_rows import encode_torch

g = torch.Generator().manual_seed(0)
x = torch.randn(2, 3, 37, 64, generator=g) * torch.logspace(-3, 3, 37)[:, None]
x[0, 0, 0] = 0.0
x[0, 0, 1, 5] = float("nan")
x[0, 0, 2, 7] = float("inf")
x[0, 0, 3] = 1e-40
x[0, 0, 4] = torch.arange(64) - 31.5
x[0, 0, 5] = (torch.arange(64) - 32) * (127 / 32)
x[0, 0, 6, :3] = float("-inf")
checked = 0
for rows in (x, x.bfloat16(), x.half(), x[..., :48], x[..., :5], x[:, :, :0]):
    got, want = fused.encode(rows), encode_torch(rows)
    assert fused.same_rows(got, want), rows.dtype
    finite = want[..., -2:].contiguous().view(torch.bfloat16).isfinite().squeeze(-1)
    assert torch.equal(got[finite], want[finite])
    checked += 1
# Into a window's slots (a contiguous piece of a bigger store), the rest left as it was.
store = torch.full((40, 2, 3, 66), 9, dtype=torch.int8)
rows = x.permute(2, 0, 1, 3)[:30]
assert fused.encode(rows, out=store[5:35]).data_ptr() == store[5].data_ptr()
assert fused.same_rows(store[5:35], encode_torch(rows))
assert bool((store[:5] == 9).all()) and bool((store[35:] == 9).all())
checked += 1
off = encode_torch(x)
off[1, 2, 3, 4] += 1
assert not fused.same_rows(fused.encode(x), off)
print("row sets checked", checked)
"""


def test_the_triton_encoder_gives_the_torch_bytes_in_the_interpreter():
    from triton_interpreter import run_interpreted  # tests/support (pythonpath)

    from kakeyaturbo.gpu import fused_int8_rows

    if fused_int8_rows.triton is None:
        pytest.skip("Triton is not installed")
    assert "row sets checked 7" in run_interpreted(FUSED)


def test_off_a_gpu_the_codec_encodes_and_a_disagreeing_kernel_is_dropped(monkeypatch):
    from kakeyaturbo.gpu import fused_int8_rows

    x = rows()
    assert not fused_int8_rows.usable(x, int8_rows.encode_torch)  # the CPU: the codec
    kernel = fused_int8_rows.KERNEL

    def agrees(encode) -> bool:
        monkeypatch.setattr(fused_int8_rows, "encode", encode)

        def check() -> bool:
            return fused_int8_rows.same_rows(fused_int8_rows.encode(x), int8_rows.encode_torch(x))

        return kernel.agrees(x.device, check)

    with pytest.warns(RuntimeWarning, match="int8 row encoder disagrees"):
        assert not agrees(lambda r: int8_rows.encode_torch(r * 1.5))
    assert agrees(int8_rows.encode_torch)
