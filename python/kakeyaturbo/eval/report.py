"""`kakeyaturbo report`: regenerate `reports/README.md` from the JSON results beside it.

Nothing here computes a number: every figure is read from a JSON file written by an `eval`
command, and the command that wrote it is printed above its table.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["render", "write_report"]


def _pct(x: float | None, digits: int = 2, sign: bool = True) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{100 * x:+.{digits}f}%" if sign else f"{100 * x:.{digits}f}%"


def _ci(ci: list[float | None] | None, digits: int = 2) -> str:
    if not ci or ci[0] is None:
        return ""
    return f" [{100 * ci[0]:+.{digits}f}, {100 * ci[1]:+.{digits}f}]"


def _sci(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def _bytes(x: float | None) -> str:
    return "-" if x is None else f"{round(x):,}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _cmd(obj: dict[str, Any]) -> str:
    return f"```\n{obj.get('command', '(command not recorded)')}\n```\n"


def _env(obj: dict[str, Any]) -> str:
    e = obj.get("environment") or {}
    return (
        f"_{e.get('created', '?')}; kakeyaturbo {e.get('kakeyaturbo')}, torch {e.get('torch')}, "
        f"transformers {e.get('transformers')}, {e.get('threads')} threads; "
        f"{obj.get('seconds', '?')} s._\n"
    )


def _quality_table(rows: list[dict[str, Any]], first: str = "method", extra=None) -> list[str]:
    head = f"| {first} | ratio | stored bytes | delta-ppl [95% CI] | KL | top-1 | verdict |"
    out = [head, "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        name = extra(r) if extra else f"`{r['method']}`"
        if r.get("skipped") or r.get("error"):
            out.append(
                f"| {name} | - | - | {'skipped' if r.get('skipped') else 'error'}: "
                f"{r.get('skipped') or r.get('error')} | | | |"
            )
            continue
        out.append(
            f"| {name} | {_ratio(r.get('ratio'))} | {_bytes(r.get('stored_bytes'))} | "
            f"{_pct(r.get('delta_ppl'))}{_ci(r.get('delta_ppl_ci'))} | {_sci(r.get('kl'))} | "
            f"{_pct(r.get('top1'), 1, sign=False)} | {r.get('verdict')} |"
        )
    return out


def _setup(obj: dict[str, Any]) -> str:
    return (
        f"Model `{obj.get('model')}` ({obj.get('layers')} layers, {obj.get('kv_heads')} KV heads, "
        f"head_dim {obj.get('head_dim')}), text `{obj.get('text')}`: "
        f"{obj.get('passages')} passages of ctx {obj.get('ctx')} + "
        f"{obj.get('n_eval')} scored tokens, "
        f"mode `{obj.get('mode')}`. "
        f"Reference perplexity {obj.get('ppl_ref') or 0:.2f}.\n"
    )


def _section(obj: dict[str, Any], title: str, setup: bool = True) -> list[str]:
    """A section's heading, the command that made it, its setup and its environment."""
    return [f"## {title}", "", _cmd(obj), *([_setup(obj)] if setup else []), _env(obj), ""]


def _sweep(obj: dict[str, Any], name: str) -> list[str]:
    out = _section(obj, f"Pareto table: compression ratio vs quality (`{name}`)")
    out.append(
        "| method | bits | ratio | bits/value | stored bytes/prefix | delta-ppl [95% CI] | KL "
        "| top-1 | verdict | front (dppl) | front (KL) |"
    )
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---|:---:|:---:|")
    notes = []
    for e in obj["table"]:
        if e.get("note"):
            notes.append(f"- `{e['method']}`: {e['note']}")
            continue
        bits = "-" if e.get("bits") is None else f"{e['bits']:g}"
        out.append(
            f"| `{e['method']}` | {bits} | {_ratio(e['ratio'])} | {16 / e['ratio']:.2f} | "
            f"{_bytes(e['stored_bytes'])} | "
            f"{_pct(e['delta_ppl'])}{_ci(e.get('delta_ppl_ci'))} | {_sci(e['kl'])} | "
            f"{_pct(e['top1'], 1, sign=False)} | {e['verdict']} | "
            f"{'**yes**' if e['pareto'] else ''} | {'**yes**' if e['pareto_kl'] else ''} |"
        )
    out += ["", *_sweep_summary(obj)]
    if obj.get("plot"):
        out += ["", f"![Pareto plot]({Path(obj['plot']).name})"]
    if notes:
        out += ["", "Not run:", *notes]
    return out + [""]


