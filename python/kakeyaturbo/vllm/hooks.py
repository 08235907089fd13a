"""Install and remove the codec's hooks on a vLLM model (an ``nn.Module`` built by vLLM).

Three kinds of hook, all removable, none touching a class (only this model's instances):

* a forward pre-hook on the model itself reads the forward's ``positions`` (and, when vLLM's
  forward context is set, the sequences' ``query_start_loc``) and plans which rows to code
  (:func:`~kakeyaturbo.vllm.coder.plan_forward`), once for all layers;
* ``hook="pre-rope"``: each supported attention module (``LlamaAttention``,
  ``Qwen2Attention`` and their subclasses) gets its ``rotary_emb`` attribute replaced by a
  per-layer wrapper that codes the keys before delegating to the original (vLLM shares one
  rotary module between layers, so the module itself is never hooked);
* each vLLM ``Attention`` layer gets a pre-hook (in-forward mode: it swaps in the
  reconstructed K/V before the cache write and the attention) or a post-hook (snapshot mode:
  after the exact attention has run, it calls the layer once more with the reconstructed K/V,
  which overwrites the same cache slots; that second call's output is discarded).

vLLM's attention reads K/V back from its paged cache, so what the cache holds is what every
later decode step attends to. Written against vLLM 0.32 (``vllm.model_executor.layers.
attention.Attention``; ``vllm.attention.layer.Attention`` before 0.15); the model must run
eagerly (``enforce_eager=True``): the hooks run Python and the CPU codec inside the forward,
which neither torch.compile nor CUDA graphs can capture.
"""

from __future__ import annotations

import inspect
import re
import weakref
from typing import Any, Optional

import torch

from .coder import ForwardPlan, HookStats, KVCoder, plan_forward, runs_from_query_starts
from .config import VLLMHookConfig

__all__ = ["KakeyaVLLMHooks", "PRE_ROPE_FAMILIES", "install_hooks", "layer_index"]

#: Attention modules whose forward is ``qkv -> split -> rotary_emb(positions, q, k) ->
#: attn(q, k, v)`` (checked in vLLM 0.32's installed llama.py and qwen2.py), matched by class name
#: along the MRO so that subclasses (Mistral, ...) count.
PRE_ROPE_FAMILIES = ("LlamaAttention", "Qwen2Attention")


def layer_index(layer_name: str) -> int:
    """The decoder layer index in a vLLM layer name (``model.layers.3.self_attn.attn`` -> 3)."""
    nums = re.findall(r"(?:^|\.)(\d+)(?=\.|$)", layer_name)
    if len(nums) != 1:
        raise ValueError(f"cannot tell the layer index of {layer_name!r}")
    return int(nums[0])


def _is_attention_layer(m: torch.nn.Module) -> bool:
    """vLLM's ``Attention`` by what the hooks use of it (MLA and encoder layers excluded)."""
    if not all(hasattr(m, a) for a in ("layer_name", "num_kv_heads", "head_size", "impl")):
        return False
    if getattr(m, "kv_sharing_target_layer_name", None) is not None:
        return False  # it reads another layer's cache and writes none
    attn_type = str(getattr(m, "attn_type", "decoder")).lower()
    return attn_type.endswith("decoder") and "encoder" not in attn_type


def _family(m: torch.nn.Module) -> Optional[str]:
    names = [c.__name__ for c in type(m).__mro__]
    return next((f for f in PRE_ROPE_FAMILIES if f in names), None)


def _split_qkv(args: tuple, kwargs: dict) -> tuple[Any, Any, Any]:
    names = ("query", "key", "value")
    vals = [args[i] if i < len(args) else kwargs.get(n) for i, n in enumerate(names)]
    return vals[0], vals[1], vals[2]


def _with_kv(args: tuple, kwargs: dict, k: Any, v: Any) -> tuple[tuple, dict]:
    args, kwargs = list(args), dict(kwargs)
    for i, name, val in ((1, "key", k), (2, "value", v)):
        if i < len(args):
            args[i] = val
        else:
            kwargs[name] = val
    return tuple(args), kwargs


