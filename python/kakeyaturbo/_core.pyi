"""Type stubs for the Rust extension ``kakeyaturbo._core`` (checked by mypy.stubtest in CI)."""

from typing import Any, Optional, Sequence, TypeAlias, Union, final

import numpy as np
import numpy.typing as npt

__all__ = [
    "Basis",
    "ChecksumError",
    "CodecParams",
    "EncodedLayer",
    "FORMAT_VERSION",
    "FormatError",
    "KakeyaTurboError",
    "UnsupportedVersionError",
    "codec_params_defaults",
    "coded_key_logits",
    "coded_value_sums",
    "coded_attend",
    "bf16_products",
    "decode_batch",
    "decode_norm_codes",
    "decode_layer",
    "encode_batch",
    "encode_layer",
    "fit_codebook",
    "gaussian_codebook",
    "gaussian_distortions",
    "int16_products",
    "int8_rows_encode",
    "share_torch_threads",
    "stage_errors",
    "wht_rotate",
    "PreparedKeys",
    "prepare_keys",
]

__version__: str
FORMAT_VERSION: int

# Token norms: float32 [streams, tokens], or per block uint8 codes [streams, tokens] and
# float16 bounds [streams, 2] (two lists).
_Norms: TypeAlias = (
    npt.NDArray[np.float32]
    | tuple[Sequence[npt.NDArray[np.uint8]], Sequence[npt.NDArray[np.float16]]]
)

class KakeyaTurboError(Exception): ...
class FormatError(KakeyaTurboError): ...

class ChecksumError(FormatError):
    stored: int
    computed: int

class UnsupportedVersionError(FormatError):
    version: int
    supported: tuple[int, ...]

@final
class CodecParams:
    def __new__(
        cls,
        *,
        block_size: int = 512,
        bit_width: int = 3,
        pca_method: str = "exact",
        target_rank: Optional[int] = None,
        oversample: int = 8,
        power_iters: int = 2,
        variance_ratio: float = 1.0,
        rank_cap: Optional[int] = None,
        share_basis: bool = False,
        k: int = 16,
        kmeans_iters: int = 8,
        metric: str = "mse",
        outlier_threshold: float = 4.0,
        skeleton_dtype: str = "fp16",
        seed: int = 0,
        centroids: Optional[Sequence[float]] = None,
        allocation: str = "uniform",
        bits_per_value: float = 2.0,
    ) -> CodecParams: ...
    @property
    def block_size(self) -> int: ...
    @property
    def bit_width(self) -> int: ...
    @property
    def pca_method(self) -> str: ...
    @property
    def target_rank(self) -> Optional[int]: ...
    @property
    def oversample(self) -> int: ...
    @property
    def power_iters(self) -> int: ...
    @property
    def variance_ratio(self) -> float: ...
    @property
    def rank_cap(self) -> Optional[int]: ...
    @property
    def share_basis(self) -> bool: ...
    @property
    def k(self) -> int: ...
    @property
    def kmeans_iters(self) -> int: ...
    @property
    def metric(self) -> str: ...
    @property
    def outlier_threshold(self) -> float: ...
    @property
    def skeleton_dtype(self) -> str: ...
    @property
    def seed(self) -> int: ...
    @property
    def centroids(self) -> Optional[list[float]]: ...
    @property
    def allocation(self) -> str: ...
    @property
    def bits_per_value(self) -> float: ...
    def to_dict(self) -> dict[str, Any]: ...
    def replace(self, **changes: Any) -> CodecParams: ...
    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __ne__(self, value: object, /) -> bool: ...

@final
class EncodedLayer:
    @staticmethod
    def from_bytes(data: bytes) -> EncodedLayer: ...
    def to_bytes(self) -> bytes: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def shape(self) -> tuple[int, int]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def basis_fingerprint(self) -> Optional[int]: ...
    @property
    def params(self) -> CodecParams: ...
    @property
    def stats(self) -> list[dict[str, int]]: ...
    def __reduce__(self) -> tuple[Any, tuple[bytes]]: ...