def _sweep_summary(obj: dict[str, Any]) -> list[str]:
    """Plain statements read off the table: best ratio per verdict level, kakeya against peers."""
    rows = [e for e in obj["table"] if not e.get("note")]
    out = []
    for level, ok in (("ACCEPT", ("ACCEPT",)), ("MARGINAL or better", ("ACCEPT", "MARGINAL"))):
        pick = [e for e in rows if e["verdict"] in ok]
        mine = [e for e in pick if e.get("family") == "kakeya"]
        peers = [e for e in pick if e.get("family") != "kakeya"]
        best = max(peers, key=lambda e: e["ratio"], default=None)
        line = f"- Highest ratio rated {level}: "
        line += f"peers `{best['method']}` {_ratio(best['ratio'])}" if best else "peers: none"
        own = max(mine, key=lambda e: e["ratio"], default=None)
        line += (
            f"; kakeyaturbo `{own['method']}` {_ratio(own['ratio'])}."
            if own
            else "; kakeyaturbo: none."
        )
        out.append(line)
    recipes = sorted(
        {
            str((r.get("params") or {}).get("recipe"))
            for r in obj.get("methods", [])
            if r.get("family") == "kakeya" and not r.get("error")
        }
    )
    if recipes:
        out.append(
            f"- `kakeya` rows start from the recipe: {', '.join(f'`{x}`' for x in recipes)}."
        )
    return out


def _layers(obj: dict[str, Any], name: str) -> list[str]:
    out = _section(obj, f"Diagnostics for `{obj['method']}` (`{name}`)")

    def opt(r, key):
        o = r.get("options") or {}
        return o.get(key)

    out += ["Per-layer sensitivity (codec on one layer, the rest as computed; snapshot):", ""]
    out += _quality_table(obj["per_layer"], "layer", lambda r: str((opt(r, "layers") or ["?"])[0]))
    out += ["", "Depth compounding (codec on the first k layers; in-forward):", ""]
    out += _quality_table(
        obj["depth"], "first k layers", lambda r: str(len(opt(r, "layers") or []))
    )
    out += ["", "K-only / V-only attribution (the other stream as computed):", ""]
    out += _quality_table(
        obj["streams"], "mode / streams", lambda r: f"{r.get('mode')} / {opt(r, 'streams')}"
    )
    return out + [""]


def _bytes_section(obj: dict[str, Any], name: str) -> list[str]:
    out = _section(obj, f"Bytes per layer and long-context projection (`{name}`)", setup=False)
    out.append(
        f"Layer types: {', '.join(sorted(set(obj['layer_types'])))}; unit costs fitted on "
        f"prefixes of at most {obj['fit_max']} tokens, checked against longer measured prefixes."
    )
    out.append("")
    ctxs = [str(c) for c in obj["contexts"]]
    head = (
        "| method | "
        + " | ".join(f"ratio @{c}" for c in ctxs)
        + " | "
        + " | ".join(f"ratio @{t // 1024}k (proj.)" for t in obj["targets"])
        + " | projection error |"
    )
    out += [head, "|---|" + "---:|" * (len(ctxs) + len(obj["targets"]) + 1)]
    for m in obj["methods"]:
        if m.get("skipped") or m.get("error"):
            out.append(f"| `{m['method']}` | {m.get('skipped') or m.get('error')} |")
            continue
        errs = ", ".join(f"{v['rel_error']:+.4%} @{v['tokens']}" for v in m["validation"]) or "-"
        out.append(
            f"| `{m['method']}` | "
            + " | ".join(_ratio(m["totals"][c]["ratio"]) for c in ctxs)
            + " | "
            + " | ".join(_ratio(p["ratio"]) for p in m["projection"])
            + f" | {errs} |"
        )
    if obj["targets"]:
        t = obj["targets"][-1]
        out += ["", f"Projected stored bytes at {t:,} tokens by layer type (MiB):", ""]
        out += [
            "| method | full attention | sliding | skipped (bf16) | total | bf16 |",
            "|---|" + "---:|" * 5,
        ]
        for m in obj["methods"]:
            if m.get("skipped") or m.get("error"):
                continue
            p = m["projection"][-1]
            cell = [p["by_type"].get(k) for k in ("full", "sliding", "skipped")]
            out.append(
                f"| `{m['method']}` | "
                + " | ".join("-" if c is None else f"{c / 2**20:,.1f}" for c in cell)
                + f" | {p['stored_bytes'] / 2**20:,.1f} | {p['bf16_bytes'] / 2**20:,.1f} |"
            )
    out += ["", "Stored bytes per layer (K + V) at the longest measured context:", ""]
    last = ctxs[-1]
    ok = [m for m in obj["methods"] if not (m.get("skipped") or m.get("error"))]
    if ok:
        out.append("| layer | type | " + " | ".join(f"`{m['method']}`" for m in ok) + " | bf16 |")
        out.append("|---:|---|" + "---:|" * (len(ok) + 1))
        for i in range(obj["layers"]):
            rows = [m["per_layer"][last][i] for m in ok]
            kind = obj["layer_types"][i].replace("_attention", "")
            out.append(
                f"| {i} | {kind} | "
                + " | ".join(
                    _bytes(r["k"] + r["v"]) + (" (skipped)" if r["type"] == "skipped" else "")
                    for r in rows
                )
                + f" | {_bytes(rows[0]['bf16'])} |"
            )
    return out + [""]


