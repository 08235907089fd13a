"""Checks of a calibration bundle before any of it is used: the metadata's fields and types,
every tensor's dtype, shape and finiteness, and the algebra that ties the tensors together
(rotations orthonormal, inverses inverse, second moments symmetric and PSD, the whitening
the Cholesky factor of the ridged query moment). Every failure is a
:class:`~kakeyaturbo.calibration.schema.CalibrationError` naming where and what."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from .schema import (
    BUNDLE_VERSION,
    JOINT_TENSOR_NAMES,
    LEGACY_HASH,
    OPTIONAL_TENSOR_NAMES,
    PROBE,
    PROBE_VALUES,
    PROBED_PROJECTIONS,
    PROJ_PROBE,
    PROJ_PROBE_CHUNKS,
    PROJ_PROBE_VALUES,
    TENSOR_NAMES,
    VALUE_METRICS,
    CalibrationError,
)

#: Largest ``max |QᵀQ - I|`` of a rotation stored in float32 (rounding gives ~1e-6).
ORTHO_TOL = 1e-3
#: Largest ``max |A B - I|`` of an inverse pair: this plus ``INVERSE_RTOL`` times ``max |A| |B|``
#: (float32 rounding of both factors gives a few 1e-7 of that; a wrong pair, order 1 or more).
INVERSE_TOL, INVERSE_RTOL = 1e-3, 1e-4
#: Relative tolerance of the other identities (symmetry, PSD, whitening = Cholesky factor).
RTOL = 1e-3

_INT_FIELDS = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
)
_HEX16 = re.compile(r"[0-9a-f]{16}")
_SENSITIVITY_MODES = ("snapshot", "in-forward", "both")


def read_meta(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(fingerprint, meta)`` of ``calibration.json`` at ``path``, checked (meta without the
    version and fingerprint)."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CalibrationError(f"{path}: cannot be read ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CalibrationError(f"{path}: not UTF-8 text (byte {e.start})") from None
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as e:
        raise CalibrationError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise CalibrationError(f"{path}: not valid JSON (nested too deep)") from None
    if not isinstance(meta, dict):
        raise CalibrationError(f"{path}: expected a JSON object, got {_kind(meta)}")
    version = meta.pop("version", None)
    if type(version) is not int or version != BUNDLE_VERSION:
        raise CalibrationError(
            f"{path}: bundle version {version!r}, this build reads version {BUNDLE_VERSION}"
        )
    fingerprint = meta.pop("fingerprint", None)
    if not isinstance(fingerprint, dict):
        raise CalibrationError(f"{path}: no model fingerprint (fingerprint: {_kind(fingerprint)})")
    check_meta(fingerprint, meta, str(path))
    return fingerprint, meta


def check_meta(fingerprint: dict[str, Any], meta: dict[str, Any], where: str) -> None:
    """Fields and types of the fingerprint and of the rest of the metadata."""

    def fail(field: str, what: str) -> None:
        raise CalibrationError(f"{where}: {field} {what}")

    if not isinstance(fingerprint, dict):
        fail("fingerprint", f"must be an object, not {_kind(fingerprint)}")
    known = {"model_type", *_INT_FIELDS, PROBE, PROJ_PROBE, LEGACY_HASH}
    for k in fingerprint:
        if k not in known:
            fail(f"fingerprint.{k}", "is not a fingerprint field")
    if not isinstance(fingerprint.get("model_type"), str) or not fingerprint["model_type"]:
        fail("fingerprint.model_type", f"must be a non-empty string, not {_show(fingerprint)}")
    for k in _INT_FIELDS:
        if k not in fingerprint:
            fail(f"fingerprint.{k}", "is missing")
        _positive_int(fingerprint[k], f"fingerprint.{k}", fail)
    if fingerprint["num_attention_heads"] % fingerprint["num_key_value_heads"]:
        fail(
            "fingerprint.num_attention_heads",
            f"({fingerprint['num_attention_heads']}) is not a multiple of "
            f"num_key_value_heads ({fingerprint['num_key_value_heads']})",
        )
    if PROBE in fingerprint:
        _floats(fingerprint[PROBE], PROBE_VALUES, f"fingerprint.{PROBE}", fail)
    if PROJ_PROBE in fingerprint:
        count = 2 * len(PROBED_PROJECTIONS) * (PROJ_PROBE_VALUES + PROJ_PROBE_CHUNKS)
        _floats(fingerprint[PROJ_PROBE], count, f"fingerprint.{PROJ_PROBE}", fail)
    if LEGACY_HASH in fingerprint and not _is_hex16(fingerprint[LEGACY_HASH]):
        fail(f"fingerprint.{LEGACY_HASH}", "must be 16 lowercase hex digits")
    layers = fingerprint["num_hidden_layers"]
    for k, v in meta.items():
        if k in ("tokens", "ctx", "auto_fit"):
            _positive_int(v, k, fail)
        elif k in ("ridge", "fit_seconds"):
            if not _is_number(v) or not math.isfinite(v) or v < 0:
                fail(k, f"must be a finite number >= 0, not {v!r}")
        elif k in ("text_file", "command"):
            if not isinstance(v, str):
                fail(k, f"must be a string, not {_kind(v)}")
        elif k == "text_sha256":
            if not _is_hex16(v):
                fail(k, f"must be 16 lowercase hex digits, not {v!r}")
        elif k == "value_metric":
            if v not in VALUE_METRICS:
                fail(k, f"must be one of {', '.join(map(repr, VALUE_METRICS))}, not {v!r}")
        elif k == "joint_heads":
            if not isinstance(v, bool):
                fail(k, f"must be true or false, not {v!r}")
        elif k == "sensitivity":
            _check_sensitivity(v, layers, fail)
        else:
            fail(k, "is not a field of calibration.json")


def _check_sensitivity(scan: Any, layers: int, fail) -> None:
    if not isinstance(scan, dict):
        fail("sensitivity", f"must be an object, not {_kind(scan)}")
    if "offsets" not in scan:
        fail("sensitivity.offsets", "is missing")
    for k, v in scan.items():
        f = f"sensitivity.{k}"
        if k in ("offsets", "kl"):
            if not isinstance(v, dict) or set(v) != {"k", "v"}:
                fail(f, f"must be an object with lists 'k' and 'v', not {_show_keys(v)}")
            for s in "kv":
                _floats(v[s], layers, f"{f}.{s}", fail)
        elif k == "mode":
            if v not in _SENSITIVITY_MODES:
                fail(f, f"must be one of {', '.join(_SENSITIVITY_MODES)}, not {v!r}")
        elif k == "probe_bits":
            if not _is_number(v) or not math.isfinite(v) or v <= 0:
                fail(f, f"must be a positive number, not {v!r}")
        elif k == "passages":
            _positive_int(v, f, fail)
        elif k == "blend":
            if not isinstance(v, str):
                fail(f, f"must be a string, not {_kind(v)}")
        elif k == "kl_by_mode":
            if not isinstance(v, dict):
                fail(f, f"must be an object, not {_kind(v)}")
            for mode, kl in v.items():
                if not isinstance(kl, dict) or set(kl) != {"k", "v"}:
                    fail(f"{f}.{mode}", f"must be an object with 'k' and 'v', not {_show_keys(kl)}")
                for s in "kv":
                    _floats(kl[s], layers, f"{f}.{mode}.{s}", fail)
        else:
            fail(f, "is not a field of the sensitivity scan")


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    """The tensors of ``tensors.safetensors`` at ``path``, float32 each (else the error)."""
    from safetensors import safe_open

    out = {}
    try:
        with safe_open(str(path), framework="np") as f:
            for name in f.keys():
                dtype = f.get_slice(name).get_dtype()
                if dtype != "F32":
                    raise CalibrationError(f"{path}: {name} is {dtype}, expected F32 (float32)")
                out[name] = f.get_tensor(name)
    except CalibrationError:
        raise
    except Exception as e:  # noqa: BLE001 - the reader raises many kinds
        raise CalibrationError(
            f"{path}: not a readable safetensors file ({type(e).__name__}: {e})"
        ) from None
    return out


def check_tensors(
    fingerprint: dict[str, Any], tensors: dict[str, np.ndarray], meta: dict[str, Any], where: str
) -> None:
    """Names, dtypes, shapes and finiteness of the tensors, then their algebra."""
    L, H, D = (fingerprint[k] for k in ("num_hidden_layers", "num_key_value_heads", "head_dim"))

    def fail(what: str) -> None:
        raise CalibrationError(f"{where}: {what}")

    allowed = set(TENSOR_NAMES) | set(OPTIONAL_TENSOR_NAMES) | set(JOINT_TENSOR_NAMES)
    for name in tensors:
        if name not in allowed:
            fail(f"{name} is not a tensor of a calibration bundle")
    for name in TENSOR_NAMES:
        if name not in tensors:
            fail(f"bundle lacks tensor {name!r}")
    joint = [name for name in JOINT_TENSOR_NAMES if name in tensors]
    if joint and len(joint) != len(JOINT_TENSOR_NAMES):
        (lacks,) = set(JOINT_TENSOR_NAMES) - set(joint)
        fail(f"bundle holds {joint[0]!r} without its pair {lacks!r}")
    for name, m in tensors.items():
        if name in JOINT_TENSOR_NAMES:
            want = (L, H * D, H * D)
        else:
            want = (L, H, D) if name.endswith("variances") else (L, H, D, D)
        if not isinstance(m, np.ndarray) or m.dtype not in (np.float32, np.float64):
            fail(f"{name} is {getattr(m, 'dtype', type(m).__name__)}, expected float32")
        if tuple(m.shape) != want:
            fail(
                f"tensor {name!r} has shape {tuple(m.shape)}, expected {want} (the "
                "fingerprint's num_hidden_layers, num_key_value_heads, head_dim)"
            )
        if not np.isfinite(m).all():
            fail(f"tensor {name!r} holds NaN or Inf at {_at(np.argwhere(~np.isfinite(m))[0])}")
    _check_consistency(tensors, meta, fail)
    for name in ("k_pca", *joint) + (() if "v_inverse" in tensors else ("v_transform",)):
        _orthonormal(name, tensors[name], fail)
    _inverse("k_transform", "k_inverse", tensors, fail)
    if "v_inverse" in tensors:
        _inverse("v_transform", "v_inverse", tensors, fail)
    for name in ("k_variances", "v_variances"):
        _variances(name, tensors[name].astype(np.float64), fail)
    _whitening(tensors, meta.get("ridge"), fail)


def _check_consistency(tensors: dict, meta: dict, fail) -> None:
    """The metadata's account of the tensors, where it gives one."""
    vm = meta.get("value_metric")
    if vm is not None and (vm != "none") != ("v_inverse" in tensors):
        held = "holds" if "v_inverse" in tensors else "lacks"
        fail(f"v_inverse: the bundle {held} it, but calibration.json has value_metric={vm!r}")
    jh = meta.get("joint_heads")
    if jh is not None and jh != all(n in tensors for n in JOINT_TENSOR_NAMES):
        held = "holds" if jh is False else "lacks"
        fail(f"k_joint: the bundle {held} frames across heads, but joint_heads={jh!r}")


