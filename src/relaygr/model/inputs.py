"""Typed requests of the model API and their validation.

Validation happens once, at the edge of ``HSTU.prefill`` / ``HSTU.rank``: every rule that a
caller can break raises a typed ``relaygr.errors`` exception before any work starts, so a
rejected call changes nothing. After validation, tensors are 1-D int64 on the model's device.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from relaygr.errors import (
    ConfigError,
    EmptyInputError,
    IncompatiblePrefixError,
    InvalidInputError,
    ItemOutOfRangeError,
    SequenceTooLongError,
    TimestampError,
)
from relaygr.model.config import HSTUConfig
from relaygr.model.kv import PrefixKV

IntSeq = Tensor | Sequence[int]


@dataclass(frozen=True)
class PrefillInput:
    """Pre-infer ``items`` (with optional ``timestamps``), extending ``past`` when given.

    ``next_timestamp``: given exactly when the model has ``time_query="next"`` and the items
    are timed: the time of the event after ``items`` (the request time when none follows yet),
    which the last token's time bias measures from (``PrefixKV.next_timestamp``).
    """

    items: IntSeq
    timestamps: IntSeq | None = None
    past: PrefixKV | None = None
    next_timestamp: int | None = None


@dataclass(frozen=True)
class RankInput:
    """Score ``candidates`` for one user.

    The history is ``prefix`` (cached K/V) or ``prefix_items`` (computed in this pass), followed
    by the optional recent ``suffix_items``. ``query_timestamp`` is the request time the
    candidates are scored at; it defaults to the last history timestamp when the history is
    timed (for a ``time_query="next"`` model ranking a cached prefix with nothing after it: the
    time that prefix was computed for, ``PrefixKV.next_timestamp``) and must be absent when it
    is not.
    """

    candidates: IntSeq
    prefix: PrefixKV | None = None
    prefix_items: IntSeq | None = None
    prefix_timestamps: IntSeq | None = None
    suffix_items: IntSeq | None = None
    suffix_timestamps: IntSeq | None = None
    query_timestamp: int | None = None


@dataclass(frozen=True)
class History:
    """A validated history to compute: new tokens after an optional cached past."""

    past: PrefixKV | None
    items: Tensor            # [T] int64, may be empty when everything is cached
    timestamps: Tensor | None  # [T] int64, present iff the history is timed
    # under time_query="next" with a timed history: the time after the last token (the next
    # event's, or the request's), which that token's time bias measures from; else None
    next_ts: int | None = None

    @property
    def past_tokens(self) -> int:
        return 0 if self.past is None else self.past.num_tokens

    @property
    def total_tokens(self) -> int:
        return self.past_tokens + int(self.items.numel())

    @property
    def timed(self) -> bool:
        return self.timestamps is not None


def as_ids(name: str, value: IntSeq, device: torch.device) -> Tensor:
    """A 1-D int64 tensor on ``device`` from a tensor or a sequence of ints (floats and
    bools refused, as sequences too: converted first, 1.9 would be item 1)."""
    if isinstance(value, Tensor):
        tensor = value
    else:
        try:
            values = list(value)
            tensor = torch.as_tensor(values) if values else torch.empty(0, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise InvalidInputError(f"{name} must be integers in int64: {exc}") from None
    if tensor.dim() != 1:
        raise InvalidInputError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
    if tensor.dtype.is_floating_point or tensor.dtype == torch.bool or tensor.is_complex():
        raise InvalidInputError(f"{name} must hold integers, got dtype {tensor.dtype}")
    return tensor.to(device=device, dtype=torch.int64)


# Timestamps (seconds) the time buckets take: every gap between two of them, and a timestamp
# less a bucket start (at most 2^61 for the bucket counts HSTUConfig allows), stay in int64.
MAX_ABS_TIMESTAMP = 2 ** 61


def check_timestamp_range(name: str, timestamps: Tensor) -> None:
    """``TimestampError`` unless every timestamp is within +-``MAX_ABS_TIMESTAMP`` seconds."""
    if not timestamps.numel():
        return
    low, high = torch.aminmax(timestamps)            # one pass, one read back
    if int(low) < -MAX_ABS_TIMESTAMP or int(high) > MAX_ABS_TIMESTAMP:
        raise TimestampError(f"{name} holds a timestamp beyond +-2^61 seconds")


def check_item_range(name: str, items: Tensor, num_items: int) -> None:
    if items.numel() == 0:
        return
    low, high = int(items.min()), int(items.max())
    if low < 1 or high > num_items:
        bad = low if low < 1 else high
        raise ItemOutOfRangeError(f"{name} holds item id {bad}; valid ids are 1..{num_items}")


def check_past(cfg: HSTUConfig, past: PrefixKV, device: torch.device, dtype: torch.dtype) -> None:
    expected = (cfg.num_layers, cfg.num_heads, cfg.head_dim)
    got = (past.k.shape[0], past.k.shape[1], past.k.shape[3])
    if got != expected:
        raise IncompatiblePrefixError(
            f"prefix has (layers, heads, head_dim) {got}, model expects {expected}")
    if tuple(past.last_hidden.shape) != (cfg.dim,):
        raise IncompatiblePrefixError(f"prefix's last_hidden has shape "
                                      f"{tuple(past.last_hidden.shape)}, model dim is {cfg.dim}")
    if past.device != device or past.dtype != dtype:
        raise IncompatiblePrefixError(
            f"prefix is {past.dtype} on {past.device}, model is {dtype} on {device}; "
            "move it with PrefixKV.to() first")


def build_history(cfg: HSTUConfig, device: torch.device, dtype: torch.dtype,
                  past: PrefixKV | None, parts: list[tuple[str, IntSeq | None, IntSeq | None]]
                  ) -> History:
    """Validate and concatenate history parts ``(name, items, timestamps)`` after ``past``."""
    if dtype == torch.float16:
        raise ConfigError("a float16 model cannot serve: its range ends at 65504, so the causal "
                          "mask's -1e30 becomes -inf and SiLU of it NaN; use bfloat16 or float32")
    if past is not None:
        check_past(cfg, past, device, dtype)
    timed: bool | None = None if past is None else past.has_timestamps
    items_list: list[Tensor] = []
    ts_list: list[Tensor] = []
    for name, items, timestamps in parts:
        if items is None:
            if timestamps is not None:
                raise TimestampError(f"{name} timestamps given without {name} items")
            continue
        ids = as_ids(f"{name}_items", items, device)
        check_item_range(f"{name}_items", ids, cfg.num_items)
        if timed is None:
            timed = timestamps is not None
        if timed != (timestamps is not None):
            raise TimestampError(
                f"{name} timestamps are {'missing' if timed else 'given'} but the rest of the "
                f"history is {'timed' if timed else 'untimed'}")
        items_list.append(ids)
        if timestamps is not None:
            ts = as_ids(f"{name}_timestamps", timestamps, device)
            if ts.numel() != ids.numel():
                raise TimestampError(
                    f"{name} has {ids.numel()} items but {ts.numel()} timestamps")
            check_timestamp_range(f"{name}_timestamps", ts)
            ts_list.append(ts)
    new_items = torch.cat(items_list) if items_list else torch.empty(0, dtype=torch.int64,
                                                                     device=device)
    new_ts = torch.cat(ts_list) if timed and ts_list else (
        torch.empty(0, dtype=torch.int64, device=device) if timed else None)
    history = History(past, new_items, new_ts)
    if history.total_tokens > cfg.max_seq_len:
        raise SequenceTooLongError(
            f"history has {history.total_tokens} tokens; the model's max_seq_len is "
            f"{cfg.max_seq_len}")
    return history


def check_time_integer(name: str, value: object) -> int:
    """``value`` as an int timestamp: an integer within +-``MAX_ABS_TIMESTAMP`` seconds."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
            or not -MAX_ABS_TIMESTAMP <= int(value) <= MAX_ABS_TIMESTAMP:
        raise TimestampError(f"{name} must be an integer within +-2^61 seconds, got {value!r}")
    return int(value)


