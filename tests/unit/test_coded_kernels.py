"""The codec's attention kernels (``coded_key_logits``, ``coded_value_sums``, and
``coded_attend``, the whole attention of a decode step) compute what the decoded keys and values
give, on real codes: RoPE in either pairing and partial, per-row positions, per-head frames,
token norms as floats or as their one-byte codes, blocks of unequal length, masks, softcap. And
they refuse what they cannot read with an exception naming the argument."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import kakeyaturbo as kt
from kakeyaturbo.codec import (
    bf16_products,
    coded_attend,
    coded_key_logits,
    coded_value_sums,
    decode_norm_codes,
    int16_products,
)
from kakeyaturbo.hf import int8_rows
from kakeyaturbo.hf.rope import RotarySpec
from kakeyaturbo.norm_codes import decode_norms, encode_norms

ROWS, HEADS, D, G = 2, 3, 64, 3
LENS = (64, 64, 20)  # the last block shorter
PARAMS = kt.CodecParams(
    allocation="waterfill", k=0, bits_per_value=3, block_size=64, pca_method="none"
)


def coded_stream_major(seed: int):
    """Blocks of ROWS * HEADS random streams, stream-major, and their decoded values
    [streams, tokens, D]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS * HEADS, sum(LENS), D, generator=g) * torch.linspace(3, 0.2, D)
    per_block, t0 = [], 0
    for n in LENS:
        per_block.append(kt.encode_batch(x[:, t0 : t0 + n].contiguous(), PARAMS))
        t0 += n
    encs = [per_block[b][s] for s in range(ROWS * HEADS) for b in range(len(LENS))]
    y = torch.cat([torch.as_tensor(kt.decode_batch(blk)) for blk in per_block], dim=1)
    return encs, y


@pytest.mark.parametrize(
    "rot_dim,adjacent", [(64, False), (64, True), (32, False)], ids=["half", "adjacent", "partial"]
)
def test_key_logits_equal_rope_of_decoded_keys(rot_dim, adjacent):
    encs, y = coded_stream_major(0)
    t = y.shape[1]
    g = torch.Generator().manual_seed(1)
    rope = RotarySpec(
        inv_freq=10000.0 ** (-torch.arange(0, rot_dim, 2).float() / rot_dim),
        rot_dim=rot_dim,
        adjacent_pairs=adjacent,
    )
    frames = torch.randn(HEADS, D, D, generator=g) / 8
    q = torch.randn(ROWS, HEADS, G, D, generator=g)
    pos = torch.arange(t)[None] + torch.tensor([[0], [1000]])  # each row its own positions
    keys = y.view(ROWS, HEADS, t, D) @ frames
    want = q @ rope.rotate(keys, pos).transpose(-1, -2)

    order = rope.split_order(D)
    fr, qq = (frames, q) if order is None else (frames[..., order], q[..., order])
    rot = rope.split_rotation(pos, torch.device("cpu"))
    got = coded_key_logits(
        encs,
        ROWS * HEADS,
        qq.reshape(-1, G, D).contiguous().numpy(),
        fr.contiguous().numpy(),
        rot.numpy(),
    )
    torch.testing.assert_close(torch.from_numpy(got).view_as(want), want, rtol=1e-4, atol=1e-4)
    assert (want - q @ keys.transpose(-1, -2)).abs().max() > 1  # RoPE mattered


@pytest.mark.parametrize(
    ("precision", "native", "bound"),
    [("int16", int16_products, 2**-9), ("bfloat16", bf16_products, 2**-7)],
)
def test_narrow_precisions_stay_close_to_the_float32_frame_product(precision, native, bound):
    """``precision="int16"`` / ``"bfloat16"``: the logits and the whole attention within the
    narrow products' rounding of the float32 ones (int16: 11-13 bits of each input, bfloat16:
    8); computed so only where the CPU can (``int16_products`` / ``bf16_products``), float32
    bit for bit elsewhere."""
    encs, _ = coded_stream_major(5)
    s = ROWS * HEADS
    g = torch.Generator().manual_seed(6)
    frames = (torch.randn(HEADS, D, D, generator=g) / 8).numpy()
    q = torch.randn(s, G, D, generator=g).numpy()
    exact = np.zeros((s, 0, D), np.float32)

    def both(fn, *args, **kw):
        return [fn(*args, **kw, precision=p) for p in ("float32", precision)]

    for full, narrow in (
        both(coded_key_logits, encs, s, q, frames),
        both(coded_attend, encs, encs, s, q, exact, exact, 0.125, key_frames=frames),
    ):
        if not native(D):
            np.testing.assert_array_equal(narrow, full)
            continue
        worst = np.abs(narrow - full).max()
        assert 0 < worst <= bound * np.abs(full).max()


