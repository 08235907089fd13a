"""Probe, not shipped: the evaluation with one coding frame across a layer's KV heads.

    .venv/bin/python benches/probe_joint_frames_eval.py --calibration artifacts/calib-smollm2
    .venv/bin/python benches/probe_joint_frames_eval.py --calibration artifacts/calib-smollm2 \\
        --mode in-forward --bits 2.5

`benches/probe_joint_heads.py` bounds what a frame across heads would save; this measures it
end to end. For every layer it fits, on calibration text only, the PCA of all KV heads'
coordinates together (``heads x head_dim``): keys in the bundle's query-aware whitened frame
(taken there exactly as the pipeline codes them), values as each head's unit vector. The
evaluation then runs with `Pipeline.roundtrip` replaced (for this process only) by one that
codes each layer's heads as one stream of ``heads x head_dim`` coordinates in that frame, with
the recipe's bits, per-layer offsets, sinks and newest-token rule, and every stored byte
counted as the evaluation counts it (value norms per head, one byte each). The joint frames
are calibration data like the bundle's frames and are not counted.

`KakeyaCache`'s attention over the codes does not go through `roundtrip`; this is the
evaluation's measure of the coding, not a shipped path. The shipped one came after it:
`kakeyaturbo calibrate --joint-heads` and `kakeya:calibration=<that bundle>` (docs/recipe.md
item 11, `reports/joint_heads*.json`).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoTokenizer

import smollm2_eval  # benches/, beside this script
from bench_args import CALIBRATION_TEXT  # benches/, beside this script
from kakeyaturbo.calibration import Calibration
from kakeyaturbo.capture import capture_kv, read_tokens
from kakeyaturbo.eval.harness import evaluate_method
from kakeyaturbo.eval.registry import build_method
from kakeyaturbo.modeling import resolve_model_dir
from kakeyaturbo.norm_codes import decode_norms
from kakeyaturbo.pipeline import Pipeline, _neutralise, decode_blocks
from kakeyaturbo.recipes import default_recipe

CHUNK = 1024


def joint_frames(model, tok, pipe: Pipeline, text: str, tokens: int) -> dict[str, list]:
    """Per stream, per layer, ``[H*D, H*D]`` float32: eigenvectors (descending) of the
    covariance of the heads' coordinates together (:func:`joint_coordinates`)."""
    ids = read_tokens(tok, text, tokens)
    sums: dict = {}
    n = 0
    for lo in range(0, tokens, CHUNK):
        kv = capture_kv(model, ids[lo : lo + CHUNK])
        for layer in range(model.config.num_hidden_layers):
            for stream in "kv":
                y = joint_coordinates(pipe, kv, layer, stream)
                s, c = sums.get((stream, layer), (0.0, 0.0))
                sums[(stream, layer)] = (s + y.sum(0), c + y.T @ y)
        n += len(ids[lo : lo + CHUNK])
    frames: dict[str, list] = {"k": [], "v": []}
    for (stream, _layer), (s, c) in sorted(sums.items()):
        mean = s / n
        _, vecs = np.linalg.eigh(c / n - np.outer(mean, mean))
        frames[stream].append(torch.from_numpy(vecs[:, ::-1].copy()).float())
    return frames


def joint_coordinates(pipe: Pipeline, kv: dict, layer: int, stream: str) -> np.ndarray:
    """``[tokens, H*D]`` float64: a captured layer's (:func:`~kakeyaturbo.capture.capture_kv`)
    pre-RoPE keys or values as :func:`coded_heads` hands them to the joint frame."""
    name = f"layer{layer}.k_pre_rope" if stream == "k" else f"layer{layer}.v"
    x = torch.from_numpy(kv[name])[None]
    return coded_heads(pipe, x, layer, stream)[0][0, 0].double().numpy()


def coded_heads(pipe: Pipeline, x: torch.Tensor, layer: int, stream: str):
    """``x`` ``[B, H, T, D]`` (pre-RoPE keys, or values) as the joint stream's input
    ``[B, 1, T, H*D]`` before the joint frame, and the values' norms ``[B, H, T]`` (None for
    keys): keys in the bundle's per-head coding frame, values as unit vectors."""
    b, h, t, d = x.shape
    norms = None
    if stream == "k":
        y = pipe._into_frame(x, layer, "k")
    else:
        norms = x.norm(dim=-1).half()
        y = x / norms.float().clamp_min(torch.finfo(torch.float16).tiny)[..., None]
    return y.permute(0, 2, 1, 3).reshape(b, 1, t, h * d), norms


def install(frames: dict[str, list], streams: str) -> None:
    """Replace `Pipeline.roundtrip` by the joint-frame round trip for ``streams``."""
    exact_roundtrip = Pipeline.roundtrip

    def roundtrip(self, x, layer, stream, positions=None, sinks=None, newer=None):
        if stream not in streams:
            return exact_roundtrip(self, x, layer, stream, positions, sinks, newer)
        xf = x.detach().float().cpu()
        if stream == "k" and positions is not None and self.recipe.pre_rope:
            xf = self._rope_for(layer).unrotate(xf, positions.cpu())
        if sinks is not None and bool(sinks.any()):
            xf = _neutralise(xf, sinks.cpu(), self.recipe.block_size)
        b, h, t, d = xf.shape
        frame = frames[stream][layer]
        heads, norms = coded_heads(self, xf, layer, stream)
        # Each head's norms are stored with the joint stream's blocks (and counted).
        blocks = self.code_frame(heads @ frame, layer, stream, norms, newer)
        decoded = decode_blocks(blocks, b)
        per_head = (decoded[:, 0] @ frame.T).reshape(b, t, h, d).permute(0, 2, 1, 3)
        if stream == "k":
            out = self._from_frame(per_head, layer, "k", positions)
        else:  # each head's decoded direction gets its stored norm back
            kept = decode_norms([blk.norms for blk in blocks])
            out = per_head * (kept / per_head.norm(dim=-1).clamp_min(1e-12))[..., None]
        out = out.to(device=x.device, dtype=x.dtype)
        if sinks is not None:
            out = torch.where(sinks.to(out.device)[:, None, :, None], x, out)
        return out, blocks

    Pipeline.roundtrip = roundtrip


def main(argv=None) -> None:
    ap = smollm2_eval.parser(__doc__)
    ap.add_argument("--mode", default="snapshot", choices=["snapshot", "in-forward"])
    ap.add_argument("--bits", type=float, nargs="+", default=[2.5, 2.25, 2.0])
    ap.add_argument("--streams", default="kv", choices=["kv", "k", "v"])
    ap.add_argument("--fit-text", default=CALIBRATION_TEXT)
    ap.add_argument("--fit-tokens", type=int, default=8 * CHUNK)
    args = ap.parse_args(argv)
    setup = smollm2_eval.setup(args)
    calib = Calibration.load(args.calibration)
    pipe = Pipeline(default_recipe(calib), calibration=calib)
    tok = AutoTokenizer.from_pretrained(resolve_model_dir(args.model))
    frames = joint_frames(setup.model, tok, pipe, args.fit_text, args.fit_tokens)
    install(frames, args.streams)
    print(f"joint frames for {args.streams}, fitted on {args.fit_tokens} tokens; mode {args.mode}")
    for bits in args.bits:
        method = build_method(f"kakeya:calibration={args.calibration},bits_per_value={bits:g}")
        r = evaluate_method(setup.model, setup.reference, method, args.mode)
        print(f"{bits:g} bits per value: {smollm2_eval.scores(r)}")


if __name__ == "__main__":
    main()
