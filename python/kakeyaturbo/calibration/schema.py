"""What a calibration bundle holds: its version, its files, its tensors' names and what each
means, and the one error every check raises (shared by the loader and its validation)."""

from __future__ import annotations

from .._core import KakeyaTurboError

#: The ridge added to the query second moment, relative to its mean eigenvalue. Small: a query
#: channel scaled down 100x (a key channel scaled up to match, as q/k biases and trained models
#: make them) has 1e-4 of the mean variance, and a ridge of 1e-3 weighed its key errors 11x
#: above what queries read of them (docs/calibration.md). Not smaller: at 1e-6 the frames'
#: conditioning made float32 attention over the codes and decoding differ by 8e-4 in a logit.
DEFAULT_RIDGE = 1e-5

#: The values' frame: fitted on the values as they are ("none"), with each channel weighted by
#: what the output projection reads of it ("channel"), or in the output-weighted frame
#: ("output"); the last two hold ``v_inverse`` (calibration.fit).
VALUE_METRICS = ("none", "channel", "output")
DEFAULT_VALUE_METRIC = "channel"

BUNDLE_VERSION = 1
META_FILE = "calibration.json"
TENSORS_FILE = "tensors.safetensors"
# Tensors every bundle holds, each [layers, kv_heads, ...].
TENSOR_NAMES = (
    "q_second_moment",  # E[q q^T] of pre-RoPE queries, pooled over the GQA group  [L,H,D,D]
    "k_whiten",  # lower Cholesky factor L of the (ridged) query second moment    [L,H,D,D]
    "k_transform",  # L @ U_k: pre-RoPE key (row) -> whitened PCA coordinates       [L,H,D,D]
    "k_inverse",  # inverse of k_transform                                          [L,H,D,D]
    "k_variances",  # variances of the whitened-PCA key coordinates, descending    [L,H,D]
    "k_pca",  # U of plain (unwhitened) pre-RoPE key PCA, for ablations          [L,H,D,D]
    "v_transform",  # U_v, diag(s) @ U_v or L_o @ U_v: value (row) -> PCA coords     [L,H,D,D]
    "v_variances",  # variances of the value coordinates, descending                [L,H,D]
)
# Tensors some bundles hold (see transforms.py).
OPTIONAL_TENSOR_NAMES = (
    "v_inverse",  # inverse of v_transform (absent: v_transform is orthonormal)      [L,H,D,D]
)
# Frames across a layer's KV heads (``calibrate --joint-heads``), each [L, H*D, H*D]: an
# orthonormal rotation, columns by descending variance, of the heads' coding-frame coordinates
# side by side (keys: k_transform's; values: their unit vectors).
JOINT_TENSOR_NAMES = ("k_joint", "v_joint")


class CalibrationError(KakeyaTurboError, ValueError):
    """A bundle is missing, malformed, of another version, or for another model."""


#: The fingerprint's sample of the first layer's key projection, and its size.
PROBE, PROBE_VALUES = "k_proj0_probe", 64
#: The fingerprint's probe of the query, key and value projections of the first and the last
#: layer, in that order: PROJ_PROBE_VALUES sampled weights and the mean square of each of
#: PROJ_PROBE_CHUNKS runs of rows, per projection. A fine-tune that leaves the first key
#: projection alone (LoRA on queries and values), or a channel rescaled into the next layer
#: (AWQ-style smoothing: few weights, missed by samples), is another model to its frames.
PROJ_PROBE, PROJ_PROBE_VALUES, PROJ_PROBE_CHUNKS = "qkv_probe", 32, 16
PROBED_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
#: Relative tolerance of the probe: above bfloat16's rounding (at most 2^-8), below any fine-tune.
PROBE_RTOL = 2.0**-7
#: Bundles before the probe hashed the weights' float32 bits (so matched one dtype only).
LEGACY_HASH = "k_proj0_sha256"