def test_unknown_precisions_are_refused_by_name():
    encs, _ = coded_stream_major(5)
    s = ROWS * HEADS
    q = np.zeros((s, G, D), np.float32)
    exact = np.zeros((s, 0, D), np.float32)
    with pytest.raises(ValueError, match="precision must be 'float32', 'int16' or 'bfloat16'"):
        coded_key_logits(encs, s, q, precision="float16")
    with pytest.raises(ValueError, match="precision"):
        coded_attend(encs, encs, s, q, exact, exact, 0.125, precision="fp8")


def test_key_and_value_norm_scales():
    encs, y = coded_stream_major(2)
    t = y.shape[1]
    g = torch.Generator().manual_seed(3)
    norms = torch.rand(ROWS * HEADS, t, generator=g) + 0.5
    scale = norms / y.norm(dim=-1)
    q = torch.randn(ROWS * HEADS, G, D, generator=g)
    got = coded_key_logits(encs, ROWS * HEADS, q.numpy(), norms=norms.numpy())
    want = (q @ y.transpose(-1, -2)) * scale[:, None]
    torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-4, atol=1e-4)

    w = torch.rand(ROWS * HEADS, G, t, generator=g)
    w[:, :, 5] = 0  # a masked token
    for n in (None, norms):
        got = coded_value_sums(encs, ROWS * HEADS, w.numpy(), None if n is None else n.numpy())
        want = w @ (y if n is None else y * scale[..., None])
        torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-4, atol=1e-4)


