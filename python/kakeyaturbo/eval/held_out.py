"""An evaluation's scores split into the passages a choice was made on and the rest.

A recipe's free settings (a rate, a blend) were chosen by looking at some evaluation runs; their
passages flatter it. Given the result JSON of a larger run and the JSONs the choice looked at,
this re-aggregates each method's per-passage scores over the passages whose text windows overlap
none of the chosen runs' windows (held out) and over the others, with the same metrics, intervals
and verdicts as `eval ppl` (``metrics.summarize``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kakeyaturbo.eval.metrics import PassageScores, Summary, summarize

__all__ = ["HeldOut", "held_out", "format_held_out", "text_windows"]


def text_windows(result: dict) -> list[tuple[int, int]]:
    """Each passage's [start, end) in the evaluation text's tokens."""
    length = result["ctx"] + result["n_eval"] + 1
    if result.get("protocol") == "copy":
        length = (length + 1) // 2  # each window is written twice (modeling.copy_passages)
    return [(s, s + length) for s in result["passage_starts"]]


def _overlaps(w: tuple[int, int], others: list[tuple[int, int]]) -> bool:
    return any(w[0] < o[1] and o[0] < w[1] for o in others)


@dataclass(frozen=True)
class HeldOut:
    method: str
    ratio: float
    held_out: Summary
    chosen: Summary | None
    n_held_out: int
    n_chosen: int


def _scores(method: dict, keep: list[bool], tokens: int) -> Summary | None:
    rows = method["passages"]
    if len(rows) != len(keep):
        raise ValueError(
            f"{method['method']}: {len(rows)} passages scored, {len(keep)} passage starts"
        )
    kept = [
        PassageScores(r["nll_ref"], r["nll"], r["kl"], r["top1"], tokens)
        for r, k in zip(rows, keep, strict=True)
        if k
    ]
    return summarize(kept) if kept else None


def held_out(result: dict, chosen: list[dict]) -> list[HeldOut]:
    """Per method of `result`: its scores on the passages overlapping no window of `chosen`."""
    if result.get("kind") != "ppl":
        raise ValueError("held-out needs an `eval ppl` result (kind 'ppl')")
    seen = [w for c in chosen for w in text_windows(c)]
    mine = text_windows(result)
    if any(c.get("text") != result.get("text") for c in chosen):
        raise ValueError("the chosen runs evaluated another text: nothing to hold out against")
    keep = [not _overlaps(w, seen) for w in mine]
    if not any(keep):
        raise ValueError("every passage overlaps a chosen run's passages: none is held out")
    out = []
    for m in result["methods"]:
        held = _scores(m, keep, result["n_eval"])
        assert held is not None  # some passage is kept
        out.append(
            HeldOut(
                m["method"],
                m["ratio"],
                held,
                _scores(m, [not k for k in keep], result["n_eval"]),
                sum(keep),
                len(keep) - sum(keep),
            )
        )
    return out


def _row(label: str, n: int, ratio: float, s: Summary | None) -> str:
    if s is None:
        return f"{label:10s} {n:3d}  (none)"
    lo, hi = s.delta_ppl_ci
    return (
        f"{label:10s} {n:3d} {ratio:6.2f}x {s.delta_ppl:+8.2%} [{lo:+.2%}, {hi:+.2%}]"
        f" {s.kl:9.2e} {s.top1:6.1%}  {s.verdict}"
    )


def format_held_out(result: dict, rows: list[HeldOut]) -> str:
    """A text table: each method on its held-out passages, then on the chosen ones."""
    lines = [
        f"mode {result.get('mode', 'snapshot')}, protocol {result.get('protocol')}, "
        f"ctx {result['ctx']} + {result['n_eval']}",
        f"{'passages':10s} {'n':>3s} {'ratio':>7s} {'delta-ppl [95% CI]':>29s} {'KL':>9s} "
        f"{'top-1':>6s}  verdict",
    ]
    for r in rows:
        lines.append(r.method)
        lines.append("  " + _row("held out", r.n_held_out, r.ratio, r.held_out))
        lines.append("  " + _row("chosen on", r.n_chosen, r.ratio, r.chosen))
    return "\n".join(lines)
