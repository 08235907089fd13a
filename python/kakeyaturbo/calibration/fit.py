"""Fitting a calibration bundle: one pass over calibration text accumulates, per layer and
KV head, the second moments of pre-RoPE queries, keys and values; the bases follow from
them in closed form (so no second pass over the text is needed). The optional output metric
of the values comes from the weights of the output projection, no text needed."""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import Optional

import numpy as np
from tqdm.auto import tqdm

from ..modeling import heads_first, kv_geometry, pre_rope_modules
from .bundle import Calibration, model_fingerprint
from .schema import DEFAULT_RIDGE, DEFAULT_VALUE_METRIC, VALUE_METRICS


class _Moments:
    """Running sums for one layer: sum x x^T per KV head for q (pooled), k and v, and sums;
    with ``joint``, also across the heads: the keys side by side and the values' unit vectors
    side by side (``[H*D, H*D]``), for the frames across heads."""

    def __init__(
        self, heads: int, d: int, joint: bool = False, v_scale: Optional[np.ndarray] = None
    ):
        # Each value channel's weight [H, D] (value_channel_scales), or None: the values' frame
        # and their unit vectors are fitted on the values so weighted.
        self.v_scale = v_scale
        self.qq = np.zeros((heads, d, d))
        self.kk = np.zeros((heads, d, d))
        self.vv = np.zeros((heads, d, d))
        self.k = np.zeros((heads, d))
        self.v = np.zeros((heads, d))
        self.kk_joint = np.zeros((heads * d, heads * d)) if joint else None
        self.uu_joint = np.zeros((heads * d, heads * d)) if joint else None
        self.u = np.zeros(heads * d) if joint else None  # sum of the unit vectors side by side
        self.nq = 0
        self.n = 0

    def add(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, group: int) -> None:
        # q: [T, Hq, D] -> pooled per KV head; k, v: [T, H, D]
        t, hq, d = q.shape
        qg = q.reshape(t, hq // group, group, d).transpose(1, 0, 2, 3).reshape(hq // group, -1, d)
        self.qq += np.einsum("hnd,hne->hde", qg, qg)
        self.kk += np.einsum("thd,the->hde", k, k)
        self.vv += np.einsum("thd,the->hde", v, v)
        self.k += k.sum(0)
        self.v += v.sum(0)
        if self.kk_joint is not None:
            side = k.reshape(t, -1)
            self.kk_joint += side.T @ side
            # Values are coded as unit vectors (the recipe's token norms): their frame is fitted
            # on those, which no per-head moment gives.
            if self.v_scale is not None:
                v = v * self.v_scale
            u = v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-30)
            side = u.reshape(t, -1)
            self.uu_joint += side.T @ side
            self.u += side.sum(0)
        self.nq += t * group
        self.n += t


def collect_moments(
    model,
    token_ids: Optional[list[int]] = None,
    ctx: int = 1024,
    progress: bool = True,
    rope=None,
    joint: bool = False,
    windows: Optional[list[list[int]]] = None,
    value_scales: Optional[np.ndarray] = None,
) -> list[_Moments]:
    """Runs ``token_ids`` through the model in windows of ``ctx`` tokens (or the given
    ``windows``, one forward pass each). With ``rope`` (a
    :class:`~kakeyaturbo.hf.rope.ModelRope`) the queries and keys are taken post-RoPE, each
    window's tokens at positions 0.. (for post-RoPE key frames). ``joint``: also the moments
    across heads (:class:`_Moments`). ``value_scales`` ``[L, H, D]``
    (:func:`value_channel_scales`): the value frames are fitted on the values so weighted."""
    import torch

    geo = kv_geometry(model.config)
    d, hq, hkv = geo.head_dim, geo.query_heads, geo.kv_heads
    layers = model.model.layers
    moments = [
        _Moments(hkv, d, joint, None if value_scales is None else value_scales[li])
        for li in range(len(layers))
    ]
    current: dict[tuple[int, str], np.ndarray] = {}
    n_tokens = [0]  # tokens of the window in flight
    hooks = []
    for li, layer in enumerate(layers):
        for name, mod in zip("qkv", pre_rope_modules(layer.self_attn)):

            def hook(_m, _i, out, li=li, name=name):
                # [T, H, D] for the window in flight (one sequence per forward)
                x = heads_first(out.detach(), n_tokens[0], d)
                if rope is not None and name != "v":
                    x = rope.rotate(x.float(), li, 0)
                current[(li, name)] = x[0].transpose(0, 1).double().cpu().numpy()

            hooks.append(mod.register_forward_hook(hook))
    if windows is None:
        if token_ids is None:
            raise ValueError("collect_moments needs token_ids or windows")
        windows = [token_ids[i : i + ctx] for i in range(0, len(token_ids) - 1, ctx)]
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for w in tqdm(windows, desc="calibrating", unit="window", disable=not progress):
                n_tokens[0] = len(w)
                model(torch.tensor([w], device=device))
                for li in range(len(layers)):
                    moments[li].add(
                        current[(li, "q")], current[(li, "k")], current[(li, "v")], hq // hkv
                    )
    finally:
        for h in hooks:
            h.remove()
    return moments