@final
class Basis:
    def __new__(cls, rows: npt.NDArray[Any]) -> Basis: ...
    @property
    def rows(self) -> npt.NDArray[np.float32]: ...
    @property
    def d_eff(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def fingerprint(self) -> int: ...
    def __reduce__(self) -> tuple[Any, tuple[npt.NDArray[np.float32]]]: ...

def _params_from_dict(d: dict[str, Any]) -> CodecParams: ...
def codec_params_defaults() -> dict[str, Any]: ...
def encode_layer(
    x: npt.NDArray[Any],
    params: CodecParams,
    weights: Optional[npt.NDArray[np.float32]] = None,
    bf16_bits: bool = False,
    basis: Optional[Basis] = None,
) -> EncodedLayer: ...
def encode_batch(
    x: npt.NDArray[Any],
    params: CodecParams,
    bf16_bits: bool = False,
    bases: Optional[Sequence[Basis]] = None,
) -> list[EncodedLayer]: ...
def decode_layer(enc: EncodedLayer, basis: Optional[Basis] = None) -> npt.NDArray[np.float32]: ...
def decode_batch(
    encs: Sequence[EncodedLayer], bases: Optional[Sequence[Basis]] = None
) -> npt.NDArray[np.float32]: ...
def stage_errors(x: npt.NDArray[Any], params: CodecParams) -> dict[str, float]: ...
def coded_key_logits(
    encs: Sequence[EncodedLayer],
    streams: int,
    queries: npt.NDArray[np.float32],
    frames: Optional[npt.NDArray[np.float32]] = None,
    rotation: Optional[npt.NDArray[np.float32]] = None,
    norms: Optional[_Norms] = None,
    precision: str = "float32",
    rotation_repeats: int = 1,
) -> npt.NDArray[np.float32]: ...
def coded_value_sums(
    encs: Sequence[EncodedLayer],
    streams: int,
    weights: npt.NDArray[np.float32],
    norms: Optional[_Norms] = None,
) -> npt.NDArray[np.float32]: ...

# One [streams, n, head_dim] run, float32 or raw bfloat16 bits, or int8 rows [streams, n,
# head_dim + 2]; or a list of runs in order.
_ExactRun = Union[npt.NDArray[np.float32], npt.NDArray[np.uint16], npt.NDArray[np.int8]]
_ExactRuns = Union[_ExactRun, Sequence[_ExactRun]]

def coded_attend(
    key_encs: Sequence[EncodedLayer],
    value_encs: Sequence[EncodedLayer],
    streams: int,
    queries: npt.NDArray[np.float32],
    exact_keys: _ExactRuns,
    exact_values: _ExactRuns,
    scaling: float,
    *,
    key_frames: Optional[npt.NDArray[np.float32]] = None,
    rotation: Optional[npt.NDArray[np.float32]] = None,
    key_norms: Optional[_Norms] = None,
    value_frames: Optional[npt.NDArray[np.float32]] = None,
    value_norms: Optional[_Norms] = None,
    bias: Optional[npt.NDArray[np.float32]] = None,
    softcap: Optional[float] = None,
    heads: int = 1,
    exact_queries: Optional[npt.NDArray[np.float32]] = None,
    key_scales: Optional[Union[npt.NDArray[np.float32], _Norms]] = None,
    value_scales: Optional[Union[npt.NDArray[np.float32], _Norms]] = None,
    precision: str = "float32",
    prepared: Optional[PreparedKeys] = None,
    rotation_repeats: int = 1,
) -> npt.NDArray[np.float32]: ...

@final
class PreparedKeys:
    def prepared(self) -> int: ...
    def __len__(self) -> int: ...

def prepare_keys(
    key_encs: Sequence[EncodedLayer],
    streams: int,
    key_frames: Optional[npt.NDArray[np.float32]] = None,
    rotation: Optional[npt.NDArray[np.float32]] = None,
    precision: str = "float32",
    background: bool = True,
    rotation_repeats: int = 1,
    token_norms: bool = False,
) -> Optional[PreparedKeys]: ...
def bf16_products(head_dim: int) -> bool: ...
def int16_products(head_dim: int) -> bool: ...
def decode_norm_codes(norms: _Norms, streams: int) -> npt.NDArray[np.float32]: ...
def int8_rows_encode(x: npt.NDArray[np.float32]) -> npt.NDArray[np.int8]: ...
def gaussian_codebook(bits: int) -> list[float]: ...
def gaussian_distortions() -> list[float]: ...
def fit_codebook(samples: npt.NDArray[Any], bits: int, iters: int = 100) -> list[float]: ...
def wht_rotate(x: Sequence[float], seed: int, inverse: bool = False) -> list[float]: ...
def waterfill_sections(enc: EncodedLayer) -> list[dict[str, Any]]: ...
def share_torch_threads(enabled: bool) -> bool: ...
def _workers() -> tuple[str, int]: ...
