"""Ray CPU shares are planned to fit the cluster, or refused up front with the arithmetic."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from relaygr.distributed.app import CpuShares, plan_cpu_shares
from relaygr.errors import ConfigError


def test_default_shares_fit_a_small_machine() -> None:
    # 2 CPUs, 2 replicas: the ingress and each replica get 0.66 (the hang: 1 + 2 x 1 = 3 CPUs)
    assert plan_cpu_shares(2.0, 2, None) == CpuShares(0.66, 0.66)
    assert plan_cpu_shares(16.0, 3, None) == CpuShares(1.0, 1.0)   # at most one CPU each
    assert plan_cpu_shares(2.0, 2, 0.5) == CpuShares(0.66, 0.5)


def test_shares_that_cannot_be_placed_are_refused_with_the_arithmetic() -> None:
    with pytest.raises(ConfigError, match=r"need 3 CPUs; the Ray cluster has 2\. Pass "
                                          r"--replica-cpus \(e\.g\. 0\.5\)"):
        plan_cpu_shares(2.0, 2, 1.0, ingress_cpus=1.0)


def test_ingress_replicas_share_the_cluster_with_the_ranking_replicas() -> None:
    assert plan_cpu_shares(2.0, 1, None, ingresses=2) == CpuShares(0.66, 0.66)
    with pytest.raises(ConfigError, match=r"2 ingress x 0\.75 CPU and 1 replicas x 0\.75 CPU "
                                          r"need 2\.25 CPUs"):
        plan_cpu_shares(2.0, 1, 0.75, ingress_cpus=0.75, ingresses=2)
