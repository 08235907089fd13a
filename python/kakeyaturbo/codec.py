"""The codec's Python API: encode/decode numpy arrays and torch tensors.

All the work happens in the Rust core (``kakeyaturbo._core``) with the GIL released;
this module only validates inputs and converts between frameworks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from . import _core
from ._arrays import Origin, call_core, count_arg, from_core, to_core
from ._core import Basis, CodecParams
from .decode_limit import check_decode_limit, layer_totals
from .recipes import default_recipe


class EncodedLayer:
    """One encoded ``[tokens, head_dim]`` stream. In memory it is exactly its wire bytes:
    ``nbytes == len(to_bytes())``."""

    __slots__ = ("_raw", "_origin")

    def __init__(self, raw: _core.EncodedLayer, origin: Optional[Origin] = None):
        self._raw = raw
        self._origin = origin

    @classmethod
    def from_bytes(cls, data: Any) -> EncodedLayer:
        """Parses and fully validates ``data`` (bytes-like); raises ``FormatError``."""
        if not isinstance(data, bytes):
            try:
                data = bytes(memoryview(data))
            except TypeError:
                raise TypeError(
                    f"data: expected a bytes-like object, got {type(data).__name__}"
                ) from None
        return cls(_core.EncodedLayer.from_bytes(data))

    def to_bytes(self) -> bytes:
        return self._raw.to_bytes()

    @property
    def nbytes(self) -> int:
        return self._raw.nbytes

    @property
    def shape(self) -> tuple[int, int]:
        return self._raw.shape

    @property
    def dtype(self) -> str:
        return self._raw.dtype

    @property
    def params(self) -> CodecParams:
        return self._raw.params

    @property
    def basis_fingerprint(self) -> Optional[int]:
        """Fingerprint of the external :class:`Basis` needed to decode (None: self-contained)."""
        return self._raw.basis_fingerprint

    @property
    def stats(self) -> list[dict]:
        """Per block: n, d_eff, k_used, kmeans_iters, n_outliers."""
        return self._raw.stats

    def __getstate__(self):
        return (self._raw.to_bytes(), self._origin)

    def __setstate__(self, state):
        self._raw = _core.EncodedLayer.from_bytes(state[0])
        self._origin = state[1]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EncodedLayer) and self.to_bytes() == other.to_bytes()

    def __hash__(self) -> int:
        return hash(self.to_bytes())

    def __repr__(self) -> str:
        return repr(self._raw)


@dataclass(frozen=True)
class KVCodecParams:
    """Separate parameters for keys and values (they have different statistics and
    different error metrics: keys matter through ``q . k``, values through averaging).
    The defaults are the default recipe's (:mod:`kakeyaturbo.recipes`)."""

    k: CodecParams = field(default_factory=lambda: _recipe_params("k"))
    v: CodecParams = field(default_factory=lambda: _recipe_params("v"))

    def __post_init__(self):
        for name in ("k", "v"):
            if not isinstance(getattr(self, name), CodecParams):
                raise TypeError(f"{name}: expected CodecParams, got {type(getattr(self, name))}")


def _recipe_params(stream: str) -> CodecParams:
    return getattr(default_recipe(), stream)


def _params(params: Optional[CodecParams]) -> CodecParams:
    if params is None:
        return CodecParams()
    if not isinstance(params, CodecParams):
        raise TypeError(f"params: expected CodecParams, got {type(params).__name__}")
    return params


def _basis(basis: Optional[Basis], name: str = "basis") -> Optional[Basis]:
    if basis is not None and not isinstance(basis, Basis):
        raise TypeError(f"{name}: expected kakeyaturbo.Basis, got {type(basis).__name__}")
    return basis


def _bases(bases: Any, name: str = "bases") -> Optional[list]:
    if bases is None:
        return None
    if isinstance(bases, Basis):
        return [bases]
    return [_basis(b, f"{name}[{i}]") for i, b in enumerate(bases)]


