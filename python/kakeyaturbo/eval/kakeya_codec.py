"""The project's codec as an evaluation method, with an explicit bundle or none: what the
registered `kakeya` method (:mod:`kakeyaturbo.eval.kakeya`) builds on, and what the sensitivity
scan codes with (it cannot use the registered one, whose default bundle is fitted by that scan).
"""

from __future__ import annotations

from typing import Any

import torch

from kakeyaturbo.eval.methods import Method, MethodOptions, stream_params
from kakeyaturbo.pipeline import CodedBlock, Pipeline
from kakeyaturbo.recipes import Recipe, default_recipe

__all__ = ["KakeyaCodec"]

_RECIPE_KEYS = (
    "k_token_norms",
    "v_token_norms",
    "whiten",
    "recent_tokens",
    "recent_bits",
    "joint_heads",
)


class KakeyaCodec(Method):
    """``calibration``: a bundle folder, or None / False for none (frames fitted per passage);
    the other parameters as :mod:`kakeyaturbo.eval.kakeya` describes."""

    name = "kakeya"
    codes_sinks_in_place = True

    def __init__(self, params: dict[str, Any]):
        super().__init__(params)
        params = dict(params)
        calib = params.pop("calibration", None)
        self._layer_bits = bool(params.pop("layer_bits", True))
        self._recipe_changes = {k: params.pop(k) for k in _RECIPE_KEYS if k in params}
        self._stream_changes = {s: stream_params(params, s) for s in ("k", "v")}
        if calib is None or calib is False:
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

    @property
    def bits(self):
        return (self.recipe.k.bits_per_value + self.recipe.v.bits_per_value) / 2

    def block_tokens(self, stream):
        return self.recipe.block_size

    def resolved_params(self):
        return {"recipe": self.label, **self.recipe.describe()}

    def compress(self, x, layer, stream, sink_tokens=None):
        if self.calibration is not None and stream == "k" and not self.options.pre_rope:
            raise ValueError("kakeya with calibration needs pre_rope=true (pre-RoPE frames)")
        # The harness hands the prefix from token 0 (codes_sinks_in_place) and says how many
        # sinks it holds: they are held exact beside the stream, as KakeyaCache holds them.
        sinks = torch.zeros((1, x.shape[2]), dtype=torch.bool)
        sinks[:, : self.options.sink_tokens if sink_tokens is None else sink_tokens] = True
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
