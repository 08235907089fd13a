"""``kakeyaturbo capture``: save real K/V (pre- and post-RoPE) of a local HF model."""

from __future__ import annotations

import argparse
from pathlib import Path

from .cli_args import add_model_argument, add_text_argument, int_at_least


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("capture", help="capture K/V from a local model to .safetensors")
    add_model_argument(p)
    add_text_argument(p, "UTF-8 text file to run through the model")
    p.add_argument(
        "--tokens", type=int_at_least(1), default=1024, help="tokens in the forward pass"
    )
    p.add_argument(
        "--offset-chars", type=int_at_least(0), default=0, help="start this many characters in"
    )
    p.add_argument("--out", required=True, type=Path, help=".safetensors file (or folder of .npy)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .capture import capture_kv, read_tokens, save_tensors
    from .modeling import load_model

    model, tok = load_model(args.model)
    ids = read_tokens(tok, args.text, args.tokens, args.offset_chars)
    tensors = capture_kv(model, ids)
    path = save_tensors(tensors, args.out)
    print(f"wrote {len(tensors)} tensors ({', '.join(sorted(tensors)[:3])}, ...) to {path}")
    return 0
