"""A key or value channel 100x the others, as q/k biases make (Qwen2's keys), costs no more
than its share: the stored bytes barely move, the other channels keep their accuracy and the
outlier itself is coded at least as well as an ordinary channel. A codec that spent its bits
on the outlier (a per-block scale over all channels, a basis that ignores it) fails here, and
so do values coded as unit vectors regardless (``unit_tokens.py``: their other coordinates
become heavy-tailed and fill the sparse outliers, 19% more bytes at 3.8x the error)."""

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


@pytest.mark.parametrize(
    "stream, outlier",
    [
        ("k", "bias"),
        ("k", "spread"),
        ("v", "bias"),
        ("v", "spread"),
    ],
)
def test_an_outlier_channel_costs_its_share(stream: str, outlier: str) -> None:
    plain_bytes, plain_rest, plain_channel = _coded(_data(None), stream)
    nbytes, rest, channel = _coded(_data(outlier), stream)
    assert nbytes <= 1.10 * plain_bytes, (nbytes, plain_bytes)
    assert rest <= 1.4 * plain_rest, (rest, plain_rest)
    assert channel <= plain_channel, (channel, plain_channel)


@pytest.mark.parametrize("outlier, norms", [(None, True), ("bias", False), ("spread", False)])
def test_values_dominated_by_one_channel_are_coded_without_token_norms(outlier, norms) -> None:
    pipe = Pipeline(default_recipe())
    blocks = pipe.encode(_data(outlier), 0, "v")
    assert all((blk.norms is not None) == norms for blk in blocks)
    # The choice holds for the sequence: later tokens of the layer follow it, whatever they are.
    later = pipe.encode(_data(None if outlier else "spread"), 0, "v")
    assert all((blk.norms is not None) == norms for blk in later)
    pipe.forget(0)  # a new sequence decides again
    assert pipe.token_norms.decide(_data(None), 0, "v")
