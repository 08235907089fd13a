"""The parts that touch vLLM's engine objects (imported only where vLLM runs).

Checked against vLLM 0.32: ``VllmConfig.compilation_config.mode`` (``CompilationMode``,
0 = NONE; ``level`` before 0.11) and ``cudagraph_mode``; with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
and one GPU the engine core and its worker live in the ``LLM`` process, and the model is
``llm.llm_engine.model_executor.driver_worker.worker.model_runner.model``.
"""

from __future__ import annotations

from typing import Any

import torch

from .._core import KakeyaTurboError

__all__ = ["EagerModeError", "check_eager", "in_process_model"]


class EagerModeError(KakeyaTurboError, RuntimeError):
    """vLLM would compile or graph-capture the model, which would bake the hooks out."""


def _enum_value(x: Any) -> Any:
    return getattr(x, "value", x)


def check_eager(vllm_config: Any) -> None:
    """Raise :class:`EagerModeError` unless the model runs eagerly (no torch.compile, no CUDA
    graphs): the hooks run Python and the CPU codec inside the forward."""
    cc = getattr(vllm_config, "compilation_config", None)
    if cc is None:
        return
    mode = _enum_value(getattr(cc, "mode", getattr(cc, "level", 0)))
    graphs = getattr(cc, "cudagraph_mode", None)
    graphs_off = (
        graphs is None
        or str(getattr(graphs, "name", graphs)).upper() == "NONE"
        or (_enum_value(graphs) == 0)
    )
    if (mode not in (0, None)) or not graphs_off:
        raise EagerModeError(
            "kakeyaturbo's vLLM hooks need an eager model: start vLLM with --enforce-eager "
            f"(LLM(..., enforce_eager=True)); compilation mode is {mode!r}, CUDA graphs {graphs!r}"
        )


def in_process_model(llm: Any) -> torch.nn.Module:
    """The model of a ``vllm.LLM`` whose worker runs in this process."""
    try:
        executor = llm.llm_engine.model_executor
        model = executor.driver_worker.worker.model_runner.model
    except AttributeError:
        model = None
    if not isinstance(model, torch.nn.Module):
        raise RuntimeError(
            "this LLM's model is not in this process: set VLLM_ENABLE_V1_MULTIPROCESSING=0 "
            "(one GPU) before creating it, or use the plugin (VLLM_PLUGINS=kakeyaturbo with "
            "KAKEYATURBO_VLLM_CONFIG), which hooks every worker"
        )
    return model
