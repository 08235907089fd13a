#!/usr/bin/env python3
"""Capture real K and V (pre- and post-RoPE) from a local model folder.

    python scripts/capture_kv.py --model ../shared/models/kt-ref-a \
        --text ../shared/data/calibration-text.txt --tokens 1024 --out artifacts/kv.safetensors

Same as ``kakeyaturbo capture``; kept as a script for people who grep the repo for one.
"""

import sys

from kakeyaturbo.cli import main

if __name__ == "__main__":
    sys.exit(main(["capture", *sys.argv[1:]]))
