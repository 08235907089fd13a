"""Quality metrics of a compressed KV cache against the uncompressed run.

Both runs teacher-force the same tokens, so every scored position has a reference distribution
`p` and an alternative `q` over the vocabulary:

- delta-ppl = ppl_alt / ppl_ref - 1 = exp(mean(nll_alt - nll_ref)) - 1 (0.01 is 1%);
- KL(ref || alt) = sum_v p_v (log p_v - log q_v), averaged over positions;
- top-1 agreement: the share of positions where both argmaxes agree.

Confidence intervals are paired over passages: each passage gives one difference (its mean NLL
difference, its mean KL, its top-1 share), and the 95% interval is the Student-t interval of the
mean of those per-passage values. delta-ppl's interval is the image of the NLL one through
exp(.) - 1. With a single passage there is no spread to measure and the interval is NaN.

Verdicts use the point estimates: ACCEPT when |delta-ppl| <= 1% and top-1 >= 95%, MARGINAL when
|delta-ppl| <= 3% and top-1 >= 90%, REJECT otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "PassageScores",
    "Summary",
    "passage_scores",
    "student_t_ppf",
    "summarize",
    "verdict",
]

ACCEPT_DPPL, ACCEPT_TOP1 = 0.01, 0.95
MARGINAL_DPPL, MARGINAL_TOP1 = 0.03, 0.90


@dataclass(frozen=True)
class PassageScores:
    """Per-passage means over its scored tokens."""

    nll_ref: float
    nll_alt: float
    kl: float
    top1: float
    tokens: int


@dataclass(frozen=True)
class Summary:
    ppl_ref: float
    ppl_alt: float
    delta_ppl: float
    delta_ppl_ci: tuple[float, float]
    kl: float
    kl_ci: tuple[float, float]
    top1: float
    top1_ci: tuple[float, float]
    verdict: str
    tokens: int


def passage_scores(
    logits_ref: torch.Tensor, logits_alt: torch.Tensor, targets: torch.Tensor
) -> list[PassageScores]:
    """Scores of each row of a batch: logits [B, T, V] (any float dtype), targets [B, T]."""
    lp_ref = torch.log_softmax(logits_ref.double(), dim=-1)
    lp_alt = torch.log_softmax(logits_alt.double(), dim=-1)
    t = targets.unsqueeze(-1)
    nll_ref = -lp_ref.gather(-1, t).squeeze(-1)
    nll_alt = -lp_alt.gather(-1, t).squeeze(-1)
    # exp(lp_ref) * (lp_ref - lp_alt); terms with p = 0 contribute 0 (exp underflows to exactly 0)
    kl = (lp_ref.exp() * (lp_ref - lp_alt)).sum(-1).clamp_min(0.0)
    top1 = (lp_ref.argmax(-1) == lp_alt.argmax(-1)).double()
    return [
        PassageScores(
            float(nll_ref[b].mean()),
            float(nll_alt[b].mean()),
            float(kl[b].mean()),
            float(top1[b].mean()),
            int(targets.shape[1]),
        )
        for b in range(targets.shape[0])
    ]


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta (Numerical Recipes, modified Lentz)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def _betai(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbeta = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    front = math.exp(lbeta + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def _student_t_cdf(t: float, df: float) -> float:
    tail = 0.5 * _betai(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def student_t_ppf(p: float, df: float) -> float:
    """Quantile of Student's t with `df` degrees of freedom (bisection on the exact CDF)."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError("need 0 < p < 1 and df > 0")
    if p < 0.5:
        return -student_t_ppf(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while _student_t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _student_t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def mean_ci(values: list[float], level: float = 0.95) -> tuple[float, tuple[float, float]]:
    """Mean and Student-t confidence interval of the mean (NaN interval for fewer than 2 values)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, (math.nan, math.nan)
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    half = student_t_ppf(0.5 + level / 2.0, n - 1) * math.sqrt(var / n)
    return mean, (mean - half, mean + half)


def verdict(delta_ppl: float, top1: float) -> str:
    if abs(delta_ppl) <= ACCEPT_DPPL and top1 >= ACCEPT_TOP1:
        return "ACCEPT"
    if abs(delta_ppl) <= MARGINAL_DPPL and top1 >= MARGINAL_TOP1:
        return "MARGINAL"
    return "REJECT"


def summarize(scores: list[PassageScores], level: float = 0.95) -> Summary:
    """Aggregate per-passage scores; every passage weighs by its token count."""
    if not scores:
        raise ValueError("no passages to summarize")
    tokens = sum(s.tokens for s in scores)
    nll_ref = sum(s.nll_ref * s.tokens for s in scores) / tokens
    nll_alt = sum(s.nll_alt * s.tokens for s in scores) / tokens
    kl = sum(s.kl * s.tokens for s in scores) / tokens
    top1 = sum(s.top1 * s.tokens for s in scores) / tokens
    _, (dlo, dhi) = mean_ci([s.nll_alt - s.nll_ref for s in scores], level)
    _, kl_ci = mean_ci([s.kl for s in scores], level)
    _, top1_ci = mean_ci([s.top1 for s in scores], level)
    delta = math.expm1(nll_alt - nll_ref)
    return Summary(
        ppl_ref=math.exp(nll_ref),
        ppl_alt=math.exp(nll_alt),
        delta_ppl=delta,
        delta_ppl_ci=(math.expm1(dlo), math.expm1(dhi)),
        kl=kl,
        kl_ci=kl_ci,
        top1=top1,
        top1_ci=top1_ci,
        verdict=verdict(delta, top1),
        tokens=tokens,
    )
