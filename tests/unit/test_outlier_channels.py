"""A key or value channel 100x the others, as q/k biases make (Qwen2's keys), costs no more
than its share: the stored bytes barely move, the other channels keep their accuracy and the
outlier itself is coded at least as well as an ordinary channel. A codec that spent its bits
on the outlier (a per-block scale over all channels, a basis that ignores it) fails here."""

import pytest
import torch

from kakeyaturbo.pipeline import Pipeline
from kakeyaturbo.recipes import default_recipe

H, T, D, CHANNEL = 2, 512, 64, 5


def _data(outlier: str | None) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    # correlated channels with a decaying spectrum, as real K/V have
    mix = torch.randn(D, D, generator=g) * torch.logspace(0, -1.5, D)[:, None]
    x = torch.randn(1, H, T, D, generator=g) @ mix
    s = x[..., CHANNEL].std()
    if outlier == "bias":  # a large constant (a bias) with a 30x spread
        x[..., CHANNEL] = 100 * s + 30 * s * torch.randn(1, H, T, generator=g)
    elif outlier == "spread":  # a channel with 100x the spread of the others
        x[..., CHANNEL] = 100 * s * torch.randn(1, H, T, generator=g)
    return x


def _coded(x: torch.Tensor, stream: str) -> tuple[int, float, float]:
    """(stored bytes, relative error of the other channels, relative error of the outlier)."""
    y, blocks = Pipeline(default_recipe()).roundtrip(x, 0, stream)
    rest = [c for c in range(D) if c != CHANNEL]

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    return (
        sum(b.nbytes for b in blocks),
        rel(y[..., rest], x[..., rest]),
        rel(y[..., CHANNEL], x[..., CHANNEL]),
    )


# Values with a 100x spread channel store 19% more bytes (32,452 against 27,256): as unit
# vectors, 228 of a 256-token block's quantised residuals cross the sparse-outlier threshold
# (against 1 without the channel). Strict, so the fix shows up as this case passing.
SPREAD_VALUES = pytest.mark.xfail(
    strict=True, reason="values: a 100x spread channel fills the sparse outliers (issue 68)"
)


@pytest.mark.parametrize(
    "stream, outlier",
    [
        ("k", "bias"),
        ("k", "spread"),
        ("v", "bias"),
        pytest.param("v", "spread", marks=SPREAD_VALUES),
    ],
)
def test_an_outlier_channel_costs_its_share(stream: str, outlier: str) -> None:
    plain_bytes, plain_rest, plain_channel = _coded(_data(None), stream)
    nbytes, rest, channel = _coded(_data(outlier), stream)
    assert nbytes <= 1.10 * plain_bytes, (nbytes, plain_bytes)
    assert rest <= 1.4 * plain_rest, (rest, plain_rest)
    assert channel <= plain_channel, (channel, plain_channel)
