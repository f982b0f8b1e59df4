"""The relative bias tables' lookup: indexing's values, a sum of the same terms as gradient."""

from __future__ import annotations

import torch

from relaygr.model.attention import time_buckets, time_buckets_sorted
from relaygr.model.layers import table_lookup
from tests.tolerance import reorder_tolerance


def test_table_lookup_equals_indexing_and_its_gradient_sums_the_same_terms() -> None:
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(201, generator=gen, requires_grad=True)
    # a [B, T, T] causal-distance-like index: each weight repeats thousands of times
    index = torch.randint(0, 201, (4, 60, 60), generator=gen)
    upstream = torch.randn(4, 60, 60, generator=gen)

    looked_up = table_lookup(table, index)
    assert torch.equal(looked_up, table[index])          # the same elements, bit for bit
    (grad,) = torch.autograd.grad((looked_up * upstream).sum(), table)
    (reference,) = torch.autograd.grad((table[index] * upstream).sum(), table)
    # each weight's gradient sums its repeats' upstream values, in some order
    counts = torch.bincount(index.flatten(), minlength=201)
    abs_sums = torch.zeros(201).index_add_(0, index.flatten(), upstream.abs().flatten())
    bound = torch.tensor([reorder_tolerance(max(int(n), 1), float(s))
                          for n, s in zip(counts, abs_sums, strict=True)])
    assert ((grad - reference).abs() <= bound).all()
    assert torch.equal(counts > 0, grad != 0)


def test_sorted_time_buckets_equal_the_per_pair_search_on_every_causal_pair() -> None:
    """``time_buckets_sorted`` (a cumulative sum over crossings) and ``time_buckets`` (one search
    per pair) agree wherever a key is not later than its query, gaps from 0 to decades."""
    gen = torch.Generator().manual_seed(3)
    for num_buckets in (2, 16, 64):
        gaps = torch.randint(0, 10, (300,), generator=gen) ** torch.randint(0, 9, (300,),
                                                                           generator=gen)
        key_ts = 1_000_000 + torch.cumsum(gaps, 0)
        query_ts = torch.cat([key_ts[::7].flip(0), key_ts[-1:] + 5])
        fast = time_buckets_sorted(query_ts, key_ts, num_buckets)
        exact = time_buckets(query_ts, key_ts, num_buckets)
        causal = key_ts[None, :] <= query_ts[:, None]
        assert fast.dtype == exact.dtype == torch.int32
        assert torch.equal(fast[causal], exact[causal])
        assert int(exact.max()) == num_buckets - 1 or num_buckets == 64
