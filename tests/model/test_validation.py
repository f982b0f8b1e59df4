"""Bad input raises a typed error before any work, and the model is left as it was."""

from __future__ import annotations

import pytest
import torch

from relaygr.errors import (
    ConfigError,
    EmptyInputError,
    IncompatiblePrefixError,
    InvalidInputError,
    ItemOutOfRangeError,
    SequenceTooLongError,
    TimestampError,
)
from relaygr.model import HSTUConfig, PrefixKV, concat_prefix
from tests.model.helpers import make_model


@pytest.fixture(scope="module")
def model():  # type: ignore[no-untyped-def]
    return make_model(0, max_seq_len=100)


def test_empty_candidates(model) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(EmptyInputError, match="candidates"):
        model.rank([], prefix_items=[1, 2, 3])


def test_empty_history(model) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(EmptyInputError, match="history"):
        model.rank([1])
    with pytest.raises(EmptyInputError, match="prefill"):
        model.prefill([])


@pytest.mark.parametrize("bad", [0, -3, 501])
def test_item_ids_out_of_range(model, bad: int) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ItemOutOfRangeError, match=f"item id {bad}; valid ids are 1..500"):
        model.rank([1, bad], prefix_items=[1, 2])
    with pytest.raises(ItemOutOfRangeError):
        model.prefill([4, bad])
    with pytest.raises(ItemOutOfRangeError):
        model.rank([1], prefix_items=[2], suffix_items=[bad])


def test_too_long(model) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SequenceTooLongError, match="101 tokens; the model's max_seq_len is 100"):
        model.rank([1], prefix_items=[1] * 90, suffix_items=[2] * 11)
    kv = model.prefill([1] * 95)
    with pytest.raises(SequenceTooLongError):
        model.prefill([1] * 6, past=kv)
    with pytest.raises(SequenceTooLongError):
        model.rank([1], prefix=kv, suffix_items=[1] * 6)


def test_timestamp_mismatches(model) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TimestampError, match="3 items but 2 timestamps"):
        model.prefill([1, 2, 3], timestamps=[10, 20])
    timed = model.prefill([1, 2], timestamps=[10, 20])
    with pytest.raises(TimestampError, match="suffix timestamps are missing"):
        model.rank([1], prefix=timed, suffix_items=[3])
    untimed = model.prefill([1, 2])
    with pytest.raises(TimestampError, match="suffix timestamps are given"):
        model.rank([1], prefix=untimed, suffix_items=[3], suffix_timestamps=[30])
    with pytest.raises(TimestampError, match="query_timestamp"):
        model.rank([1], prefix=untimed, query_timestamp=5)
    with pytest.raises(TimestampError):
        model.rank([1], prefix_items=[1], suffix_timestamps=[4])


def test_malformed_tensors(model) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidInputError, match="1-D"):
        model.rank(torch.ones(2, 2, dtype=torch.long), prefix_items=[1])
    with pytest.raises(InvalidInputError, match="integers"):
        model.rank(torch.tensor([1.5]), prefix_items=[1])
    with pytest.raises(InvalidInputError, match="either prefix"):
        model.rank([1], prefix=model.prefill([1]), prefix_items=[1])


def test_incompatible_prefix(model) -> None:  # type: ignore[no-untyped-def]
    other = make_model(0, max_seq_len=100, num_layers=1)
    with pytest.raises(IncompatiblePrefixError, match="layers"):
        model.rank([1], prefix=other.prefill([1, 2]))


def test_errors_are_value_errors_and_leave_no_state(model) -> None:  # type: ignore[no-untyped-def]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError):
        model.rank([999], prefix_items=[1])
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("bad", [{"dim": 30, "num_heads": 4}, {"num_layers": 0},
                                 {"dropout": 1.0}, {"max_seq_len": -1},
                                 {"rank_score": "retrieval"}])
def test_bad_config(bad: dict) -> None:
    with pytest.raises(ConfigError):
        HSTUConfig(num_items=10, **bad)


def test_config_roundtrip_rejects_unknown_keys() -> None:
    cfg = HSTUConfig(num_items=10, dim=16, num_heads=2)
    assert HSTUConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown"):
        HSTUConfig.from_dict({**cfg.to_dict(), "heads": 3})


