"""Model-test helpers: small random models whose biases matter, and random histories."""

from __future__ import annotations

from typing import Literal, overload

import torch

from relaygr.model import HSTU, HSTUConfig
from tests.tolerance import SCORE_TOL


def make_model(seed: int = 0, /, **overrides: object) -> HSTU:
    """A small eval-mode model with non-zero relative biases (so a wrong position shows)."""
    params: dict[str, object] = {"num_items": 500, "dim": 32, "num_layers": 2, "num_heads": 4,
                                 "max_seq_len": 4096, "query_block": 64, "candidate_block": 40}
    params.update(overrides)
    torch.manual_seed(seed)
    model = HSTU(HSTUConfig(**params))  # type: ignore[arg-type]
    with torch.no_grad():
        for layer in model.blocks:
            layer.pos_w.normal_(0.0, 0.3)
            layer.time_w.normal_(0.0, 0.3)
        model.candidate_type.normal_(0.0, 0.3)
    return model.eval()


@overload
def random_history(gen: torch.Generator, length: int, num_items: int, timed: Literal[True],
                   start_ts: int = ...) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def random_history(gen: torch.Generator, length: int, num_items: int, timed: bool,
                   start_ts: int = ...) -> tuple[torch.Tensor, torch.Tensor | None]: ...


def random_history(gen: torch.Generator, length: int, num_items: int, timed: bool,
                   start_ts: int = 1_600_000_000) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``length`` random items, and (if ``timed``) their non-decreasing timestamps."""
    items = torch.randint(1, num_items + 1, (length,), generator=gen)
    if not timed:
        return items, None
    gaps = torch.randint(0, 200_000, (length,), generator=gen)
    return items, start_ts + torch.cumsum(gaps, 0)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = SCORE_TOL,
                 rtol: float = SCORE_TOL) -> None:
    """Equal up to float32 rounding of a reordered reduction (``tests/tolerance.py``): the
    exactness bound for the suite's models, whose outputs (scores, K/V, hidden states) are of
    order 1."""
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
