"""The hooks' tensor path: one layer's new keys or values, in vLLM's layout, round-tripped
through the codec.

vLLM hands attention the K/V of every token scheduled in a forward, all sequences stacked:
``[num_tokens, num_kv_heads * head_dim]``. A forward mixes prompt chunks (many consecutive
tokens of one sequence) with decode steps (one token per sequence). :func:`plan_forward`
splits the rows into runs of one sequence and picks the rows to code:

* runs with fewer than ``min_tokens`` rows past the sinks (decode steps) stay exact;
* a run is coded through :class:`~kakeyaturbo.pipeline.Pipeline`, the round trip
  ``KakeyaCache`` and ``kakeyaturbo eval`` use (same recipe, frames and blocks); rows at
  positions below ``sink_tokens`` (attention sinks) are held exact, as there.

The plan is made once per forward and shared by every layer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from ..pipeline import Pipeline
from .config import VLLMHookConfig
from .transfer import TransferStats, to_device, to_host

__all__ = ["ForwardPlan", "HookStats", "KVCoder", "plan_forward", "runs_from_positions"]


@dataclass(frozen=True)
class ForwardPlan:
    """Rows of one forward to code: half-open ``[start, end)`` row ranges, one per run, and
    how many leading rows of each are attention sinks (held exact)."""

    num_tokens: int
    coded: tuple[tuple[int, int], ...]
    sinks: tuple[int, ...] = ()

    @property
    def coded_tokens(self) -> int:
        return sum(e - s for s, e in self.coded)


def runs_from_positions(positions: Sequence[int] | np.ndarray) -> list[tuple[int, int]]:
    """Row ranges of consecutive positions (a new run wherever ``pos[i] != pos[i-1] + 1``).

    Two sequences stacked back to back whose positions happen to continue (one ends at p, the
    next starts at p + 1) form one run; :func:`runs_from_query_starts` has no such ambiguity
    and is used when vLLM's attention metadata is at hand.
    """
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    if pos.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(pos) != 1) + 1
    edges = [0, *breaks.tolist(), int(pos.size)]
    return list(zip(edges[:-1], edges[1:]))


def runs_from_query_starts(query_start_loc: Sequence[int] | np.ndarray) -> list[tuple[int, int]]:
    """Row ranges of the sequences of a forward from vLLM's ``query_start_loc`` (cumulative
    query lengths, ``[num_seqs + 1]``)."""
    q = np.asarray(query_start_loc, dtype=np.int64).reshape(-1)
    if q.size < 2 or q[0] != 0 or (np.diff(q) < 0).any():
        raise ValueError(f"query_start_loc must start at 0 and not decrease, got {q.tolist()}")
    return [(int(a), int(b)) for a, b in zip(q[:-1], q[1:]) if b > a]


def plan_forward(
    positions: Any,
    config: VLLMHookConfig,
    runs: Optional[list[tuple[int, int]]] = None,
) -> ForwardPlan:
    """Which rows of a forward whose tokens sit at ``positions`` ([num_tokens]) get coded.

    ``runs`` (one row range per sequence) defaults to :func:`runs_from_positions`."""
    if isinstance(positions, torch.Tensor):
        positions = positions.detach().to("cpu").numpy()
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    runs = runs_from_positions(pos) if runs is None else runs
    coded, sinks = [], []
    for s, e in runs:
        if not 0 <= s < e <= pos.size:
            raise ValueError(f"run [{s}, {e}) outside the forward's {pos.size} tokens")
        # Sinks lead their run (positions are consecutive inside it).
        n_sinks = int(np.count_nonzero(pos[s:e] < config.sink_tokens))
        if e - s - n_sinks >= config.min_tokens:
            coded.append((s, e))
            sinks.append(n_sinks)
    return ForwardPlan(int(pos.size), tuple(coded), tuple(sinks))


@dataclass
class _StreamCount:
    coded_tokens: int = 0
    exact_tokens: int = 0
    encoded_bytes: int = 0
    bf16_bytes: int = 0  # the coded tokens as bfloat16

    def add(self, other: _StreamCount) -> None:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class HookStats:
    """What the hooks coded, measured: tokens, exact serialized bytes, seconds."""

    layers: dict[tuple[int, str], _StreamCount] = field(default_factory=dict)
    transfer: TransferStats = field(default_factory=TransferStats)
    codec_seconds: float = 0.0
    forwards: int = 0
    coded_forwards: int = 0

    def count(self, layer: int, stream: str) -> _StreamCount:
        return self.layers.setdefault((layer, stream), _StreamCount())

    def as_dict(self) -> dict[str, Any]:
        total = _StreamCount()
        rows = []
        for (layer, stream), c in sorted(self.layers.items()):
            total.add(c)
            rows.append({"layer": layer, "stream": stream, **vars(c)})
        enc = total.encoded_bytes
        return {
            **vars(total),
            "ratio_vs_bf16": total.bf16_bytes / enc if enc else None,
            "codec_seconds": self.codec_seconds,
            "forwards": self.forwards,
            "coded_forwards": self.coded_forwards,
            **self.transfer.as_dict(),
            "layers": rows,
        }


class KVCoder:
    """Round-trips one layer's K or V rows of a forward through the codec.

    Args:
        config: what to code and how.
        hf_config: the model's Hugging Face config; a calibration bundle is checked against
            it (:class:`~kakeyaturbo.calibration.CalibrationError` when it is for another
            model).
    """

    def __init__(self, config: VLLMHookConfig, hf_config: Any = None) -> None:
        if not isinstance(config, VLLMHookConfig):
            raise TypeError(f"config must be a VLLMHookConfig, got {type(config).__name__}")
        self.config = config
        calibration = None
        if config.calibration is not None:
            from kakeyaturbo.calibration import Calibration

            calibration = Calibration.load(config.calibration, hf_config)
        # Keys reach the coder already pre-RoPE (pre-RoPE hook) or as attention sees them
        # (post-RoPE hook): the pipeline never rotates them.
        self.pipeline = Pipeline(config.recipe(calibration), calibration)
        self.stats = HookStats()

    def roundtrip(
        self, x: torch.Tensor, layer: int, stream: str, plan: ForwardPlan, head_dim: int
    ) -> torch.Tensor:
        """``x`` ([num_tokens, kv_heads * head_dim] or [num_tokens, kv_heads, head_dim]) with the
        plan's rows replaced by their reconstruction; the same shape, dtype and device. Returns
        ``x`` itself when nothing is coded."""
        count = self.stats.count(layer, stream)
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"layer {layer} {stream}: expected a torch.Tensor, got {type(x).__name__}"
            )
        if x.shape[0] != plan.num_tokens:
            raise ValueError(
                f"layer {layer} {stream}: {x.shape[0]} rows, but the forward's positions "
                f"cover {plan.num_tokens} tokens"
            )
        if not self.config.codes(layer, stream) or not plan.coded:
            count.exact_tokens += plan.num_tokens
            return x
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"layer {layer} {stream}: dtype {x.dtype} is not supported")
        width = x.shape[1] if x.dim() == 2 else x.shape[1] * x.shape[2]
        if x.dim() not in (2, 3) or width % head_dim:
            raise ValueError(
                f"layer {layer} {stream}: shape {tuple(x.shape)} is not "
                f"[tokens, kv_heads * {head_dim}]"
            )
        heads = width // head_dim
        host = to_host(x, self.stats.transfer).reshape(plan.num_tokens, heads, head_dim)
        out = host.clone()
        for (s, e), n_sinks in zip(plan.coded, plan.sinks):
            seg = host[s:e].float().permute(1, 0, 2)[None]  # [1, H, n, D]: a stream per head
            out[s:e] = self._code(seg, n_sinks, layer, stream, count)[0].permute(1, 0, 2)
            count.exact_tokens += n_sinks
        count.exact_tokens += plan.num_tokens - plan.coded_tokens
        return to_device(out.reshape(x.shape), x.device, self.stats.transfer)

    def _code(
        self, seg: torch.Tensor, n_sinks: int, layer: int, stream: str, count: _StreamCount
    ) -> torch.Tensor:
        sinks = torch.zeros((1, seg.shape[2]), dtype=torch.bool)
        sinks[:, :n_sinks] = True
        pipe = self.pipeline.fresh()  # a prompt is an independent sequence: its own frames
        t0 = time.perf_counter()
        # The run ends at the newest prompt token of the forward.
        y, blocks = pipe.roundtrip(seg, layer, stream, sinks=sinks, newer=0)
        self.stats.codec_seconds += time.perf_counter() - t0
        count.coded_tokens += seg.shape[2] - n_sinks
        count.encoded_bytes += sum(b.nbytes for b in blocks) + pipe.frame_bytes()
        count.bf16_bytes += (seg.shape[2] - n_sinks) * seg.shape[1] * seg.shape[3] * 2
        return y
