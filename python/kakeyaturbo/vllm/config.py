"""What the vLLM hooks do, as one validated, JSON-serialisable object.

The same knobs as :class:`~kakeyaturbo.hf.KakeyaCache` and ``kakeyaturbo eval``: codec
parameters per stream (the project recipe when left out), a calibration bundle, skipped layers
and attention sinks; plus where to hook (``pre-rope`` / ``post-rope``), when to code
(``snapshot`` / ``in-forward``) and which streams (``kv`` / ``k`` / ``v``).

The plugin reads it from ``KAKEYATURBO_VLLM_CONFIG``: JSON text, or the path of a JSON file::

    {"mode": "snapshot", "hook": "pre-rope", "streams": "kv",
     "calibration": "calib/", "skip_layers": [0], "sink_tokens": 4,
     "k_params": {"bits_per_value": 2.0}, "v_params": {"bits_per_value": 1.5}}

``k_params`` / ``v_params`` override fields of the recipe's parameters (any
:class:`~kakeyaturbo.CodecParams` keyword); they never replace the recipe wholesale, so
``{"bits_per_value": 2.0}`` keeps water-filling and the recipe's block size.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import kakeyaturbo as kt
from kakeyaturbo.recipes import DEFAULT_SINK_TOKENS, Recipe, default_recipe

__all__ = ["CONFIG_ENV", "HOOKS", "MODES", "STREAMS", "VLLMHookConfig"]

#: Environment variable the plugin reads its configuration from (JSON text or a file path).
CONFIG_ENV = "KAKEYATURBO_VLLM_CONFIG"
MODES = ("snapshot", "in-forward")
HOOKS = ("pre-rope", "post-rope")
STREAMS = ("kv", "k", "v")
#: Runs of fewer new tokens of one sequence than this stay exact (decode steps, tiny chunks):
#: a PCA basis fitted on a handful of vectors costs more than the vectors.
DEFAULT_MIN_TOKENS = 16


@dataclass(frozen=True)
class VLLMHookConfig:
    """Configuration of :func:`kakeyaturbo.vllm.install_hooks` and the vLLM plugin.

    Attributes:
        mode: ``"snapshot"``: a prompt is attended exactly in its prefill forward and its K/V
            are stored in vLLM's cache as the codec's reconstruction (the evaluation's
            snapshot protocol). ``"in-forward"``: the prefill forward itself attends to the
            reconstruction, so errors compound through the layers.
        hook: ``"pre-rope"``: keys are coded before the rotary embedding, in the calibration
            bundle's query-aware frame when one is given (Llama and Qwen2 families).
            ``"post-rope"``: keys are coded as vLLM's ``Attention`` layer receives them (any
            model; no calibration).
        streams: which of keys and values are coded; the other stays exact.
        k_params, v_params: codec parameters; ``None`` takes the default recipe's
            (:func:`~kakeyaturbo.recipes.default_recipe`, with or without a calibration).
        calibration: a calibration bundle folder (``kakeyaturbo calibrate``); needs
            ``hook="pre-rope"``.
        skip_layers: decoder layer indices kept exact.
        sink_tokens: tokens at positions below this are held exact (attention sinks), as in
            ``KakeyaCache`` and the evaluation.
        min_tokens: a sequence's run of new tokens in one forward shorter than this stays
            exact (decode steps are never coded: generated tokens are not compressed, as in
            the evaluation protocol).
        stats_file: where the plugin writes each process's :meth:`KakeyaVLLMHooks.stats` as
            JSON when the process exits (``{pid}`` in the path is replaced by the process id).
    """

    mode: str = "snapshot"
    hook: str = "pre-rope"
    streams: str = "kv"
    k_params: Optional[kt.CodecParams] = None
    v_params: Optional[kt.CodecParams] = None
    calibration: Optional[str] = None
    skip_layers: tuple[int, ...] = ()
    sink_tokens: int = DEFAULT_SINK_TOKENS
    min_tokens: int = DEFAULT_MIN_TOKENS
    stats_file: Optional[str] = None
    _recipe: Recipe = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, allowed in (("mode", MODES), ("hook", HOOKS), ("streams", STREAMS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        for name in ("k_params", "v_params"):
            p = getattr(self, name)
            if p is not None and not isinstance(p, kt.CodecParams):
                raise TypeError(f"{name} must be a kakeyaturbo.CodecParams, got {type(p).__name__}")
        if self.calibration is not None:
            if not isinstance(self.calibration, (str, os.PathLike)):
                got = type(self.calibration).__name__
                raise TypeError(f"calibration must be a bundle folder path, got {got}")
            object.__setattr__(self, "calibration", str(self.calibration))
            if self.hook != "pre-rope":
                raise ValueError(
                    "a calibration bundle codes keys pre-RoPE: it needs hook='pre-rope'"
                )
        skip = self.skip_layers
        if isinstance(skip, (str, bytes)) or not all(_is_int(i) and i >= 0 for i in skip):
            raise ValueError(f"skip_layers must be non-negative layer indices, got {skip!r}")
        object.__setattr__(self, "skip_layers", tuple(sorted(set(int(i) for i in skip))))
        for name in ("sink_tokens", "min_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if self.stats_file is not None and not isinstance(self.stats_file, str):
            raise TypeError(f"stats_file must be a path string, got {self.stats_file!r}")
        if self.min_tokens < 2:
            raise ValueError(
                f"min_tokens must be >= 2 (one token has no PCA), got {self.min_tokens}"
            )
        object.__setattr__(self, "_recipe", _recipe_for(self.calibration))

    @property
    def codec_params(self) -> dict[str, kt.CodecParams]:
        """``{"k": ..., "v": ...}``: the given parameters, else the recipe's."""
        return {
            "k": self.k_params if self.k_params is not None else self._recipe.k,
            "v": self.v_params if self.v_params is not None else self._recipe.v,
        }

    def recipe(self, calibration: Any = None) -> Recipe:
        """The recipe the hooks code with, given the loaded calibration bundle (or None)."""
        base = default_recipe(calibration) if calibration is not None else self._recipe
        return base.replace(
            k=self.codec_params["k"], v=self.codec_params["v"], sink_tokens=self.sink_tokens
        )

    def codes(self, layer: int, stream: str) -> bool:
        """Whether ``stream`` ('k' or 'v') of decoder layer ``layer`` is coded."""
        return stream in self.streams and layer not in self.skip_layers

    # ---- JSON ------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VLLMHookConfig:
        """From plain data (parsed JSON); unknown keys are an error, not ignored."""
        if not isinstance(d, dict):
            raise TypeError(f"config must be a JSON object, got {type(d).__name__}")
        allowed = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; allowed: {sorted(allowed)}")
        kw = dict(d)
        recipe = _recipe_for(kw.get("calibration"))
        for stream in ("k", "v"):
            over = kw.pop(f"{stream}_params", None)
            if over is None:
                continue
            if not isinstance(over, dict):
                raise TypeError(f"{stream}_params must be a JSON object of CodecParams fields")
            try:
                kw[f"{stream}_params"] = getattr(recipe, stream).replace(**over)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{stream}_params: {exc}") from None
        if "skip_layers" in kw:
            if not isinstance(kw["skip_layers"], list):
                raise ValueError(f"skip_layers must be a list, got {kw['skip_layers']!r}")
            kw["skip_layers"] = tuple(kw["skip_layers"])
        return cls(**kw)

    @classmethod
    def from_json(cls, text_or_path: str) -> VLLMHookConfig:
        """From JSON text, or from the path of a JSON file."""
        text = text_or_path.strip()
        if not text.startswith("{"):
            path = Path(text)
            if not path.is_file():
                raise ValueError(
                    "config is neither JSON text (it does not start with '{') nor a file: "
                    f"{text!r}"
                )
            text = path.read_text(encoding="utf-8")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"config is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """Plain data that :meth:`from_dict` reads back to an equal config (full parameters)."""
        return {
            "mode": self.mode,
            "hook": self.hook,
            "streams": self.streams,
            "k_params": None if self.k_params is None else self.k_params.to_dict(),
            "v_params": None if self.v_params is None else self.v_params.to_dict(),
            "calibration": self.calibration,
            "skip_layers": list(self.skip_layers),
            "sink_tokens": self.sink_tokens,
            "min_tokens": self.min_tokens,
            "stats_file": self.stats_file,
        }


def _recipe_for(calibration: Any) -> Recipe:
    """The recipe a config's parameters start from: with or without a calibration bundle."""
    return default_recipe(True if calibration else None)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
