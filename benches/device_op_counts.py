"""Torch ops and Triton launches of one decode step (or of the prompt's prefill, ``--prefill``)
as a GPU would make them, counted on the CPU: DynamicCache's, and KakeyaCache's with torch ops
only and with the Triton kernels.

    python benches/device_op_counts.py --calibration artifacts/calib-smollm2-joint-both
    python benches/device_op_counts.py --calibration artifacts/calib-smollm2-joint-both \
        --prefill --context 4096

On a GPU a decode step of KakeyaCache is set by the host queueing small kernels, one per op
(``reports/gpu_h100.txt``), so the ops per step are what the GPU work has to cut. Here the
model runs on the CPU with attention over the codes on its torch path (``CPU_KERNELS =
False``, as on a GPU), the hot window's int8 rows encoded as on a GPU (``encode_torch``, or the
Triton encoder), and the Triton kernels in Triton's interpreter, made to run on the CPU. An
op counts where it does work (views, empty tensors and casts to the same dtype do not); a
Triton kernel counts one launch and the ops inside the interpreter none. No time is
measured: the interpreter is slow. Beside the counts, the most bytes of tensors made during the
step or prefill alive at once: each storage an op makes is tracked until its last tensor is
gone, which is what a GPU's caching allocator would have to hold beyond what was there (but
for its rounding), free of the CPU allocator's noise. Results: reports/device_op_counts.txt.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported

import argparse  # noqa: E402
import collections  # noqa: E402
import re  # noqa: E402
import traceback  # noqa: E402
import weakref  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from bench_args import add_model_and_text  # noqa: E402  (benches/, beside this script)
from kakeyaturbo.calibration import Calibration  # noqa: E402
from kakeyaturbo.gpu import (  # noqa: E402
    encode_kernels,
    fused_attention,
    fused_decode,
    fused_int8_rows,
    fused_norm_encode,
    joint_attend_kernels,
)
from kakeyaturbo.gpu.triton_support import checked_kernels  # noqa: E402
from kakeyaturbo.hf import (  # noqa: E402
    CACHE_ARG,
    KakeyaCache,
    KakeyaOptions,
    coded_attention,
    hot_window,
    int8_rows,
)
from kakeyaturbo.hf.context import DEFERRED_FLUSH_BYTES  # noqa: E402
from kakeyaturbo.modeling import load_model, read_text, tokenize_text  # noqa: E402

NO_WORK = re.compile(
    r"aten\.(view|_reshape_alias|_unsafe_view|as_strided|unsqueeze|squeeze|select|slice|"
    r"narrow|split|split_with_sizes|chunk|unbind|unflatten|flatten|transpose|t|permute|expand|"
    r"expand_as|view_as|diagonal|detach|alias|lift_fresh|resolve_conj|resolve_neg|empty|"
    r"empty_like|empty_strided|new_empty|new_empty_strided|numpy_T|result_type|item|"
    r"_local_scalar_dense|is_nonzero|equal)\."
)
# Ops that return their input where there is nothing to do (a cast to the same dtype).
MAYBE_NOTHING = re.compile(r"aten\.(to|reshape|contiguous|type_as)\.")
# (module, its Triton kernel)
KERNELS = (
    (fused_decode, "decode_kernel"),
    (fused_decode, "norms_kernel"),
    (encode_kernels, "plan_kernel"),
    (encode_kernels, "codes_kernel"),
    (encode_kernels, "totals_kernel"),
    (encode_kernels, "outliers_kernel"),
    (fused_norm_encode, "norm_codes_kernel"),
    (fused_attention, "key_logits_kernel"),
    (fused_int8_rows, "encode_kernel"),
    (joint_attend_kernels, "partials_kernel"),
    (joint_attend_kernels, "combine_kernel"),
)


class Counts(TorchDispatchMode):
    """Working torch ops by the innermost kakeyaturbo function on the stack ("model" else);
    none while a Triton kernel runs (``quiet``). And the most bytes of tensors made inside
    alive at once (``peak``): what a GPU's caching allocator would have to hold beyond what
    was there before (but for its rounding), free of the CPU allocator's noise."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter = collections.Counter()
        self.quiet = False
        self.live: dict[int, list[int]] = {}  # storage address: [bytes, tensors holding it]
        self.now = self.peak = 0
        self.peak_at = "nowhere"  # where the peak was reached: the innermost package calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._track(args, kwargs, out)
        name = str(func)
        if self.quiet or NO_WORK.match(name):
            return out
        first = args[0] if args else None
        same = isinstance(out, torch.Tensor) and isinstance(first, torch.Tensor)
        if MAYBE_NOTHING.match(name) and same and out.data_ptr() == first.data_ptr():
            return out
        # A foreach copy is one launch on a GPU only where CUDA's fast route takes it.
        many = name.startswith("aten._foreach_copy_")
        self.sites[_site()] += hot_window.launches(args[0], args[1]) if many else 1
        return out

    def _track(self, args, kwargs, out) -> None:
        """Count the storages an op made (not its inputs': views, in-place ops), each until
        the last tensor made here on it is gone."""
        given = set()
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                given.add(t.untyped_storage().data_ptr())
            elif isinstance(t, (torch.UntypedStorage, torch.TypedStorage)):  # set_'s
                given.add(t.data_ptr())
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            at = storage.data_ptr()
            if at in self.live:
                self.live[at][1] += 1
            elif at in given or storage.nbytes() == 0:
                continue
            else:
                self.live[at] = [storage.nbytes(), 1]
                self.now += storage.nbytes()
                if self.now > self.peak:
                    self.peak, self.peak_at = self.now, _site(calls=3)
            weakref.finalize(t, self._release, at)

    def _release(self, at: int) -> None:
        held = self.live[at]
        held[1] -= 1
        if held[1] == 0:
            self.now -= held[0]
            del self.live[at]


