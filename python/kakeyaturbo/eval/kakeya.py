"""The `kakeya` method: the project's own codec in the evaluation harness.

`kakeya` alone is the project's default recipe (`kakeyaturbo.recipes.default_kv_params()`);
every key of the spec overrides a `CodecParams` field of both streams (`bit_width=2`), a
`k_`/`v_` key overrides one stream (`v_bit_width=4`), and the shared harness keys (`sink`,
`window`, `skip_layers`, ...) override the recipe's method options. Bytes are the exact size of
each serialized `EncodedLayer` (`nbytes`, header included), one per passage, layer, stream and
KV head.
"""

from __future__ import annotations

from typing import Any

import torch

from kakeyaturbo.eval.methods import COMMON_KEYS, Method, MethodOptions, register, stream_params

__all__ = ["Kakeya", "default_recipe"]

# Used only while `kakeyaturbo.recipes` does not exist yet; the report says which one ran.
FALLBACK_RECIPE: dict[str, Any] = {"bit_width": 3}


def _codec():
    try:
        import kakeyaturbo as kt

        kt.encode_batch  # noqa: B018 - the compiled core may be missing in a source checkout
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(
            f"the kakeyaturbo codec is not importable ({exc}); build it with maturin"
        ) from exc
    return kt


def default_recipe():
    """(KVCodecParams, method options dict, source label)."""
    kt = _codec()
    try:
        from kakeyaturbo.recipes import default_kv_params
    except ImportError:
        p = kt.CodecParams(**FALLBACK_RECIPE)
        return (
            kt.KVCodecParams(k=p, v=p),
            {},
            "fallback:" + ",".join(f"{k}={v}" for k, v in FALLBACK_RECIPE.items()),
        )
    rec = default_kv_params()
    kv, opts = rec if isinstance(rec, tuple) else (rec, {})
    opts = dict(opts or {})
    source = "kakeyaturbo.recipes.default_kv_params"
    if "pre_rope" not in opts:
        # the recipe codes keys pre-RoPE; default_kv_params does not say so, default_recipe does
        try:
            from kakeyaturbo.recipes import default_recipe as _recipe

            opts["pre_rope"] = bool(getattr(_recipe(), "pre_rope", False))
            source += " + default_recipe().pre_rope"
        except ImportError:
            pass
    return kv, opts, source


@register(
    "kakeya", "kakeyaturbo codec; bare = the default recipe; keys override CodecParams fields"
)
class Kakeya(Method):
    name = "kakeya"

    def __init__(self, params: dict[str, Any]):
        super().__init__(params)
        self.kt = _codec()
        kv, opts, self.recipe = default_recipe()
        unknown = set(opts) - set(COMMON_KEYS)
        if unknown:
            raise ValueError(
                f"kakeya: recipe options {sorted(unknown)} are not harness options {COMMON_KEYS}"
            )
        self.default_options = MethodOptions.from_params(opts)
        self.codec = {}
        for s in ("k", "v"):
            base = kv.k if s == "k" else kv.v
            over = stream_params(params, s)
            self.codec[s] = base.replace(**over) if over else base

    @property
    def bits(self):
        def one(p):
            return (
                p.bits_per_value
                if getattr(p, "allocation", "uniform") != "uniform"
                else p.bit_width
            )

        return (one(self.codec["k"]) + one(self.codec["v"])) / 2

    def block_tokens(self, stream):
        return int(self.codec[stream].block_size)

    def resolved_params(self):
        return {
            "recipe": self.recipe,
            "k": self.codec["k"].to_dict(),
            "v": self.codec["v"].to_dict(),
        }

    def compress(self, x, layer, stream):
        b, h, t, d = x.shape
        x3 = x.reshape(b * h, t, d).float().contiguous()
        encs = self.kt.encode_batch(x3, self.codec[stream])
        x_hat = torch.as_tensor(self.kt.decode_batch(encs))
        x_hat = x_hat.reshape(b, h, t, d).to(x.dtype)
        rows = [{"encoded": sum(e.nbytes for e in encs[i * h : (i + 1) * h])} for i in range(b)]
        return x_hat, rows