def encode_layer(
    x: Any,
    params: Optional[CodecParams] = None,
    weights: Any = None,
    basis: Optional[Basis] = None,
) -> EncodedLayer:
    """Encodes ``x`` of shape ``[tokens, head_dim]`` (float32/float16/bfloat16, numpy or
    torch; CUDA tensors are copied to the host; float64, numpy's default, is converted to
    float32 and decodes as float32). ``weights`` ([tokens], >= 0) weight the PCA.
    ``basis`` (a calibrated :class:`Basis`) replaces the fitted one and is not stored."""
    arr, bf16, origin = to_core(x, "x", 2)
    w = None
    if weights is not None:
        w, _, _ = to_core(
            weights
            if not isinstance(weights, (list, tuple))
            else np.asarray(weights, dtype=np.float32),
            "weights",
            1,
        )
        w = np.require(w, np.float32, ["C", "A"])  # aligned too: the core reads a slice of it
    raw = _core.encode_layer(arr, _params(params), weights=w, bf16_bits=bf16, basis=_basis(basis))
    return EncodedLayer(raw, origin)


def decode_layer(
    enc: EncodedLayer, out: Optional[str] = None, basis: Optional[Basis] = None
) -> Any:
    """Decodes to the input's shape, dtype, framework and device. Layers read with
    ``from_bytes`` decode to numpy (torch for bfloat16) unless ``out`` says otherwise. A
    ceiling set on the decode limit (:mod:`kakeyaturbo.decode_limit`) applies here too."""
    _check_layer(enc, "enc")
    check_decode_limit("enc", [enc._raw])
    return from_core(_core.decode_layer(enc._raw, basis=_basis(basis)), enc.dtype, enc._origin, out)


def encode_block(x: Any, params: Optional[CodecParams] = None, weights: Any = None) -> EncodedLayer:
    """Encodes at most ``params.block_size`` vectors as a single block."""
    p = _params(params)
    n = x.shape[0] if hasattr(x, "shape") else len(x)
    if n > p.block_size:
        raise ValueError(f"x: {n} vectors exceed block_size={p.block_size}; use encode_layer")
    return encode_layer(x, p, weights)


def decode_block(enc: EncodedLayer, out: Optional[str] = None) -> Any:
    """Decodes an encoding made by :func:`encode_block`."""
    _check_layer(enc, "enc")
    if len(enc.stats) != 1:
        raise ValueError(f"enc: holds {len(enc.stats)} blocks, not one; use decode_layer")
    return decode_layer(enc, out)


def encode_batch(
    x: Any, params: Optional[CodecParams] = None, bases: Any = None
) -> list[EncodedLayer]:
    """Encodes ``[streams, tokens, head_dim]`` (e.g. batch x kv-heads; dtypes as for
    :func:`encode_layer`, float64 converted to float32) as independent streams, in parallel on
    all cores. A 4-D ``[layers, heads, tokens, head_dim]`` input is
    flattened to streams in row-major order. ``bases``: one :class:`Basis` for all streams
    or one per stream."""
    arr, bf16, origin = to_core(x, "x", x.ndim if getattr(x, "ndim", 0) == 4 else 3)
    if arr.ndim == 4:
        arr = arr.reshape(-1, *arr.shape[2:])
    raws = _core.encode_batch(arr, _params(params), bf16_bits=bf16, bases=_bases(bases))
    return [EncodedLayer(r, origin) for r in raws]


class CoreLayers(tuple):
    """Layers already unwrapped for the core (:func:`core_layers`): the batch calls take them
    as they are, so a caller that hands the same layers over on every step (a cache's blocks,
    immutable once written) checks and unwraps them once, and counts their bytes once for
    the decode limit (``totals``: decoded, stored)."""

    totals: tuple[int, int]


