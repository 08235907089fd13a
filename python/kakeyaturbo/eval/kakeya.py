"""The `kakeya` method: the project's codec in the evaluation harness, through the same
:class:`~kakeyaturbo.pipeline.Pipeline` that ``KakeyaCache`` stores with.

`kakeya` alone is the default recipe (:func:`kakeyaturbo.recipes.default_recipe`) with the
model's own bundle (`calibration=auto`, fitted on first use from text the model samples, then
cached; `calibration=none` codes without a bundle, fitting frames per passage); every key of
the spec overrides a `CodecParams` field of both streams (`bits_per_value=2`), a `k_`/`v_` key
overrides one stream (`v_bits_per_value=4`), `k_token_norms` / `v_token_norms` override the
recipe's per-token norms, and the shared harness keys (`sink_tokens`, `residual_length`,
`skip_layers`, ...) override the recipe's method options. `calibration=DIR` codes in the bundle's
frames with the calibrated default (its per-layer bits too, unless `layer_bits=false`), and
`whiten=false` swaps the key frame for plain key PCA (an ablation); `joint_heads=v` (or `k`,
`false`) codes only that stream across a layer's KV heads with a bundle that has frames across
them.

Each passage is an independent sequence: it gets its own self-fitted frames (counted as
`frames` bytes), exactly as a fresh ``KakeyaCache`` would fit them on that prefix. Bytes are
the exact serialized size of every stream plus the token norms (``norm_codes.py``).
"""

from __future__ import annotations

from typing import Any

from kakeyaturbo.calibration.auto import AUTO
from kakeyaturbo.eval.kakeya_codec import KakeyaCodec
from kakeyaturbo.eval.methods import register

__all__ = ["Kakeya"]


@register(
    "kakeya", "kakeyaturbo codec; bare = the default recipe; keys override CodecParams fields"
)
class Kakeya(KakeyaCodec):
    def __init__(self, params: dict[str, Any]):
        auto = params.get("calibration", AUTO) == AUTO
        super().__init__({k: v for k, v in params.items() if not (auto and k == "calibration")})
        self.params = params
        #: True until :meth:`prepare` has fitted or found the model's own bundle.
        self.needs_model = auto

    def prepare(self, model) -> None:
        """The default ``calibration=auto``: the model's own bundle (fitted on first use from
        text it samples, then cached; :mod:`kakeyaturbo.calibration.auto`), or none where
        ``KAKEYATURBO_AUTO_CALIBRATION=0``."""
        if not self.needs_model:
            return
        from kakeyaturbo.calibration.auto import auto_bundle_dir, auto_calibration

        calib = auto_calibration(model)
        if calib is not None:
            self._build(calib, f" + auto bundle {auto_bundle_dir(model)}")
            if (self.recipe.sink_tokens, self.recipe.pre_rope) != (
                self.default_options.sink_tokens,
                self.default_options.pre_rope,
            ):
                raise AssertionError("the calibrated recipe changed the harness options")
        self.needs_model = False
