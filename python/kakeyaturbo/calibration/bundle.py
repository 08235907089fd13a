"""The calibration bundle on disk: ``calibration.json`` (version, model fingerprint, how it
was made) and ``tensors.safetensors`` (float32 matrices per layer and KV head)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .schema import (
    BUNDLE_VERSION,
    JOINT_TENSOR_NAMES,
    LEGACY_HASH,
    META_FILE,
    PROBE,
    PROBE_RTOL,
    PROBE_VALUES,
    PROBED_PROJECTIONS,
    PROJ_PROBE,
    PROJ_PROBE_CHUNKS,
    PROJ_PROBE_VALUES,
    TENSORS_FILE,
    CalibrationError,
)


def model_fingerprint(model_or_config: Any) -> dict[str, Any]:
    """What a bundle must match: architecture and shapes, plus a sample of the first layer's
    key projection so that two checkpoints of one architecture are told apart."""
    cfg = getattr(model_or_config, "config", model_or_config)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    fp = {
        "model_type": cfg.model_type,
        "num_hidden_layers": int(cfg.num_hidden_layers),
        "num_attention_heads": int(cfg.num_attention_heads),
        "num_key_value_heads": int(
            getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        ),
        "head_dim": int(head_dim),
        "hidden_size": int(cfg.hidden_size),
    }
    w = _k_proj0(model_or_config)
    if w is not None:
        # Sampled weights, compared with a tolerance, not a hash of their bits: one checkpoint
        # loaded in float32, bfloat16 or float16 is one model to its calibration.
        fp[PROBE] = _probe(w)
    proj = _projections_probe(model_or_config)
    if proj is not None:
        fp[PROJ_PROBE] = proj
    return fp


def _projections_probe(model_or_config: Any) -> Optional[list[float]]:
    """Samples and row-run energies of the query, key and value projections of the first and
    the last layer (None for a config, or a model without the three)."""
    try:
        layers = model_or_config.model.layers
        ws = [getattr(layers[i].self_attn, n).weight for i in (0, -1) for n in PROBED_PROJECTIONS]
    except (AttributeError, IndexError, TypeError):
        return None
    import torch

    out: list[float] = []
    for w in ws:
        w = w.detach().cpu()
        out += _probe(w.float().numpy(), PROJ_PROBE_VALUES)
        # From the weights in bfloat16, so that the float32 checkpoint and its bfloat16 copy
        # give one energy to the bit (the auto bundle's key rounds them).
        rows = np.square(w.to(torch.bfloat16).double().numpy()).mean(axis=1)
        out += [float(r.mean()) for r in np.array_split(rows, PROJ_PROBE_CHUNKS)]
    return out


def _k_proj0(model_or_config: Any) -> Optional[np.ndarray]:
    """The first layer's key projection (None for a config, or a model that fuses it into
    another projection: such a model is matched by its shapes alone)."""
    try:
        w = model_or_config.model.layers[0].self_attn.k_proj.weight
    except (AttributeError, IndexError, TypeError):
        return None
    return w.detach().float().cpu().numpy()


def _probe(w: np.ndarray, values: int = PROBE_VALUES) -> list[float]:
    at = np.linspace(0, w.size - 1, values).round().astype(np.int64)
    return [float(x) for x in w.reshape(-1)[at]]


def _weights_differ(bundle_fp: dict[str, Any], model: Any) -> Optional[str]:
    """Why the model's weights are not the ones the bundle was fitted on (None: they are, to
    the probe's tolerance, or the bundle records none)."""
    w = _k_proj0(model)
    if w is None:
        return None
    if PROBE in bundle_fp and not _close(bundle_fp[PROBE], _probe(w)):
        return f"{PROBE}: the first layer's key projection holds other weights"
    if PROJ_PROBE in bundle_fp:
        proj = _projections_probe(model)
        if proj is None or not _close(bundle_fp[PROJ_PROBE], proj):
            return f"{PROJ_PROBE}: the first or last layer's q/k/v projections hold other weights"
    if PROBE in bundle_fp:
        return None
    if LEGACY_HASH in bundle_fp:
        have = hashlib.sha256(np.ascontiguousarray(w).tobytes()).hexdigest()[:16]
        if have != bundle_fp[LEGACY_HASH]:
            return (
                f"{LEGACY_HASH}: bundle {bundle_fp[LEGACY_HASH]!r}, model {have!r} (a bundle "
                "of this version hashes float32 weights: load the model in the dtype it was "
                "calibrated in, or recalibrate)"
            )
    return None


