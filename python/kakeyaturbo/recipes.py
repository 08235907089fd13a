"""The default recipe: what ``KakeyaCache.from_model(model)`` and the evaluation's bare
``kakeya`` method use, and why (measured; see ``reports/README.md``).

1. **Keys are coded pre-RoPE.** RoPE spins every key pair by a position-dependent angle,
   which spreads a low-rank key distribution over all directions; undoing it before coding
   (and redoing it after decoding) keeps the keys compact. On kt-ref-a this alone moved
   top-1 agreement from 94% to 97% at 1.5 bits per key value.
2. **Transform coding with reverse water-filling** (``allocation="waterfill"``) in a PCA
   frame instead of a uniform bit width after a random rotation: the bits go to the
   directions that hold the variance, and directions below the water level get none.
3. **The frame comes from calibration when there is one**, from the data otherwise:
   with a bundle (``kakeyaturbo calibrate``) keys are coded in the query-aware whitened PCA
   frame and values in their PCA frame, both fitted once per model, so nothing per
   sequence is spent on bases (``pca_method="none"`` in that frame). Without one, a PCA
   basis per layer and head is fitted on the data and stored once (``share_basis``).
4. **Attention sinks** (the first 4 tokens) stay full precision: they are few and large.
5. **No k-means skeleton, MSE metric**: on this model the skeleton did not pay for its
   side information, and the inner-product scale measured slightly worse than MSE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._core import CodecParams
from .codec import KVCodecParams

#: Bits per stored value of the calibrated recipe (keys, values).
CALIBRATED_BITS = (2.5, 2.0)
#: Bits per stored value of the self-calibrated recipe (keys, values).
SELF_CALIBRATED_BITS = (2.0, 1.5)
DEFAULT_SINK_TOKENS = 4
DEFAULT_BLOCK_SIZE = 512


@dataclass(frozen=True)
class Recipe:
    """Codec parameters plus how the cache / evaluation must use them."""

    k: CodecParams
    v: CodecParams
    pre_rope: bool = True
    sink_tokens: int = DEFAULT_SINK_TOKENS
    calibrated: bool = False  # True: k/v expect the calibrated coding frames

    @property
    def kv(self) -> KVCodecParams:
        return KVCodecParams(k=self.k, v=self.v)


def _waterfill(bits: float, block_size: int, **kw: Any) -> CodecParams:
    return CodecParams(
        allocation="waterfill", k=0, bits_per_value=bits, block_size=block_size, **kw
    )


def calibrated_recipe(
    k_bits: float = CALIBRATED_BITS[0],
    v_bits: float = CALIBRATED_BITS[1],
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Recipe:
    """For data already in a calibration bundle's frames: no basis is stored."""
    return Recipe(
        k=_waterfill(k_bits, block_size, pca_method="none"),
        v=_waterfill(v_bits, block_size, pca_method="none"),
        calibrated=True,
    )


def self_calibrated_recipe(
    k_bits: float = SELF_CALIBRATED_BITS[0],
    v_bits: float = SELF_CALIBRATED_BITS[1],
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Recipe:
    """No bundle: one PCA basis per encoded layer and head, fitted on the data, stored once.
    Components holding the last 1% of the variance are not stored (at these rates water-
    filling gives them almost no bits, and their basis rows would cost more than they save)."""
    return Recipe(
        k=_waterfill(k_bits, block_size, share_basis=True, variance_ratio=0.99),
        v=_waterfill(v_bits, block_size, share_basis=True, variance_ratio=0.99),
    )


def default_recipe(calibrated: bool = False) -> Recipe:
    """The recipe for data with (``calibrated=True``) or without a calibration bundle."""
    return calibrated_recipe() if calibrated else self_calibrated_recipe()


def default_kv_params() -> tuple[KVCodecParams, dict[str, Any]]:
    """(codec parameters, harness options) of the uncalibrated default, for the evaluation."""
    r = default_recipe()
    return r.kv, {"sink": r.sink_tokens, "pre_rope": r.pre_rope}