def _site(calls: int = 1) -> str:
    """The innermost kakeyaturbo function on the stack ("model" where there is none), or the
    innermost ``calls`` of them, innermost first."""
    found = []
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/kakeyaturbo/" in frame.filename.replace("\\", "/"):
            found.append(re.sub(r".*/kakeyaturbo/", "", frame.filename) + ":" + frame.name)
            if len(found) == calls:
                break
    return " < ".join(found) or "model"


class Launches:
    """A Triton kernel that counts its launches, and whose work inside the interpreter is not
    counted as torch ops."""

    def __init__(self, kernel, name: str, counts: Counts, launches: collections.Counter):
        self.kernel, self.name, self.counts, self.launches = kernel, name, counts, launches

    def __getitem__(self, grid):
        run = self.kernel[grid]

        def launch(*args, **kwargs):
            self.launches[self.name] += 1
            self.counts.quiet = True
            try:
                return run(*args, **kwargs)
            finally:
                self.counts.quiet = False

        return launch


def use_kernels(on: bool, counts: Counts, launches: collections.Counter) -> None:
    """The Triton kernels run (interpreted) wherever they would on a GPU, or never; the int8
    rows are encoded as on a GPU."""
    for module, kernel in KERNELS:
        real = getattr(module, kernel)
        real = real.kernel if isinstance(real, Launches) else real
        setattr(module, kernel, Launches(real, kernel.strip("_"), counts, launches))
    # Each kernel passes (or fails) its device's check as if on a GPU; the modules' own limits
    # (query rows, row widths) still decide where it runs.
    for checked in checked_kernels():
        checked.usable = lambda device, check, _on=on: _on
    int8_rows.encode = fused_int8_rows.encode if on else int8_rows.encode_torch


@torch.inference_mode()
def one_step(model, ids, ctx: int, cache, counts: Counts, launches: collections.Counter) -> None:
    model(ids[:, :ctx], **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1)
    model(ids[:, ctx : ctx + 1], **{CACHE_ARG: cache}, use_cache=True)
    launches.clear()  # the step's only
    with counts:
        model(ids[:, ctx + 1 : ctx + 2], **{CACHE_ARG: cache}, use_cache=True)


@torch.inference_mode()
def prefill(model, ids, ctx: int, cache, counts: Counts, launches: collections.Counter) -> None:
    launches.clear()
    with counts:
        model(ids[:, :ctx], **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_and_text(ap)
    ap.add_argument("--calibration", type=Path, default=None, help="a bundle (default: none)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--top", type=int, default=12, help="call sites listed per setting")
    ap.add_argument("--prefill", action="store_true", help="count the prompt's forward")
    ap.add_argument(
        "--flush-together-mib",
        type=float,
        default=DEFERRED_FLUSH_BYTES / 2**20,
        help="KakeyaCache's flush_together_bytes, in MiB (0: each layer flushes alone)",
    )
    args = ap.parse_args()
    run, what = (prefill, "prefill") if args.prefill else (one_step, "step")

    torch.set_num_threads(1)
    coded_attention.CPU_KERNELS = False
    model, tok = load_model(args.model, dtype="float32")
    ids = tokenize_text(tok, read_text(args.text))[: args.context + 2][None]
    bundle = None if args.calibration is None else Calibration.load(args.calibration, model)
    print(
        f"model {Path(args.model).name}, bundle {args.calibration}, context {args.context}, "
        f"counting the {what}, flush_together_bytes {args.flush_together_mib:g} MiB"
    )
    settings = (
        ("DynamicCache", None),
        ("KakeyaCache, torch ops", False),
        ("KakeyaCache, Triton kernels", True),
    )
    for label, kernels in settings:
        counts, launches = Counts(), collections.Counter()
        if kernels is None:
            model.set_attn_implementation("sdpa")
            cache = DynamicCache(config=model.config)
        else:
            use_kernels(kernels, counts, launches)
            cache = KakeyaCache.from_model(
                model,
                calibration=bundle,
                hot_dtype=torch.bfloat16,
                options=KakeyaOptions(flush_together_bytes=int(args.flush_together_mib * 2**20)),
            )
        run(model, ids, args.context, cache, counts, launches)
        own = sum(n for site, n in counts.sites.items() if site != "model")
        total = sum(counts.sites.values()) + sum(launches.values())
        print(
            f"\n{label}: {total} ops and launches per {what}, {counts.sites['model']} of them "
            f"the model's (transformers), {own + sum(launches.values())} the cache's "
            f"(Triton launches: {dict(launches) or 'none'}); tensors made in it alive at once: "
            f"{counts.peak / 2**20:.1f} MiB at most, reached in {counts.peak_at}"
        )
        for site, n in counts.sites.most_common(args.top):
            print(f"  {n:6d}  {site}")


if __name__ == "__main__":
    main()