def core_layers(encs: Sequence[EncodedLayer]) -> CoreLayers:
    """``encs`` unwrapped for the core, once (a TypeError names the first that is not an
    :class:`EncodedLayer`)."""
    layers = CoreLayers(_raws(encs))
    layers.totals = layer_totals(layers)
    return layers


def _type_name(x: Any) -> str:
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _check_layer(e: Any, name: str) -> None:
    if isinstance(e, EncodedLayer):
        return
    hint = ""
    if isinstance(e, _core.EncodedLayer):
        hint = " (the core's own object: wrap it as kakeyaturbo.EncodedLayer(raw))"
    raise TypeError(f"{name}: expected kakeyaturbo.EncodedLayer, got {_type_name(e)}{hint}")


def _layers(encs: Any, name: str) -> list:
    """``encs`` as a list of checked layers, an iterator read once; a TypeError names what
    is not one."""
    if isinstance(encs, (EncodedLayer, _core.EncodedLayer)):
        raise TypeError(f"{name}: expected a sequence of EncodedLayer, got one (pass [layer])")
    if not isinstance(encs, list):
        try:
            encs = list(encs)
        except TypeError:
            raise TypeError(
                f"{name}: expected a sequence of EncodedLayer, got {_type_name(encs)}"
            ) from None
    for i, e in enumerate(encs):
        if not isinstance(e, EncodedLayer):
            _check_layer(e, f"{name}[{i}]")
    return encs


def _raws(encs: Any, name: str = "encs") -> Sequence:
    """The core layers of ``encs``, or a TypeError naming the first that is not one."""
    if isinstance(encs, CoreLayers):
        return encs
    return [e._raw for e in _layers(encs, name)]


def decode_batch(encs: Sequence[EncodedLayer], out: Optional[str] = None, bases: Any = None) -> Any:
    """Decodes equally shaped layers to ``[streams, tokens, head_dim]`` in parallel
    (``bases`` as in :func:`encode_batch`, for layers encoded with one).
    Layers declaring more decoded bytes in total than the decode limit allows
    (:mod:`kakeyaturbo.decode_limit`) are a ``FormatError``, before anything is allocated."""
    encs = _layers(encs, "encs")
    if not encs:
        raise ValueError("encs: the list is empty")
    raws = [e._raw for e in encs]
    dtypes = {e.dtype for e in encs}
    if len(dtypes) != 1:
        raise ValueError(f"encs: mixed dtypes {sorted(dtypes)}")
    check_decode_limit("encs", raws)  # the core's own check, with KAKEYATURBO_MAX_DECODED_BYTES
    values = _core.decode_batch(raws, bases=_bases(bases))
    return from_core(values, encs[0].dtype, encs[0]._origin, out)


def stage_errors(x: Any, params: Optional[CodecParams] = None) -> dict:
    """Relative Frobenius error after each stage: ``pca`` (projection alone), ``skeleton``
    (PCA + skeleton, residual dropped), ``quantised`` (no outlier compensation), ``full``."""
    arr, bf16, _ = to_core(x, "x", 2)
    if bf16 or arr.dtype != np.float32:
        arr = np.ascontiguousarray(_widen(arr, bf16))
    return _core.stage_errors(arr, _params(params))


def _widen(arr: np.ndarray, bf16: bool) -> np.ndarray:
    if bf16:
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def gaussian_codebook(bits: int) -> np.ndarray:
    """Lloyd-Max levels for N(0, 1) at ``bits`` in 1..8."""
    return np.asarray(_core.gaussian_codebook(bits), dtype=np.float32)


def fit_codebook(samples: Any, bits: int, iters: int = 100) -> np.ndarray:
    """Lloyd-Max levels fitted to 1-D ``samples``; pass as ``CodecParams(centroids=...)``."""
    arr, bf16, _ = to_core(samples, "samples", 1)
    arr = np.ascontiguousarray(_widen(arr, bf16)) if (bf16 or arr.dtype != np.float32) else arr
    return np.asarray(_core.fit_codebook(arr, bits, iters), dtype=np.float32)


