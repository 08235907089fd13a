"""The `kakeya` method: the project's own codec in the evaluation harness.

`kakeya` alone is the project's default recipe (`kakeyaturbo.recipes.default_kv_params()`);
every key of the spec overrides a `CodecParams` field of both streams (`bit_width=2`), a
`k_`/`v_` key overrides one stream (`v_bit_width=4`), and the shared harness keys (`sink`,
`window`, `skip_layers`, ...) override the recipe's method options. `calibration=DIR` codes
keys in the bundle's query-aware pre-RoPE frame and values in their PCA frame with the
calibrated recipe (`kakeyaturbo.recipes.calibrated_recipe`), and `whiten=false` swaps the
key frame for plain key PCA (an ablation). Bytes are the exact size of
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
        params = dict(params)
        calib_dir = params.pop("calibration", None)
        whiten = params.pop("whiten", True)
        use_layer_bits = bool(params.pop("layer_bits", False))
        self.layer_offsets: dict[str, list[float]] | None = None
        self.transforms = None
        if calib_dir is not None:
            from kakeyaturbo.calibration import Calibration, KVTransforms
            from kakeyaturbo.recipes import calibrated_recipe

            self.calibration = Calibration.load(str(calib_dir))
            self.transforms = KVTransforms(self.calibration, whiten=bool(whiten))
            rec = calibrated_recipe()
            kv = rec.kv
            # The bundle's frames are pre-RoPE: keys must be un-rotated before coding.
            opts = {"sink": rec.sink_tokens, "pre_rope": True}
            self.recipe = f"kakeyaturbo.recipes.calibrated_recipe + {calib_dir}"
            if use_layer_bits:
                offsets = {s: self.calibration.layer_bit_offsets(s) for s in ("k", "v")}
                if offsets["k"] is None or offsets["v"] is None:
                    raise ValueError(f"layer_bits=true: {calib_dir} has no sensitivity scan")
                self.layer_offsets = offsets  # type: ignore[assignment]
                self.recipe += " (layer_bits)"
            if not whiten:
                self.recipe += " (whiten=false)"
        else:
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
        xf = x.float()
        if self.transforms is not None:
            if stream == "k" and not self.options.pre_rope:
                raise ValueError(
                    "kakeya with calibration needs pre_rope=true (its frames are pre-RoPE)"
                )
            fp = self.calibration.fingerprint
            if (h, d) != (fp["num_key_value_heads"], fp["head_dim"]):
                raise ValueError(
                    f"calibration bundle is for {fp['num_key_value_heads']} KV heads of "
                    f"{fp['head_dim']} dims, the model has {h} of {d}")
            xf = self.transforms.forward(xf, layer, stream)
        x3 = xf.reshape(b * h, t, d).contiguous()
        params = self.codec[stream]
        if self.layer_offsets is not None:
            bits = params.bits_per_value + self.layer_offsets[stream][layer]
            params = params.replace(bits_per_value=min(max(bits, 0.25), 8.0))
        encs = self.kt.encode_batch(x3, params)
        x_hat = torch.as_tensor(self.kt.decode_batch(encs)).reshape(b, h, t, d)
        if self.transforms is not None:
            x_hat = self.transforms.inverse(x_hat, layer, stream)
        x_hat = x_hat.to(x.dtype)
        rows = [{"encoded": sum(e.nbytes for e in encs[i * h : (i + 1) * h])} for i in range(b)]
        return x_hat, rows