def with_continuation(cfg: HSTUConfig, history: History, next_ts: int | None,
                      name: str) -> History:
    """``history`` with the time after its last token (``History.next_ts``), checked.

    A model with ``time_query="next"`` measures each timed token's time bias from the event
    after it, so it needs that time (``name``) and a cached past whose own continuation
    (``PrefixKV.next_timestamp``) is where this history goes on: its first new event's time, or
    ``next_ts`` when nothing is new. Any other model or an untimed history takes none.
    """
    past = history.past
    if not (cfg.next_time_query and history.timed):
        if next_ts is not None:
            raise TimestampError(f"{name} is read only by a model with time_query='next' on a "
                                 "timed history")
        if past is not None and past.next_timestamp is not None:
            raise IncompatiblePrefixError("the cached prefix was computed by a model with "
                                          "time_query='next'; this one measures from each "
                                          "token's own time")
        return history
    if next_ts is None:
        raise TimestampError(f"a model with time_query='next' needs {name}: the time of the "
                             "event after the last history item (the request time when none "
                             "follows), which that item's time bias measures from")
    next_ts = check_time_integer(name, next_ts)
    if past is not None and past.num_tokens:
        assert history.timestamps is not None
        starts = int(history.timestamps[0]) if history.items.numel() else next_ts
        if past.next_timestamp is None:
            raise IncompatiblePrefixError(
                "the cached prefix records no continuation time (computed by a model with "
                "time_query='own', or its time was not kept): a time_query='next' model "
                "cannot read it; recompute it")
        if past.next_timestamp != starts:
            raise IncompatiblePrefixError(
                f"the cached prefix was computed for a continuation at {past.next_timestamp} "
                f"but this history goes on at {starts}: under time_query='next' its last "
                "token's keys and values depend on that time; recompute it")
    return History(past, history.items, history.timestamps, next_ts)