class _KeyCodingRotary(torch.nn.Module):
    """One layer's stand-in for its (shared) rotary embedding: codes the pre-RoPE keys."""

    def __init__(self, inner: torch.nn.Module, hooks: KakeyaVLLMHooks, layer: int, head_dim: int):
        super().__init__()
        self.inner = inner
        self._hooks = weakref.ref(hooks)  # a dropped, never removed handle codes nothing
        self._layer = layer
        self._head_dim = head_dim

    def forward(self, positions, query, key=None, *args, **kwargs):
        hooks, layer = self._hooks(), self._layer
        plan = None if hooks is None else hooks._plan
        if key is None or hooks is None or plan is None:
            return self.inner(positions, query, key, *args, **kwargs)
        k_hat = hooks.coder.roundtrip(key, layer, "k", plan, self._head_dim)
        if k_hat is key:
            return self.inner(positions, query, key, *args, **kwargs)
        if hooks.config.mode == "in-forward":
            return self.inner(positions, query, k_hat, *args, **kwargs)
        q_rot, k_rot = self.inner(positions, query, key, *args, **kwargs)
        # Rotate the reconstruction too (vLLM's CUDA rotary works in place on both arguments,
        # so it gets a scratch query of its own), for the cache write after the attention.
        _, k_hat_rot = self.inner(positions, k_hat.clone(), k_hat, *args, **kwargs)
        hooks._pending_k[layer] = k_hat_rot
        return q_rot, k_rot


