"""The `kakeya` method: the project's codec in the evaluation harness, through the same
:class:`~kakeyaturbo.pipeline.Pipeline` that ``KakeyaCache`` stores with.

`kakeya` alone is the default recipe (:func:`kakeyaturbo.recipes.default_recipe`); every key of
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
        calib_dir = params.pop("calibration", None)
        layer_bits = bool(params.pop("layer_bits", True))
        recipe_changes = {k: params.pop(k) for k in _RECIPE_KEYS if k in params}
        self.calibration = None
        if calib_dir is not None:
            from kakeyaturbo.calibration import Calibration

            self.calibration = Calibration.load(str(calib_dir))
        recipe: Recipe = default_recipe(self.calibration)
        if not layer_bits:
            recipe_changes.update(k_layer_bits=(), v_layer_bits=())
        for s in ("k", "v"):
            over = stream_params(params, s)
            if over:
                recipe_changes[s] = getattr(recipe, s).replace(**over)
        self.recipe = recipe.replace(**recipe_changes) if recipe_changes else recipe
        self.label = "kakeyaturbo.recipes.default_recipe" + (
            f" + {calib_dir}" if calib_dir is not None else ""
        )
        self.default_options = MethodOptions(
            sink_tokens=self.recipe.sink_tokens, pre_rope=self.recipe.pre_rope
        )
        # The harness hands keys already un-rotated (pre_rope option), so the pipeline gets no
        # positions.
        self.pipeline = Pipeline(self.recipe, self.calibration)
        #: Set to a dict to keep every row's blocks: {(layer, stream): [blocks of row 0, ...]}.
        self.recorded: dict[tuple[int, str], list[list[CodedBlock]]] | None = None

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
