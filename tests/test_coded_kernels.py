"""The codec's attention kernels (``coded_key_logits``, ``coded_value_sums``) compute what the
decoded keys and values give, on real codes: RoPE in either pairing and partial, per-row
positions, per-head frames, token norms, blocks of unequal length. And they refuse what they
cannot read with an exception naming the argument."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kakeyaturbo as kt
from kakeyaturbo.codec import coded_key_logits, coded_value_sums
from kakeyaturbo.hf.rope import RotarySpec

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
