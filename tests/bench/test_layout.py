"""The baseline's serving layout at the operating point (``relaygr.bench.layout``,
``relaygr.bench.operating``), on simulated cost curves: layouts over the same cores, the cost
curve timed with every instance busy, the layout serving the most requests a second within the
SLO, and the baseline's capacity read from it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from relaygr.bench.layout import Layout
from relaygr.bench.operating import operating_point
from relaygr.errors import ConfigError
from tests.bench.simulated_plan import CurveProbe, LayoutCurveProbe
from tests.bench.test_operating import SEARCH, SHARE, SLO_MS, slow_ms


def test_layouts_split_the_same_cores() -> None:
    assert Layout(2, 1).splits() == (Layout(2, 1), Layout(1, 2))
    assert Layout(2, 2).splits() == (Layout(4, 1), Layout(2, 2), Layout(1, 4))
    assert Layout(1, 1).splits() == (Layout(1, 1),)
    assert str(Layout(1, 2)) == "1 x 2 threads"
    with pytest.raises(ConfigError):
        Layout(0, 2)


def serving_2x1(speedup_at_2: float, contention_at_2: float = 1.0) -> LayoutCurveProbe:
    """The slow machine on 2 cores, served as two one-thread instances: a second thread makes
    one pass ``speedup_at_2`` x faster, two instances at once each ``contention_at_2`` x
    slower (shared caches and memory bandwidth)."""
    return LayoutCurveProbe(slow_ms, Layout(2, 1),
                            contention=lambda k: contention_at_2 if k == 2 else 1.0,
                            speedup=lambda t: speedup_at_2 if t == 2 else 1.0)


def test_the_curve_is_timed_on_the_serving_layout_with_every_instance_busy() -> None:
    """The length follows the cost on the layout the modes serve on: where two instances at
    once each compute 1.5x slower, the pass reaches half the SLO at a shorter length than
    alone, and the chosen length's cost on the serving layout is the target's."""
    alone = operating_point(CurveProbe(slow_ms), SLO_MS, SHARE, 16, 256, SEARCH)
    probe = serving_2x1(speedup_at_2=1.2, contention_at_2=1.5)
    busy = operating_point(probe, SLO_MS, SHARE, 16, 256, SEARCH)
    assert busy.prefix_len < alone.prefix_len
    assert busy.cost_ms == pytest.approx(1.5 * slow_ms(busy.prefix_len))
    assert abs(busy.cost_ms - busy.target_ms) <= SEARCH.tolerance * busy.target_ms
    # every length of the curve, and the batch cap's calls, on the serving layout
    served = [c for c in probe.layout_calls if c[0] == Layout(2, 1)]
    assert len(served) == len(busy.curve) + len(busy.batch_curve)
    assert [c for c in probe.layout_calls if c[0] != Layout(2, 1)] == \
        [(Layout(1, 2), busy.prefix_len, 1)]


def test_the_baselines_layout_serves_the_most_requests_per_second_within_the_slo() -> None:
    """Two one-thread instances serve 2 / t requests a second; one of two threads 1 / (t / s)
    for a speed-up s from its second thread: the second thread wins only when s beats two
    instances' contention by more than the tolerance."""
    poor = operating_point(serving_2x1(speedup_at_2=1.5), SLO_MS, SHARE, 16, 256, SEARCH)
    assert [s.layout for s in poor.layout_curve] == [Layout(2, 1), Layout(1, 2)]
    one, two = poor.layout_curve
    assert (one.cost_ms, two.cost_ms) == (poor.cost_ms, pytest.approx(poor.cost_ms / 1.5))
    assert one.requests_per_s == pytest.approx(2e3 / poor.cost_ms)
    assert poor.baseline_layout == Layout(2, 1) and "its layout: 2 x 1 threads" in poor.reason
    # contended memory: two instances at once each 1.3x slower, the second thread 1.9x faster
    good = operating_point(serving_2x1(speedup_at_2=1.9, contention_at_2=1.3), SLO_MS, SHARE,
                           16, 256, SEARCH)
    assert good.baseline_layout == Layout(1, 2)
    assert good.layout_curve[1].requests_per_s > good.layout_curve[0].requests_per_s
    # within the tolerance of the serving layout's rate: no change
    even = operating_point(serving_2x1(speedup_at_2=2.0, contention_at_2=1.04), SLO_MS, SHARE,
                           16, 256, SEARCH)
    assert even.baseline_layout == Layout(2, 1)


def test_a_layout_whose_call_passes_the_slo_is_not_chosen() -> None:
    """Served as one instance of two threads at 60 % of the SLO (30 ms), two one-thread
    instances would each take 1.8 x 30 = 54 ms: more requests a second (2 / 54 > 1 / 30), but
    every one of them over the SLO."""
    probe = LayoutCurveProbe(slow_ms, Layout(1, 2), contention=lambda k: 1.0,
                             speedup=lambda t: 1.8 if t == 2 else 1.0)
    point = operating_point(probe, SLO_MS, 0.6, 16, 256, SEARCH)
    serving, split = point.layout_curve
    assert split.layout == Layout(2, 1) and split.cost_ms > SLO_MS
    assert split.requests_per_s > (1 + SEARCH.tolerance) * serving.requests_per_s
    assert point.baseline_layout == Layout(1, 2)


def test_a_probe_without_layouts_searches_none() -> None:
    point = operating_point(CurveProbe(slow_ms), SLO_MS, SHARE, 16, 256, SEARCH)
    assert point.layout_curve == () and point.baseline_layout is None
    assert "layout" not in point.reason


def test_the_baselines_capacity_is_its_chosen_layouts_or_its_instances_calls() -> None:
    """Requests a second of the baseline's compute at the length: the chosen layout's
    instances each computing a call of the batch cap; without layouts timed, one instance's
    calls times the serving instances."""
    layouts = operating_point(serving_2x1(speedup_at_2=1.5), SLO_MS, SHARE, 16, 256, SEARCH)
    assert layouts.baseline_requests_per_s == pytest.approx(2e3 / layouts.cost_ms)
    calls = operating_point(CurveProbe(slow_ms), SLO_MS, SHARE, 16, 256, SEARCH,
                            {"instances": 3})
    assert calls.baseline_batch == 1
    assert calls.baseline_requests_per_s == pytest.approx(3e3 / calls.batch_curve[0].cost_ms)
    assert replace(calls, batch_curve=()).baseline_requests_per_s is None
