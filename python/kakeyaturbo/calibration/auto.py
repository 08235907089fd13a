"""The bundle every user gets: fitted on first use from text the model samples itself, then
kept under ``$KAKEYATURBO_CACHE/bundles/`` and reused for that model, as compilers cache what
they tune. No text, no flags, nothing fitted on what the cache will hold."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

from .bundle import Calibration, model_fingerprint
from .in_float32 import in_float32
from .schema import DEFAULT_VALUE_METRIC, META_FILE, PROBE, PROJ_PROBE, CalibrationError

__all__ = ["AUTO", "AUTO_TOKENS", "auto_calibration", "auto_enabled", "auto_bundle_dir"]

#: The ``calibration`` value that asks for this bundle.
AUTO = "auto"
#: Sampled tokens the bundle is fitted on (32 sequences of 256): on SmolLM2 4k already measured
#: as well as 16k, and 8k was ACCEPT where 4k was MARGINAL (docs/recipe.md).
AUTO_TOKENS = 8192
#: The sensitivity scan's sampled passages, each SCAN_CTX + SCAN_EVAL + 1 tokens (the
#: evaluation's window; shorter where the model's positions end first).
SCAN_PASSAGES, SCAN_CTX, SCAN_EVAL = 4, 960, 64
#: Bumped when the fit changes, so that bundles of an older fit are not reused (3: always
#: fitted in float32, keyed by the query, key and value projections too; 4: the key
#: whitening's ridge 1e-5; 5: value channels weighted by what the output projection reads;
#: 6: half the sampled sequences from openings of code).
AUTO_VERSION = 6
#: Setting this to 0 turns the fit off: "auto" then means no bundle (frames fitted per sequence).
ENV = "KAKEYATURBO_AUTO_CALIBRATION"


def auto_enabled() -> bool:
    v = os.environ.get(ENV, "1").strip().lower()
    if v not in ("0", "1", "false", "true", "off", "on", "no", "yes"):
        raise ValueError(f"{ENV}={v!r}: use 1 (fit a bundle on first use) or 0 (no bundle)")
    return v in ("1", "true", "on", "yes")


def auto_bundle_dir(model) -> Path:
    """Where the bundle of ``model`` is kept: a hash of its shapes and sampled weights (rounded
    to bfloat16 first, so the checkpoint in float32 or bfloat16 finds one bundle) and of the
    fit's version."""
    import torch

    from ..modeling import cache_dir

    fp = dict(model_fingerprint(model))
    for name in (PROBE, PROJ_PROBE):
        if name in fp:
            probe = torch.tensor(fp[name], dtype=torch.float32).to(torch.bfloat16).tolist()
            fp[name] = [f"{v:.3g}" for v in probe]
    key = json.dumps({"fit": AUTO_VERSION, "tokens": AUTO_TOKENS, **fp}, sort_keys=True)
    name = f"{fp['model_type']}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    return cache_dir() / "bundles" / name


def auto_calibration(model, progress: bool = True) -> Calibration | None:
    """The model's bundle from the cache, or fitted now (3.4 minutes for a 135M model on two
    cores) and cached. None when ``KAKEYATURBO_AUTO_CALIBRATION=0``, or where the model cannot be
    fitted (a warning says why; the cache then fits frames per sequence)."""
    if not auto_enabled():
        return None
    where = auto_bundle_dir(model)
    if (where / META_FILE).is_file():
        try:
            return Calibration.load(where, model)
        except CalibrationError as e:  # damaged or stale: fit it again
            warnings.warn(f"{where}: {e}; fitting it again", stacklevel=2)
            shutil.rmtree(where, ignore_errors=True)
    try:
        with in_float32(model):  # whichever of the checkpoint's copies asks first
            calib = fit_sampled(model, progress=progress)
    except Exception as e:  # noqa: BLE001 - any model the fit cannot run still gets a cache
        warnings.warn(
            f"could not fit a calibration bundle for this model ({type(e).__name__}: {e}); "
            f"frames are fitted per sequence instead (set {ENV}=0 to skip the attempt)",
            stacklevel=2,
        )
        return None
    _save_atomically(calib, where)
    if progress:
        print(
            f"kakeyaturbo: fitted a calibration bundle on {calib.meta['tokens']} sampled tokens "
            f"in {calib.meta['fit_seconds']:.0f} s (kept in {where})"
        )
    return calib


