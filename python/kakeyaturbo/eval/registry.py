"""Build methods from specs: loads the built-in methods (peers in `baselines`, the project's
codec in `kakeya`) into the registry of `methods`, which imports neither of them."""

from __future__ import annotations

from typing import Any

from kakeyaturbo.eval import baselines, hf_baselines, kakeya  # noqa: F401 - importing registers them
from kakeyaturbo.eval.methods import (
    COMMON_KEYS,
    METHOD_HELP,
    METHODS,
    Method,
    attach_options,
    parse_spec,
)

__all__ = ["METHOD_HELP", "build_method"]


def build_method(spec: str, extra_options: dict[str, Any] | None = None) -> Method:
    """Parse `spec`, build the method, attach its options (method defaults < spec < extra)."""
    name, params = parse_spec(spec)
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(sorted(METHODS))}")
    common = {k: params.pop(k) for k in COMMON_KEYS if k in params}
    return attach_options(METHODS[name](params), spec, common, extra_options)
