"""`eval table`: an `eval ppl` or `eval sweep` result as one short table a newcomer reads at a
glance: each method's compression ratio, delta-ppl, KL, top-1 and verdict, best ratio first,
the methods that did not run last with the reason, and what the verdicts mean."""

from __future__ import annotations

from typing import Any

from kakeyaturbo.eval.metrics import ACCEPT_DPPL, ACCEPT_TOP1, MARGINAL_DPPL, MARGINAL_TOP1

__all__ = ["VERDICTS", "format_table"]

# From the thresholds `eval` applies, so the legend cannot drift from the rule.
VERDICTS = (
    f"ACCEPT: |delta-ppl| <= {100 * ACCEPT_DPPL:g}% and top-1 >= {100 * ACCEPT_TOP1:g}%; "
    f"MARGINAL: |delta-ppl| <= {100 * MARGINAL_DPPL:g}% and top-1 >= {100 * MARGINAL_TOP1:g}%; "
    "REJECT: anything worse"
)

_HEAD = ("method", "ratio", "delta-ppl", "KL", "top-1", "verdict")


def _ran(row: dict[str, Any]) -> bool:
    return row.get("ratio") is not None and row.get("verdict") is not None


def _cells(row: dict[str, Any]) -> tuple[str, ...]:
    return (
        row["method"],
        f"{row['ratio']:.2f}x",
        f"{100 * row['delta_ppl']:+.2f}%",
        f"{row['kl']:.2e}",
        f"{100 * row['top1']:.1f}%",
        row["verdict"],
    )


def format_table(result: dict[str, Any], mark: str | None = None) -> str:
    """The table of ``result["methods"]``; the row whose method is ``mark`` gets a ``*``.

    ``result`` is the JSON that `eval ppl` or `eval sweep` writes. A method that was skipped or
    failed is listed after the table with its reason, so a missing peer is never silent.
    """
    rows = result.get("methods")
    if not isinstance(rows, list):
        raise ValueError("not an evaluation result: it has no 'methods' list")
    ran = sorted((r for r in rows if _ran(r)), key=lambda r: -r["ratio"])
    lines = [_HEAD] + [_cells(r) for r in ran]
    widths = [max(len(line[i]) for line in lines) for i in range(len(_HEAD))]

    def fmt(cells: tuple[str, ...], star: bool) -> str:
        first = ("* " if star else "  ") + cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:-1], widths[1:-1])]
        return "  ".join([first, *rest, cells[-1]])

    out = [fmt(_HEAD, False)]
    out += [fmt(_cells(r), r["method"] == mark) for r in ran]
    for r in rows:
        if not _ran(r):
            why = r.get("skipped") or r.get("error") or "no result"
            out.append(f"  {r['method']}: not run: {why}")
    where = [f"{result['passages']} passages"] if result.get("passages") else []
    if result.get("ctx"):
        where.append(f"ctx {result['ctx']} + {result.get('n_eval')} scored tokens")
    if result.get("mode"):
        where.append(str(result["mode"]))
    if where:
        out.append("  (" + ", ".join(where) + "; ratio = bf16 bytes / stored bytes)")
    if mark is not None and any(r["method"] == mark for r in ran):
        out.append(f"  * marks {mark}")
    out.append("  " + VERDICTS)
    return "\n".join(out)
