"""Calibration: per-model statistics that make the codec spend bits where attention looks.

A bundle (``kakeyaturbo calibrate``) holds, per layer and KV head, the query second moment,
the query-aware key whitening and the PCA bases of whitened keys and of values, all fitted
on calibration text. Keys are coded pre-RoPE in the whitened PCA frame, values in their PCA
frame, so that water-filling spends bits on the directions that matter.
"""

from .bundle import BUNDLE_VERSION, Calibration, CalibrationError, model_fingerprint
from .fit import calibrate
from .transforms import KVTransforms

__all__ = [
    "BUNDLE_VERSION",
    "Calibration",
    "CalibrationError",
    "KVTransforms",
    "calibrate",
    "model_fingerprint",
]
