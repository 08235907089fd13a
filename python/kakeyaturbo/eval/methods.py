"""Method specs, the method registry, and the options every method shares.

A method spec is `name` or `name:key=value,key=value`, e.g. `kivi:bits=2,group=32` or
`kakeya:bit_width=3,variance_ratio=0.99,k=0`. Values are parsed as bool (`true`/`false`), `none`,
int, float (`inf` too), or left as strings; `a+b+c` is a list (`skip_layers=0+5`, and `2-4` inside
a layer list is a range). A key `k_<key>` or `v_<key>` overrides `<key>` for that stream only
(`kivi:bits=2,v_bits=4`); note that `k` alone is a key of its own (the codec's k-means centres).

These keys are handled by the harness for every method, so they mean the same thing everywhere:

- `sink_tokens=N`: the first N tokens of the prefix stay full precision (attention sinks;
  stored as bf16, counted);
- `residual_length=N`: the last N tokens of the prefix stay full precision (the recent window,
  as `KakeyaCache`'s hot window);
- `window_values=full|int8`: `int8` holds the values of that recent window (and of the
  `in-forward-hot` protocol's window) as `KakeyaCache(int8_hot_values=True)` holds them
  (`kakeyaturbo.hf.int8_rows`, D + 2 bytes a row);
- `skip_layers=a+b`: those layers stay full precision;
- `layers=a+b`: only those layers are compressed (diagnostics; the others stay full precision);
- `streams=kv|k|v`: which of keys/values are compressed (the other stays full precision);
- `passthrough=bf16|exact`: what "full precision" does to the tensors (see below);
- `pre_rope=true`: keys are handed to the method with the model's rotary embedding undone (at
  their absolute positions) and rotated back after decoding;
- `sliding=exact|code`: sliding-window layers (Gemma 3, Mistral-style) hold their window exact
  (the default, as `KakeyaCache` holds them), or the method codes the window too.

"Full precision" is the bf16 baseline the ratio is measured against: those parts are counted at
2 bytes per element and, by default, rounded to bf16. `passthrough=exact` leaves them as computed
instead (same bytes), which the diagnostics use so that one layer's or one stream's error is
measured alone.

The registry is a plain dict, `METHODS[name] = factory`, where a factory takes the parsed
parameters (with the shared keys removed) and returns a `Method`. Add a method with
`register("name", "one-line help")` used as a decorator; `kakeyaturbo.eval.registry` loads the
built-in methods and builds methods from specs (this module imports none of them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

__all__ = [
    "METHODS",
    "Method",
    "MethodOptions",
    "parse_spec",
    "register",
    "stream_params",
]

#: The shared option keys every method takes, with the form of their values.
COMMON_KEY_VALUES = {
    "sink_tokens": "N",
    "residual_length": "N",
    "window_values": "full|int8",
    "skip_layers": "a+b",
    "layers": "a+b",
    "streams": "kv|k|v",
    "passthrough": "bf16|exact",
    "pre_rope": "true|false",
    "sliding": "exact|code",
}
COMMON_KEYS = tuple(COMMON_KEY_VALUES)
STREAMS = ("k", "v")

# category -> bytes, for one passage's prefix; a method's total is the sum of its values
ByteCount = dict[str, int]


def _parse_value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "yes"):
        return True
    if low in ("false", "no"):
        return False
    if low in ("none", "null"):
        return None
    if "+" in text:
        return [_parse_value(t) for t in text.split("+") if t]
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text.strip()


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """`"kivi:bits=2,group=32"` -> `("kivi", {"bits": 2, "group": 32})`."""
    name, _, rest = spec.strip().partition(":")
    if not name:
        raise ValueError(f"empty method name in spec {spec!r}")
    params: dict[str, Any] = {}
    for item in filter(None, (t.strip() for t in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"method spec {spec!r}: expected key=value, got {item!r}")
        key = key.strip()
        if key in params:
            raise ValueError(f"method spec {spec!r}: key {key!r} given twice")
        params[key] = _parse_value(value)
    return name, params


def stream_params(params: dict[str, Any], stream: str) -> dict[str, Any]:
    """The parameters of one stream: shared keys, then `k_`/`v_` overrides for that stream."""
    if stream not in STREAMS:
        raise ValueError(f"stream must be 'k' or 'v', not {stream!r}")
    out = {k: v for k, v in params.items() if not (k[:2] in ("k_", "v_") and len(k) > 2)}
    out.update({k[2:]: v for k, v in params.items() if k.startswith(stream + "_") and len(k) > 2})
    return out


def _layer_list(value: Any) -> tuple[int, ...]:
    items = value if isinstance(value, list) else [value]
    out: list[int] = []
    for item in items:
        if isinstance(item, str) and "-" in item:
            lo, hi = item.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(item))
    return tuple(sorted(set(out)))


@dataclass(frozen=True)
class MethodOptions:
    """The harness-level options of a method (see the module docs)."""

    sink_tokens: int = 0
    residual_length: int = 0
    window_values: str = "full"
    skip_layers: tuple[int, ...] = ()
    layers: tuple[int, ...] | None = None
    streams: str = "kv"
    passthrough: str = "bf16"
    pre_rope: bool = False
    sliding: str = "exact"

    @classmethod
    def from_params(
        cls, params: dict[str, Any], base: MethodOptions | None = None
    ) -> MethodOptions:
        base = base or cls()
        kw: dict[str, Any] = {}
        for name in ("sink_tokens", "residual_length"):
            if name in params:
                kw[name] = int(params[name])
        if "skip_layers" in params:
            kw["skip_layers"] = _layer_list(params["skip_layers"])
        if "layers" in params:
            kw["layers"] = (
                None if params["layers"] in (None, "all") else _layer_list(params["layers"])
            )
        if "streams" in params:
            kw["streams"] = str(params["streams"]).lower()
        if "pre_rope" in params:
            kw["pre_rope"] = bool(params["pre_rope"])
        if "passthrough" in params:
            kw["passthrough"] = str(params["passthrough"]).lower()
        if "window_values" in params:
            kw["window_values"] = str(params["window_values"]).lower()
        if "sliding" in params:
            kw["sliding"] = str(params["sliding"]).lower()
        opts = replace(base, **kw)
        if opts.window_values not in ("full", "int8"):
            raise ValueError(f"window_values must be full or int8, not {opts.window_values!r}")
        if opts.passthrough not in ("bf16", "exact"):
            raise ValueError(f"passthrough must be bf16 or exact, not {opts.passthrough!r}")
        if opts.sliding not in ("exact", "code"):
            raise ValueError(f"sliding must be exact or code, not {opts.sliding!r}")
        if opts.streams not in ("kv", "k", "v"):
            raise ValueError(f"streams must be kv, k or v, not {opts.streams!r}")
        if opts.sink_tokens < 0 or opts.residual_length < 0:
            raise ValueError("sink_tokens and residual_length must be >= 0")
        return opts

    def compresses(self, layer: int, stream: str) -> bool:
        if stream not in self.streams or layer in self.skip_layers:
            return False
        return self.layers is None or layer in self.layers

    def to_dict(self) -> dict[str, Any]:
        return {
            "sink_tokens": self.sink_tokens,
            "residual_length": self.residual_length,
            "window_values": self.window_values,
            "skip_layers": list(self.skip_layers),
            "layers": None if self.layers is None else list(self.layers),
            "streams": self.streams,
            "passthrough": self.passthrough,
            "pre_rope": self.pre_rope,
            "sliding": self.sliding,
        }

    def is_default(self) -> bool:
        return self == MethodOptions()


class Method:
    """A KV codec under evaluation.

    `compress(x, layer, stream)` takes one layer's keys or values, `x` of shape
    [batch, kv_heads, tokens, head_dim] where each batch row is an independent passage, and
    returns the reconstruction (same shape and dtype) and the stored bytes of each row, split by
    category (`codes`, `scales`, `header`, ...). Rows must not influence each other.
    """

    name: str = ""
    supports_in_forward: bool = True

    def __init__(self, params: dict[str, Any]):
        self.params = params
        self.spec = ""
        self.options = MethodOptions()
        self.default_options = MethodOptions()

    @property
    def bits(self) -> float | None:
        """Nominal bits per coordinate, for grouping sweeps (None when it has no such knob)."""
        return None

    def block_tokens(self, stream: str) -> int:
        """Tokens per independently stored unit of a stream (a block, a token group): bytes grow
        by a constant per whole unit, which the byte projection relies on."""
        return 1

    def resolved_params(self) -> dict[str, Any]:
        """Everything that determines the method's output, JSON-serialisable."""
        return dict(self.params)

    def compress(
        self, x: torch.Tensor, layer: int, stream: str
    ) -> tuple[torch.Tensor, list[ByteCount]]:
        raise NotImplementedError

    def prepare(self, model) -> None:
        """Called with the model before the method codes anything (the harness does): a
        method that fits something to the model does it here. Default: nothing."""

    def describe(self) -> dict[str, Any]:
        return {
            "method": self.spec,
            "family": self.name,
            "bits": self.bits,
            "params": self.resolved_params(),
            "options": self.options.to_dict(),
        }


def attach_options(
    method: Method, spec: str, common: dict[str, Any], extra: dict[str, Any] | None = None
) -> Method:
    """Give ``method`` its spec and its shared options (its defaults < ``common`` < ``extra``)."""
    method.spec = spec.strip()
    opts = MethodOptions.from_params(common, method.default_options)
    if extra:
        opts = MethodOptions.from_params(extra, opts)
    method.options = opts
    return method


MethodFactory = Callable[[dict[str, Any]], Method]


METHODS: dict[str, MethodFactory] = {}
METHOD_HELP: dict[str, str] = {}


def register(name: str, help: str) -> Callable[[MethodFactory], MethodFactory]:
    """Decorator: `@register("kivi", "KIVI-style ...")` on a factory `params -> Method`."""

    def deco(factory: MethodFactory) -> MethodFactory:
        METHODS[name] = factory
        METHOD_HELP[name] = help
        return factory

    return deco


def nominal_bytes(numel: int, bits: float) -> int:
    """Bytes of `numel` codes of `bits` bits packed densely."""
    return math.ceil(numel * bits / 8)
