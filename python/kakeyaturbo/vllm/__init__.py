"""vLLM integration: round-trip K and V through the codec inside vLLM's forward.

>>> from kakeyaturbo.vllm import VLLMHookConfig, install_hooks
>>> hooks = install_hooks(model, VLLMHookConfig(mode="snapshot", calibration="calib"))
>>> ...                                  # run vLLM as usual (enforce_eager=True)
>>> hooks.stats()["ratio_vs_bf16"]; hooks.remove()

or, with no change to user code, the plugin::

    VLLM_PLUGINS=kakeyaturbo KAKEYATURBO_VLLM_CONFIG='{"mode": "snapshot"}' \\
        vllm serve MODEL_DIR --enforce-eager

Written against vLLM 0.32 (:data:`VLLM_VERSION`). Importing this package does not import
vLLM: the tensor path (:class:`KVCoder`) and the hooks work on any torch model laid out like
vLLM's; only :mod:`.plugin` and :mod:`.engine` need vLLM itself. What the hooks measure is
quality: vLLM's paged cache still holds bf16 pages, and the codec's bytes are reported in
``stats()`` rather than saved.
"""

from .coder import KVCoder
from .config import VLLMHookConfig
from .hooks import KakeyaVLLMHooks, install_hooks
from .plugin import register

#: The vLLM release whose installed source tests/integration/test_vllm_contract.py checked
#: the hooks against (class paths, forward bodies, plugin API); the newest that installs on
#: Python 3.11.
VLLM_VERSION = "0.32.0"

# What a user calls; the rest is importable from its own module (``.coder``: plan_forward,
# runs_from_positions; ``.config``: CONFIG_ENV; ``.hooks``: layer_index, PRE_ROPE_FAMILIES;
# ``.plugin``: config_from_env, installed_hooks, worker_stats).
__all__ = [
    "KVCoder",
    "KakeyaVLLMHooks",
    "VLLMHookConfig",
    "VLLM_VERSION",
    "install_hooks",
    "register",
]
