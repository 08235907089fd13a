"""Invertible per-(layer, KV head) maps into the calibrated coding frames.

Keys (pre-RoPE, rows ``k``): ``y = k @ L @ U_k`` where ``L`` is the lower Cholesky factor of
the query second moment ``M = E[q q^T]`` and ``U_k`` the PCA basis of the whitened keys. For a
key error ``e``, ``|e @ L|^2 = e^T M e = E[(q . e)^2]``: squared error in this frame is the
expected squared attention-logit error, so MSE coding here is query-aware. Values:
``y = v @ U_v`` (orthonormal PCA), or in a bundle fitted with ``--value-metric output``
``y = v @ L_o @ U_v`` with ``L_o`` the lower Cholesky factor of the output metric
``sum_j W_j^T W_j`` over the query heads ``j`` reading the KV head (``W_j`` their columns of
the output projection); such a bundle holds the inverse as ``v_inverse``.
"""

from __future__ import annotations

import numpy as np
import torch

from .bundle import Calibration


class KVTransforms:
    """Torch transforms built from a :class:`Calibration` (float32, on the tensors' device)."""

    def __init__(self, calib: Calibration, whiten: bool = True):
        """``whiten=False`` uses the plain PCA frame of the keys (an ablation: same bytes,
        no query awareness)."""
        t = calib.tensors
        k_fwd = t["k_transform"] if whiten else t["k_pca"]
        k_inv = t["k_inverse"] if whiten else np.swapaxes(t["k_pca"], -1, -2)
        self._mats = {
            ("k", "fwd"): torch.from_numpy(np.ascontiguousarray(k_fwd, dtype=np.float32)),
            ("k", "inv"): torch.from_numpy(np.ascontiguousarray(k_inv, dtype=np.float32)),
            ("v", "fwd"): torch.from_numpy(np.asarray(t["v_transform"], dtype=np.float32)),
            ("v", "inv"): torch.from_numpy(
                np.ascontiguousarray(_value_inverse(t), dtype=np.float32)
            ),
        }
        self.num_layers = calib.num_layers
        self._joint = {
            s: torch.from_numpy(np.ascontiguousarray(t[f"{s}_joint"], dtype=np.float32))
            for s in "kv"
            if f"{s}_joint" in t
        }
        # Copies on another device are bundle data, like the frames derived from it: made once
        # per bundle and shared by every pipeline (so every cache) on it.
        self._derived, self._whiten = calib.derived, whiten

    def on(self, m: torch.Tensor, key: tuple, device: torch.device) -> torch.Tensor:
        """``m`` (one of this bundle's matrices, named by ``key``) on ``device``: a model on
        an accelerator gets each matrix copied there once per bundle, not on every decode
        step nor per cache."""
        if m.device == device:
            return m
        k = ("on device", self._whiten, *key, str(device))
        if k not in self._derived:
            self._derived[k] = m.to(device)
        return self._derived[k]

    def stacked(self, layers, stream: str, way: str, device: torch.device) -> torch.Tensor:
        """The matrices of ``layers`` stacked ``[L, ...]`` on ``device``: :meth:`matrix`'s
        (``way`` ``"fwd"`` or ``"inv"``) or :meth:`joint`'s (``way="joint"``), made once per
        bundle, layers and device (a cache coding its layers together reads them so)."""
        key = ("stacked", self._whiten, tuple(layers), stream, way, str(device))
        if key not in self._derived:
            if way == "joint":
                self.joint(0, stream)  # the bundle has them (else its error)
                every = self._joint[stream]
            else:
                every = self._mats[(stream, way)]
            self._derived[key] = every[list(layers)].to(device)
        return self._derived[key]

    def matrix(self, layer: int, stream: str, way: str) -> torch.Tensor:
        """``[H, D, D]`` float32 ``m`` of ``layer``'s ``stream``: ``y = x @ m`` (``way="fwd"``)
        or ``x = y @ m`` (``"inv"``)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside 0..{self.num_layers - 1}")
        return self._mats[(stream, way)][layer]

    def joint(self, layer: int, stream: str) -> torch.Tensor:
        """``[H*D, H*D]`` float32 orthonormal ``J`` of ``layer``'s ``stream``: the heads'
        coding-frame coordinates side by side, ``y``, go to ``y @ J``."""
        if stream not in self._joint:
            raise ValueError("the calibration bundle has no frames across heads (--joint-heads)")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside 0..{self.num_layers - 1}")
        return self._joint[stream][layer]

    def _apply(self, x: torch.Tensor, layer: int, stream: str, way: str) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(f"expected [batch, kv_heads, tokens, head_dim], got {tuple(x.shape)}")
        m = self.on(self.matrix(layer, stream, way), (layer, stream, way), x.device)
        _check_heads(x.shape[1], m.shape[0])
        return torch.einsum("bhtd,hde->bhte", x.float(), m)

    def forward(self, x: torch.Tensor, layer: int, stream: str) -> torch.Tensor:
        """Into the coding frame (keys must be pre-RoPE)."""
        return self._apply(x, layer, stream, "fwd")

    def forward_layers(self, x: torch.Tensor, layers, stream: str) -> torch.Tensor:
        """:meth:`forward` of ``x`` ``[L, B, H, T, D]``, the spans of ``layers``, by one
        product (each layer's the same as :meth:`forward` gives)."""
        m = self.stacked(layers, stream, "fwd", x.device)
        _check_heads(x.shape[2], m.shape[1])
        return torch.einsum("lbhtd,lhde->lbhte", x.float(), m)

    def inverse(self, y: torch.Tensor, layer: int, stream: str) -> torch.Tensor:
        """Back from the coding frame."""
        return self._apply(y, layer, stream, "inv")


def _check_heads(heads: int, calibrated: int) -> None:
    if heads != calibrated:
        raise ValueError(f"{heads} KV heads, calibration has {calibrated}")


def _value_inverse(t: dict[str, np.ndarray]) -> np.ndarray:
    if "v_inverse" in t:
        return t["v_inverse"]
    # U_v is orthonormal: its inverse is its transpose.
    return np.swapaxes(t["v_transform"], -1, -2)
