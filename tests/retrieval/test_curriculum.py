"""Katz scores against a hand-computed power series, the pool order, pacing and sampling."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch

from relaygr.retrieval.config import Pacing
from relaygr.retrieval.curriculum import (
    NegativeSampler,
    difficulty_pools,
    katz_user_scores,
    pacing_share,
)

# 4 users x 3 items: u0-{i0,i1}, u1-{i1}, u2-{i2}, u3-{i0,i1,i2}
R = sp.csr_matrix(np.array([[1, 1, 0], [0, 1, 0], [0, 0, 1], [1, 1, 1]], dtype=np.float32))
# B = R R^T (common items between users), by hand
B = np.array([[2, 1, 0, 2], [1, 1, 0, 1], [0, 0, 1, 1], [2, 1, 1, 3]], dtype=np.float64)


def test_katz_is_the_truncated_power_series() -> None:
    beta = 0.5
    got = katz_user_scores(R, np.arange(4), beta, hops=2)
    expected = beta ** 2 * B + beta ** 4 * (B @ B)
    # products of small integers and powers of two: exact in float64
    np.testing.assert_array_equal(got, expected)
    assert got[0, 3] == 0.25 * 2 + 0.0625 * 11   # u0-u3: 2 paths of length 2, 11 of length 4
    one_hop = katz_user_scores(R, np.array([2]), beta, hops=1)
    np.testing.assert_array_equal(one_hop, beta ** 2 * B[2:3])


def test_pools_order_users_easy_to_hard_and_exclude_the_anchor() -> None:
    pools = difficulty_pools(R, 0.5, 2, pool_size=3, rng=np.random.default_rng(0))
    # anchor 0: B row [2, 1, 0, 2], (B @ B) row [9, 5, 2, 11]
    # -> u1 0.25 + 0.0625 * 5, u2 0.0625 * 2, u3 0.5 + 0.0625 * 11: u2 < u1 < u3
    assert pools[0].tolist() == [2, 1, 3]
    # anchor 2: B row [0, 0, 1, 1], (B @ B) row [2, 1, 2, 4] -> u1 0.0625 < u0 0.125 < u3 0.5
    assert pools[2].tolist() == [1, 0, 3]
    for anchor in range(4):
        assert anchor not in pools[anchor]


def test_pacing_grows_from_the_start_share_to_the_whole_pool() -> None:
    assert pacing_share(Pacing.LINEAR, 0.0, 0.25) == 0.25
    assert pacing_share(Pacing.LINEAR, 0.5, 0.25) == 0.625
    assert pacing_share(Pacing.LINEAR, 2.0, 0.25) == 1.0
    assert pacing_share(Pacing.ROOT, 1.0, 0.25) == 1.0
    assert pacing_share(Pacing.STEP, 0.2, 0.25) == 0.25
    assert pacing_share(Pacing.STEP, 0.4, 0.25) == 0.625
    assert pacing_share(Pacing.STEP, 0.7, 0.25) == 1.0
    assert pacing_share(Pacing.NONE, 0.0, 0.25) == 1.0


def test_sampler_draws_only_from_the_available_easy_end() -> None:
    pools = np.array([[5, 6, 7, 8], [9, 8, 7, 6]])
    sampler = NegativeSampler(10, Pacing.LINEAR, pools, start_share=0.25, curriculum_epochs=4)
    gen = torch.Generator().manual_seed(0)
    assert sampler.available(0) == 1 and sampler.available(2) == 3 and sampler.available(9) == 4
    first = sampler.sample(torch.tensor([0, 1]), 5, epoch=0, gen=gen)
    assert first[0].tolist() == [5] * 5 and first[1].tolist() == [9] * 5
    later = sampler.sample(torch.tensor([0, 1] * 50), 8, epoch=2, gen=gen)
    assert set(later[0::2].flatten().tolist()) == {5, 6, 7}


def test_uniform_sampler_never_returns_the_anchor() -> None:
    sampler = NegativeSampler(3, Pacing.NONE, None, start_share=1.0, curriculum_epochs=1)
    anchors = torch.tensor([0, 1, 2] * 100)
    negs = sampler.sample(anchors, 4, epoch=0, gen=torch.Generator().manual_seed(1))
    assert not (negs == anchors[:, None]).any()
    assert set(negs.flatten().tolist()) == {0, 1, 2}
