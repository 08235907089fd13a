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

import torch

from kakeyaturbo.calibration.auto import AUTO
from kakeyaturbo.eval.methods import Method, MethodOptions, register, stream_params
from kakeyaturbo.pipeline import CodedBlock, Pipeline
from kakeyaturbo.recipes import Recipe, default_recipe

__all__ = ["Kakeya"]

_RECIPE_KEYS = (
    "k_token_norms",
    "v_token_norms",
    "whiten",
    "recent_tokens",
    "recent_bits",
    "joint_heads",
)


@register(
    "kakeya", "kakeyaturbo codec; bare = the default recipe; keys override CodecParams fields"
)
class Kakeya(Method):
    name = "kakeya"
    codes_sinks_in_place = True

    def __init__(self, params: dict[str, Any]):
        super().__init__(params)
        params = dict(params)
        calib = params.pop("calibration", AUTO)
        self._layer_bits = bool(params.pop("layer_bits", True))
        self._recipe_changes = {k: params.pop(k) for k in _RECIPE_KEYS if k in params}
        self._stream_changes = {s: stream_params(params, s) for s in ("k", "v")}
        #: True until :meth:`prepare` has fitted or found the model's own bundle.
        self.needs_model = calib == AUTO
        if calib is None or calib is False or self.needs_model:
            self._build(None, "")
        else:
            from kakeyaturbo.calibration import Calibration

            self._build(Calibration.load(str(calib)), f" + {calib}")
        self.default_options = MethodOptions(
            sink_tokens=self.recipe.sink_tokens, pre_rope=self.recipe.pre_rope
        )
        #: Set to a dict to keep every row's blocks: {(layer, stream): [blocks of row 0, ...]}.
        self.recorded: dict[tuple[int, str], list[list[CodedBlock]]] | None = None

    def _build(self, calibration, label: str) -> None:
        self.calibration = calibration
        recipe: Recipe = default_recipe(calibration)
        changes = dict(self._recipe_changes)
        if not self._layer_bits:
            changes.update(k_layer_bits=(), v_layer_bits=())
        for s, over in self._stream_changes.items():
            if over:
                changes[s] = getattr(recipe, s).replace(**over)
        self.recipe = recipe.replace(**changes) if changes else recipe
        self.label = "kakeyaturbo.recipes.default_recipe" + label
        # The harness hands keys already un-rotated (pre_rope option), so the pipeline gets no
        # positions.
        self.pipeline = Pipeline(self.recipe, calibration)

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

    @property
    def bits(self):
        return (self.recipe.k.bits_per_value + self.recipe.v.bits_per_value) / 2

    def block_tokens(self, stream):
        return self.recipe.block_size

    def resolved_params(self):
        return {"recipe": self.label, **self.recipe.describe()}

    def compress(self, x, layer, stream):
        if self.calibration is not None and stream == "k" and not self.options.pre_rope:
            raise ValueError("kakeya with calibration needs pre_rope=true (pre-RoPE frames)")
        # The harness hands the prefix from token 0 (codes_sinks_in_place): the sinks are held
        # exact beside the stream, as KakeyaCache holds them.
        sinks = torch.zeros((1, x.shape[2]), dtype=torch.bool)
        sinks[:, : self.options.sink_tokens] = True
        # The prefix ends where the harness's recent window (held exact) begins.
        newer = self.options.residual_length
        outs, rows = [], []
        for i in range(x.shape[0]):
            pipe = self.pipeline.fresh()  # one passage = one sequence: its own frames
            y, blocks = pipe.roundtrip(
                x[i : i + 1].float(), layer, stream, sinks=sinks, newer=newer
            )
            outs.append(y)
            rows.append(
                {
                    "encoded": sum(b.encoded_bytes for b in blocks),
                    "norms": sum(b.norm_bytes for b in blocks),
                    "frames": pipe.frame_bytes(),
                }
            )
            if self.recorded is not None:
                self.recorded.setdefault((layer, stream), []).append(blocks)
        return torch.cat(outs).to(x.dtype), rows
