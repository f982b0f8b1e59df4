"""The P99 decision rule against exact binomial values, and its sequential error."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binom

from relaygr.bench.decision import P99Decision, P99Rule, Verdict, sequential_error
from relaygr.errors import ConfigError


def test_fewest_samples_to_pass_match_the_binomial() -> None:
    # no overage: (0.99)^n <= 1 - c; 458.2 -> 459 at 99%, 298.1 -> 299 at 95%, 229.1 -> 230 at 90%
    assert P99Rule(0.99).min_samples_to_pass() == 459
    assert P99Rule(0.95).min_samples_to_pass() == 299
    assert P99Rule(0.90).min_samples_to_pass() == 230
    assert 0.99 ** 459 <= 0.01 < 0.99 ** 458
    # one overage at 99%: P(M <= 1 | n, 1%) <= 1% first at n = 662
    assert P99Rule(0.99).min_samples_to_pass(1) == 662
    assert binom.cdf(1, 662, 0.01) <= 0.01 < binom.cdf(1, 661, 0.01)


@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_boundaries_are_the_exact_binomial_tails(confidence: float) -> None:
    rule, alpha = P99Rule(confidence), 1 - confidence
    allow, need = rule.boundaries(1024)
    for n in (1, 2, 10, 40, 100, 230, 459, 700, 1000):
        m = np.arange(n + 1)
        passing = m[binom.cdf(m, n, 0.01) <= alpha]
        failing = m[binom.sf(m - 1, n, 0.01) <= alpha]
        assert allow[n] == (passing.max() if len(passing) else -1)
        assert need[n] == (failing.min() if len(failing) else n + 1)
        for overages in (0, 1, 2, 5, n):
            if overages > n:
                continue
            expected = (Verdict.PASS if overages in passing else
                        Verdict.FAIL if overages in failing else Verdict.UNDECIDED)
            assert rule.verdict(n, overages) is expected


def test_one_spike_in_forty_is_undecided_not_a_fail() -> None:
    # the 4-QPS point: 40 requests, one 50 ms spike. P(M >= 1 | 40, 1%) = 0.33.
    for confidence in (0.9, 0.95, 0.99):
        assert P99Rule(confidence).verdict(40, 1) is Verdict.UNDECIDED
        assert P99Rule(confidence).verdict(40, 0) is Verdict.UNDECIDED   # too few to pass
    # P(M >= 3 | 40, 1%) = 0.0075 <= 1% < P(M >= 2 | 40, 1%) = 0.061
    assert binom.sf(2, 40, 0.01) <= 0.01 < binom.sf(1, 40, 0.01)
    assert P99Rule(0.99).verdict(40, 3) is Verdict.FAIL
    assert P99Rule(0.99).verdict(40, 2) is Verdict.UNDECIDED
    decision = P99Decision.of(P99Rule(0.95), 300, 0)
    assert decision == P99Decision(Verdict.PASS, 300, 0, 0.95)


def _simulated_error(rule: P99Rule, n_max: int, verdict: Verdict, paths: int) -> float:
    """Share of Bernoulli(1%) paths that reach ``verdict`` within n_max looks (Monte Carlo)."""
    rng = np.random.default_rng(0)
    overages = np.cumsum(rng.random((paths, n_max)) < rule.tail, axis=1)   # [paths, n]
    allow, need = rule.boundaries(n_max)
    n = np.arange(1, n_max + 1)
    hit = overages <= allow[n] if verdict is Verdict.PASS else overages >= need[n]
    return float(hit.any(axis=1).mean())


def test_sequential_error_matches_simulation_and_the_sequential_rule_keeps_alpha() -> None:
    fixed = P99Rule(0.9)
    for verdict in (Verdict.PASS, Verdict.FAIL):
        exact = sequential_error(fixed, 256, verdict)
        simulated = _simulated_error(fixed, 256, verdict, 40_000)
        # Monte Carlo standard error at p ~ 0.1-0.3 and 40,000 paths: < 0.0023; 4 sigma
        assert simulated == pytest.approx(exact, abs=0.01)
    # looking after every request, the fixed-size levels let the false fail rate exceed alpha
    assert sequential_error(P99Rule(0.99), 2048, Verdict.FAIL) > 0.05
    for confidence in (0.9, 0.99):
        rule = P99Rule(confidence).sequential(1000)
        assert rule.boundaries(8)[0][0] == -1
        for verdict in (Verdict.PASS, Verdict.FAIL):
            assert sequential_error(rule, 1024, verdict) <= 1 - confidence + 1e-12
    # the price: a pass needs more requests (bucket 1024 at 99%: 533 rather than 459)
    assert P99Rule(0.99).sequential(1000).min_samples_to_pass() == 533
    assert P99Rule(0.99).sequential(1000) == P99Rule(0.99).sequential(1024)   # one bucket


def test_bad_rules_and_counts_are_rejected() -> None:
    with pytest.raises(ConfigError):
        P99Rule(confidence=0.3)
    with pytest.raises(ConfigError):
        P99Rule(quantile=1.0)
    with pytest.raises(ConfigError):
        P99Rule().verdict(10, 11)
    assert P99Rule().verdict(0, 0) is Verdict.UNDECIDED
    assert math.isclose(P99Rule().tail, 0.01)
