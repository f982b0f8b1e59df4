"""Numeric tolerances derived from the arithmetic, never from what one machine printed.

Two float evaluations of the same function differ only where the order of a reduction changes: a
blocked sum against a whole one, another thread split, another SIMD width (AVX2 and AVX-512
accumulate every dot product in different orders), a cached prefix against a recomputed one. For
a sum of ``n`` terms in a dtype with unit roundoff ``u = eps / 2``, the rounding error behaves
like a random walk: it exceeds ``lam * sqrt(n) * u * sum|x_i|`` with probability at most about
``2 n exp(-lam**2 / 2)`` (Higham and Mary, "A New Approach to Probabilistic Rounding Error
Analysis", SIAM J. Sci. Comput. 41(5), 2019). With ``lam = 10`` that probability is below 1e-17
for every size used here, so a test using these bounds fails only when the computation differs,
never because a machine rounded otherwise. Two orders can each be that far from the exact sum, in
opposite directions: hence the factor 2. ``chained`` reductions one after another (layers) add.
"""

from __future__ import annotations

import math

import torch

LAMBDA = 10.0


def reorder_tolerance(terms: int, abs_sum: float = 1.0, dtype: torch.dtype = torch.float32,
                      chained: int = 1) -> float:
    """Largest plausible |a - b| between two orders of ``chained`` reductions of ``terms`` terms
    whose absolute values sum to ``abs_sum`` (see the module docstring)."""
    assert terms >= 1 and abs_sum >= 0 and chained >= 1
    u = torch.finfo(dtype).eps / 2
    return 2 * chained * LAMBDA * math.sqrt(terms) * u * abs_sum


def stored_rounding_tolerance(roundings: int, magnitude: float = 1.0,
                              dtype: torch.dtype = torch.bfloat16) -> float:
    """Bound for a computation that accumulates in float32 but stores ``roundings`` intermediate
    results in ``dtype`` (bfloat16 on CUDA): each store rounds by at most ``u * magnitude`` and
    two runs round independently, so they differ by at most ``2 * roundings * u * magnitude``."""
    assert roundings >= 1 and magnitude >= 0
    return 2 * roundings * (torch.finfo(dtype).eps / 2) * magnitude


# Scores of the suite's models (tests/model/helpers.make_model: 2 layers, max_seq_len 4096, the
# attention normaliser n = max_seq_len, scores of order 1). A cached pass and a full pass split
# the history's attention differently (cached segment + new keys, query blocks, candidate
# micro-batches, matmuls of other shapes): the longest reordered reduction is attention over up to
# 4,096 keys whose terms |SiLU(qk + b) v| / n sum to at most about 1, once per layer. The shorter
# reductions (projections over dim <= 64) add far less. That bound, 1.5e-4, is what "cached scores
# equal the full pass up to float rounding" (DESIGN.md section 3) means in float32 at this size.
SCORE_TOL = reorder_tolerance(terms=4096, abs_sum=1.0, chained=2)