def coded_key_logits(
    encs: Sequence[EncodedLayer],
    streams: int,
    queries: np.ndarray,
    frames: Optional[np.ndarray] = None,
    rotation: Optional[np.ndarray] = None,
    norms: Optional[np.ndarray] = None,
    precision: str = "float32",
    rotation_repeats: int = 1,
) -> np.ndarray:
    """Attention logits ``[streams, g, tokens]`` of ``queries`` ``[streams, g, head_dim]``
    against coded keys, without a decoded copy: ``q . rope_t(y_t @ frames[s % heads]) *
    norms[s, t] / |y_t|``. ``encs`` holds ``streams`` streams one after the other, each
    stream's blocks in token order; ``frames`` ``[heads, head_dim, head_dim]`` (None:
    identity); ``rotation`` ``[rows or 1, tokens, 2, pairs]``, the cosines then the sines
    turning channels ``(i, i + P)`` (None: no RoPE), ``P = pairs * rotation_repeats``, pair
    ``i`` by angle ``i % pairs`` (keys coded across heads: every head's pairs side by side,
    turned alike, from one head's table); ``norms`` ``[streams, tokens]`` (None: no scale).
    float32, C-contiguous. ``precision``: the frame product's arithmetic, the costliest part:
    ``"float32"``; ``"int16"`` (``y_t`` less a centre per block, and the frame, as 16-bit
    integers with scales per block, 11-13 bits of each, exact int32 sums; the centre's product
    in float32; blocks without a basis or key norms decode to those integers straight from
    their codes, centred on each coordinate's decodable range) where :func:`int16_products`
    says the CPU has AVX512-VNNI or AVX2 (the same bits on either); or ``"bfloat16"`` (both
    rounded to bfloat16, float32 sums) where :func:`bf16_products` says it multiplies
    bfloat16 natively. Both multiply faster than float32 there (twice its rate with AVX-512)
    and run the float32 product elsewhere. NaN or infinity in an array is a ValueError naming
    it (as for :func:`coded_attend`).
    Layers declaring more decoded bytes in total than the decode limit allows
    (:mod:`kakeyaturbo.decode_limit`) are a ``FormatError``, before anything is allocated."""
    raws = _raws(encs)
    check_decode_limit("encs", raws)
    return call_core(
        _core.coded_key_logits,
        encs=raws,
        streams=count_arg(streams, "streams"),
        queries=queries,
        frames=frames,
        rotation=rotation,
        norms=norms,
        precision=precision,
        rotation_repeats=count_arg(rotation_repeats, "rotation_repeats"),
    )


def bf16_products(head_dim: int) -> bool:
    """Whether ``precision="bfloat16"`` multiplies in bfloat16 on this CPU for coded streams of
    ``head_dim`` coordinates (AVX512-BF16, ``head_dim`` a multiple of 16); where it does not,
    that precision runs the float32 product."""
    return _core.bf16_products(head_dim)


def int16_products(head_dim: int) -> bool:
    """Whether ``precision="int16"`` multiplies in 16-bit integers on this CPU for coded streams
    of ``head_dim`` coordinates (AVX512-VNNI or AVX2, ``head_dim`` a multiple of 16); where it
    does not, that precision runs the float32 product."""
    return _core.int16_products(head_dim)


