"""The relative bias tables' lookup: indexing's values, a sum of the same terms as gradient."""

from __future__ import annotations

import torch

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