def test_norm_codes_scale_as_their_decoded_norms():
    encs, y = coded_stream_major(9)
    s, t = ROWS * HEADS, y.shape[1]
    codes, norms = norm_code_arrays(torch.rand(s, t) * 3 + 0.2)
    q = torch.randn(s, G, D)
    w = torch.rand(s, G, t)
    for fn, arg in ((coded_key_logits, q), (coded_value_sums, w)):
        want = fn(encs, s, arg.numpy(), norms=norms.numpy())
        got = fn(encs, s, arg.numpy(), norms=codes)  # exp2 in Rust and torch: an ulp apart
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_refused_by_name():
    encs, y = coded_stream_major(4)
    s, t = ROWS * HEADS, y.shape[1]
    q = np.zeros((s, G, D), np.float32)
    with pytest.raises(TypeError, match="queries: expected a C-contiguous float32 array of 3"):
        coded_key_logits(encs, s, q.astype(np.float64))
    with pytest.raises(TypeError, match="queries"):
        coded_key_logits(encs, s, np.zeros((s, D, G), np.float32).transpose(0, 2, 1))
    with pytest.raises(TypeError, match="frames"):
        coded_key_logits(encs, s, q, np.zeros((HEADS, D), np.float32))
    with pytest.raises(ValueError, match="queries"):
        coded_key_logits(encs, s, np.zeros((s, G, D - 1), np.float32))
    with pytest.raises(ValueError, match="queries"):  # zero-sized, dims overflowing a product
        coded_key_logits(encs, s, np.zeros((s, 2**57, 0), np.float32))
    with pytest.raises(ValueError, match="streams"):
        coded_key_logits(encs, 4, q)
    with pytest.raises(ValueError, match="equal blocks"):
        coded_key_logits([encs[1], encs[2], encs[0]] + encs[3:], s, q)
    with pytest.raises(ValueError, match="rotation"):
        coded_key_logits(encs, s, q, rotation=np.zeros((1, t, 2, D // 2 + 1), np.float32))
    with pytest.raises(ValueError, match="norms"):
        coded_key_logits(encs, s, q, norms=np.ones((s, t - 1), np.float32))
    with pytest.raises(ValueError, match="weights"):
        coded_value_sums(encs, s, np.zeros((s, G, t + 1), np.float32))
    with pytest.raises(TypeError, match="encs"):
        coded_value_sums([y], 1, np.zeros((1, G, t), np.float32))


def norm_code_arrays(norms: torch.Tensor):
    """``norms`` [streams, tokens] coded per block as KakeyaCache holds them, the lists
    ``coded_attend`` takes, and what they decode to (``decode_norms``)."""
    parts, t0 = [], 0
    for n in LENS:
        parts.append(encode_norms(norms[None, :, t0 : t0 + n]))
        t0 += n
    codes = ([p.arrays()[0] for p in parts], [p.arrays()[1] for p in parts])
    return codes, decode_norms(parts)[0]


def test_norm_codes_decode_as_torch_decodes_them_and_hostile_ones_are_refused():
    """The codec's decoder of one-byte token norms (blocks coded across heads read their
    per-head norms through it) gives torch's decode_norms, zeros included, over blocks of
    unequal length; lengths that do not split into the streams (ValueError) and bounds that
    are not positive finite float16 (FormatError) are refused."""
    g = torch.Generator().manual_seed(5)
    s = 6
    norms = torch.rand(s, sum(LENS), generator=g) * 5 + 0.05
    norms[2, 3] = 0.0  # an exact zero keeps code 0
    (codes, bounds), want = norm_code_arrays(norms)
    got = torch.from_numpy(decode_norm_codes((codes, bounds), s))
    assert got.shape == (s, sum(LENS)) and got[2, 3] == 0
    torch.testing.assert_close(got, want, rtol=2e-7, atol=0)  # exp2 in Rust and torch
    with pytest.raises(ValueError, match="split into 7 streams"):
        decode_norm_codes((codes, bounds), 7)
    bad = [b.copy() for b in bounds]
    bad[1][0, 0] = np.float16("inf")
    with pytest.raises(kt.FormatError, match="positive finite"):
        decode_norm_codes((codes, bad), s)
    with pytest.raises(ValueError, match="bounds"):
        decode_norm_codes((codes, [b[:-1] for b in bounds]), s)
    with pytest.raises(TypeError, match="norms"):
        decode_norm_codes(np.ones((s, 4), np.float32), s)


@pytest.mark.parametrize("softcap", [None, 20.0])
def test_whole_attention_equals_the_softmax_over_decoded_tokens(softcap):
    kencs, yk = coded_stream_major(5)
    vencs, yv = coded_stream_major(6)
    s, t, e = ROWS * HEADS, yk.shape[1], 7
    g = torch.Generator().manual_seed(7)
    rope = RotarySpec(
        inv_freq=10000.0 ** (-torch.arange(0, D, 2).float() / D), rot_dim=D, adjacent_pairs=False
    )
    kf, vf = torch.randn(HEADS, D, D, generator=g) / 8, torch.randn(HEADS, D, D, generator=g) / 8
    q = torch.randn(ROWS, HEADS, G, D, generator=g)
    pos = torch.arange(t)[None] + torch.tensor([[0], [300]])
    (kcodes, kn), (vcodes, vn) = (
        norm_code_arrays(torch.rand(s, t, generator=g) * 4 + 0.1) for _ in range(2)
    )
    ek, ev = (torch.randn(ROWS, HEADS, e, D, generator=g) for _ in range(2))
    # Per batch row: a few coded and exact tokens masked, and row 1's last query row whole.
    bias = torch.randn(ROWS, 1, G, t + e, generator=g).clamp(max=0)
    bias[torch.rand(bias.shape, generator=g) < 0.2] = float("-inf")
    bias[1, 0, G - 1] = float("-inf")

    # The reference, from the decoded keys and values in float64.
    keys = (yk * (kn / yk.norm(dim=-1))[..., None]).view(ROWS, HEADS, t, D).double() @ kf.double()
    keys = rope.rotate(keys, pos)
    values = (yv * (vn / yv.norm(dim=-1))[..., None]).view(ROWS, HEADS, t, D).double() @ vf.double()
    scores = q.double() @ torch.cat((keys, ek.double()), dim=2).transpose(-1, -2) * 0.125
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores + bias.double(), dim=-1).nan_to_num(0.0)
    want = probs @ torch.cat((values, ev.double()), dim=2)

    got = coded_attend(
        kencs,
        vencs,
        s,
        q.reshape(s, G, D).numpy(),
        ek.reshape(s, e, D).numpy(),
        ev.reshape(s, e, D).numpy(),
        0.125,
        key_frames=kf.numpy(),
        rotation=rope.split_rotation(pos, torch.device("cpu")).numpy(),
        key_norms=kcodes,
        value_frames=vf.numpy(),
        value_norms=vcodes,
        bias=bias.reshape(ROWS, G, t + e).numpy(),
        softcap=softcap,
    )
    got = torch.from_numpy(got).view(ROWS, HEADS, G, D)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    assert (got[1, :, G - 1] == 0).all()


def test_exact_runs_read_as_held_equal_one_float32_array():
    """A cache hands its exact tokens over as runs: sinks and a bfloat16 hot window as held
    (raw bits), then the new tokens in float32. The kernel must read them as the one float32
    array of the same values: bit for bit, since widening bfloat16 is exact."""
    kencs, _ = coded_stream_major(5)
    vencs, _ = coded_stream_major(6)
    s, g = ROWS * HEADS, torch.Generator().manual_seed(11)
    q = torch.randn(s, G, D, generator=g).numpy()
    runs = {}
    for name in ("k", "v"):
        hot = torch.randn(s, 9, D, generator=g).bfloat16()
        new = torch.randn(s, 1, D, generator=g)
        bits = hot.view(torch.int16).numpy().view(np.uint16)
        held = [np.ascontiguousarray(bits[:, :4]), np.ascontiguousarray(bits[:, 4:])]
        runs[name] = ([*held, new.numpy()], torch.cat((hot.float(), new), 1))
    for k in (runs["k"][0], tuple(runs["k"][0])):  # a list or a tuple of runs
        got = coded_attend(kencs, vencs, s, q, k, runs["v"][0], 0.125)
        want = coded_attend(kencs, vencs, s, q, runs["k"][1].numpy(), runs["v"][1].numpy(), 0.125)
        assert np.array_equal(got, want)
    # Values held as int8 rows (a cache's hot window) are read as held: the bits of the same
    # rows decoded to float32 by torch.
    held = int8_rows.encode(runs["v"][1][:, :9])
    decoded = torch.cat((int8_rows.decode(held), runs["v"][1][:, 9:]), 1).numpy()
    v8 = [held[:, :4].contiguous().numpy(), held[:, 4:].contiguous().numpy(), runs["v"][0][2]]
    got = coded_attend(kencs, vencs, s, q, runs["k"][0], v8, 0.125)
    want = coded_attend(kencs, vencs, s, q, runs["k"][1].numpy(), decoded, 0.125)
    assert np.array_equal(got, want)
    with pytest.raises(ValueError, match=r"exact_values.*head_dim \+ 2"):
        coded_attend(kencs, vencs, s, q, runs["k"][0], [v8[0][..., 1:].copy(), *v8[1:]], 0.125)
    # The runs' counts must match, and each run be float32 or bfloat16 bits, C-contiguous.
    with pytest.raises(ValueError, match="exact_values: 2 runs for the 3 runs"):
        coded_attend(kencs, vencs, s, q, runs["k"][0], runs["v"][0][1:], 0.125)
    ints, v = [runs["k"][1].numpy().astype(np.int16)], [runs["v"][1].numpy()]
    with pytest.raises(TypeError, match="exact_keys"):
        coded_attend(kencs, vencs, s, q, ints, v, 0.125)
    strided = [runs["k"][1].numpy()[:, ::2]]  # every other token: not C-contiguous
    with pytest.raises(TypeError, match="exact_keys"):
        coded_attend(kencs, vencs, s, q, strided, [v[0][:, ::2].copy()], 0.125)


def test_whole_attention_refuses_bad_inputs_by_name():
    encs, y = coded_stream_major(8)
    s, t = ROWS * HEADS, y.shape[1]
    q, ex = np.zeros((s, G, D), np.float32), np.zeros((s, 4, D), np.float32)
    (codes, bounds), _ = norm_code_arrays(torch.rand(s, t) + 0.5)

    def call(**kw):
        args = dict(exact_keys=ex, exact_values=ex, scaling=1.0)
        args.update(kw)
        return coded_attend(encs, encs, s, q, **args)

    call()
    with pytest.raises(TypeError, match="exact_keys"):
        call(exact_keys=ex.astype(np.float64))
    with pytest.raises(ValueError, match="exact_values"):
        call(exact_values=np.zeros((s, 3, D), np.float32))
    with pytest.raises(ValueError, match="bias"):
        call(bias=np.zeros((4, G, t + 4), np.float32))
    with pytest.raises(TypeError, match="value_norms"):
        call(value_norms=([c.astype(np.int16) for c in codes], bounds))
    with pytest.raises(ValueError, match="norm codes: 2 blocks"):
        call(key_norms=(codes[:2], bounds[:2]))
    hostile = [b.copy() for b in bounds]
    hostile[1][2, 0] = np.nan  # the decoder treats every byte as hostile
    with pytest.raises(kt.FormatError, match="not a positive finite"):
        call(value_norms=(codes, hostile))
    with pytest.raises(ValueError, match="value_encs: .*equal blocks"):
        coded_attend(encs, encs[:-1] + encs[:1], s, q, ex, ex, 1.0)
    # Streams across heads: each row's own-head query is needed, and the heads must split
    # the stream's coordinates and its query rows.
    with pytest.raises(TypeError, match="exact_queries"):
        call(heads=2)
    with pytest.raises(ValueError, match="heads"):
        call(heads=0)
    half = np.zeros((s, G, D // 2), np.float32)
    with pytest.raises(ValueError, match=f"{G} query rows per stream do not split over 2"):
        call(heads=2, exact_queries=half)


def test_heads_scales_as_codes_are_the_scales_decoded():
    """Streams coded across heads: a cache hands each head's token-norm codes over as it holds
    them (``key_scales`` / ``value_scales`` as ``(codes, bounds)``), and the codec decodes them
    in the call: the bits of attention with the scales decoded first. Codes of too few tokens
    and hostile bounds are refused by name."""
    encs, y = coded_stream_major(8)
    s, t, heads = ROWS * HEADS, y.shape[1], 2
    g = torch.Generator().manual_seed(21)
    rows, d = 2 * heads, D // heads
    q = torch.randn(s, rows, D, generator=g).numpy()
    own = torch.randn(s, rows, d, generator=g).numpy()
    ex = torch.randn(s * heads, 3, d, generator=g).numpy()
    frames = (torch.randn(heads, D, d, generator=g) / 8).numpy()
    codes, _ = norm_code_arrays(torch.rand(s * heads, t, generator=g) + 0.5)
    scales = decode_norm_codes(codes, s * heads).reshape(s, heads, t)

    def call(ks, vs):
        return coded_attend(
            encs,
            encs,
            s,
            q,
            ex,
            ex,
            0.125,
            value_frames=frames,
            heads=heads,
            exact_queries=own,
            key_scales=ks,
            value_scales=vs,
        )

    want = call(scales, scales)
    np.testing.assert_array_equal(call(codes, codes), want)
    np.testing.assert_array_equal(call(codes, scales), want)
    assert not np.array_equal(call(None, codes), want)
    with pytest.raises(ValueError, match="key_scales"):
        call((codes[0][:2], codes[1][:2]), None)  # two of the three blocks
    hostile = [b.copy() for b in codes[1]]
    hostile[0][1, 1] = np.inf
    with pytest.raises(kt.FormatError, match="value_scales"):
        call(None, (codes[0], hostile))


@pytest.mark.parametrize("torch_threads", [1, 2])
def test_callers_on_several_threads_get_what_one_caller_gets(torch_threads):
    """Every calling thread runs the kernels on a rayon pool of its own, the caller one of its
    workers, or with torch on several threads on its own OpenMP team
    (``rust/kakeyaturbo-py/src/workers.rs``): callers at once, and threads that end and drop
    their pool, must neither hang nor change a bit of the results."""
    kencs, _ = coded_stream_major(11)
    vencs, _ = coded_stream_major(12)
    s, g = ROWS * HEADS, torch.Generator().manual_seed(13)
    q = torch.randn(s, G, D, generator=g).numpy()
    ex = torch.randn(s, 5, D, generator=g).numpy()

    def work(_=None):
        return (
            coded_attend(kencs, vencs, s, q, ex, ex, 0.125),
            coded_key_logits(kencs, s, q),
            kt.decode_batch(kencs[:: len(LENS)]),  # every stream's first block
        )

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = work()
        torch.set_num_threads(torch_threads)
        assert kt._core._workers()[0] == ("team" if torch_threads > 1 else "rayon")
        for _ in range(2):  # the second executor's threads are new: the first ones' pools are gone
            with ThreadPoolExecutor(max_workers=4) as pool:
                for got in pool.map(work, range(12)):
                    for a, b in zip(got, want):
                        np.testing.assert_array_equal(a, b)
        for a, b in zip(work(), want):
            np.testing.assert_array_equal(a, b)
    finally:
        torch.set_num_threads(before)