def _orthonormal(name: str, q: np.ndarray, fail) -> None:
    # float32 products: rounding stays ~1e-6, far under the tolerance, at half the cost
    q = q.astype(np.float32, copy=False)
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is an inf error: refused
        err = _max_per_matrix(np.swapaxes(q, -1, -2) @ q - np.eye(q.shape[-1], dtype=np.float32))
    _over(err, ORTHO_TOL, f"{name} is not orthonormal (max |QᵀQ - I| = {{:.3g}})", fail)


def _inverse(fwd: str, inv: str, tensors: dict, fail) -> None:
    a, b = (tensors[n].astype(np.float64) for n in (fwd, inv))
    err = _max_per_matrix(a @ b - np.eye(a.shape[-1]))
    # |A| |B| bounds the rounding of the product: ill-conditioned pairs get more room
    tol = INVERSE_TOL + INVERSE_RTOL * _max_per_matrix(np.abs(a) @ np.abs(b))
    _over(err, tol, f"{inv} is not the inverse of {fwd} (max |AB - I| = {{:.3g}})", fail)


def _variances(name: str, v: np.ndarray, fail) -> None:
    top = np.maximum(v.max(axis=-1), 0.0)
    neg = np.maximum(-v.min(axis=-1), 0.0) / np.maximum(top, 1e-30)
    _over(neg, RTOL, f"{name} holds a negative variance (relative {{:.3g}})", fail)
    rise = np.maximum(np.diff(v, axis=-1).max(axis=-1, initial=0.0), 0.0)
    _over(rise / np.maximum(top, 1e-30), RTOL, f"{name} is not descending (rise {{:.3g}})", fail)