def _ppl(obj: dict[str, Any], name: str) -> list[str]:
    out = _section(obj, f"`eval ppl` results (`{name}`)")
    return out + _quality_table(obj["methods"]) + [""]


HEADER = """# kakeyaturbo evaluation reports

Generated by `kakeyaturbo report` from the JSON files in this folder: every number below was
written by the command printed above it (run from the repository root). To regenerate
everything, results, plot and this page, in one go:

```
{all_command}
```

Protocol (`kakeyaturbo eval ppl`): each passage prefills `ctx` tokens, the method compresses
that prefix cache (snapshot mode: all layers' K/V from the exact prefill; in-forward mode: each
layer attends over reconstructed K/V, so errors compound with depth), then `n_eval` tokens are
teacher-forced on top and compared with the uncompressed run. delta-ppl = ppl_method /
ppl_ref - 1; KL(ref || method) in nats per token; top-1 = share of positions whose argmax
agrees. 95% intervals are paired Student-t intervals over passages. Verdict: ACCEPT when
|delta-ppl| <= 1% and top-1 >= 95%, MARGINAL when <= 3% and >= 90%, REJECT otherwise.
Bytes are what one passage's prefix stores (codes, scales, norms, codec headers and skeletons,
full-precision sinks, windows and skipped layers), and ratio = bf16 bytes / stored bytes.
Peers are reimplementations (see `python/kakeyaturbo/eval/baselines.py`), except `hf-*`,
transformers' own `QuantizedCache` run as it ships; all are counted by the same rule: codes
bit-packed, scales/zero-points/norms fp16 (fp8 scales fp32; kakeya's token norms a byte each
plus two fp16 bounds per block stream), seeded rotations and fixed codebooks free. `bits` is
a method's nominal code width; bits/value = 16 / ratio is what it really stores per cached
number, side information included. For `hf-*`, `allocated_bytes` in
the JSON is what the backend's tensors actually occupy in memory; `hf-fp8` has no residual
window, so as shipped it also quantizes the scored continuation tokens.

"""

#: A results folder's own index of its files, put after the header when present.
INDEX = "index.md"

WEAK_MODEL_NOTE = """\
kt-ref-a is a weak model (flat predictions): a KV error moves perplexity little (in either
direction) and flips top-1 sooner, so read KL and top-1 alongside delta-ppl. Quality claims are
judged on SmolLM2-135M (`reports/`), not here.
"""


def render(results: Path, all_command: str | None = None) -> str:
    files = sorted(p for p in Path(results).glob("*.json"))
    objs = []
    for p in files:
        try:
            objs.append((p.name, json.loads(p.read_text())))
        except (OSError, json.JSONDecodeError):
            continue
    all_cmd = all_command
    for _, o in objs:
        all_cmd = all_cmd or o.get("all_command")
    lines = [HEADER.format(all_command=all_cmd or "(run the commands below)")]
    # A hand-written index beside the results (what each file shows) survives regeneration.
    index = Path(results) / INDEX
    if index.is_file():
        lines.append(index.read_text().rstrip() + "\n")
    if any("kt-ref-a" in str(o.get("model", "")) for _, o in objs):
        lines.append(WEAK_MODEL_NOTE)
    order = {"sweep": 0, "layers": 1, "bytes": 2, "ppl": 3}
    for name, o in sorted(objs, key=lambda t: (order.get(t[1].get("kind"), 9), t[0])):
        kind = o.get("kind")
        if kind == "sweep":
            lines += _sweep(o, name)
        elif kind == "layers":
            lines += _layers(o, name)
        elif kind == "bytes":
            lines += _bytes_section(o, name)
        elif kind == "ppl":
            lines += _ppl(o, name)
    return "\n".join(lines).rstrip() + "\n"


def write_report(
    results: str | Path, out: str | Path | None = None, all_command: str | None = None
) -> Path:
    results = Path(results)
    out = Path(out) if out else results / "README.md"
    out.write_text(render(results, all_command))
    return out
