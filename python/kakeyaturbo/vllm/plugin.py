"""The vLLM general plugin: ``VLLM_PLUGINS=kakeyaturbo`` hooks every model vLLM loads.

vLLM calls :func:`register` in every process it starts (the API server, the engine core,
each worker) through the ``vllm.general_plugins`` entry point, before any model is built.
``register`` wraps ``BaseModelLoader.load_model`` (vLLM 0.32:
``vllm.model_executor.model_loader.base_loader``) so that each model it returns has the
hooks installed with the configuration from ``KAKEYATURBO_VLLM_CONFIG``.

vLLM loads every installed general plugin when ``VLLM_PLUGINS`` is unset, so installing
kakeyaturbo must not change a server by itself: the plugin acts only when
``KAKEYATURBO_VLLM_CONFIG`` is set or ``VLLM_PLUGINS`` names ``kakeyaturbo`` (then with the
default configuration).
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
from typing import Any, Optional

from .config import CONFIG_ENV, VLLMHookConfig

__all__ = ["PLUGIN_NAME", "config_from_env", "installed_hooks", "register", "worker_stats"]

PLUGIN_NAME = "kakeyaturbo"
logger = logging.getLogger("kakeyaturbo.vllm")
_INSTALLED: list = []  # KakeyaVLLMHooks of the models loaded in this process


def config_from_env(environ: Optional[dict] = None) -> Optional[VLLMHookConfig]:
    """The configuration the plugin would use, or None when it is not asked to act."""
    env = os.environ if environ is None else environ
    text = env.get(CONFIG_ENV)
    if text:
        return VLLMHookConfig.from_json(text)
    named = [p.strip() for p in env.get("VLLM_PLUGINS", "").split(",")]
    return VLLMHookConfig() if PLUGIN_NAME in named else None


def installed_hooks() -> list:
    """The hooks the plugin installed in this process (one per loaded model)."""
    return list(_INSTALLED)


def worker_stats(worker: Any = None) -> list[dict[str, Any]]:
    """Stats of this process's hooks; ``llm.collective_rpc(worker_stats)`` gathers every
    worker's (multiprocess engines need ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` to send it)."""
    return [h.stats() for h in _INSTALLED]


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (may run several times a process)."""
    config = config_from_env()
    if config is None:
        logger.debug("kakeyaturbo plugin loaded but not asked to act (%s unset)", CONFIG_ENV)
        return
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    if getattr(BaseModelLoader.load_model, "_kakeyaturbo_config", None) is not None:
        return
    original = BaseModelLoader.load_model

    @functools.wraps(original)
    def load_model(self, vllm_config, model_config, *args, **kwargs):
        from .engine import check_eager
        from .hooks import install_hooks

        check_eager(vllm_config)
        model = original(self, vllm_config, model_config, *args, **kwargs)
        hooks = install_hooks(model, config, hf_config=getattr(model_config, "hf_config", None))
        _INSTALLED.append(hooks)
        logger.info(
            "kakeyaturbo: hooked %d attention layers (%s, %s, streams=%s)",
            len(hooks.layers),
            config.mode,
            config.hook,
            config.streams,
        )
        if config.stats_file and len(_INSTALLED) == 1:
            atexit.register(_write_stats, config.stats_file)
        return model

    load_model._kakeyaturbo_config = config  # type: ignore[attr-defined]
    BaseModelLoader.load_model = load_model


def _write_stats(path: str) -> None:
    path = path.replace("{pid}", str(os.getpid()))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(worker_stats(), f, indent=1)