def _whitening(tensors: dict, ridge: Any, fail) -> None:
    """k_whiten is the lower Cholesky factor of q_second_moment plus a ridge times I, and
    k_transform is k_whiten times a rotation."""
    m = tensors["q_second_moment"].astype(np.float64)
    w = tensors["k_whiten"].astype(np.float64)
    t = tensors["k_transform"].astype(np.float64)
    d = m.shape[-1]
    size = np.maximum(np.abs(m).max(axis=(-1, -2)), 1e-30)
    asym = _max_per_matrix(m - np.swapaxes(m, -1, -2)) / size
    _over(asym, RTOL, "q_second_moment is not symmetric (relative {:.3g})", fail)
    _psd(m, size, fail)
    upper = _max_per_matrix(np.triu(w, 1)) / np.maximum(np.abs(w).max(axis=(-1, -2)), 1e-30)
    _over(upper, RTOL, "k_whiten is not lower triangular (relative {:.3g})", fail)
    lowest_diag = np.diagonal(w, axis1=-2, axis2=-1).min(axis=-1)
    if not (lowest_diag > 0).all():
        at = np.unravel_index(np.argmin(lowest_diag), lowest_diag.shape)
        fail(f"k_whiten has a diagonal entry <= 0 ({lowest_diag[at]:.3g}) at {_at(at)}")
    ww = w @ np.swapaxes(w, -1, -2)
    scale = np.maximum(np.abs(ww).max(axis=(-1, -2)), 1e-30)
    ridged = ww - m
    c = np.trace(ridged, axis1=-2, axis2=-1) / d
    off = _max_per_matrix(ridged - c[..., None, None] * np.eye(d)) / scale
    what = "k_whiten k_whitenᵀ is not q_second_moment plus a multiple of I (relative {:.3g})"
    _over(off, RTOL, what, fail)
    _over(-c / scale, RTOL, "k_whiten k_whitenᵀ is q_second_moment minus a ridge ({:.3g})", fail)
    if ridge is not None:
        want = ridge * np.trace(m, axis1=-2, axis2=-1) / d
        bad = np.abs(c - want) / np.maximum(want, scale * RTOL)
        _over(
            bad,
            0.05,
            f"k_whiten's ridge is not ridge={ridge} times the mean eigenvalue "
            "of q_second_moment (relative error {:.3g})",
            fail,
        )
    tt = t @ np.swapaxes(t, -1, -2)
    err = _max_per_matrix(tt - ww) / scale
    what = "k_transform is not k_whiten times a rotation (max |TTᵀ - WWᵀ| relative {:.3g})"
    _over(err, RTOL, what, fail)