def _close(want: list[float], got: list[float]) -> bool:
    """Whether a probe's samples match, to its tolerance."""
    a, b = np.asarray(want, dtype=np.float64), np.asarray(got, dtype=np.float64)
    # The floor keeps weights rounded to zero (float16's subnormals) from failing.
    tol = PROBE_RTOL * (np.abs(a) + 1e-3 * np.abs(a).max())
    return a.shape == b.shape and bool(np.all(np.abs(b - a) <= tol))


@dataclass
class Calibration:
    """A loaded (or freshly fitted) calibration bundle."""

    fingerprint: dict[str, Any]
    tensors: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)
    #: What users of the bundle derive from its tensors, kept here so that it is made once per
    #: bundle and shared by every cache and sequence coded with it (never saved).
    derived: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_layers(self) -> int:
        return int(self.fingerprint["num_hidden_layers"])

    @property
    def joint_heads(self) -> bool:
        """Whether the bundle holds frames across each layer's KV heads (``k_joint``,
        ``v_joint``): the pipeline then codes a layer's heads as one stream."""
        return all(name in self.tensors for name in JOINT_TENSOR_NAMES)

    def save(self, out_dir: str | Path) -> Path:
        from safetensors.numpy import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in self.tensors.items()},
            str(out / TENSORS_FILE),
        )
        meta = {"version": BUNDLE_VERSION, "fingerprint": self.fingerprint, **self.meta}
        (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        return out

    @property
    def nbytes(self) -> int:
        """Size of the tensors as stored (float32); report it beside any ratio that uses it."""
        return int(sum(v.size * 4 for v in self.tensors.values()))

    @classmethod
    def load(cls, bundle_dir: str | Path, model: Any = None) -> Calibration:
        """Reads a bundle, checked in full before any of it is used (see validate.py); with
        ``model`` (or its config), checks it was made for that model."""
        from .validate import check_tensors, read_meta, read_tensors

        d = Path(bundle_dir)
        if not (d / META_FILE).is_file() or not (d / TENSORS_FILE).is_file():
            raise CalibrationError(
                f"{d} is not a calibration bundle (needs {META_FILE} and {TENSORS_FILE})"
            )
        fingerprint, meta = read_meta(d / META_FILE)
        tensors = read_tensors(d / TENSORS_FILE)
        check_tensors(fingerprint, tensors, meta, str(d / TENSORS_FILE))
        calib = cls(fingerprint=fingerprint, tensors=tensors, meta=meta)
        if model is not None:
            calib.check_model(model)
        return calib

    def _check_tensors(self, where: str = "calibration bundle") -> None:
        """The checks :meth:`load` makes, on a bundle in memory."""
        from .validate import check_meta, check_tensors

        check_meta(self.fingerprint, self.meta, where)
        check_tensors(self.fingerprint, self.tensors, self.meta, where)

    def check_model(self, model: Any) -> None:
        """Raises CalibrationError naming every field where the model differs."""
        # Shapes from the config; the weights are compared apart, with the probe's tolerance.
        have = model_fingerprint(getattr(model, "config", model))
        diffs = [
            f"{k}: bundle {self.fingerprint.get(k)!r}, model {v!r}"
            for k, v in have.items()
            if k in self.fingerprint and self.fingerprint[k] != v
        ]
        weights = _weights_differ(self.fingerprint, model)
        diffs += [] if weights is None else [weights]
        missing = [k for k in have if k not in self.fingerprint]
        if diffs or missing:
            raise CalibrationError(
                "calibration bundle was made for another model: " + "; ".join(diffs + missing)
            )

    def layer_bit_offsets(self, stream: str) -> Optional[list[float]]:
        """Per-layer bit offsets (mean zero) from the sensitivity scan, if the bundle has one:
        layer ``i`` of ``stream`` gets ``bits_per_value + offsets[i]``."""
        scan = self.meta.get("sensitivity")
        if scan is None:
            return None
        off = [float(b) for b in scan["offsets"][stream]]
        if len(off) != self.num_layers:
            raise CalibrationError(
                f"sensitivity offsets for {len(off)} layers, bundle has {self.num_layers}"
            )
        return off
