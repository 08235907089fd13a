"""Metrics with known answers: delta-ppl, KL, top-1, paired intervals, verdicts."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kakeyaturbo.eval.metrics import (
    PassageScores,
    mean_ci,
    passage_scores,
    student_t_ppf,
    summarize,
    verdict,
)


def test_identical_logits_score_zero():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 50, generator=g)
    targets = torch.randint(0, 50, (3, 7), generator=g)
    scores = passage_scores(logits, logits.clone(), targets)
    assert len(scores) == 3
    for s in scores:
        assert s.nll_ref == s.nll_alt
        assert s.kl == 0.0
        assert s.top1 == 1.0
        assert s.tokens == 7
    summary = summarize(scores)
    assert summary.delta_ppl == 0.0
    assert summary.verdict == "ACCEPT"


def test_two_token_vocabulary_by_hand():
    # ref: p = (0.75, 0.25), alt: q = (0.25, 0.75) at every position; targets always token 0
    lp = torch.log(torch.tensor([0.75, 0.25]))
    lq = torch.log(torch.tensor([0.25, 0.75]))
    ref = lp.expand(1, 4, 2).clone()
    alt = lq.expand(1, 4, 2).clone()
    targets = torch.zeros(1, 4, dtype=torch.long)
    (s,) = passage_scores(ref, alt, targets)
    assert s.nll_ref == pytest.approx(-math.log(0.75))
    assert s.nll_alt == pytest.approx(-math.log(0.25))
    assert s.kl == pytest.approx(0.75 * math.log(3) + 0.25 * math.log(1 / 3))
    assert s.top1 == 0.0
    summary = summarize([s])
    # ppl ratio = exp(nll_alt - nll_ref) = 0.75 / 0.25
    assert summary.delta_ppl == pytest.approx(2.0)
    assert summary.ppl_alt / summary.ppl_ref == pytest.approx(3.0)
    assert math.isnan(summary.delta_ppl_ci[0])  # one passage: no spread to measure
    assert summary.verdict == "REJECT"


def test_logits_are_shift_invariant():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 30, generator=g)
    targets = torch.randint(0, 30, (2, 5), generator=g)
    a = passage_scores(logits, logits + 3.0, targets)
    assert all(s.kl == pytest.approx(0.0, abs=1e-12) and s.top1 == 1.0 for s in a)


@pytest.mark.parametrize(
    ("p", "df", "expected"),
    [
        (0.975, 1, 12.7062),
        (0.975, 15, 2.1314),
        (0.975, 4, 2.7764),
        (0.95, 10, 1.8125),
        (0.975, 1e6, 1.95996),
    ],
)
def test_student_t_quantiles(p, df, expected):
    assert student_t_ppf(p, df) == pytest.approx(expected, abs=2e-4)
    assert student_t_ppf(1 - p, df) == pytest.approx(-expected, abs=2e-4)


def test_paired_interval_by_hand():
    values = [0.01, 0.03, 0.02, 0.04]
    mean, (lo, hi) = mean_ci(values)
    sd = math.sqrt(sum((v - 0.025) ** 2 for v in values) / 3)
    half = 3.182446 * sd / 2  # t_{0.975, 3} * sd / sqrt(4)
    assert mean == pytest.approx(0.025)
    assert lo == pytest.approx(0.025 - half, rel=1e-5)
    assert hi == pytest.approx(0.025 + half, rel=1e-5)


def test_summary_interval_is_paired_over_passages():
    # Two passages with very different perplexities but the same paired difference: the
    # interval of delta-ppl collapses to a point, which an unpaired interval would not.
    scores = [PassageScores(3.0, 3.1, 0.01, 0.9, 10), PassageScores(6.0, 6.1, 0.03, 0.8, 10)]
    s = summarize(scores)
    assert s.delta_ppl == pytest.approx(math.expm1(0.1))
    assert s.delta_ppl_ci[0] == pytest.approx(s.delta_ppl) and s.delta_ppl_ci[1] == pytest.approx(
        s.delta_ppl
    )
    assert s.kl == pytest.approx(0.02)
    assert s.top1 == pytest.approx(0.85)
    assert s.kl_ci[0] < 0.02 < s.kl_ci[1]


@pytest.mark.parametrize(
    ("dppl", "top1", "expected"),
    [
        (0.0, 1.0, "ACCEPT"),
        (0.01, 0.95, "ACCEPT"),
        (-0.01, 0.95, "ACCEPT"),
        (0.0101, 0.99, "MARGINAL"),
        (0.0, 0.949, "MARGINAL"),
        (0.03, 0.90, "MARGINAL"),
        (-0.0301, 0.99, "REJECT"),
        (0.0, 0.899, "REJECT"),
        (2.0, 0.0, "REJECT"),
    ],
)
def test_verdict_thresholds(dppl, top1, expected):
    assert verdict(dppl, top1) == expected


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1.0, 1.0, allow_nan=False), min_size=2, max_size=40))
def test_interval_contains_mean_and_shrinks_with_more_copies(values):
    mean, (lo, hi) = mean_ci(values)
    assert lo <= mean + 1e-12 and mean <= hi + 1e-12
    _, (lo4, hi4) = mean_ci(values * 4)  # same spread, 4x the passages: narrower interval
    assert hi4 - lo4 <= hi - lo + 1e-12
