"""The ``kakeya`` serde's stored object: a fixed header, a payload, a CRC32 over both.

Layout (little-endian)::

    magic "KTLM" | version u16 | mode u8 | dtype u8 | shape 4 x u32 (2, layers, tokens, hidden)
    | kv_heads u16 | head_dim u16 | start u32 | sinks u16 | payload_len u32 | payload | crc32 u32

``mode`` 0: the codec's blocks (:mod:`.chunk_codec`); 1: the chunk's own bytes (a chunk the
codec does not take); 2: :mod:`.fallback` codes (``start`` holds their bits). ``start`` is the
RoPE position the keys were unrotated from. Objects are zero-padded to the serde's size bound
after the CRC. Any
mismatch, truncation or bad checksum raises :class:`KakeyaFormatError`, so LMCache sees a
failed load (a miss), never garbage KV.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

MAGIC = b"KTLM"
VERSION = 1
MODE_CODED, MODE_RAW, MODE_FALLBACK = 0, 1, 2
_HEAD = struct.Struct("<4sHBB4IHHIHI")
HEADER_BYTES = _HEAD.size
CRC_BYTES = 4
OVERHEAD = HEADER_BYTES + CRC_BYTES
#: dtype codes; the names are torch's.
DTYPES = {1: "bfloat16", 2: "float16", 3: "float32"}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
_MAX_U32 = 0xFFFFFFFF


class KakeyaFormatError(ValueError):
    """A stored object that is not a valid ``kakeya`` container for the chunk asked for."""


@dataclass(frozen=True)
class Header:
    mode: int
    dtype: str
    shape: tuple[int, int, int, int]
    kv_heads: int
    head_dim: int
    start: int
    sinks: int
    payload_len: int


def pack(header: Header, payload: bytes) -> bytes:
    if len(payload) != header.payload_len or len(payload) > _MAX_U32:
        raise ValueError(f"payload of {len(payload)} bytes, header says {header.payload_len}")
    head = _HEAD.pack(
        MAGIC,
        VERSION,
        header.mode,
        DTYPE_CODES[header.dtype],
        *header.shape,
        header.kv_heads,
        header.head_dim,
        header.start,
        header.sinks,
        header.payload_len,
    )
    body = head + payload
    return body + struct.pack("<I", zlib.crc32(body))


def unpack(data: memoryview) -> tuple[Header, memoryview]:
    """(header, payload) of ``data`` (the object's bytes, possibly with trailing slack)."""
    if len(data) < OVERHEAD:
        raise KakeyaFormatError(f"kakeya object truncated: {len(data)} bytes, needs {OVERHEAD}")
    fields = _HEAD.unpack_from(data, 0)
    magic, version, mode, dtype, *rest = fields
    if magic != MAGIC:
        raise KakeyaFormatError(f"not a kakeya object (magic {bytes(magic)!r})")
    if version != VERSION:
        raise KakeyaFormatError(f"kakeya container version {version}, this reader knows {VERSION}")
    if mode not in (MODE_CODED, MODE_RAW, MODE_FALLBACK) or dtype not in DTYPES:
        raise KakeyaFormatError(f"kakeya header: bad mode {mode} or dtype code {dtype}")
    shape = tuple(rest[:4])
    kv_heads, head_dim, start, sinks, payload_len = rest[4:]
    end = HEADER_BYTES + payload_len
    if end + CRC_BYTES > len(data):
        raise KakeyaFormatError(
            f"kakeya object truncated: payload of {payload_len} bytes, {len(data)} in all"
        )
    (crc,) = struct.unpack_from("<I", data, end)
    if zlib.crc32(data[:end]) != crc:
        raise KakeyaFormatError("kakeya object checksum mismatch (corrupted in the store)")
    header = Header(mode, DTYPES[dtype], shape, kv_heads, head_dim, start, sinks, payload_len)  # type: ignore[arg-type]
    return header, data[HEADER_BYTES:end]


class Writer:
    """Length-prefixed sections of a payload."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def u32(self, n: int) -> None:
        self.parts.append(struct.pack("<I", n))

    def blob(self, b: bytes) -> None:
        self.u32(len(b))
        self.parts.append(b)

    def getvalue(self) -> bytes:
        return b"".join(self.parts)


class Reader:
    """Bounds-checked reads of a payload: running off its end is a format error."""

    def __init__(self, data: memoryview) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise KakeyaFormatError(
                f"kakeya payload truncated: needs {n} bytes at {self.pos} of {len(self.data)}"
            )
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def blob(self) -> memoryview:
        return self.take(self.u32())

    def done(self) -> None:
        if self.pos != len(self.data):
            raise KakeyaFormatError(
                f"kakeya payload has {len(self.data) - self.pos} bytes past its last section"
            )
