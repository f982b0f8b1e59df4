"""``HSTUConfig.time_query``: under "next" a position's time bias measures gaps from the time of
the item it predicts, not its own. The serving passes compute such a model exactly given the time
after each cached prefix (``PrefixKV.next_timestamp``), refuse a prefix read with another
continuation, and the relay's loader refuses the model."""

from __future__ import annotations

import pytest
import torch

from relaygr.errors import ConfigError, IncompatiblePrefixError, TimestampError
from relaygr.kvcache.pools import slice_tokens
from relaygr.model import PrefillInput, PrefixKV
from relaygr.model import hstu as hstu_module
from relaygr.model.attention import time_buckets
from relaygr.model.passes import concat_prefix
from tests.model.helpers import assert_close, make_model, random_history

ITEMS = torch.tensor([[5, 9, 2, 7]])
STAMPS = torch.tensor([[100, 101, 110, 1000]])
# the request time after the history, which the last position predicts at (each earlier one at
# the next item's time)
REQUEST = torch.tensor([5000])
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
    assert _causal(_buckets_read(nxt, monkeypatch, query_timestamps=REQUEST)) == NEXT_BUCKETS
    # an "own" model reads no request time for its history
    assert _causal(_buckets_read(own, monkeypatch, query_timestamps=REQUEST)) == OWN_BUCKETS


def test_next_changes_only_the_query_times() -> None:
    """Same weights: where every event and the request share one time, "next" is "own" bit for
    bit; at distinct times the outputs move (the time bias is read)."""
    own = make_model(4, time_query="own")
    nxt = make_model(4, time_query="next")
    nxt.load_state_dict(own.state_dict())
    same = torch.full_like(STAMPS, 100)
    with torch.no_grad():
        assert torch.equal(nxt.encode_padded(ITEMS, same, torch.tensor([100])),
                           own.encode_padded(ITEMS, same))
        reference = own.encode_padded(ITEMS, STAMPS)
        moved = nxt.encode_padded(ITEMS, STAMPS, REQUEST)
    assert (moved - reference).abs().max() > 1e-3
    # a position's output reads only its own and earlier query times: the last one's time
    # (the request's) leaves every earlier position alone
    with torch.no_grad():
        shifted = nxt.encode_padded(ITEMS, STAMPS, REQUEST + 10_000_000)
    assert torch.equal(shifted[0, :-1], moved[0, :-1])
    assert (shifted[0, -1] - moved[0, -1]).abs().max() > 1e-3


def test_query_times_default_to_the_last_event_and_only_a_next_model_reads_them() -> None:
    own, nxt = make_model(1), make_model(1, time_query="next")
    with torch.no_grad():
        assert torch.equal(nxt.encode_padded(ITEMS, STAMPS),
                           nxt.encode_padded(ITEMS, STAMPS, STAMPS[:, -1]))
        assert torch.equal(own.encode_padded(ITEMS, STAMPS, REQUEST),
                           own.encode_padded(ITEMS, STAMPS))
    with pytest.raises(TimestampError, match="carry no timestamps"):
        nxt.encode_padded(ITEMS, None, REQUEST)
    with pytest.raises(TimestampError, match="one per history"):
        nxt.encode_padded(ITEMS, STAMPS, STAMPS)
    with pytest.raises(ConfigError, match="time_query must be one of"):
        make_model(1, time_query="previous")


@pytest.mark.parametrize("layer_style", ["ours", "reference"])
def test_serving_passes_compute_a_next_model_as_the_dense_path(layer_style: str) -> None:
    model = make_model(5, time_query="next", layer_style=layer_style)
    gen = torch.Generator().manual_seed(5)
    items, ts = random_history(gen, 150, 500, timed=True)
    request_ts = int(ts[-1]) + 86_400
    cands = torch.randint(1, 501, (70,), generator=gen)
    with torch.no_grad():
        hidden = model.encode_padded(items[None], ts[None], torch.tensor([request_ts]))[0]
        dense = model.rank_padded(items[None], cands[None], ts[None],
                                  torch.tensor([request_ts]))[0]
    kv = model.prefill(items, ts, next_timestamp=request_ts)
    assert kv.next_timestamp == request_ts
    assert_close(kv.last_hidden, hidden[-1])
    full = model.rank(cands, prefix_items=items, prefix_timestamps=ts, query_timestamp=request_ts)
    assert_close(full, dense)
    assert_close(model.rank(cands, prefix=kv, query_timestamp=request_ts), dense)
    assert_close(model.rank(cands, prefix=kv), dense)   # the time the prefix was computed for
    for cut in (1, 64, 149):     # a cached prefix, then the events after it in the ranking pass
        head = model.prefill(items[:cut], ts[:cut], next_timestamp=int(ts[cut]))
        assert head.next_timestamp == int(ts[cut])
        cached = model.rank(cands, prefix=head, suffix_items=items[cut:],
                            suffix_timestamps=ts[cut:], query_timestamp=request_ts)
        assert_close(cached, dense)
        grown = model.prefill(items[cut:], ts[cut:], past=head, next_timestamp=request_ts)
        assert_close(grown.k, kv.k)
        assert_close(grown.v, kv.v)
        assert_close(grown.last_hidden, kv.last_hidden)