def value_output_metrics(model) -> Optional[list[np.ndarray]]:
    """Per layer, ``[kv_heads, D, D]``: ``sum_j W_j^T W_j`` over the query heads ``j`` that read
    each KV head, ``W_j`` their columns of the output projection. A value error ``e`` moves
    head ``j``'s share of the layer output by ``W_j (sum_t p_t e_t)``, so ``e^T M e`` weighs it
    as the output sees it (up to the attention weights). ``None`` where a layer has no
    ``o_proj`` of the expected shape (the values then keep the plain PCA frame)."""
    geo = kv_geometry(model.config)
    d, hq, hkv = geo.head_dim, geo.query_heads, geo.kv_heads
    out = []
    for layer in model.model.layers:
        o_proj = getattr(layer.self_attn, "o_proj", None)
        w = getattr(o_proj, "weight", None)
        if w is None or tuple(w.shape[1:]) != (hq * d,):
            return None
        # [hidden, hq*d] -> [hkv, group, hidden, d]
        w = w.detach().double().cpu().numpy().reshape(-1, hkv, hq // hkv, d).transpose(1, 2, 0, 3)
        out.append(np.einsum("hgnd,hgne->hde", w, w))
    return out


#: The smallest weight a value channel gets, relative to the layer's mean: a channel the output
#: never reads is still coded (its frame stays invertible).
MIN_CHANNEL_SCALE = 1e-4


def value_channel_scales(model) -> Optional[np.ndarray]:
    """``[L, kv_heads, D]``: each value channel's weight, the square root of the output metric's
    diagonal (:func:`value_output_metrics`: how much of the layer output a unit error in that
    channel moves) over its mean across the head's channels. A value channel scaled up by ``c``
    and read by ``o_proj`` columns scaled down by ``c`` (a function-preserving rescale, what
    q/k/v biases and massive activations look like to the cache) gets weight ``1 / c``, so the
    weighted values, and every code fitted on them, do not change. ``None`` where
    :func:`value_output_metrics` is."""
    metrics = value_output_metrics(model)
    if metrics is None:
        return None
    out = []
    for m in metrics:
        diag = np.diagonal(m, axis1=-2, axis2=-1)
        rel = diag / np.maximum(diag.mean(-1, keepdims=True), 1e-300)
        out.append(np.sqrt(np.maximum(rel, MIN_CHANNEL_SCALE**2)))
    return np.stack(out)


def _ridged_cholesky(m: np.ndarray, ridge: float) -> np.ndarray:
    """Lower Cholesky factor of the metric ``m`` plus ``ridge`` times its mean eigenvalue: the
    ridge keeps the factor well conditioned where queries (or the output) never point."""
    d = m.shape[-1]
    return np.linalg.cholesky(m + ridge * np.trace(m) / d * np.eye(d))


def _eig_desc(c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lam, u = np.linalg.eigh((c + c.T) / 2)
    order = np.argsort(lam)[::-1]
    return np.maximum(lam[order], 0.0), u[:, order]


def fit_bundle(
    moments: list[_Moments],
    ridge: float = DEFAULT_RIDGE,
    value_metrics: Optional[list[np.ndarray]] = None,
) -> dict[str, np.ndarray]:
    """Closed-form bases from the moments (see transforms.py for the frames); with
    ``value_metrics`` (:func:`value_output_metrics`) the value frame is output-weighted; from
    moments collected with ``value_scales`` it is ``diag(s) @ U_v``, ``U_v`` the PCA frame of
    the weighted values."""
    scaled = moments[0].v_scale is not None
    if scaled and value_metrics is not None:
        raise ValueError("value_metrics and moments of weighted values cannot be combined")
    out: dict[str, list] = {
        k: []
        for k in (
            "q_second_moment",
            "k_whiten",
            "k_transform",
            "k_inverse",
            "k_variances",
            "k_pca",
            "v_transform",
            "v_variances",
        )
    }
    if value_metrics is not None or scaled:
        out["v_inverse"] = []
    for li, m in enumerate(moments):
        per = {k: [] for k in out}
        for h in range(m.qq.shape[0]):
            d = m.qq.shape[-1]
            mq = m.qq[h] / m.nq
            lower = _ridged_cholesky(mq, ridge)
            mean_k = m.k[h] / m.n
            cov_k = m.kk[h] / m.n - np.outer(mean_k, mean_k)
            lam_k, u_k = _eig_desc(lower.T @ cov_k @ lower)
            tk = lower @ u_k
            mean_v = m.v[h] / m.n
            cov_v = m.vv[h] / m.n - np.outer(mean_v, mean_v)
            lower_o = np.eye(d)
            if value_metrics is not None:  # scaled to mean eigenvalue 1: values keep their scale
                mo = value_metrics[li][h]
                lower_o = _ridged_cholesky(mo / max(np.trace(mo) / d, 1e-30), ridge)
            elif scaled:
                lower_o = np.diag(m.v_scale[h].astype(np.float64))
            lam_v, u_v = _eig_desc(lower_o.T @ cov_v @ lower_o)
            tv = lower_o @ u_v
            per["q_second_moment"].append(mq)
            per["k_whiten"].append(lower)
            per["k_transform"].append(tk)
            per["k_inverse"].append(np.linalg.inv(tk))
            per["k_variances"].append(lam_k)
            per["k_pca"].append(_eig_desc(cov_k)[1])
            per["v_transform"].append(tv)
            per["v_variances"].append(lam_v)
            if value_metrics is not None:
                per["v_inverse"].append(np.linalg.inv(tv))
            elif scaled:  # (diag(s) U)^-1 = U^T diag(1/s), exactly
                per["v_inverse"].append(u_v.T / m.v_scale[h][None, :])
        for k in out:
            out[k].append(np.stack(per[k]))
    tensors = {k: np.stack(v).astype(np.float32) for k, v in out.items()}
    if all(m.kk_joint is not None for m in moments):
        if value_metrics is not None:
            raise ValueError(
                "joint frames need orthonormal value frames: the output value metric changes "
                "the values' norms, which the unit vectors are fitted without"
            )
        tensors.update(_joint_frames(moments, tensors))
    return tensors


def _joint_frames(moments: list[_Moments], t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per layer, the PCA across KV heads of the coordinates the pipeline hands to the joint
    frame: keys in each head's query-aware frame (``k @ k_transform``), values as unit vectors
    (of the weighted values, where they are) in each head's orthonormal PCA frame ``U_v``, heads
    side by side."""
    out: dict[str, list] = {"k_joint": [], "v_joint": []}
    for li, m in enumerate(moments):
        frames = {s: t[f"{s}_transform"][li].astype(np.float64) for s in "kv"}
        if m.v_scale is not None:
            frames["v"] = frames["v"] / m.v_scale[:, :, None]
        blocks = {s: _block_diagonal(f) for s, f in frames.items()}
        mean_k = m.k.reshape(-1) / m.n
        cov_k = m.kk_joint / m.n - np.outer(mean_k, mean_k)
        mean_u = m.u / m.n
        cov_u = m.uu_joint / m.n - np.outer(mean_u, mean_u)
        for name, cov, frame in (("k_joint", cov_k, blocks["k"]), ("v_joint", cov_u, blocks["v"])):
            out[name].append(_eig_desc(frame.T @ cov @ frame)[1])
    return {k: np.stack(v).astype(np.float32) for k, v in out.items()}


def _block_diagonal(per_head: np.ndarray) -> np.ndarray:
    """``[H, D, D]`` -> the ``[H*D, H*D]`` matrix applying head ``h``'s to its own channels."""
    h, d, _ = per_head.shape
    out = np.zeros((h * d, h * d))
    for i in range(h):
        out[i * d : (i + 1) * d, i * d : (i + 1) * d] = per_head[i]
    return out


#: Widest layer (KV heads x head dim) coded across heads by default: the frames are
#: ``width^2`` floats per layer and stream, and attention over the codes makes every head's
#: keys from all ``width`` coordinates (``H`` times the per-head frame product).
JOINT_MAX_WIDTH = 512


def default_joint_heads(model) -> bool:
    """Whether ``calibrate`` fits frames across heads unless told: for layers of 2 or more KV
    heads (one head has nothing to share) at most :data:`JOINT_MAX_WIDTH` wide (SmolLM2: 3 x
    64, where it was measured; a Llama-3-8B layer, 8 x 128, keeps per-head frames)."""
    geo = kv_geometry(model.config)
    return 2 <= geo.kv_heads and geo.kv_heads * geo.head_dim <= JOINT_MAX_WIDTH


def calibrate(
    model,
    tokenizer,
    text_file: str | Path,
    tokens: int = 30_000,
    ctx: int = 1024,
    ridge: float = DEFAULT_RIDGE,
    progress: bool = True,
    command: Optional[str] = None,
    value_metric: str = DEFAULT_VALUE_METRIC,
    joint_heads: Optional[bool] = None,
) -> Calibration:
    """Fits a bundle on the first ``tokens`` tokens of ``text_file``. ``value_metric``: the
    values' frame, fitted on the values with each channel weighted by what the output
    projection reads of it (``"channel"``, :func:`value_channel_scales`: a rescaled channel
    costs its share), on the values as they are (``"none"``), or in the output-weighted frame
    (``"output"``, :func:`value_output_metrics`; measured on SmolLM2 it did not pay,
    ``docs/recipe.md``). ``joint_heads`` adds frames across each layer's KV heads
    (``k_joint``, ``v_joint``): recipes built from the bundle then code a layer's heads as one
    stream, which measured better per byte on SmolLM2 (``docs/recipe.md`` item 11). By default
    (None) it is on where it fits, see :func:`default_joint_heads`."""
    if value_metric not in VALUE_METRICS:
        raise ValueError(f"value_metric={value_metric!r}: use one of {', '.join(VALUE_METRICS)}")
    output = value_metric == "output"
    if joint_heads is None:
        joint_heads = not output and default_joint_heads(model)
    if joint_heads and output:
        raise ValueError(
            "joint_heads and value_metric='output' cannot be combined (see fit_bundle): pass "
            "joint_heads=False (--no-joint-heads) with it"
        )
    text = Path(text_file).read_text(encoding="utf-8")
    ids = tokenizer(text[: tokens * 12], add_special_tokens=False)["input_ids"][:tokens]
    if len(ids) < ctx:
        raise ValueError(f"text_file: {len(ids)} tokens is too little to calibrate (need {ctx})")
    value_metrics = value_output_metrics(model) if output else None
    scales = value_channel_scales(model) if value_metric == "channel" else None
    if value_metric != "none" and value_metrics is None and scales is None:
        warnings.warn(
            f"value_metric={value_metric!r}: the model's attention has no o_proj of shape "
            "[hidden, heads x head_dim]; the values keep their plain PCA frame",
            stacklevel=2,
        )
    moments = collect_moments(
        model, ids, ctx=ctx, progress=progress, joint=joint_heads, value_scales=scales
    )
    meta = {
        "tokens": len(ids),
        "ctx": ctx,
        "text_file": Path(text_file).name,
        "text_sha256": hashlib.sha256(text.encode()).hexdigest()[:16],
        "joint_heads": joint_heads,
    }
    if command:
        meta["command"] = command
    return calibration_from_moments(model, moments, meta, ridge, value_metrics)


def calibration_from_moments(
    model,
    moments: list[_Moments],
    meta: dict,
    ridge: float = DEFAULT_RIDGE,
    value_metrics: Optional[list[np.ndarray]] = None,
) -> Calibration:
    """The bundle of ``model`` whose bases :func:`fit_bundle` fits on ``moments``; ``meta``
    says how the moments were collected."""
    metric = "channel" if moments[0].v_scale is not None else "none"
    meta = {
        **meta,
        "ridge": ridge,
        "value_metric": "output" if value_metrics is not None else metric,
    }
    return Calibration(
        fingerprint=model_fingerprint(model),
        tensors=fit_bundle(moments, ridge, value_metrics),
        meta=meta,
    )
