"""``KakeyaCache``: a transformers v5 ``Cache`` whose full-attention layers are block-compressed.

Each decoder layer gets the cache layer its attention type calls for (see ``layer_plan``):
compressed full-attention layers are :class:`~kakeyaturbo.hf.layer.KakeyaLayer`; skipped
full-attention layers are plain ``DynamicLayer``; sliding/chunked layers are transformers' own
``DynamicSlidingWindowLayer``, or with ``code_sliding`` sliding ones are
:class:`~kakeyaturbo.hf.sliding_layer.SlidingKakeyaLayer`; KV-sharing consumers get
transformers' placeholder.

``from_model`` also hooks the model's decoder so the cache sees each forward's ``position_ids``
(needed to undo RoPE exactly in pre-RoPE mode, padded rows included) and 2-D ``attention_mask``
(to keep the first *real* tokens of left-padded rows as attention sinks). The hook only reads
forwards whose ``cache`` (``past_key_values`` before transformers 5.24) is this cache, holds
the cache weakly and goes away with it.
"""

from __future__ import annotations

import copy
import inspect
import os
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

import kakeyaturbo as kt

from ..calibration.auto import AUTO
from ..pipeline import Pipeline
from ..recipes import Recipe
from ._compat import Cache, DummyLayer, DynamicLayer, DynamicSlidingWindowLayer
from .attention import ACTIVE_STEP
from .attention import NAME as ATTENTION_NAME
from .blocks import storage_bytes
from .budget import DecodedBudget
from .cache_setup import load_calibration, resolve_recipe, with_window_bits
from .context import CacheContext, StepInputs
from .flushing import finish_forward
from .hot_window import DEFAULT_RESIDUAL_LENGTH
from .layer import KakeyaLayer
from .layer_plan import (
    CODED_KINDS,
    LayerKind,
    LayerSpec,
    build_layer_plan,
    cache_layer_count,
    text_config,
)
from .options import KakeyaOptions, flag, non_negative_int
from .report import compression_note, report
from .rope import ModelRope
from .sliding_layer import SlidingKakeyaLayer

_REPORT_SUMS = (
    "tokens",
    "compressed_tokens",
    "compressed_bytes",
    "full_precision_bytes",
    "aux_bytes",
    "decoded_cache_bytes",
    "device_copy_bytes",
    "total_bytes",
    "bf16_equivalent_bytes",
    "dense_bytes",
)


def _floating_dtype(name: str, value: object) -> torch.dtype | None:
    if value is None:
        return None
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise TypeError(f"{name} must be a floating torch.dtype or None, got {value!r}")
    return value


