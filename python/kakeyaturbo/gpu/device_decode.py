"""Decoding coded blocks with torch ops on the device the model runs on.

The codec's own decoder runs on the CPU. A model on an accelerator that attends over the codes
(``hf/coded_attention.py``, off the CPU) would otherwise decode every block on the CPU on every
step and copy the coordinates over, so the CPU would set the pace. Here a
stream kind's blocks are held on the device once, when they are written (their packed code
streams and side values as stored: :class:`DeviceBlocks`), and each step decodes them there
with a handful of gathers and multiply-adds per run of equal blocks (on a GPU with Triton, one
kernel per run: ``fused_decode.py``). The cache keeps no host copy then: a flush's blocks are
joined to the held ones, and a crop or a beam's reorder takes blocks and rows of them, on the
device (:meth:`DeviceBlocks.joined`, :meth:`DeviceBlocks.take`), laid out as if built anew.

The arithmetic is the codec's, in its order (:func:`kakeyaturbo._core.waterfill_sections`):
component ``j`` of a vector is ``mean_j + (level(code) * sigma_j) * gain(bits_j)``, ``mean_j``
where ``bits_j = 0``, and an outlier ``mean_j + value * sigma_j``; so the output equals the
codec's decoder bit for bit on any device that rounds float32 as IEEE does. It reads the
blocks the pipeline's recipes write (water-filled, no basis); the sections come from the
codec's reader, which has checked every byte, and the values each block can decode to are
checked finite when it is taken on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from .. import _core
from .._runs import equal_runs
from ..norm_codes import StackedNorms
from . import fused_decode

__all__ = ["DeviceBlocks", "PackedRun", "checked_parts", "reads"]

#: Widest code of one component (the codec's ``MAX_COMPONENT_BITS``).
MAX_WIDTH = 8
#: Zero bytes after the last code stream: a code is read from the two bytes it starts in,
#: and a zero-width component at the very end starts one byte past the stream.
PAD = 2

SKELETON_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _level_table() -> torch.Tensor:
    """``[MAX_WIDTH + 1, 256]`` float32: row ``b`` the Gaussian codebook of ``b`` bits (row 0
    a single zero level), zero-padded."""
    table = torch.zeros(MAX_WIDTH + 1, 1 << MAX_WIDTH)
    for b in range(1, MAX_WIDTH + 1):
        table[b, : 1 << b] = torch.tensor(_core.gaussian_codebook(b))
    return table


LEVELS = _level_table()
#: ``(1 << b) - 1`` for each width ``b``: a component's code mask.
_MASKS = torch.tensor([(1 << b) - 1 for b in range(MAX_WIDTH + 1)])
# Made once per device and shared by every run (a handful of bytes, not a cache's).
_ON: dict[tuple, torch.Tensor] = {}


def on_device(name: str, make, device: torch.device) -> torch.Tensor:
    key = (name, str(device))
    if key not in _ON:
        _ON[key] = make().to(device)
    return _ON[key]


def checked_parts(counts: Sequence[int], k: int) -> list[int]:
    """``counts`` as consecutive parts of ``k`` stream-blocks (each part at least one, all of
    them covered), else a ``ValueError``."""
    counts = [int(c) for c in counts]
    if not counts or sum(counts) != k or min(counts) <= 0:
        raise ValueError(f"parts of {counts} stream-blocks for {k}")
    return counts


def reads(params: Any) -> bool:
    """Whether blocks coded with ``params`` (``kakeyaturbo.CodecParams``) can be held and
    decoded here: water-filled, without a basis (what the pipeline's recipes write)."""
    plain = params.pca_method == "none" and not params.share_basis
    return plain and params.allocation == "waterfill"


@dataclass(eq=False)
class PackedRun:
    """Equally long coded streams (``K`` stream-blocks of ``n`` vectors of ``d`` values) held
    on one device as stored: the packed codes one after the other, and per stream-block its
    component widths, scales and mean. What each step would otherwise recompute from them
    with a dozen small ops (a kernel launch each on a GPU) is kept too, where it is small:
    where each stream-block starts and its bits per vector, and the outliers' decoded values.
    (Each component's first bit is not: as int32 it was 5% of what the run holds; the
    decoders sum the widths before it.)"""

    codes: torch.Tensor  # uint8 [sum of code bytes + PAD]
    base: torch.Tensor  # int64 [K]: the byte where each stream-block's codes start
    per_vector: torch.Tensor  # int64 [K]: bits of one vector
    bits: torch.Tensor  # uint8 [K, d]
    sigma: torch.Tensor  # float16 [K, d] (stored so)
    mean: torch.Tensor  # [K, d] in the skeleton dtype (stored so)
    gains: torch.Tensor  # float32 [MAX_WIDTH + 1]: reconstruction gain per width
    # The outliers by tile of fused_decode.BLOCK_N vectors of a stream-block (the Triton
    # decoder's: each of its programs puts its own tile's), in order of tile:
    outlier_pos: torch.Tensor  # int64 [m]: into the [K, n, d] output, flattened
    outlier_dec: torch.Tensor  # float32 [m]: their decoded values, ``mean + value * sigma``
    outlier_tiles: torch.Tensor  # int64 [K * ceil(n / BLOCK_N) + 1]: where each tile's start
    n: int

    @classmethod
    def of(cls, encs: Sequence[Any], device: torch.device) -> PackedRun:
        """The stream-blocks ``encs`` (``kakeyaturbo.EncodedLayer``, one block each, equally
        long) on ``device``."""
        parts = []
        for enc in encs:
            raw = getattr(enc, "_raw", enc)
            sections = _core.waterfill_sections(raw)
            if len(sections) != 1:
                raise ValueError(f"expected one block per coded stream, got {len(sections)}")
            parts.append((sections[0], raw.params))
        n = parts[0][0]["n"]
        if any(s["n"] != n for s, _ in parts):
            raise ValueError("PackedRun: the streams hold different numbers of vectors")
        skeleton = {p.skeleton_dtype for _, p in parts}
        gains = {s["gains"].tobytes() for s, _ in parts}
        if len(skeleton) != 1 or len(gains) != 1:
            raise ValueError("PackedRun: the streams were coded with different parameters")
        sections = [s for s, _ in parts]
        _check_finite(sections)
        sizes = np.array([s["codes"].size for s in sections], dtype=np.int64)
        base = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        codes = np.concatenate([s["codes"] for s in sections] + [np.zeros(PAD, np.uint8)])
        bits = np.stack([s["bits"] for s in sections])
        d = bits.shape[1]
        pos = np.concatenate([s["outlier_pos"] + k * n * d for k, s in enumerate(sections)])
        sigma = np.stack([s["sigma"] for s in sections]).astype(np.float16)
        mean = torch.from_numpy(np.stack([s["mean"] for s in sections]))
        mean = mean.to(SKELETON_DTYPES[skeleton.pop()])
        # The decoder's arithmetic for an outlier, in float32: mean + value * sigma.
        block, comp = pos // (n * d), pos % d
        value = torch.from_numpy(np.concatenate([s["outlier_val"] for s in sections]))
        value = value.half().float() * torch.from_numpy(sigma[block, comp]).float()
        outlier_dec = mean[block, comp].float() + value
        tiles = -(-n // fused_decode.BLOCK_N)
        tile = block * tiles + pos % (n * d) // d // fused_decode.BLOCK_N
        by_tile = np.argsort(tile, kind="stable")
        pos, outlier_dec = pos[by_tile], outlier_dec[torch.from_numpy(by_tile)]
        starts = np.searchsorted(tile[by_tile], np.arange(len(sections) * tiles + 1))
        put = lambda a: torch.as_tensor(a).to(device)  # noqa: E731
        return cls(
            codes=put(codes),
            base=put(base),
            per_vector=put(bits.sum(axis=1, dtype=np.int64)),
            bits=put(bits),
            sigma=put(sigma),
            mean=mean.to(device),
            gains=put(sections[0]["gains"]),
            outlier_pos=put(pos),
            outlier_dec=outlier_dec.to(device),
            outlier_tiles=put(starts.astype(np.int64)),
            n=n,
        )

    @classmethod
    def cat(cls, runs: Sequence[PackedRun]) -> PackedRun:
        """The stream-blocks of ``runs`` (equally long, coded with the same parameters, on one
        device) one after the other."""
        head = runs[0]
        if len(runs) == 1:
            return head
        n, d = head.n, head.bits.shape[1]
        for run in runs[1:]:
            same = run.n == n and run.bits.shape[1] == d and run.mean.dtype == head.mean.dtype
            if not same or not torch.equal(run.gains, head.gains):
                raise ValueError("PackedRun.cat: the runs were coded with different parameters")
        sizes = [run.codes.numel() - PAD for run in runs]
        streams = [run.bits.shape[0] for run in runs]
        pad = head.codes.new_zeros(PAD)
        codes = torch.cat([run.codes[:-PAD] for run in runs] + [pad])
        at, k, base, pos = 0, 0, [], []
        for run, size, count in zip(runs, sizes, streams):
            base.append(run.base + at)
            pos.append(run.outlier_pos + k * n * d)
            at, k = at + size, k + count
        counts = torch.cat([run.outlier_tiles.diff() for run in runs])
        return cls(
            codes=codes,
            base=torch.cat(base),
            per_vector=torch.cat([run.per_vector for run in runs]),
            bits=torch.cat([run.bits for run in runs]),
            sigma=torch.cat([run.sigma for run in runs]),
            mean=torch.cat([run.mean for run in runs]),
            gains=head.gains,
            outlier_pos=torch.cat(pos),
            outlier_dec=torch.cat([run.outlier_dec for run in runs]),
            outlier_tiles=torch.cat((counts.new_zeros(1), counts.cumsum(0))),
            n=n,
        )

    def split(self, counts: Sequence[int]) -> list[PackedRun]:
        """The run's stream-blocks in consecutive parts of ``counts`` stream-blocks, each a run
        laid out as :meth:`of` lays out its streams (several layers' streams coded at once, one
        run per layer). Each part's codes are its own (with their zero padding); its other
        tensors are views where that needs no op: the parts' views split their storage."""
        k, d = self.bits.shape
        counts = checked_parts(counts, k)
        if len(counts) == 1:
            return [self]
        tiles = (self.outlier_tiles.numel() - 1) // k
        edges = np.concatenate(([0], np.cumsum(counts)))
        ends = torch.cat((self.base, self.base.new_full((1,), self.codes.numel() - PAD)))
        at = torch.as_tensor(edges, device=self.base.device)
        byte, outlier = torch.stack((ends[at], self.outlier_tiles[at * tiles])).tolist()
        gains = self.gains.expand(len(counts), -1).clone()  # one per part, as of makes them
        parts = []
        for i, (lo, hi) in enumerate(zip(edges[:-1].tolist(), edges[1:].tolist())):
            b0, b1, o0, o1 = byte[i], byte[i + 1], outlier[i], outlier[i + 1]
            parts.append(
                PackedRun(
                    codes=torch.nn.functional.pad(self.codes[b0:b1], (0, PAD)),
                    base=self.base[lo:hi] - b0,
                    per_vector=self.per_vector[lo:hi],
                    bits=self.bits[lo:hi],
                    sigma=self.sigma[lo:hi],
                    mean=self.mean[lo:hi],
                    gains=gains[i],
                    outlier_pos=self.outlier_pos[o0:o1] - lo * self.n * d,
                    outlier_dec=self.outlier_dec[o0:o1],
                    outlier_tiles=self.outlier_tiles[lo * tiles : hi * tiles + 1] - o0,
                    n=self.n,
                )
            )
        return parts

    def take(self, index: torch.Tensor) -> PackedRun:
        """Stream-blocks ``index`` of the run (int64 ``[K']``, in any order, repeats allowed)
        as a run of their own: each one's packed codes, side values and outliers, laid out as
        :meth:`of` lays out the same streams. Runs on the device, from what it holds (the
        streams' host copies may be gone)."""
        k, d = self.bits.shape
        index = index.to(device=self.codes.device, dtype=torch.long)
        # Each stream-block's codes are whole bytes, up to where the next one's start.
        end = torch.cat((self.base[1:], self.base.new_full((1,), self.codes.numel() - PAD)))
        start, size = self.base[index], (end - self.base)[index]
        codes = torch.cat((self.codes[_spans(start, size)], self.codes.new_zeros(PAD)))
        # The outliers of stream-block j are tiles j * tiles .. (j + 1) * tiles.
        tiles = (self.outlier_tiles.numel() - 1) // k
        counts = self.outlier_tiles.diff().view(k, tiles)[index]
        held = counts.sum(dim=1)
        pick = _spans(self.outlier_tiles[:-1].view(k, tiles)[index, 0], held)
        to = torch.arange(index.numel(), device=index.device)
        shift = ((to - index) * (self.n * d)).repeat_interleave(held)
        return PackedRun(
            codes=codes,
            base=size.cumsum(0) - size,
            per_vector=self.per_vector[index],
            bits=self.bits[index],
            sigma=self.sigma[index],
            mean=self.mean[index],
            gains=self.gains,
            outlier_pos=self.outlier_pos[pick] + shift,
            outlier_dec=self.outlier_dec[pick],
            outlier_tiles=torch.cat((counts.new_zeros(1), counts.flatten().cumsum(0))),
            n=self.n,
        )

    @property
    def nbytes(self) -> int:
        """Bytes held on the device (the codebooks' level table, shared, is not counted)."""
        held = (self.codes, self.base, self.per_vector, self.bits, self.sigma, self.mean)
        held += (self.gains, self.outlier_pos, self.outlier_dec, self.outlier_tiles)
        return sum(t.numel() * t.element_size() for t in held)

    def level_rows(self) -> torch.Tensor:
        """The codebooks' levels ``[MAX_WIDTH + 1, 256]`` float32 on the run's device (row
        ``b`` the ``b``-bit codebook, zero-padded; shared by every run there)."""
        return on_device("levels", lambda: LEVELS, self.codes.device)

    def decode(self) -> torch.Tensor:
        """``[K, n, d]`` float32 on the run's device, as the codec decodes it: by one Triton
        kernel on a GPU (``fused_decode.py``), else by :meth:`decode_with_torch`."""
        if fused_decode.usable(self):
            return fused_decode.decode(self)
        return self.decode_with_torch()

    def decode_with_torch(self) -> torch.Tensor:
        """:meth:`decode` by 31 torch ops, on any device."""
        dev = self.codes.device
        bits = self.bits.long()
        vector = on_device(f"arange {self.n}", lambda: torch.arange(self.n), dev)
        # Component j of vector 0 starts after the stream-block's first bit and the widths of
        # the components before j.
        first = (self.base * 8)[:, None] + bits.cumsum(dim=1) - bits
        start = first[:, None, :] + vector[None, :, None] * self.per_vector[:, None, None]
        byte = start >> 3
        codes = self.codes.int()
        word = codes[byte] | (codes[byte + 1] << 8)  # a code spans at most two bytes
        code = (word >> (start & 7)) & on_device("masks", lambda: _MASKS, dev)[bits][:, None, :]
        level = self.level_rows().view(-1)[(bits << MAX_WIDTH)[:, None, :] + code]
        sigma, mean = self.sigma.float()[:, None, :], self.mean.float()[:, None, :]
        return self.put_outliers(mean + (level * sigma) * self.gains[bits][:, None, :])

    def put_outliers(self, y: torch.Tensor) -> torch.Tensor:
        """``y`` (``[K, n, d]``, every other value decoded) with the outliers' exact values put
        in place: the last step of either decoder."""
        if self.outlier_pos.numel():
            y.view(-1)[self.outlier_pos] = self.outlier_dec
        return y


def _spans(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The indices ``starts[i] .. starts[i] + lengths[i]`` of every ``i``, one after the other."""
    total = int(lengths.sum())
    skip = starts - (lengths.cumsum(0) - lengths)
    at = torch.arange(total, device=starts.device)
    return skip.repeat_interleave(lengths, output_size=total) + at


def _check_finite(sections: list[dict]) -> None:
    """Every value a block can decode to is finite (the codec's decoder checks the same)."""
    top = np.abs(LEVELS.numpy()).max(axis=1)  # largest level magnitude per width
    for s in sections:
        bits = s["bits"].astype(np.int64)
        reach = np.abs(s["mean"]) + top[bits] * s["sigma"] * s["gains"][bits]
        comp = s["outlier_pos"] % bits.size
        outl = np.abs(s["mean"][comp]) + np.abs(s["outlier_val"]) * s["sigma"][comp]
        if not (np.isfinite(reach).all() and np.isfinite(outl).all()):
            raise ValueError("decoded values are not finite")


@dataclass(eq=False)
class DeviceBlocks:
    """One stream kind's blocks of a layer (``pipeline.CodedBlock``, oldest first) held on
    ``device`` for decoding there: the pipeline's ``decode_codes`` / ``decode`` take it in
    place of the blocks. Built when a cache's blocks change, reused every step."""

    runs: list[tuple[PackedRun, int]]  # each run of equally long blocks, and its block count
    streams: int  # coded streams per block (rows x heads, or rows across heads)
    norms: Optional[StackedNorms]  # the blocks' token norms on the device, or None
    tokens: int

    @classmethod
    def of(cls, blocks: Sequence[Any], device: torch.device) -> DeviceBlocks:
        if not blocks:
            raise ValueError("DeviceBlocks: no blocks")
        streams = len(blocks[0].encs)
        runs = []
        for run in equal_runs(blocks, lambda blk: blk.tokens):
            encs = [blk.encs[s] for s in range(streams) for blk in run]  # stream-major
            runs.append((PackedRun.of(encs, device), len(run)))
        norms = None
        if blocks[0].norms is not None:  # stacked copies, even on the CPU: nbytes counts them
            norms = StackedNorms.of([blk.norms for blk in blocks], device)
        return cls(runs, streams, norms, sum(blk.tokens for blk in blocks))

    @classmethod
    def joined(cls, parts: Sequence[DeviceBlocks]) -> DeviceBlocks:
        """The blocks of ``parts`` one after the other (a cache's blocks and those a flush
        adds), laid out as :meth:`of` lays out the same blocks."""
        streams = {part.streams for part in parts}
        with_norms = {part.norms is not None for part in parts}
        if len(streams) != 1 or len(with_norms) != 1:
            raise ValueError("DeviceBlocks.joined: the parts hold different streams")
        norms = None
        if with_norms.pop():
            norms = StackedNorms([run for part in parts for run in part.norms.runs])
        runs = [run for part in parts for run in part.runs]
        whole = cls(runs, streams.pop(), norms, sum(part.tokens for part in parts))
        return whole.take(range(whole.blocks))

    @property
    def blocks(self) -> int:
        return sum(count for _, count in self.runs)

    @property
    def device(self) -> torch.device:
        return self.runs[0][0].codes.device

    def take(
        self, blocks: Sequence[int], rows: int = 0, order: Optional[Sequence[int]] = None
    ) -> DeviceBlocks:
        """Blocks ``blocks`` (indices into the held blocks, in token order) of the ``rows``
        batch rows ``order`` (default: every row as held), laid out as :meth:`of` lays out the
        same blocks: what a cache keeps after a crop or a beam's reorder, or decodes of a few
        blocks, from what the device holds."""
        where = []  # (run, block in it) of each held block
        for r, (_, count) in enumerate(self.runs):
            where += [(r, i) for i in range(count)]
        streams = list(range(self.streams))
        if order is not None:  # a batch row's streams are consecutive: its heads, or one
            per = self.streams // rows
            streams = [row * per + j for row in order for j in range(per)]
        runs, groups, tokens = [], [], 0
        for group in equal_runs([where[b] for b in blocks], lambda w: self.runs[w[0]][0].n):
            n = self.runs[group[0][0]][0].n
            sources = [r for r, (run, _) in enumerate(self.runs) if run.n == n]
            # The stream-blocks of the sources joined, stream-major within each source.
            k_at, b_at, k, b = {}, {}, 0, 0
            for r in sources:
                k_at[r], b_at[r] = k, b
                k, b = k + self.runs[r][0].bits.shape[0], b + self.runs[r][1]
            index = [k_at[r] + s * self.runs[r][1] + i for s in streams for r, i in group]
            joined = PackedRun.cat([self.runs[r][0] for r in sources])
            runs.append((joined.take(torch.tensor(index)), len(group)))
            groups.append((sources, torch.tensor([b_at[r] + i for r, i in group])))
            tokens += n * len(group)
        norms = None
        if self.norms is not None:
            norms = self.norms.take(groups, None if order is None else torch.tensor(order))
        return DeviceBlocks(runs, len(streams), norms, tokens)

    @property
    def nbytes(self) -> int:
        held = sum(run.nbytes for run, _ in self.runs)
        return held + (0 if self.norms is None else self.norms.nbytes)

    def decode(self, rows: int) -> torch.Tensor:
        """``[rows, S, tokens, C]`` float32 on the device: what ``pipeline.decode_blocks``
        returns for the same blocks."""
        parts = []
        for run, count in self.runs:
            y = run.decode()  # [streams * count, n, C], stream-major
            parts.append(y.reshape(rows, self.streams // rows, count * run.n, y.shape[-1]))
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