def _psd(m: np.ndarray, size: np.ndarray, fail) -> None:
    """PSD within RTOL of its largest entry: a Cholesky factor of it so shifted exists (a
    batched factorisation costs a tenth of the eigenvalues, which only locate a failure)."""
    shifted = m + (RTOL * size)[..., None, None] * np.eye(m.shape[-1])
    try:
        np.linalg.cholesky(shifted)
        return
    except np.linalg.LinAlgError:
        pass
    lowest = np.linalg.eigvalsh((m + np.swapaxes(m, -1, -2)) / 2)[..., 0]
    _over(-lowest / size, RTOL, "q_second_moment is not PSD (relative eigenvalue -{:.3g})", fail)


def _max_per_matrix(x: np.ndarray) -> np.ndarray:
    return np.abs(x).max(axis=(-1, -2))


def _over(err: np.ndarray, tol: Any, what: str, fail) -> None:
    """Fails naming the worst matrix (layer, head) if ``err`` exceeds ``tol`` (a number, or
    one per matrix) anywhere."""
    bad = ~(err <= tol)  # NaN counts as over
    if bad.any():
        ranked = np.where(bad, np.nan_to_num(err, nan=np.inf), -np.inf)
        worst = np.unravel_index(np.argmax(ranked), err.shape)
        limit = np.broadcast_to(tol, err.shape)[worst]
        fail(f"{what.format(err[worst])} at {_at(worst)}, tolerance {limit:.3g}")


def _at(index) -> str:
    parts = ("layer", "head", "row", "column")
    return ", ".join(f"{p} {int(i)}" for p, i in zip(parts, index))


def _positive_int(v: Any, field: str, fail) -> None:
    if type(v) is not int or v < 1:
        fail(field, f"must be a positive integer, not {_show_value(v)}")


def _floats(v: Any, n: int, field: str, fail) -> None:
    if not isinstance(v, list) or len(v) != n:
        got = f"{len(v)} values" if isinstance(v, list) else _kind(v)
        fail(field, f"must be a list of {n} numbers, not {got}")
    for i, x in enumerate(v):
        if not _is_number(x) or not math.isfinite(x):
            fail(f"{field}[{i}]", f"must be a finite number, not {x!r}")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_hex16(v: Any) -> bool:
    return isinstance(v, str) and _HEX16.fullmatch(v) is not None


def _kind(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _show_value(v: Any) -> str:
    return f"{_kind(v)} {v!r}" if not isinstance(v, (dict, list)) else _kind(v)


def _show(fp: dict) -> str:
    return _show_value(fp.get("model_type")) if "model_type" in fp else "missing"


def _show_keys(v: Any) -> str:
    return f"keys {sorted(v)}" if isinstance(v, dict) else _kind(v)
