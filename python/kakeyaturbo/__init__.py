"""kakeyaturbo: a KV-cache codec for transformer LLMs with a Rust core.

>>> import numpy as np, kakeyaturbo as kt
>>> x = np.random.default_rng(0).standard_normal((600, 64)).astype(np.float32)
>>> enc = kt.encode_layer(x, kt.CodecParams(bit_width=4))
>>> kt.decode_layer(kt.EncodedLayer.from_bytes(enc.to_bytes())).shape
(600, 64)
"""

from ._core import (
    FORMAT_VERSION,
    Basis,
    ChecksumError,
    CodecParams,
    FormatError,
    KakeyaTurboError,
    UnsupportedVersionError,
    __version__,
    share_torch_threads,
)
from .codec import (
    EncodedLayer,
    KVCodecParams,
    decode_batch,
    decode_block,
    decode_layer,
    encode_batch,
    encode_block,
    encode_layer,
    fit_codebook,
    gaussian_codebook,
    stage_errors,
)

__all__ = [
    "FORMAT_VERSION",
    "Basis",
    "ChecksumError",
    "CodecParams",
    "EncodedLayer",
    "FormatError",
    "KVCodecParams",
    "KakeyaTurboError",
    "UnsupportedVersionError",
    "__version__",
    "decode_batch",
    "decode_block",
    "decode_layer",
    "encode_batch",
    "encode_block",
    "encode_layer",
    "fit_codebook",
    "gaussian_codebook",
    "share_torch_threads",
    "stage_errors",
]