class KakeyaCache(Cache):
    """A KV cache that holds old tokens of full-attention layers as kakeyaturbo blocks.

    Args:
        config: the model config (multimodal configs: the text config is used).
        recipe: how K/V are coded (:class:`~kakeyaturbo.recipes.Recipe`); default:
            :func:`~kakeyaturbo.recipes.default_recipe` for the given calibration.
        calibration: a calibration bundle (folder or :class:`~kakeyaturbo.calibration.
            Calibration`): keys are coded pre-RoPE in its query-aware frame and values in their
            PCA frame; without one, frames are fitted on each layer's first coded tokens.
            ``"auto"`` (what :meth:`from_model` passes unless told): the model's own bundle,
            fitted on first use from text it samples and cached
            (:func:`kakeyaturbo.calibration.auto.auto_calibration`); it needs the model, so it
            is for :meth:`from_model` only.
        k_params, v_params: replace the recipe's codec parameters of keys / values (their
            ``block_size``, the streaming granularity, must be equal).
        residual_length: newest tokens always kept full precision (the hot window).
        sink_tokens: first real tokens of every row kept full precision (attention sinks);
            None: the recipe's.
        skip_layers: full-attention (or, with ``code_sliding``, sliding) layer indices kept
            full precision.
        code_sliding: code the window of sliding-window layers (Gemma 3, Mistral style) too,
            in blocks, forgetting those the window leaves (``hf/sliding_layer.py``). False
            (default): they hold their window exact, as transformers holds it. Without a
            ``recipe`` coded windows get ``recipes.SLIDING_EXTRA_BITS`` more bits. Coding
            them pays where the window is long against ``block_size + residual_length``; on
            windows of 512 it is 1.8x fewer bytes at 6x the KL (docs/recipe.md).
        pre_rope: store keys pre-RoPE (unrotate before encoding, rotate back after decoding).
            Needs the positions of each forward: build the cache with :meth:`from_model`.
            None (default): the recipe's choice where this model's RoPE can be inverted, and
            always True with a calibration.
        hot_dtype: floating dtype in which the exact tokens (hot window, sinks) are held; None
            (default): the model's. ``torch.bfloat16`` on a float32 model halves their bytes
            (what a bfloat16 deployment holds) at bfloat16's rounding of those tokens; the
            codec then codes the rounded tokens.
        int8_hot_values: hold the hot window's values as int8 rows (default; one bfloat16
            scale per token and head, :mod:`~kakeyaturbo.hf.int8_rows`): about half the bytes
            of bfloat16, each entry within 0.4% of its row's largest; keys and sinks stay in
            ``hot_dtype``. False: values in ``hot_dtype`` too.
        options: the speed knobs (:class:`~kakeyaturbo.hf.options.KakeyaOptions`: decoded-block
            budget, attention arithmetic, keys made ahead, flushes coded together); None: the
            defaults.

    Raises:
        NotImplementedError: unsupported model (layer types, RoPE type in pre-RoPE mode).
        ValueError / TypeError: bad parameters.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        *,
        recipe: Recipe | None = None,
        calibration: Any = None,
        k_params: kt.CodecParams | None = None,
        v_params: kt.CodecParams | None = None,
        residual_length: int = DEFAULT_RESIDUAL_LENGTH,
        sink_tokens: int | None = None,
        skip_layers: Iterable[int] | None = None,
        pre_rope: bool | None = None,
        hot_dtype: torch.dtype | None = None,
        int8_hot_values: bool = True,
        options: KakeyaOptions | None = None,
        code_sliding: bool = False,
    ) -> None:
        if not isinstance(config, PretrainedConfig):
            raise TypeError(
                f"config must be a transformers PretrainedConfig, got {type(config).__name__}"
            )
        code_sliding = flag("code_sliding", code_sliding)
        self.calibration = load_calibration(calibration, config)
        self.recipe = resolve_recipe(
            config,
            recipe,
            self.calibration,
            k_params,
            v_params,
            sink_tokens,
            pre_rope,
            code_sliding,
        )
        self.residual_length = non_negative_int("residual_length", residual_length)
        self.layer_plan: list[LayerSpec] = build_layer_plan(config, skip_layers, code_sliding)
        if recipe is None:  # the default recipe gives coded windows the bits they need
            self.recipe = with_window_bits(self.recipe, self.layer_plan)
        self._rope = ModelRope(config)
        if options is None:
            options = KakeyaOptions()
        elif not isinstance(options, KakeyaOptions):
            raise TypeError(f"options must be a KakeyaOptions, got {type(options).__name__}")
        self.options = options
        self._ctx = CacheContext(
            budget=DecodedBudget(options.decoded_cache_bytes),
            pipeline=Pipeline(self.recipe, self.calibration, self._rope),
            hot_dtype=_floating_dtype("hot_dtype", hot_dtype),
            int8_hot_values=flag("int8_hot_values", int8_hot_values),
            attention_precision=options.attention_precision,
            prepare_keys_ahead=options.prepare_keys_ahead,
            flush_together_bytes=options.flush_together_bytes,
        )
        cfg = text_config(config)
        layers = [
            self._make_layer(spec, cfg)
            for spec in self.layer_plan[: cache_layer_count(self.layer_plan)]
        ]
        if not any(spec.kind in CODED_KINDS for spec in self.layer_plan):
            warnings.warn(
                "KakeyaCache: this model has no compressible full-attention layer (all are "
                "sliding, chunked, "
                "shared or skipped); the cache holds everything at full precision",
                UserWarning,
                stacklevel=2,
            )
        # The layers whose codes attention reads, each making the next one's keys ahead.
        compressed = [layer for layer in layers if type(layer) is KakeyaLayer]
        for layer, following in zip(compressed, compressed[1:]):
            self._ctx.following[layer.layer_idx] = weakref.ref(following)
        self._hook_handles: list = []
        self._active: list = []  # ACTIVE_STEP tokens of the hooked forward in flight
        # Hand the codes to the model's attention where it is the "kakeya" one (from_model).
        self.coded_attention = True
        super().__init__(layers=layers)

    # What the recipe and the options chose (read-only).
    pre_rope = property(lambda self: self.recipe.pre_rope)
    sink_tokens = property(lambda self: self.recipe.sink_tokens)
    int8_hot_values = property(lambda self: self._ctx.int8_hot_values)
    attention_precision = property(lambda self: self._ctx.attention_precision)

    def _make_layer(self, spec: LayerSpec, cfg: PretrainedConfig):
        if spec.kind is LayerKind.COMPRESSED:
            # The pipeline's own table for this layer: the layer reports it as held.
            rope = self._rope(spec.index) if self.pre_rope else None
            return KakeyaLayer(spec.index, self.residual_length, self.sink_tokens, self._ctx, rope)
        if spec.kind is LayerKind.SLIDING_COMPRESSED:
            assert spec.window is not None  # build_layer_plan sets it for bounded layers
            rope = self._rope(spec.index) if self.pre_rope else None
            return SlidingKakeyaLayer(
                spec.index, spec.window, self.residual_length, self._ctx, rope
            )
        if spec.kind is LayerKind.FULL_PRECISION:
            return DynamicLayer()
        if spec.kind in (LayerKind.SLIDING, LayerKind.CHUNKED):
            assert spec.window is not None  # build_layer_plan sets it for bounded layers
            return DynamicSlidingWindowLayer(sliding_window=spec.window)
        assert DummyLayer is not None  # SHARED only reaches here on >= 5.23 (cache_layer_count)
        return DummyLayer()

    @classmethod
    def from_model(
        cls, model: PreTrainedModel, *, coded_attention: bool | None = None, **kwargs: Any
    ) -> KakeyaCache:
        """Build a cache for ``model`` and change the model: hook its decoder, switch its attention.

        The cache takes the constructor's keyword arguments (none: the default recipe with the
        model's own calibration bundle, fitted on first use and cached: ``calibration="auto"``;
        ``calibration=None`` codes without one, fitting frames per sequence). The
        model is changed in place: forward hooks on its decoder let the cache see each
        forward's positions and padding (:meth:`detach` removes them), and, unless
        ``coded_attention=False``, its attention implementation becomes ``"kakeya"``.

        ``coded_attention``: attend over the compressed blocks' codes instead of decoding them
        into dense keys and values every step (``hf/coded_attention.py``; same outputs to
        float32 rounding, far less work per step). It switches the model to the ``"kakeya"``
        attention implementation, which is ``sdpa`` for every other cache and layer. None
        (default): on where the model uses ``sdpa`` attention; True: required (raises where
        the model cannot switch); False: off, the model is left as it is.
        """
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"model must be a transformers model, got {type(model).__name__}")
        kwargs["calibration"] = load_calibration(kwargs.get("calibration", AUTO), model)
        cache = cls(model.config, **kwargs)
        cache.attach(model)
        cache.coded_attention = coded_attention is not False
        if cache.coded_attention:
            _use_coded_attention(model, required=bool(coded_attention))
        return cache

    # ---- model hook --------------------------------------------------------------------------

    def attach(self, model: torch.nn.Module) -> None:
        """Hook ``model``'s decoder so this cache sees each forward's position ids and 2-D
        attention mask. ``from_model`` calls it; call :meth:`detach` to remove the hooks."""
        self.detach()
        self._model_ref = weakref.ref(model)  # the model `save` identifies the file by
        decoder = getattr(model, "base_model", None)
        decoder = decoder if isinstance(decoder, torch.nn.Module) else model
        names = list(inspect.signature(decoder.forward).parameters)
        ref = weakref.ref(self)

        def pre_hook(module, args, kwargs):
            cache = ref()
            if cache is None:
                return None
            bound = dict(zip(names, args))
            bound.update(kwargs)
            # The decoder takes the cache as ``cache`` from transformers 5.24 and as
            # ``past_key_values`` before; a direct call may still use the old name.
            if any(bound.get(name) is cache for name in ("cache", "past_key_values")):
                coded = cache.coded_attention and (
                    getattr(module.config, "_attn_implementation", None) == ATTENTION_NAME
                )
                step = StepInputs(
                    bound.get("position_ids"),
                    bound.get("attention_mask"),
                    coded_attention=coded,
                    hooked=True,
                )
                cache._ctx.step = step
                cache._active.append(ACTIVE_STEP.set(step))
            return None

        def post_hook(module, args, kwargs, output):
            cache = ref()
            if cache is None:
                return None
            try:
                # The appends and flushes that waited for the forward's end (after a failed
                # forward too: the layers that took its tokens count them already).
                finish_forward(cache._ctx.step)
            finally:
                cache._ctx.step = StepInputs()
                if cache._active:
                    ACTIVE_STEP.reset(cache._active.pop())
            return None

        self._hook_handles = [
            decoder.register_forward_pre_hook(pre_hook, with_kwargs=True),
            decoder.register_forward_hook(post_hook, with_kwargs=True, always_call=True),
        ]
        for handle in self._hook_handles:
            weakref.finalize(self, handle.remove)

    def __deepcopy__(self, memo):
        # A copy (the prompt-reuse pattern deep-copies caches) shares nothing with the original
        # and is not hooked: its handles would remove the original's hooks. Call attach(model)
        # on the copy when it needs positions (pre-RoPE) or padding-aware sinks.
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name, value in vars(self).items():
            fresh = name in ("_hook_handles", "_active")
            setattr(new, name, [] if fresh else copy.deepcopy(value, memo))
        return new

    def detach(self) -> None:
        """Remove the model hooks installed by :meth:`attach`."""
        for handle in getattr(self, "_hook_handles", []):
            handle.remove()
        self._hook_handles = []

    # ---- save / load -------------------------------------------------------------------------

    def save(self, path: str | os.PathLike, model: PreTrainedModel | None = None) -> int:
        """Write this cache's state (coded blocks, sinks, hot window, lengths, positions,
        self-fitted frames) to one versioned, checksummed file (``hf/persist.py``), with the
        identity of ``model`` (default: the model :meth:`attach` / :meth:`from_model` hooked)
        and of this cache's settings. Returns the file's size in bytes.

        Raises NotImplementedError for a layer whose blocks are held on a GPU only (coded
        attention there) and for sliding-window layers."""
        from .persist import save_cache

        if model is None:
            ref = getattr(self, "_model_ref", None)
            model = None if ref is None else ref()
            if model is None:
                raise ValueError("KakeyaCache.save: pass the model (this cache was never attached)")
        return save_cache(self, model, path)

    @classmethod
    def load(cls, path: str | os.PathLike, model: PreTrainedModel, **kwargs: Any) -> KakeyaCache:
        """A cache for ``model`` holding the state :meth:`save` wrote to ``path``: built by
        :meth:`from_model` with ``kwargs`` (build it as the saved one was built), then filled
        from the file on the model's device.

        Raises:
            kakeyaturbo.hf.CacheMismatchError (a ValueError): the file was saved for another
                model (config fields, dtype, weights hash) or other settings (recipe,
                residual length, layer plan, hot dtype, options, calibration bundle); the
                message names each field that differs.
            kakeyaturbo.hf.CacheFileError (a ValueError): not a cache file, truncated,
                damaged (checksum), another format version, or streams the codec refuses.
        """
        from .persist import load_cache

        cache = cls.from_model(model, **kwargs)
        load_cache(cache, model, path)
        return cache

    # ---- accounting --------------------------------------------------------------------------

    def memory_report(self) -> dict:
        """Bytes held, measured from the tensors and encoded blocks actually held.

        Keys (totals, and per layer under ``"layers"``):
            compressed_bytes: sum of the encoded blocks' exact serialized sizes (where a layer
                holds its blocks on the device attention decodes them on, a GPU: the bytes
                held there, their only copy).
            full_precision_bytes: uncompressed key/value tensors held (hot window, sinks,
                skipped / sliding layers).
            aux_bytes: bookkeeping tensors (sink slots, RoPE positions in pre-RoPE mode).
            decoded_cache_bytes: decoded blocks kept under the ``decoded_cache_bytes`` budget.
            device_copy_bytes: blocks held on the host and also copied, as stored, to a device
                attention decodes them on (only where a layer filled on the CPU kernels is
                attended off them later).
            total_bytes: the sum of the five above.
            dense_bytes: what a ``DynamicCache`` holds for the same tokens (model dtype).
            bf16_equivalent_bytes: the same tokens as bfloat16.
            ratio: dense_bytes / total_bytes (how many times fewer bytes than DynamicCache).
            ratio_vs_bf16: bf16_equivalent_bytes / total_bytes.
            note (totals only): a plain-English line on what is compressed, and, while
                nothing is yet, why (tokens held exact as sinks and hot window; after how many
                tokens blocks start being coded).
        """
        layers = []
        for spec, layer in zip(self.layer_plan, self.layers):
            rep = (
                layer.memory_report()
                if isinstance(layer, KakeyaLayer)
                else _plain_layer_report(layer, spec)
            )
            rep["kind"] = spec.kind.value
            rep["layer"] = spec.index
            layers.append(rep)
        totals = {key: sum(r[key] for r in layers) for key in _REPORT_SUMS}
        total = totals["total_bytes"]
        totals["ratio"] = totals["dense_bytes"] / total if total else 1.0
        totals["ratio_vs_bf16"] = totals["bf16_equivalent_bytes"] / total if total else 1.0
        totals["decoded_cache_budget_bytes"] = self._ctx.budget.limit
        totals["note"] = compression_note(
            layers, self.residual_length, self.sink_tokens, self.recipe.block_size
        )
        totals["layers"] = layers
        return totals

    def __repr__(self) -> str:
        kinds = [spec.kind.value for spec in self.layer_plan]
        return (
            f"KakeyaCache(layers={kinds}, residual_length={self.residual_length}, "
            f"sink_tokens={self.sink_tokens})"
        )


def _use_coded_attention(model: torch.nn.Module, required: bool) -> None:
    """Switch ``model`` to the "kakeya" attention (it is sdpa's wherever no KakeyaCache layer
    hands over codes, so the model computes what it did); only from sdpa, whose masks it uses."""
    current = getattr(model.config, "_attn_implementation", None)
    if current == ATTENTION_NAME:
        return
    switchable = current == "sdpa" and hasattr(model, "set_attn_implementation")
    if switchable and getattr(model, "_can_set_attn_implementation", lambda: True)():
        model.set_attn_implementation(ATTENTION_NAME)
        if model.config._attn_implementation == ATTENTION_NAME:
            return
    if required:
        raise ValueError(
            f"coded_attention=True needs a model using 'sdpa' attention that can switch its "
            f"implementation (transformers' AttentionInterface); this one uses {current!r}"
        )


def _plain_layer_report(layer, spec: LayerSpec) -> dict:
    """Report for a transformers layer kept as is: its key/value tensors are full precision and
    any other tensor it holds (the sliding-window scalar) is bookkeeping."""
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    full = storage_bytes(keys) + storage_bytes(values)
    aux = sum(
        storage_bytes(t)
        for name, t in vars(layer).items()
        if isinstance(t, torch.Tensor) and name not in ("keys", "values")
    )
    held = 0
    bf16 = dense = 0
    if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor) and keys.dim() == 4:
        held = keys.shape[-2]
        per_token = keys.shape[0] * keys.shape[1] * (keys.shape[-1] + values.shape[-1])
        dense, bf16 = per_token * held * keys.element_size(), per_token * held * 2
    tokens = layer.get_seq_length() if hasattr(layer, "get_seq_length") else held
    return report(spec.kind.value, tokens, 0, 0, full, aux, 0, bf16, dense)