def test_floats_and_bools_given_as_lists_are_refused_not_truncated(  # type: ignore[no-untyped-def]
        model) -> None:
    """As tensors they were refused; as lists they were cast first, so 1.9 was item 1."""
    for candidates, history in (([1.9, 2.99], [5, 6, 7]), ([1, 2], [5.5, 6.5, 7.99]),
                                ([True, True], [5, 6, 7])):
        with pytest.raises(InvalidInputError, match="must hold integers"):
            model.rank(candidates, prefix_items=history)
    with pytest.raises(InvalidInputError, match="must hold integers"):
        model.rank([1], prefix_items=[5, 6], prefix_timestamps=[10.9, 11.2])
    with pytest.raises(TimestampError, match="query_timestamp must be an integer"):
        model.rank([1], prefix_items=[5, 6], prefix_timestamps=[10, 11], query_timestamp=11.9)
    with pytest.raises(InvalidInputError, match="integers in int64"):
        model.rank([2 ** 64], prefix_items=[5, 6])
    with pytest.raises(InvalidInputError, match="integers in int64"):
        model.rank(5, prefix_items=[5, 6])


@pytest.mark.parametrize("stamp", [-2 ** 63 + 10, 2 ** 62, -2 ** 61 - 1])
def test_timestamps_past_2_61_seconds_are_refused(model, stamp: int) -> None:  # type: ignore[no-untyped-def]
    """Near int64's ends a gap, or a timestamp less a bucket start, wraps: the serving path
    bucketed zero gaps as 58 where the dense path said 0 (different scores), and a query past
    2^63 failed deep inside."""
    with pytest.raises(TimestampError, match="2\\^61"):
        model.rank([1, 2], prefix_items=[5, 6, 7], prefix_timestamps=[stamp] * 3)
    with pytest.raises(TimestampError, match="2\\^61"):
        model.rank([1, 2], prefix_items=[5, 6, 7], prefix_timestamps=[0, 1, 2],
                   query_timestamp=stamp)
    ok = 2 ** 61
    model.rank([1, 2], prefix_items=[5, 6], prefix_timestamps=[ok - 1, ok], query_timestamp=ok)


def test_configs_the_passes_could_not_run_are_refused_or_served() -> None:
    """A query block under the passes' 32-query minimum crashed every history longer than
    it; more than 105 time buckets start past int64 seconds; a model of a handful of tokens
    could not warm up; float16 cannot hold the mask."""
    small = make_model(0, max_seq_len=128, query_block=16)
    history = list(range(1, 41))
    torch.testing.assert_close(small.rank([1, 2, 3], prefix_items=history),
                               small.rank([1, 2, 3], prefix=small.prefill(history)),
                               rtol=1e-5, atol=1e-5)
    HSTUConfig(num_items=10, num_time_buckets=105)
    with pytest.raises(ConfigError, match="num_time_buckets must be at most 105"):
        HSTUConfig(num_items=10, num_time_buckets=106)
    tiny = make_model(0, max_seq_len=3)
    tiny.warm_up()
    with pytest.raises(ConfigError, match="float16"):
        make_model(0).half().rank([1], prefix_items=[2, 3])


def test_a_timed_prefix_and_an_untimed_tail_are_not_joined(model) -> None:  # type: ignore[no-untyped-def]
    timed = model.prefill([5, 6, 7], [10, 11, 12])
    untimed = model.prefill([8, 9])
    with pytest.raises(IncompatiblePrefixError, match="cannot join a timed"):
        concat_prefix(timed, untimed)
    # a prefix whose user vector is not the model's width would broadcast into its scores
    odd = PrefixKV(untimed.k, untimed.v, None, untimed.last_hidden[:-1])
    with pytest.raises(IncompatiblePrefixError, match="last_hidden has shape"):
        model.rank([1], prefix=odd)


def test_the_dense_path_refuses_what_the_serving_path_refuses(model) -> None:  # type: ignore[no-untyped-def]
    items = torch.tensor([[5, 6, 7]])
    with pytest.raises(EmptyInputError, match="candidates must be"):
        model.rank_padded(items, torch.empty(1, 0, dtype=torch.int64))
    with pytest.raises(TimestampError, match="no timestamps"):
        model.rank_padded(items, torch.tensor([[1, 2]]), query_timestamps=torch.tensor([5]))