def validate_candidates(cfg: HSTUConfig, candidates: IntSeq, device: torch.device) -> Tensor:
    ids = as_ids("candidates", candidates, device)
    if ids.numel() == 0:
        raise EmptyInputError("candidates is empty; a ranking request needs at least one")
    check_item_range("candidates", ids, cfg.num_items)
    return ids


def validate_prefill(cfg: HSTUConfig, request: PrefillInput, device: torch.device,
                     dtype: torch.dtype) -> History:
    history = build_history(cfg, device, dtype, request.past,
                            [("prefill", request.items, request.timestamps)])
    if history.items.numel() == 0:
        raise EmptyInputError("prefill needs at least one new item")
    return with_continuation(cfg, history, request.next_timestamp, "next_timestamp")


def validate_rank(cfg: HSTUConfig, request: RankInput, device: torch.device,
                  dtype: torch.dtype) -> tuple[History, Tensor, int | None]:
    """→ (history, candidates, query timestamp or None for an untimed history)."""
    if request.prefix is not None and request.prefix_items is not None:
        raise InvalidInputError("give either prefix (cached) or prefix_items, not both")
    if request.prefix is not None and request.prefix_timestamps is not None:
        raise InvalidInputError("prefix_timestamps go with prefix_items; a cached prefix "
                                "carries its own")
    candidates = validate_candidates(cfg, request.candidates, device)
    history = build_history(cfg, device, dtype, request.prefix, [
        ("prefix", request.prefix_items, request.prefix_timestamps),
        ("suffix", request.suffix_items, request.suffix_timestamps),
    ])
    if history.total_tokens == 0:
        raise EmptyInputError("ranking needs a history: give prefix, prefix_items or suffix_items")
    query_ts = request.query_timestamp
    if not history.timed:
        if query_ts is not None:
            raise TimestampError("query_timestamp given but the history carries no timestamps")
        return history, candidates, None
    past = history.past
    if query_ts is None and cfg.next_time_query and not history.items.numel() \
            and past is not None and past.next_timestamp is not None:
        query_ts = past.next_timestamp     # the request time the prefix was computed for
    if query_ts is None:
        assert history.timestamps is not None
        last = history.timestamps if history.timestamps.numel() else None
        source = last if last is not None else history.past.timestamps  # type: ignore[union-attr]
        assert source is not None
        query_ts = int(source[-1])
    query_ts = check_time_integer("query_timestamp", query_ts)
    # under time_query="next" the candidates are the events after the history, at the request
    # time, which the last history token measures from
    history = with_continuation(cfg, history, query_ts if cfg.next_time_query else None,
                                "query_timestamp")
    return history, candidates, query_ts