def fit_sampled(model, tokens: int = AUTO_TOKENS, progress: bool = True) -> Calibration:
    """A bundle fitted on ``tokens`` tokens the model samples itself, its per-layer bits from
    the sensitivity scan on :data:`SCAN_PASSAGES` more sampled sequences."""
    from .fit import (
        calibration_from_moments,
        collect_moments,
        default_joint_heads,
        value_channel_scales,
    )
    from .sampled_text import opening_ids, sample_sequences

    t0 = time.perf_counter()
    openings = opening_ids(model)
    seqs = sample_sequences(model, tokens=tokens, progress=progress, openings=openings)
    joint = default_joint_heads(model)
    scales = value_channel_scales(model) if DEFAULT_VALUE_METRIC == "channel" else None
    moments = collect_moments(
        model, windows=seqs, progress=progress, joint=joint, value_scales=scales
    )
    meta = {
        "tokens": sum(len(s) for s in seqs),
        "ctx": len(seqs[0]),
        "text_file": "sampled from the model" + (", half from code openings" if openings else ""),
        "auto_fit": AUTO_VERSION,
        "joint_heads": joint,
    }
    calib = calibration_from_moments(model, moments, meta)
    scan = _scan_sampled(model, calib, progress, openings)
    if scan is not None:
        calib.meta["sensitivity"] = scan
    calib.meta["fit_seconds"] = round(time.perf_counter() - t0, 1)
    return calib


def _scan_sampled(model, calib: Calibration, progress: bool, openings) -> dict | None:
    """The sensitivity scan (``kakeyaturbo.eval.sensitivity``, both protocols) on sequences the
    model samples with another seed than the frames' text; None where the model's positions
    leave no room for a coded block before the scored tokens (every layer then gets the mean
    rate)."""
    import torch

    from ..eval.sensitivity import scan_passages
    from ..modeling import Passage
    from .sampled_text import sample_sequences

    ctx = min(SCAN_CTX, _max_positions(model) - SCAN_EVAL - 1)
    if ctx < 2 * SCAN_EVAL:
        return None
    length = ctx + SCAN_EVAL + 1
    seqs = sample_sequences(
        model,
        tokens=SCAN_PASSAGES * length,
        batch=SCAN_PASSAGES,
        seed=1,
        progress=progress,
        openings=openings,
    )
    passages = [Passage(i, 0, torch.tensor(s[:length])) for i, s in enumerate(seqs)]
    scratch = tempfile.mkdtemp(prefix="kakeyaturbo-scan-")
    try:  # the scan reads the bundle from a folder
        return scan_passages(
            model, calib.save(scratch), passages, ctx, SCAN_EVAL, progress=progress, mode="both"
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _max_positions(model) -> int:
    from ..hf.layer_plan import text_config

    return int(getattr(text_config(model.config), "max_position_embeddings", None) or 1 << 30)


def _save_atomically(calib: Calibration, where: Path) -> None:
    """Write beside ``where`` and rename, so that a process reading the cache never sees half
    a bundle and two processes fitting at once both end with a whole one."""
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{where.name}.", dir=where.parent))
        calib.save(scratch)
        try:
            scratch.rename(where)
        except OSError:  # another process got there first: its bundle is as good
            shutil.rmtree(scratch, ignore_errors=True)
    except OSError as e:
        warnings.warn(f"could not keep the calibration bundle in {where}: {e}", stacklevel=3)