def test_a_next_models_prefix_serves_only_its_own_continuation() -> None:
    nxt, own = make_model(2, time_query="next"), make_model(2)
    items, stamps = ITEMS[0], STAMPS[0]
    cands = torch.tensor([3, 4])
    with pytest.raises(TimestampError, match="needs next_timestamp"):
        nxt.prefill(items, stamps)
    with pytest.raises(TimestampError, match="needs next_timestamp"):
        nxt.prefill_job([PrefillInput(items, stamps)])
    with pytest.raises(TimestampError, match="next_timestamp is read only by"):
        own.prefill(items, stamps, next_timestamp=5000)
    with pytest.raises(TimestampError, match="next_timestamp is read only by"):
        nxt.prefill(items, None, next_timestamp=5000)       # untimed: no time bias to measure
    with pytest.raises(TimestampError, match="next_timestamp must be an integer"):
        nxt.prefill(items, stamps, next_timestamp=1.5)  # type: ignore[arg-type]
    head = nxt.prefill(items[:3], stamps[:3], next_timestamp=1000)
    whole = nxt.prefill(items, stamps, next_timestamp=5000)
    with pytest.raises(IncompatiblePrefixError, match="continuation at 1000 but this history "
                                                      "goes on at 999"):
        nxt.rank(cands, prefix=head, suffix_items=items[3:], suffix_timestamps=[999])
    with pytest.raises(IncompatiblePrefixError, match="continuation at 1000"):
        nxt.prefill(items[3:], [1001], past=head, next_timestamp=5000)
    with pytest.raises(IncompatiblePrefixError, match="continuation at 5000 but this history "
                                                      "goes on at 6000"):
        nxt.rank(cands, prefix=whole, query_timestamp=6000)
    with pytest.raises(IncompatiblePrefixError, match="computed by a model with time_query='next'"):
        own.rank(cands, prefix=whole)
    own_prefix = own.prefill(items[:3], stamps[:3])
    with pytest.raises(IncompatiblePrefixError, match="records no continuation time"):
        nxt.rank(cands, prefix=own_prefix, suffix_items=items[3:], suffix_timestamps=stamps[3:])
    with pytest.raises(IncompatiblePrefixError, match="next_timestamp must be an int"):
        PrefixKV(whole.k, whole.v, whole.timestamps, whole.last_hidden, torch.tensor(5))  # type: ignore[arg-type]
    # joining two prefixes checks the continuation too
    tail_then = nxt.prefill(items[3:], stamps[3:], past=head, next_timestamp=5000)
    assert concat_prefix(head, slice_tokens(tail_then, 3)).next_timestamp == 5000
    other = nxt.prefill(items[3:], [1001], next_timestamp=5000)
    with pytest.raises(IncompatiblePrefixError, match="continuation at 1000 and a tail"):
        concat_prefix(head, other)
    with pytest.raises(IncompatiblePrefixError, match="without a continuation time"):
        concat_prefix(own_prefix, slice_tokens(tail_then, 3))
    untimed = own.prefill(items)
    with pytest.raises(IncompatiblePrefixError, match="untimed prefix has no next_timestamp"):
        PrefixKV(untimed.k, untimed.v, None, untimed.last_hidden, 5)
    nxt.rank(cands, prefix=whole, query_timestamp=5000)     # its own continuation is served
    assert whole.to("cpu").next_timestamp == whole.contiguous().next_timestamp == 5000


def test_a_next_model_warms_up() -> None:
    model = make_model(3, time_query="next", max_seq_len=256)
    model.warm_up()      # every kind of pass, timed and untimed, each prefix for its continuation

