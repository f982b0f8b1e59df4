"""The baseline's cost curve walked to the operating point's target
(``relaygr.bench.cost_curve``): bracketing, interpolation, and the quantile it reads."""

from __future__ import annotations

import pytest

from relaygr.bench.cost_curve import LengthSearch, find_operating_length
from relaygr.errors import BenchProtocolError, ConfigError

SEARCH = LengthSearch(start_tokens=256, min_tokens=32, max_tokens=16384)


def test_the_walk_brackets_then_narrows_on_a_linear_curve() -> None:
    """On a straight line one interpolation lands on the target (to the quantum)."""
    def linear(tokens: int) -> float:
        return 2.0 + 0.05 * tokens

    chosen, bound, curve = find_operating_length(linear, 25.0, SEARCH)
    assert [s.prefix_tokens for s in curve] == [256, 512, 464]   # up once, then interpolated
    assert chosen.prefix_tokens == 464 and bound == "bracketed"
    assert chosen.cost_ms == pytest.approx(25.2)


def test_a_pass_already_over_the_target_walks_down() -> None:
    def steep(tokens: int) -> float:
        return 0.5 * tokens

    chosen, bound, curve = find_operating_length(steep, 25.0, SEARCH)
    assert [s.prefix_tokens for s in curve][:3] == [256, 128, 64]
    assert chosen.prefix_tokens == 48 and chosen.cost_ms == 24.0 and bound == "bracketed"


def test_the_curves_quantile_is_not_its_slowest_pass() -> None:
    """Enough passes that the quantile by nearest rank is never the maximum: one spike in 100
    passes does not set a P99, two do."""
    p99, p90, p50 = (LengthSearch(quantile=q) for q in (0.99, 0.9, 0.5))
    assert (p99.passes, p90.passes, p50.passes) == (100, 10, 9)
    assert p99.read([1.0] * 99 + [50.0]) == 1.0
    assert p99.read([1.0] * 98 + [50.0, 60.0]) == 50.0
    assert p50.read([3.0, 1.0, 2.0]) == 2.0 and p90.read([5.0]) == 5.0
    with pytest.raises(ConfigError):
        LengthSearch(quantile=1.0)
    with pytest.raises(BenchProtocolError):
        p99.read([])
