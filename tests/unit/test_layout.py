"""The package's shape: no import cycles (lazy, function-level imports included), and one
module owns the K/V round trip."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "python" / "kakeyaturbo"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Package modules ``name`` imports anywhere in its body (lazy imports count too)."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                root = ".".join(base[: len(base) - node.level + 1])
                mod = f"{root}.{node.module}" if node.module else root
            else:
                mod = node.module or ""
            # `from . import x` imports the submodule x, not the package's own body.
            targets = [mod] if node.module else []
            targets += [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def test_no_import_cycles():
    mods = _modules()
    graph = {name: _imports(name, path, set(mods)) for name, path in mods.items()}
    done: set[str] = set()
    stack: list[str] = []

    def visit(node: str) -> None:
        if node in stack:
            cycle = stack[stack.index(node) :] + [node]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if node in done:
            return
        stack.append(node)
        for nxt in sorted(graph[node]):
            visit(nxt)
        stack.pop()
        done.add(node)

    for name in sorted(graph):
        visit(name)


def test_one_module_calls_the_codec_for_kv():
    """Only the pipeline calls encode_batch/decode_batch on K/V: the cache, the evaluation and
    the vLLM hooks go through it (the codec's own API and the raw-codec benchmark aside)."""
    allowed = {"kakeyaturbo.codec", "kakeyaturbo.pipeline", "kakeyaturbo.bench_cli"}
    offenders = []
    for name, path in _modules().items():
        calls = {
            node.func.attr
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        }
        if name not in allowed and calls & {"encode_batch", "decode_batch"}:
            offenders.append(name)
    assert offenders == []
