"""The saved-cache container: one safetensors file, versioned and checksummed.

Layout: a standard safetensors file whose ``__metadata__`` holds

* ``format``: ``"kakeyaturbo-cache"``;
* ``version``: :data:`CACHE_FILE_VERSION`, as a decimal string;
* ``header``: JSON (model identity, cache settings, per-layer lengths; ``hf/persist.py``);
* ``sha256``: hex digest of the format, version, header and every tensor (name, dtype,
  shape, bytes, in name order).

The whole file is read and its checksum verified before anything in it is used, so a
truncated or bit-flipped file is refused with :class:`CacheFileError`, never decoded.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

FORMAT = "kakeyaturbo-cache"
#: The version this code writes and the only one it reads.
CACHE_FILE_VERSION = 1


class CacheFileError(ValueError):
    """A saved cache file that cannot be used: not one, damaged, truncated, another version."""


class CacheMismatchError(CacheFileError):
    """A saved cache made for another model, recipe, options or calibration than the cache it
    is loaded into; the message names every field that differs."""


def write(path: str | os.PathLike, header: dict, tensors: dict[str, torch.Tensor]) -> int:
    """Write the file (atomically: a temporary beside it, then renamed); its size in bytes."""
    from safetensors.torch import save

    tensors = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    text = json.dumps(header, sort_keys=True)
    meta = {
        "format": FORMAT,
        "version": str(CACHE_FILE_VERSION),
        "header": text,
        "sha256": _digest(str(CACHE_FILE_VERSION), text, tensors),
    }
    data = save(tensors, metadata=meta)
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, out)
    return len(data)


def read(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """(header, tensors on the CPU) of a file written by :func:`write`, checked in full."""
    from safetensors.torch import load

    where = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise CacheFileError(f"{where}: cannot read the cache file ({exc})") from None
    meta = _metadata(data, where)
    if meta.get("format") != FORMAT:
        raise CacheFileError(
            f"{where}: not a kakeyaturbo cache file (format {meta.get('format')!r})"
        )
    if meta.get("version") != str(CACHE_FILE_VERSION):
        raise CacheFileError(
            f"{where}: cache file format version {meta.get('version')!r}; this kakeyaturbo "
            f"reads version {CACHE_FILE_VERSION}"
        )
    try:
        tensors = load(data)
    except Exception as exc:  # safetensors' parser error on damaged input
        raise CacheFileError(f"{where}: damaged cache file ({exc})") from None
    text = meta.get("header")
    if not isinstance(text, str) or meta.get("sha256") != _digest(meta["version"], text, tensors):
        raise CacheFileError(f"{where}: checksum mismatch (the file is damaged)")
    try:
        header = json.loads(text)
    except ValueError as exc:
        raise CacheFileError(f"{where}: damaged header ({exc})") from None
    if not isinstance(header, dict):
        raise CacheFileError(f"{where}: damaged header (not an object)")
    return header, tensors


def _metadata(data: bytes, where: str) -> dict[str, Any]:
    """The safetensors ``__metadata__`` of ``data``, parsed by hand: a damaged header must
    raise CacheFileError, whatever the bytes."""
    if len(data) < 8:
        raise CacheFileError(f"{where}: truncated cache file ({len(data)} bytes)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise CacheFileError(f"{where}: truncated cache file (header of {n} bytes)")
    try:
        head = json.loads(data[8 : 8 + n].decode("utf-8"))
        meta = head.get("__metadata__") if isinstance(head, dict) else None
    except (UnicodeDecodeError, ValueError):
        meta = None
    if not isinstance(meta, dict):
        raise CacheFileError(f"{where}: not a kakeyaturbo cache file (no readable metadata)")
    return meta


def _digest(version: str, header: str, tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for part in (FORMAT, version, header):
        h.update(part.encode("utf-8") + b"\0")
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