def coded_value_sums(
    encs: Sequence[EncodedLayer],
    streams: int,
    weights: np.ndarray,
    norms: Optional[np.ndarray] = None,
) -> np.ndarray:
    """``sum_t weights[s, j, t] * norms[s, t] / |y_t| * y_t`` ``[streams, g, head_dim]`` over
    coded values (laid out as for :func:`coded_key_logits`), in the coding frame, without a
    decoded copy. ``weights`` ``[streams, g, tokens]``; ``norms`` ``[streams, tokens]`` (None:
    no scale). float32, C-contiguous. NaN or infinity is a ValueError naming the array.
    Layers declaring more decoded bytes in total than the decode limit allows
    (:mod:`kakeyaturbo.decode_limit`) are a ``FormatError``, before anything is allocated."""
    raws = _raws(encs)
    check_decode_limit("encs", raws)
    return call_core(
        _core.coded_value_sums,
        encs=raws,
        streams=count_arg(streams, "streams"),
        weights=weights,
        norms=norms,
    )


def decode_norm_codes(
    norms: tuple[Sequence[np.ndarray], Sequence[np.ndarray]], streams: int
) -> np.ndarray:
    """Token norms ``[streams, tokens]`` float32 of consecutive blocks from their one-byte
    codes: ``norms`` is ``(codes, bounds)``, per block uint8 ``[streams, block tokens]`` and
    float16 ``[streams, 2]`` (``norm_codes.py``'s format, decoded as the kernels decode it)."""
    return call_core(_core.decode_norm_codes, norms=norms, streams=count_arg(streams, "streams"))


def coded_attend(
    key_encs: Sequence[EncodedLayer],
    value_encs: Sequence[EncodedLayer],
    streams: int,
    queries: np.ndarray,
    exact_keys: Any,
    exact_values: Any,
    scaling: float,
    *,
    key_frames: Optional[np.ndarray] = None,
    rotation: Optional[np.ndarray] = None,
    key_norms: Any = None,
    value_frames: Optional[np.ndarray] = None,
    value_norms: Any = None,
    bias: Optional[np.ndarray] = None,
    softcap: Optional[float] = None,
    heads: int = 1,
    exact_queries: Optional[np.ndarray] = None,
    key_scales: Any = None,
    value_scales: Any = None,
    precision: str = "float32",
    prepared: Optional[_core.PreparedKeys] = None,
    rotation_repeats: int = 1,
) -> np.ndarray:
    """One whole attention ``[streams, rows, head_dim]`` of ``queries`` ``[streams, rows,
    head_dim]`` over coded keys and values (laid out as for :func:`coded_key_logits`) followed
    by the exact ``exact_keys`` / ``exact_values`` ``[streams, exact, head_dim]`` (or lists of
    such runs in token order; each float32, uint16 holding raw bfloat16 bits, or int8 rows
    ``[streams, exact, head_dim + 2]`` as ``hf/int8_rows.py`` holds values, which the kernel
    widens or decodes as it reads them):
    ``softmax(softcap(scaling * logits) + bias) @ values``, the value sums turned out of the
    frame by ``value_frames`` ``[heads, head_dim, head_dim]``. ``bias`` ``[bias rows, rows,
    tokens + exact]`` (stream ``s`` reads row ``s // (streams // bias rows)``; ``-inf`` masks);
    norms as float32 ``[streams, tokens]`` or ``(codes, bounds)``, lists of per-block uint8
    ``[streams, block tokens]`` and float16 ``[streams, 2]`` arrays (``NormCodes.arrays``). A
    row with every token masked gets zeros. For the few query rows of a decode step: the
    exact part is plain dots. float32, C-contiguous (arrays misaligned in memory are copied,
    but for a ``rotation`` with ``prepared``, which must be the one :func:`prepare_keys` read).

    Streams coded across ``heads`` KV heads (``heads`` > 1, a recipe's ``joint_heads``):
    ``queries`` are the wide queries ``[streams, rows, heads * head_dim]`` in the key frame's
    coordinates, their rows in ``heads`` equal groups, one per head; ``exact_queries``
    ``[streams, rows, head_dim]`` each row over its own head's channels, in the exact keys'
    order; the exact runs ``[streams * heads, exact, head_dim]``; ``value_frames`` ``[heads,
    heads * head_dim, head_dim]``; ``key_scales`` / ``value_scales`` ``[streams, heads,
    tokens]`` each head's scale of the coded keys and values, or their one-byte codes as
    ``(codes, bounds)`` lists with ``streams * heads`` rows per block, decoded in the call
    (None: 1). ``precision`` and ``rotation_repeats``: as for :func:`coded_key_logits`.
    ``prepared``: the keys made ahead by :func:`prepare_keys` from the same blocks,
    ``key_frames`` of equal values, the same ``rotation`` array (repeated alike) and
    ``precision`` (a ValueError names what differs); the result is the same bits.

    NaN or infinity in any input (``bias`` may hold ``-inf``, a mask) is a ValueError naming
    the argument and the index: the softmax would otherwise mask or zero it silently.
    Norm codes' bounds are the core's to check (a ``FormatError``).
    Layers declaring more decoded bytes in total than the decode limit allows
    (:mod:`kakeyaturbo.decode_limit`) are a ``FormatError``, before anything is allocated."""
    keys, values = _raws(key_encs, "key_encs"), _raws(value_encs, "value_encs")
    check_decode_limit("key_encs and value_encs", keys, values)
    return call_core(
        _core.coded_attend,
        ("rotation",) if prepared is not None else (),
        key_encs=keys,
        value_encs=values,
        streams=count_arg(streams, "streams"),
        queries=queries,
        exact_keys=exact_keys,
        exact_values=exact_values,
        scaling=scaling,
        key_frames=key_frames,
        rotation=rotation,
        key_norms=key_norms,
        value_frames=value_frames,
        value_norms=value_norms,
        bias=bias,
        softcap=softcap,
        heads=count_arg(heads, "heads"),
        exact_queries=exact_queries,
        key_scales=key_scales,
        value_scales=value_scales,
        precision=precision,
        prepared=prepared,
        rotation_repeats=count_arg(rotation_repeats, "rotation_repeats"),
    )


