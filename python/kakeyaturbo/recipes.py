"""The recipe: every choice of how K/V are coded, in one place. ``KakeyaCache``, the
evaluation's ``kakeya`` method and the vLLM hooks take a :class:`Recipe` and hand it to
:class:`~kakeyaturbo.pipeline.Pipeline`; nothing else picks codec parameters.

Why the default is what it is (measured on SmolLM2-135M, see ``docs/recipe.md``):

1. **Keys are coded pre-RoPE.** RoPE spins each key pair by a position-dependent angle and
   spreads a low-rank key distribution over all directions; undoing it keeps keys compact.
2. **Transform coding with reverse water-filling** in a PCA frame: bits go to the components
   that hold the variance, none below the water level.
3. **The frame comes from calibration when there is one** (keys in the query-aware whitened
   frame, so squared error is expected squared logit error; values in their PCA frame; nothing
   stored per sequence), else a PCA frame per layer and head is fitted on the first tokens
   coded and held once as float16.
4. **Values are coded as unit vectors with their norm beside** (``v_token_norms``): the codec's
   error is then relative per token. Real models put much attention on a few small-norm value
   tokens (attention sinks beyond the first ones); an error absolute per block ruins them.
   Keys are not: a logit error is absolute, and large keys are the ones attention reads.
   A layer whose tokens put most of their energy in one direction is coded without them
   (``unit_tokens.py``).
5. **Per-layer bits** come from the calibration bundle's sensitivity scan when it has one
   (mean zero: the average rate is unchanged).
6. **Attention sinks** (the first ``sink_tokens`` tokens) stay exact.
7. **The newest tokens get more bits**: a stored prefill's last ``recent_tokens`` tokens are
   what its continuation reads most (holding 32 of them exact halved KL on SmolLM2), so they
   are coded at ``recent_bits`` more bits than the rest. ``KakeyaCache`` holds its newest
   ``residual_length`` tokens exact anyway, so there the rule never applies.
8. **One frame across a layer's KV heads** where the bundle has one (``joint_heads``; what
   ``calibrate`` fits for layers of 2 or more KV heads at most 512 values wide, unless
   ``--no-joint-heads``): the heads' coordinates are correlated, and one rotation across
   them saves about 0.3 bits per value on SmolLM2, which with per-layer bits from both
   sensitivity scans (the geometric mean of their KLs) makes the recipe ACCEPT at 5.1x in
   snapshot and in-forward mode and on a copying test. The
   price is speed: attention over such codes makes every head's keys from all heads'
   coordinates (3x the key frame product on a 3-head layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ._core import CodecParams

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_SINK_TOKENS",
    "Recipe",
    "default_recipe",
]

DEFAULT_SINK_TOKENS = 4
DEFAULT_BLOCK_SIZE = 256
#: Bits per value (keys, values) without and with a calibration bundle. The calibrated rate is
#: the lowest of 2.5 and 2.6 at which SmolLM2's default bundle was ACCEPT in snapshot,
#: in-forward and copying runs alike (docs/recipe.md; 2.5 was MARGINAL in-forward).
SELF_CALIBRATED_BITS = (3.0, 3.0)
CALIBRATED_BITS = (2.6, 2.6)
#: The newest tokens at coding time get more bits (the recent window, coded rather than exact).
RECENT_TOKENS, RECENT_BITS = 64, 3.0
#: Sliding-window layers whose windows are coded (``KakeyaCache(code_sliding=True)``) get this
#: many bits more than the recipe gives the layer: at the recipe's own bits their windows were
#: MARGINAL on SmolLM2 with Gemma 3's layer pattern, ACCEPT one bit up (docs/recipe.md).
SLIDING_EXTRA_BITS = 1.0
#: Per-layer offsets are clipped to keep every layer within [MIN_BITS, MAX_BITS].
MIN_BITS, MAX_BITS = 0.25, 8.0


def waterfill_params(bits: float, block_size: int = DEFAULT_BLOCK_SIZE) -> CodecParams:
    """Frame-free water-filling (the pipeline supplies the frame)."""
    return CodecParams(
        allocation="waterfill", k=0, bits_per_value=bits, block_size=block_size, pca_method="none"
    )


@dataclass(frozen=True)
class Recipe:
    """Codec parameters per stream plus how the pipeline uses them.

    ``k_layer_bits`` / ``v_layer_bits``: per-layer offsets added to ``bits_per_value`` (empty:
    none). ``whiten``: with a calibration, code keys in the query-aware frame (False: plain
    key PCA, an ablation). ``recent_tokens`` / ``recent_bits``: the newest tokens of a sequence
    at coding time get that many more bits (a stored prefill's last tokens are the ones its
    continuation reads most; ``KakeyaCache`` holds them exact in its hot window anyway).
    ``joint_heads``: the streams (``"kv"``, ``"k"``, ``"v"`` or ``""``; True is ``"kv"``) whose
    layer's KV heads are coded as one stream in the calibration bundle's frame across them
    (needs a bundle with those frames, ``calibrate``'s default)."""

    k: CodecParams = field(default_factory=lambda: waterfill_params(SELF_CALIBRATED_BITS[0]))
    v: CodecParams = field(default_factory=lambda: waterfill_params(SELF_CALIBRATED_BITS[1]))
    k_token_norms: bool = False
    v_token_norms: bool = True
    pre_rope: bool = True
    sink_tokens: int = DEFAULT_SINK_TOKENS
    whiten: bool = True
    k_layer_bits: tuple[float, ...] = ()
    v_layer_bits: tuple[float, ...] = ()
    recent_tokens: int = RECENT_TOKENS
    recent_bits: float = RECENT_BITS
    joint_heads: str = ""

    def __post_init__(self) -> None:
        joint = {True: "kv", False: ""}.get(self.joint_heads, self.joint_heads)  # type: ignore
        if joint not in ("", "k", "v", "kv"):
            raise ValueError(
                f"joint_heads must be 'kv', 'k', 'v', '' or a bool, got {self.joint_heads!r}"
            )
        object.__setattr__(self, "joint_heads", joint)
        for name in ("k", "v"):
            p = getattr(self, name)
            if not isinstance(p, CodecParams):
                raise TypeError(f"{name}: expected CodecParams, got {type(p).__name__}")
        if int(self.k.block_size) != int(self.v.block_size):
            raise ValueError(
                f"k.block_size ({self.k.block_size}) and v.block_size ({self.v.block_size}) "
                "must be equal: keys and values are coded in the same token blocks"
            )
        if (
            isinstance(self.sink_tokens, bool)
            or not isinstance(self.sink_tokens, int)
            or (self.sink_tokens < 0)
        ):
            raise ValueError(f"sink_tokens must be a non-negative int, got {self.sink_tokens!r}")
        object.__setattr__(self, "k_layer_bits", tuple(float(b) for b in self.k_layer_bits))
        object.__setattr__(self, "v_layer_bits", tuple(float(b) for b in self.v_layer_bits))

    @property
    def block_size(self) -> int:
        return int(self.k.block_size)

    def token_norms(self, stream: str) -> bool:
        return self.k_token_norms if stream == "k" else self.v_token_norms

    def joint(self, stream: str) -> bool:
        """Whether ``stream`` is coded across a layer's KV heads (see ``joint_heads``)."""
        return stream in self.joint_heads

    def params(self, layer: int, stream: str) -> CodecParams:
        """The codec parameters of ``layer``'s ``stream`` (per-layer bits applied)."""
        return _layer_params(self, layer, stream)

    def replace(self, **changes: Any) -> Recipe:
        return replace(self, **changes)

    def with_more_bits(self, layers: set[int], extra: float, n_layers: int) -> Recipe:
        """This recipe with ``extra`` more bits per value on ``layers`` (of ``n_layers``), keys
        and values alike, on top of any per-layer offsets it has."""
        if not layers or not extra:
            return self

        def more(offsets: tuple[float, ...]) -> tuple[float, ...]:
            base = offsets or (0.0,) * n_layers
            if len(base) != n_layers:
                raise ValueError(f"the recipe's layer bits cover {len(base)} of {n_layers} layers")
            return tuple(b + (extra if i in layers else 0.0) for i, b in enumerate(base))

        return self.replace(
            k_layer_bits=more(self.k_layer_bits), v_layer_bits=more(self.v_layer_bits)
        )

    def describe(self) -> dict[str, Any]:
        return {
            "k": self.k.to_dict(),
            "v": self.v.to_dict(),
            "k_token_norms": self.k_token_norms,
            "v_token_norms": self.v_token_norms,
            "pre_rope": self.pre_rope,
            "sink_tokens": self.sink_tokens,
            "whiten": self.whiten,
            "k_layer_bits": list(self.k_layer_bits),
            "v_layer_bits": list(self.v_layer_bits),
            "recent_tokens": self.recent_tokens,
            "recent_bits": self.recent_bits,
            "joint_heads": self.joint_heads,
        }


def _layer_params(recipe: Recipe, layer: int, stream: str) -> CodecParams:
    base = recipe.k if stream == "k" else recipe.v
    offsets = recipe.k_layer_bits if stream == "k" else recipe.v_layer_bits
    if not offsets or base.allocation == "uniform":
        return base
    if not 0 <= layer < len(offsets):
        raise ValueError(f"layer {layer}: the recipe's {stream}_layer_bits cover {len(offsets)}")
    bits = min(max(float(base.bits_per_value) + offsets[layer], MIN_BITS), MAX_BITS)
    return base.replace(bits_per_value=bits)


def default_recipe(calibration: Any = None, block_size: int = DEFAULT_BLOCK_SIZE) -> Recipe:
    """The default recipe. ``calibration``: None (frames fitted on the data), a
    :class:`~kakeyaturbo.calibration.Calibration` (its frames, and its per-layer bits when it has
    a sensitivity scan), or True (a bundle's frames, before the bundle is loaded)."""
    if calibration is None or calibration is False:
        kb, vb = SELF_CALIBRATED_BITS
        return Recipe(k=waterfill_params(kb, block_size), v=waterfill_params(vb, block_size))
    kb, vb = CALIBRATED_BITS
    offsets = getattr(calibration, "layer_bit_offsets", None)
    return Recipe(
        k=waterfill_params(kb, block_size),
        v=waterfill_params(vb, block_size),
        k_layer_bits=tuple((offsets and offsets("k")) or ()),
        v_layer_bits=tuple((offsets and offsets("v")) or ()),
        joint_heads=bool(getattr(calibration, "joint_heads", False)),
    )
