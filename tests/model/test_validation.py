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
from relaygr.model import HSTUConfig
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
