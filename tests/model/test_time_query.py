"""``HSTUConfig.time_query``: under "next" a position's time bias measures gaps from the time of
the item it predicts, not its own; only the dense retrieval path reads it, and every serving pass
and the ranking head refuse such a model."""

from __future__ import annotations

import pytest
import torch

from relaygr.errors import ConfigError, TimestampError
from relaygr.model import PrefillInput, RankInput
from relaygr.model import hstu as hstu_module
from relaygr.model.attention import time_buckets
from tests.model.helpers import make_model

ITEMS = torch.tensor([[5, 9, 2, 7]])
STAMPS = torch.tensor([[100, 101, 110, 1000]])
# the time of the item each position predicts: the next item's, then the request's
NEXT = torch.tensor([[101, 110, 1000, 5000]])
# Buckets by hand: bucket b starts at a gap of ceil(1.5^b - 1) seconds (1, 2, 3, 5, 7, 11, ...,
# 656, 985, ..., 3325, 4987): gap 0 -> 0, 1 -> 1, 9 and 10 -> 5, 890..900 -> 16,
# 4000..4900 -> 20. Rows are queries, columns keys; only the causal part (j <= i) is read.
OWN_BUCKETS = [[0], [1, 0], [5, 5, 0], [16, 16, 16, 0]]          # t_i - t_j
NEXT_BUCKETS = [[1], [5, 5], [16, 16, 16], [20, 20, 20, 20]]    # t_{i+1} - t_j


def _causal(buckets: torch.Tensor) -> list[list[int]]:
    return [buckets[0, i, :i + 1].tolist() for i in range(buckets.shape[1])]


def _buckets_read(model: object, monkeypatch: pytest.MonkeyPatch, **kwargs: object
                  ) -> torch.Tensor:
    """The time buckets the dense forward of ``model`` computes for ``ITEMS``."""
    seen: list[torch.Tensor] = []

    def recording(query: torch.Tensor, key: torch.Tensor, num: int) -> torch.Tensor:
        seen.append(time_buckets(query, key, num))
        return seen[-1]

    monkeypatch.setattr(hstu_module, "time_buckets", recording)
    with torch.no_grad():
        model.encode_padded(ITEMS, STAMPS, **kwargs)  # type: ignore[attr-defined]
    assert len(seen) == 1
    return seen[0]


def test_next_measures_each_gap_from_the_predicted_items_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    own = make_model(0, num_layers=1)
    nxt = make_model(0, num_layers=1, time_query="next")
    assert _causal(_buckets_read(own, monkeypatch)) == OWN_BUCKETS
    assert _causal(_buckets_read(nxt, monkeypatch, next_timestamps=NEXT)) == NEXT_BUCKETS


def test_next_changes_only_the_query_times() -> None:
    """Same weights: "next" at its own times is "own" bit for bit; at the next items' times
    the outputs move (the time bias is read)."""
    own = make_model(4, time_query="own")
    nxt = make_model(4, time_query="next")
    nxt.load_state_dict(own.state_dict())
    with torch.no_grad():
        reference = own.encode_padded(ITEMS, STAMPS)
        assert torch.equal(nxt.encode_padded(ITEMS, STAMPS, next_timestamps=STAMPS), reference)
        moved = nxt.encode_padded(ITEMS, STAMPS, next_timestamps=NEXT)
    assert (moved - reference).abs().max() > 1e-3
    # a position's output reads only its own and earlier query times: the last one's time
    # (the request's) leaves every earlier position alone
    later = NEXT.clone()
    later[0, -1] += 10_000_000
    with torch.no_grad():
        shifted = nxt.encode_padded(ITEMS, STAMPS, next_timestamps=later)
    assert torch.equal(shifted[0, :-1], moved[0, :-1])
    assert (shifted[0, -1] - moved[0, -1]).abs().max() > 1e-3


def test_next_timestamps_go_with_a_timed_next_model_only() -> None:
    own, nxt = make_model(1), make_model(1, time_query="next")
    with pytest.raises(TimestampError, match="needs next_timestamps"):
        nxt.encode_padded(ITEMS, STAMPS)
    with pytest.raises(TimestampError, match="only by a model with time_query='next'"):
        own.encode_padded(ITEMS, STAMPS, next_timestamps=NEXT)
    with pytest.raises(TimestampError, match="carry no timestamps"):
        nxt.encode_padded(ITEMS, None, next_timestamps=NEXT)
    with pytest.raises(TimestampError, match="shape of items"):
        nxt.encode_padded(ITEMS, STAMPS, next_timestamps=NEXT[:, :2])
    with pytest.raises(ConfigError, match="time_query must be one of"):
        make_model(1, time_query="previous")


def test_every_serving_pass_and_the_ranking_head_refuse_a_next_model() -> None:
    model = make_model(2, time_query="next")
    items, stamps = ITEMS[0], STAMPS[0]
    cands = torch.tensor([3, 4])
    refused = [
        lambda: model.prefill(items, stamps),
        lambda: model.prefill_job([PrefillInput(items, stamps)]),
        lambda: model.rank(cands, prefix_items=items, prefix_timestamps=stamps),
        lambda: model.rank_batch_outputs([RankInput(cands, prefix_items=items,
                                                    prefix_timestamps=stamps)]),
        lambda: model.rank_padded(ITEMS, cands[None], STAMPS),
        lambda: model.candidate_states_padded(ITEMS, cands[None], STAMPS),
    ]
    for call in refused:
        with pytest.raises(ConfigError, match="time_query='next' cannot be served"):
            call()
