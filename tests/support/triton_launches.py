"""Every Triton launch of an interpreted script, recorded, and each compiled for real GPUs.

Triton's interpreter runs a kernel's Python on the CPU, so it checks the arithmetic but not
what only the compiler enforces: a variable of two types across a runtime ``if``, a function
that returns a float in one branch and a byte in another. Both passed the interpreter and
failed to build on a real GPU (reports/gpu_h100.txt). Triton compiles for a
GPU it does not have (its own LLVM and ptxas), so each launch an interpreted test makes is
compiled here for :data:`TARGETS` with the argument types and constants that launch passed.
"""

from __future__ import annotations

import importlib
import json
import warnings
from pathlib import Path

#: The GPUs a launch must build for: Hopper (H100, H200) and Ampere (A100).
TARGETS = (("cuda", 90, 32), ("cuda", 80, 32))

_POINTEE = {
    "torch.float32": "fp32",
    "torch.float16": "fp16",
    "torch.bfloat16": "bf16",
    "torch.float64": "fp64",
    "torch.int8": "i8",
    "torch.uint8": "u8",
    "torch.int16": "i16",
    "torch.int32": "i32",
    "torch.int64": "i64",
    "torch.bool": "i1",
}
#: Launch options a kernel call may pass beside its arguments.
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


def record(path: str) -> None:
    """In an interpreted process: append each launch (kernel, arguments' types, constants,
    options) to ``path`` as a JSON line, then run it as before."""
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def described(x):
        if isinstance(x, torch.Tensor):
            return {"pointer": _POINTEE[str(x.dtype)]}
        if x is None or isinstance(x, (bool, int, float, str)):
            return {"value": x}
        raise TypeError(f"a launch argument of type {type(x).__name__}")

    def recording(self, *args, grid, warmup, **kwargs):
        named = dict(zip(self.arg_names, args))
        named.update((k, v) for k, v in kwargs.items() if k not in _OPTIONS)
        launch = {
            "module": self.fn.__module__,
            "kernel": self.fn.__name__,
            "args": {k: described(v) for k, v in named.items()},
            "options": {k: kwargs[k] for k in _OPTIONS if k in kwargs},
        }
        with open(path, "a") as f:
            f.write(json.dumps(launch, sort_keys=True) + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording


def compile_recorded(path: Path) -> int:
    """Compile each distinct launch in ``path`` for every target (raising with the kernel's
    name and Triton's message where one does not build); the number of distinct launches."""
    lines = sorted(set(path.read_text().splitlines())) if path.exists() else []
    for line in lines:
        launch = json.loads(line)
        for target in TARGETS:
            _compile(launch, target)
    return len(lines)


def _compile(launch: dict, target: tuple) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    signature, constants = {}, {}
    for p in kernel.params:
        arg = launch["args"].get(p.name, {"value": p.default})
        if p.is_constexpr or arg.get("value", 0) is None:
            signature[p.name] = "constexpr"
            constants[p.name] = arg["value"]
        else:
            signature[p.name] = _scalar(arg)
    src = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    with warnings.catch_warnings():
        # Triton 3.9 asks that its fp-fusion default be chosen (a kernel's own choice is
        # passed in its options): not a compile failure.
        warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION")
        try:
            triton.compile(src, target=GPUTarget(*target), options=launch["options"])
        except Exception as err:
            where = f"{launch['module']}.{launch['kernel']} for sm_{target[1]}"
            raise AssertionError(f"{where} does not compile: {err}") from err


def _scalar(arg: dict) -> str:
    """A non-constant argument's Triton type, as Triton's launcher specialises it."""
    if "pointer" in arg:
        return "*" + arg["pointer"]
    value = arg["value"]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, float):
        return "fp32"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    raise TypeError(f"a launch argument {value!r}")
