"""`eval sweep`: method families x bit widths -> Pareto table (ratio vs delta-ppl) and a plot.

A family is a spec template with a `{bits}` placeholder (`kivi:bits={bits}`); a spec without
one is a single point (`bf16`, `fp8`). A point is on the Pareto front when no other point has
both a ratio at least as high and an |delta-ppl| at least as low (one of them strictly); the
same is computed with KL in place of |delta-ppl|, which is steadier on a weak model.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULT_FAMILIES", "expand", "pareto_flags", "plot_pareto", "sweep_table"]

DEFAULT_FAMILIES = [
    "bf16",
    "fp8",
    "hf-fp8",
    "kakeya",
    "kakeya:bits_per_value={bits}",
    # the recipe below 2 bits per value: where the water-filling codec keeps going
    "kakeya:bits_per_value=1.5",
    "kakeya:k_bits_per_value=1.5,v_bits_per_value=1",
    "kivi:bits={bits}",
    "turboquant:bits={bits}",
    "turboquant:bits={bits},k_qjl=1",
    "hf-hqq:bits={bits}",
    # hqq's 3-bit packing only works on axis 0 (hf_baselines.HFHqq): the 3-bit point of that peer
    "hf-hqq:bits=3,axis_key=0,axis_value=0",
    "hf-quanto:bits={bits}",
]
DEFAULT_BITS = [2, 3, 4]


def expand(families: list[str], bits: list[int]) -> list[str]:
    out: list[str] = []
    for fam in families:
        specs = [fam.format(bits=b) for b in bits] if "{bits}" in fam else [fam]
        out.extend(s for s in specs if s not in out)
    return out


def _ok(row: dict[str, Any]) -> bool:
    return not row.get("skipped") and not row.get("error") and row.get("ratio") is not None


def pareto_flags(rows: list[dict[str, Any]], quality: str = "delta_ppl") -> list[bool]:
    """Pareto-optimal flags for (max ratio, min |quality|); rows that did not run are False."""

    def q(r):
        return abs(r[quality])

    flags = []
    for r in rows:
        if not _ok(r):
            flags.append(False)
            continue
        dominated = any(
            _ok(o)
            and o is not r
            and o["ratio"] >= r["ratio"]
            and q(o) <= q(r)
            and (o["ratio"] > r["ratio"] or q(o) < q(r))
            for o in rows
        )
        flags.append(not dominated)
    return flags


def sweep_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Pareto table: one entry per row, sorted by ratio (descending), with front flags."""
    front = pareto_flags(rows, "delta_ppl")
    front_kl = pareto_flags(rows, "kl")
    table = []
    for r, f, fk in zip(rows, front, front_kl):
        entry = {
            "method": r["method"],
            "family": r.get("family"),
            "bits": r.get("bits"),
            "ratio": r.get("ratio"),
            "stored_bytes": r.get("stored_bytes"),
            "delta_ppl": r.get("delta_ppl"),
            "delta_ppl_ci": r.get("delta_ppl_ci"),
            "kl": r.get("kl"),
            "top1": r.get("top1"),
            "verdict": r.get("verdict"),
            "pareto": f,
            "pareto_kl": fk,
        }
        if not _ok(r):
            entry["note"] = r.get("skipped") or r.get("error") or "no bytes"
        table.append(entry)
    table.sort(key=lambda e: (e["ratio"] is None, -(e["ratio"] or 0)))
    return table


def _family_key(row: dict[str, Any], families: list[str]) -> str:
    spec = row["method"]
    for fam in families:
        if "{bits}" in fam:
            head, _, tail = fam.partition("{bits}")
            if (
                spec.startswith(head)
                and spec.endswith(tail)
                and spec[len(head) : len(spec) - len(tail)].isdigit()
            ):
                return fam.replace("{bits}", "b")
        elif spec == fam:
            return fam
    return spec


def plot_pareto(rows: list[dict[str, Any]], families: list[str], path: str, title: str) -> None:
    """Three panels against the compression ratio: delta-ppl (with 95% CI), KL, top-1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if _ok(r)]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in ok:
        groups.setdefault(_family_key(r, families), []).append(r)
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    markers = "osD^v<>phX*"
    for i, (fam, rs) in enumerate(groups.items()):
        rs = sorted(rs, key=lambda r: r["ratio"])
        xs = [r["ratio"] for r in rs]
        style = {
            "marker": markers[i % len(markers)],
            "label": fam,
            "linewidth": 1.2,
            "markersize": 6,
        }
        if fam.startswith("kakeya"):
            style.update(linewidth=2.6, markersize=9, color="black", zorder=5)
        dp = [100 * r["delta_ppl"] for r in rs]
        ci = [r.get("delta_ppl_ci") or [None, None] for r in rs]
        lo = [d - 100 * c[0] if c[0] is not None else 0 for d, c in zip(dp, ci)]
        hi = [100 * c[1] - d if c[1] is not None else 0 for d, c in zip(dp, ci)]
        line = axes[0].errorbar(xs, dp, yerr=[lo, hi], capsize=3, **style)
        color = line[0].get_color()
        style["color"] = color
        axes[1].plot(xs, [r["kl"] for r in rs], **style)
        axes[2].plot(xs, [100 * r["top1"] for r in rs], **style)
        for r, x in zip(rs, xs):
            if r.get("bits") is not None and r["family"] not in ("bf16",):
                axes[1].annotate(
                    f"{r['bits']:g}",
                    (x, r["kl"]),
                    fontsize=7,
                    xytext=(3, 3),
                    textcoords="offset points",
                )
    axes[0].axhline(0, color="grey", linewidth=0.8)
    for y in (1, -1):
        axes[0].axhline(y, color="grey", linewidth=0.6, linestyle=":")
    axes[0].set_ylabel("delta-ppl, % (95% CI over passages)")
    axes[1].set_ylabel("KL(ref || method), nats/token")
    axes[1].set_yscale("log")
    axes[2].set_ylabel("top-1 agreement, %")
    axes[2].axhline(95, color="grey", linewidth=0.6, linestyle=":")
    axes[2].axhline(90, color="grey", linewidth=0.6, linestyle=":")
    for ax in axes:
        ax.set_xlabel("compression ratio (bf16 bytes / stored bytes)")
        ax.grid(alpha=0.3)
    axes[2].legend(fontsize=7, loc="lower left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