class KakeyaVLLMHooks:
    """The hooks installed on one model; :meth:`remove` takes them all off again."""

    def __init__(self, model: torch.nn.Module, config: VLLMHookConfig, hf_config: Any = None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.config = config
        if hf_config is None:
            hf_config = getattr(model, "config", None)
        self.coder = KVCoder(config, hf_config)
        self._plan: Optional[ForwardPlan] = None
        self._pending_k: dict[int, torch.Tensor] = {}
        self._handles: list = []
        self._swapped: list[tuple[torch.nn.Module, torch.nn.Module]] = []  # (parent, rotary)
        #: decoder layer index -> vLLM layer name, for every hooked attention layer
        self.layers: dict[int, str] = {}
        try:
            self._install(model)
        except BaseException:
            self.remove()  # leave the model as it was
            raise

    # ---- installation ----------------------------------------------------------------------

    def _install(self, model: torch.nn.Module) -> None:
        attn_layers = [m for m in model.modules() if _is_attention_layer(m)]
        if not attn_layers:
            raise NotImplementedError(
                f"{type(model).__name__} has no vLLM decoder Attention layer to hook"
            )
        parents = {
            id(m.attn): m
            for m in model.modules()
            if isinstance(getattr(m, "attn", None), torch.nn.Module)
        }
        for attn in attn_layers:
            layer = layer_index(attn.layer_name)
            if layer in self.layers:
                raise ValueError(f"two attention layers with index {layer}: {attn.layer_name}")
            self.layers[layer] = attn.layer_name
            if self.config.hook == "pre-rope":
                self._wrap_rotary(parents.get(id(attn)), attn, layer)
        positions_at = _positions_index(model)
        ref = weakref.ref(self)

        def plan_hook(module, args, kwargs):
            hooks = ref()
            if hooks is not None:
                pos = kwargs.get("positions")
                if pos is None and positions_at < len(args):
                    pos = args[positions_at]
                hooks._begin_forward(pos)

        def end_hook(module, args, kwargs, output):
            hooks = ref()
            if hooks is not None:
                hooks._plan = None
                hooks._pending_k.clear()

        self._handles.append(model.register_forward_pre_hook(plan_hook, with_kwargs=True))
        self._handles.append(
            model.register_forward_hook(end_hook, with_kwargs=True, always_call=True)
        )
        for attn in attn_layers:
            self._hook_attention(attn, layer_index(attn.layer_name))

    def _wrap_rotary(self, parent: Optional[torch.nn.Module], attn, layer: int) -> None:
        if parent is None or _family(parent) is None or not hasattr(parent, "rotary_emb"):
            got = "no parent module" if parent is None else type(parent).__name__
            raise NotImplementedError(
                f"hook='pre-rope' supports attention modules of the {PRE_ROPE_FAMILIES} "
                f"families; {attn.layer_name} sits in {got}. Use hook='post-rope'."
            )
        rotary = parent.rotary_emb
        parent.rotary_emb = _KeyCodingRotary(rotary, self, layer, int(attn.head_size))
        self._swapped.append((parent, rotary))

    def _hook_attention(self, attn: torch.nn.Module, layer: int) -> None:
        head_dim = int(attn.head_size)
        ref = weakref.ref(self)
        post_rope_k = self.config.hook == "post-rope"

        def reconstruct(hooks, k, v):
            plan = hooks._plan
            if plan is None:
                return k, v
            if post_rope_k and k is not None:
                k = hooks.coder.roundtrip(k, layer, "k", plan, head_dim)
            elif k is not None:
                k = hooks._pending_k.pop(layer, k)
            if v is not None:
                v = hooks.coder.roundtrip(v, layer, "v", plan, head_dim)
            return k, v

        if self.config.mode == "in-forward":

            def pre_hook(module, args, kwargs):
                hooks = ref()
                if hooks is None:
                    return None
                _, k, v = _split_qkv(args, kwargs)
                k_hat, v_hat = reconstruct(hooks, k, v)
                if k_hat is k and v_hat is v:
                    return None
                return _with_kv(args, kwargs, k_hat, v_hat)

            self._handles.append(attn.register_forward_pre_hook(pre_hook, with_kwargs=True))
            return

        def post_hook(module, args, kwargs, output):
            hooks = ref()
            if hooks is None:
                return None
            _, k, v = _split_qkv(args, kwargs)
            k_hat, v_hat = reconstruct(hooks, k, v)
            if k_hat is not k or v_hat is not v:
                # Same forward context, same slots: the cache now holds the reconstruction.
                a, kw = _with_kv(args, kwargs, k_hat, v_hat)
                module.forward(*a, **kw)
            return None

        self._handles.append(attn.register_forward_hook(post_hook, with_kwargs=True))

    # ---- per forward -----------------------------------------------------------------------

    def _begin_forward(self, positions: Any) -> None:
        self._pending_k.clear()
        if not isinstance(positions, torch.Tensor) or positions.dim() != 1:
            # No usable positions (multimodal M-RoPE passes [3, tokens]): code nothing.
            self._plan = None
            return
        n = int(positions.shape[0])
        self._plan = plan_forward(positions, self.config, _runs_from_forward_context(n))
        self.coder.stats.forwards += 1
        self.coder.stats.coded_forwards += bool(self._plan.coded)

    # ---- public ----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Tokens coded and kept exact, exact serialized bytes, ratio, seconds (see README)."""
        out = self.coder.stats.as_dict()
        out["config"] = self.config.to_dict()
        return out

    def reset_stats(self) -> None:
        self.coder.stats = HookStats()

    def remove(self) -> None:
        """Take every hook off and put the original rotary embeddings back."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for parent, rotary in self._swapped:
            parent.rotary_emb = rotary
        self._swapped = []
        self._plan = None
        self._pending_k.clear()

    @property
    def installed(self) -> bool:
        return bool(self._handles)


def _positions_index(model: torch.nn.Module) -> int:
    """Where ``positions`` sits among the model forward's positional arguments."""
    params = list(inspect.signature(model.forward).parameters)
    if "positions" not in params:
        raise NotImplementedError(
            f"{type(model).__name__}.forward takes no `positions`: not a vLLM decoder model"
        )
    return params.index("positions")


def _runs_from_forward_context(num_tokens: int) -> Optional[list[tuple[int, int]]]:
    """The sequences' row ranges from vLLM's attention metadata, when a forward context is set
    and its metadata has ``query_start_loc``; None otherwise (positions decide)."""
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available
    except ImportError:
        return None
    if not is_forward_context_available():
        return None
    meta = get_forward_context().attn_metadata
    if isinstance(meta, list):
        meta = meta[0] if meta else None
    if isinstance(meta, dict):
        meta = next(
            (m for m in meta.values() if getattr(m, "query_start_loc", None) is not None), None
        )
    qsl = getattr(meta, "query_start_loc", None)
    if not isinstance(qsl, torch.Tensor):
        return None
    runs = runs_from_query_starts(qsl.detach().to("cpu").numpy())
    return runs if runs and runs[-1][1] <= num_tokens else None


def install_hooks(
    model: Any, config: Optional[VLLMHookConfig] = None, *, hf_config: Any = None
) -> KakeyaVLLMHooks:
    """Hook ``model`` so that its attention K/V are round-tripped through the codec.

    ``model`` is the ``nn.Module`` vLLM built (``LLM.apply_model`` hands it over), or a
    ``vllm.LLM`` whose model lives in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
    one GPU). ``config`` defaults to :class:`VLLMHookConfig` ``()``. Returns the handle whose
    :meth:`~KakeyaVLLMHooks.remove` undoes it and :meth:`~KakeyaVLLMHooks.stats` reports.
    """
    config = VLLMHookConfig() if config is None else config
    if not isinstance(config, VLLMHookConfig):
        raise TypeError(f"config must be a VLLMHookConfig, got {type(config).__name__}")
    if hasattr(model, "llm_engine"):
        from .engine import check_eager, in_process_model

        check_eager(model.llm_engine.vllm_config)
        model = in_process_model(model)
    return KakeyaVLLMHooks(model, config, hf_config)
