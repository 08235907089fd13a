"""LMCache's KV chunk ``[2, layers, tokens, kv_heads * head_dim]`` (keys post-RoPE, as vLLM
stores them) to a :mod:`.container` object of a size fixed by its shape, and back.

Keys: the chunk does not say where it sits in its sequence, so the encoder finds the start
position ``p`` (a multiple of the chunk size) at which unrotating the keys best fits the
calibration bundle's pre-RoPE frames, unrotates there and stores ``p``; the decoder rotates
back with the same ``p``. A wrong guess costs compression, never correctness. Values and keys
then go through :class:`~kakeyaturbo.pipeline.Pipeline` with the bundle's recipe. Sinks (the
first tokens of a sequence, ``p == 0``) are stored exact where they fit the object's fixed size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .._core import KakeyaTurboError
from ..codec import EncodedLayer
from ..coded_block import CodedBlock
from ..norm_codes import NormCodes
from ..pipeline import Pipeline
from ..unit_tokens import holds_norms
from . import container as ct
from .fallback import decode_fallback, encode_fallback, fallback_bits, fallback_bytes

_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: Chunks shorter than this are stored as they are: too short for the codec to pay.
MIN_CODED_TOKENS = 16


@dataclass(frozen=True)
class Geometry:
    num_layers: int
    kv_heads: int
    head_dim: int

    @property
    def hidden(self) -> int:
        return self.kv_heads * self.head_dim


class ChunkCodec:
    """Codes LMCache chunks of one model. ``budget_bits``: bits per value the size bound
    allows (above the recipe's rate, for the codec's side information and outliers)."""

    def __init__(
        self,
        pipeline: Pipeline,
        geometry: Geometry,
        chunk_size: int,
        max_positions: int,
        budget_bits: float,
    ) -> None:
        self.pipeline = pipeline
        self.geometry = geometry
        self.chunk_size = chunk_size
        self.max_positions = max_positions
        self.budget_bits = budget_bits

    # ---- sizes ------------------------------------------------------------------------------

    def check_shape(self, shape: tuple, dtype: torch.dtype) -> tuple[int, int, int, int]:
        g = self.geometry
        if len(shape) != 4 or shape[0] != 2 or shape[1] != g.num_layers or shape[3] != g.hidden:
            raise ValueError(
                f"kakeya serde: chunk shape {tuple(shape)} is not LMCache's [2, num_layers="
                f"{g.num_layers}, tokens, kv_heads*head_dim={g.hidden}] for this configuration"
            )
        if str(dtype).removeprefix("torch.") not in _TORCH:
            raise ValueError(f"kakeya serde: KV dtype {dtype} (takes bfloat16, float16, float32)")
        return tuple(int(s) for s in shape)  # type: ignore[return-value]

    def size_bound(self, shape: tuple, dtype: torch.dtype) -> int:
        """The exact size of every object of this shape (they are padded to it)."""
        s = self.check_shape(shape, dtype)
        values = math.prod(s)
        raw = values * torch.empty(0, dtype=dtype).element_size()
        if s[2] < MIN_CODED_TOKENS:
            return ct.OVERHEAD + raw
        coded = math.ceil(values * self.budget_bits / 8)
        return ct.OVERHEAD + min(
            raw, max(coded, fallback_bytes(values, values // self.geometry.head_dim, 1))
        )

    # ---- encode -----------------------------------------------------------------------------

    def encode(self, kv: torch.Tensor) -> bytes:
        shape = self.check_shape(tuple(kv.shape), kv.dtype)
        dtype = str(kv.dtype).removeprefix("torch.")
        bound = self.size_bound(shape, kv.dtype)
        budget = bound - ct.OVERHEAD
        g = self.geometry
        head = dict(dtype=dtype, shape=shape, kv_heads=g.kv_heads, head_dim=g.head_dim)
        x = kv.detach().cpu()
        xf = x.float()
        # Refused in every mode: the decoder takes only finite KV, so a raw chunk stored with
        # them would be a miss on every load.
        if not bool(torch.isfinite(xf).all()):
            raise ValueError("kakeya serde: the KV chunk holds NaN or infinite values")
        if shape[2] < MIN_CODED_TOKENS or budget >= x.numel() * x.element_size():
            payload = x.contiguous().view(torch.uint8).numpy().tobytes()
            return self._packed(ct.MODE_RAW, head, 0, 0, payload, bound)
        start = self.find_start(xf)
        sinks = min(self.pipeline.recipe.sink_tokens if start == 0 else 0, shape[2])
        # The first chunk's exact sinks go where they fit, then the codes alone, then the
        # fixed-size fallback.
        for s in dict.fromkeys((sinks, 0)):
            try:
                payload = self._coded(x, xf, start, s)
            except ValueError:  # beyond the codec's range (|x| > 60000, a norm past float16)
                break
            if len(payload) <= budget:
                return self._packed(ct.MODE_CODED, head, start, s, payload, bound)
        values, rows = xf.numel(), xf.numel() // g.head_dim
        bits = fallback_bits(values, rows, budget)
        payload = encode_fallback(xf, g.head_dim, bits)
        return self._packed(ct.MODE_FALLBACK, head, bits, 0, payload, bound)

    def _packed(self, mode, head, start, sinks, payload, bound) -> bytes:
        h = ct.Header(mode=mode, start=start, sinks=sinks, payload_len=len(payload), **head)
        out = ct.pack(h, payload)
        return out + bytes(bound - len(out))  # padded: the store's loads read the whole bound

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[L, T, H*D]`` -> ``[L, H, T, D]``."""
        g = self.geometry
        n, t, _ = x.shape
        return x.reshape(n, t, g.kv_heads, g.head_dim).permute(0, 2, 1, 3)

    def find_start(self, xf: torch.Tensor) -> int:
        """The chunk-size multiple at which the unrotated keys' variances in the bundle's
        frames are most compact (least sum of log variances; a rotation keeps their product
        of eigenvalues, so the right one decorrelates them best). Scored on a few layers."""
        t = xf.shape[2]
        cands = list(range(0, max(self.max_positions - t, 0) + 1, self.chunk_size)) or [0]
        if len(cands) == 1:
            return 0
        layers = sorted({0, self.geometry.num_layers // 2, self.geometry.num_layers - 1})
        k = self._heads(xf[0])
        best, best_score = 0, math.inf
        for p in cands:
            pos = torch.arange(p, p + t)[None]
            score = 0.0
            for layer in layers:
                u = self.pipeline._rope_for(layer).unrotate(k[layer][None], pos)
                y = self.pipeline._into_frame(u, layer, "k")
                score += float(torch.log(y.var(dim=2) + 1e-12).sum())
            if score < best_score:
                best, best_score = p, score
        return best

    def _coded(self, x: torch.Tensor, xf: torch.Tensor, start: int, sinks: int) -> bytes:
        t = xf.shape[2]
        pos = torch.arange(start, start + t)[None]
        mask = None
        if sinks:
            mask = torch.zeros(1, t, dtype=torch.bool)
            mask[:, :sinks] = True
        w = ct.Writer()
        pipe = self.pipeline.fresh()  # a chunk's bytes depend on its content alone
        for s, stream in enumerate("kv"):
            heads = self._heads(xf[s])
            for layer in range(self.geometry.num_layers):
                where = dict(positions=pos) if stream == "k" else {}
                blocks = pipe.encode(heads[layer][None], layer, stream, sinks=mask, **where)
                _write_blocks(w, blocks)
        if sinks:
            w.blob(x[:, :, :sinks].contiguous().view(torch.uint8).numpy().tobytes())
        return w.getvalue()

    # ---- decode -----------------------------------------------------------------------------

    def decode(self, data: memoryview, out: torch.Tensor) -> None:
        """Fills ``out`` (LMCache's chunk buffer) from ``data``; raises
        :class:`~.container.KakeyaFormatError` on anything but a valid object of its shape."""
        shape = self.check_shape(tuple(out.shape), out.dtype)
        h, payload = ct.unpack(data)
        dtype = str(out.dtype).removeprefix("torch.")
        g = self.geometry
        if (
            h.shape != shape
            or h.dtype != dtype
            or (h.kv_heads, h.head_dim) != (g.kv_heads, g.head_dim)
        ):
            raise ct.KakeyaFormatError(
                f"kakeya object is {h.dtype} {h.shape} ({h.kv_heads} x {h.head_dim}), the "
                f"chunk asked for is {dtype} {shape} ({g.kv_heads} x {g.head_dim})"
            )
        try:
            y = self._decoded(h, payload, out.dtype)
        except ct.KakeyaFormatError:
            raise
        except (
            KakeyaTurboError,
            ValueError,
            RuntimeError,
            TypeError,
            IndexError,
            OverflowError,
        ) as e:
            raise ct.KakeyaFormatError(f"kakeya object does not decode: {e}") from e
        if y.dtype.is_floating_point and not bool(torch.isfinite(y.float()).all()):
            raise ct.KakeyaFormatError("kakeya object decodes to non-finite KV")
        out.copy_(y)

    def _decoded(self, h: ct.Header, payload: memoryview, dtype: torch.dtype) -> torch.Tensor:
        shape, g = h.shape, self.geometry
        if h.mode == ct.MODE_RAW:
            raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if raw.numel() != math.prod(shape) * torch.empty(0, dtype=dtype).element_size():
                raise ct.KakeyaFormatError(f"kakeya raw payload of {raw.numel()} bytes for {shape}")
            return raw.view(dtype).reshape(shape)
        if h.mode == ct.MODE_FALLBACK:
            if not 1 <= h.start <= 8:
                raise ct.KakeyaFormatError(f"kakeya fallback of {h.start} bits")
            y = decode_fallback(payload, math.prod(shape), g.head_dim, h.start)
            return y.reshape(shape).to(dtype)  # checked in the chunk's dtype, as it is copied
        t = shape[2]
        if h.sinks > t or (h.sinks and h.start):
            raise ct.KakeyaFormatError(f"kakeya object: {h.sinks} sinks at position {h.start}")
        r = ct.Reader(payload)
        pos = torch.arange(h.start, h.start + t)[None]
        out = torch.empty(shape, dtype=torch.float32)
        for s, stream in enumerate("kv"):
            for layer in range(g.num_layers):
                blocks = _read_blocks(r, self, stream, t)
                where = pos if stream == "k" else None
                y = self.pipeline.decode(blocks, layer, stream, 1, where)[0]  # [H, T, D]
                out[s, layer] = y.permute(1, 0, 2).reshape(t, g.hidden)
        res = out.to(dtype)
        if h.sinks:
            exact = torch.frombuffer(bytearray(r.blob()), dtype=torch.uint8)
            want = 2 * g.num_layers * h.sinks * g.hidden * res.element_size()
            if exact.numel() != want:
                raise ct.KakeyaFormatError(
                    f"kakeya sinks of {exact.numel()} bytes, expected {want}"
                )
            res[:, :, : h.sinks] = exact.view(dtype).reshape(2, g.num_layers, h.sinks, g.hidden)
        r.done()
        return res


def _write_blocks(w: ct.Writer, blocks: list[CodedBlock]) -> None:
    w.u32(len(blocks))
    for blk in blocks:
        w.u32(blk.tokens)
        w.u32(len(blk.encs))
        for e in blk.encs:
            w.blob(e.to_bytes())
        if blk.norms is None:
            w.u32(0)
        else:
            w.u32(1)
            w.blob(blk.norms.codes.contiguous().numpy().tobytes())
            w.blob(blk.norms.bounds.contiguous().numpy().tobytes())


def _read_blocks(r: ct.Reader, codec: ChunkCodec, stream: str, tokens: int) -> list[CodedBlock]:
    g, recipe = codec.geometry, codec.pipeline.recipe
    joint = recipe.joint(stream)
    streams, width = (1, g.hidden) if joint else (g.kv_heads, g.head_dim)
    n = r.u32()
    if not 1 <= n <= tokens:
        raise ct.KakeyaFormatError(f"kakeya object: {n} blocks for {tokens} tokens")
    blocks, total = [], 0
    for _ in range(n):
        t = r.u32()
        total += t
        if t == 0 or total > tokens or r.u32() != streams:
            raise ct.KakeyaFormatError("kakeya object: block tokens or stream count do not match")
        encs = [EncodedLayer.from_bytes(bytes(r.blob())) for _ in range(streams)]
        for e in encs:
            if tuple(e.shape) != (t, width) or e.basis_fingerprint is not None:
                raise ct.KakeyaFormatError(
                    f"kakeya object: a stream of shape {tuple(e.shape)}, expected {(t, width)}"
                )
        norms = None
        # Blocks of a stream hold token norms or none (the pipeline's choice per layer), and
        # none where the recipe never codes them.
        has = r.u32()
        mixed = bool(blocks) and has != holds_norms(blocks)
        if has not in (0, int(recipe.token_norms(stream))) or mixed:
            raise ct.KakeyaFormatError("kakeya object: token norms do not match the recipe")
        if has:
            codes = np.frombuffer(r.blob(), np.uint8)
            bounds = np.frombuffer(r.blob(), np.float16)
            if codes.size != g.kv_heads * t or bounds.size != g.kv_heads * 2:
                raise ct.KakeyaFormatError("kakeya object: token norms of the wrong size")
            norms = NormCodes(
                torch.from_numpy(codes.copy()).view(1, g.kv_heads, t),
                torch.from_numpy(bounds.copy()).view(1, g.kv_heads, 2),
            )
        blocks.append(CodedBlock(encs, norms, t))
    if total != tokens:
        raise ct.KakeyaFormatError(f"kakeya object: blocks of {total} tokens, expected {tokens}")
    return blocks