def prepare_keys(
    key_encs: Sequence[EncodedLayer],
    streams: int,
    *,
    key_frames: Optional[np.ndarray] = None,
    rotation: Optional[np.ndarray] = None,
    precision: str = "float32",
    background: bool = True,
    rotation_repeats: int = 1,
    token_norms: bool = False,
) -> Optional[_core.PreparedKeys]:
    """The query-independent part of :func:`coded_attend`'s key logits (decoding the codes, the
    frame product, RoPE) for ``key_encs`` with ``key_frames``, ``rotation``
    (``rotation_repeats``) and ``precision`` as :func:`coded_attend` will take them, made
    ahead. With ``background`` it runs on a worker of the codec's pool while the caller goes on
    (in a decode step: while torch runs the model on one thread) and returns None where no
    worker would be idle for it (the codec on torch's threads, or a pool of one thread);
    attention computes whatever is not made yet itself.
    Without it every block is made before it returns. Do not write to ``key_frames`` or
    ``rotation`` while the result lives: they are read in place. ``token_norms``: whether
    :func:`coded_attend` will take ``key_norms`` for these blocks, which need each token's
    decoded length (without them the int16 product decodes its integer levels straight from
    the codes; with norms given anyway, attention makes those blocks again: the same bits).
    NaN or infinity in ``key_frames`` or ``rotation`` is a ValueError naming it.
    Layers declaring more decoded bytes in total than the decode limit allows
    (:mod:`kakeyaturbo.decode_limit`) are a ``FormatError``, before anything is allocated."""
    keys = _raws(key_encs, "key_encs")
    check_decode_limit("key_encs", keys)
    return call_core(
        _core.prepare_keys,
        ("rotation",),
        key_encs=keys,
        streams=count_arg(streams, "streams"),
        key_frames=key_frames,
        rotation=rotation,
        precision=precision,
        background=background,
        rotation_repeats=count_arg(rotation_repeats, "rotation_repeats"),
        token_norms=token_norms,
    )
