"""Typed messages between the cascade and a ranking instance."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from relaygr.errors import InvalidInputError
from relaygr.kvcache import PrefixId
from relaygr.relay.trigger import TriggerReason


class RankPath(str, enum.Enum):
    """Which path a ranking request took (the names the benchmark reports)."""

    DEVICE_HIT = "device_hit"      # the prefix was READY/IDLE in the device pool
    PENDING_WAIT = "pending_wait"  # it was being pre-inferred: ranking waited for it
    HOST_HIT = "host_hit"          # it was reloaded from the host tier (and extended)
    FULL = "full"                  # no usable cache: the prefix was recomputed in the pass
    TRUNCATED = "truncated"        # no usable cache: the prefix was cut (configured fallback)


@dataclass(frozen=True)
class PrefixSpec:
    """A request's long-term prefix: its cache identity and its events.

    The events are the user's history from ``window_start`` on (the window the model reads,
    ``cascade.window``; 0 while the history fits the model), at model positions ``0..n-1``.
    ``version_at(n)`` is the version of the window's first ``n`` events (from the history store,
    which hashes ``window_start`` too); the instance uses it to check that a cached shorter
    prefix is really a prefix of this one, so a prefix cached for another window never is.

    ``next_timestamp``: for a model with ``time_query="next"`` and a timed user, the time of the
    event after the prefix (``PrefixKV.next_timestamp``, what its last token's K/V is computed
    for; ``cascade.window`` holds that event back for the ranking pass); else None. A cached
    copy of the same events computed for another time is not this prefix.
    """

    pid: PrefixId
    items: Tensor                   # [n] int64
    timestamps: Tensor | None       # [n] int64 seconds, None for an untimed user
    version_at: Callable[[int], int]
    window_start: int = 0           # index in the user's history of items[0]
    next_timestamp: int | None = None

    def __post_init__(self) -> None:
        # the entry is reserved for pid.num_tokens tokens and written from these events: a
        # spec whose events do not fill it would leave the entry PENDING for good
        if self.items.dim() != 1 or self.items.numel() != self.pid.num_tokens:
            raise InvalidInputError(f"prefix of user {self.pid.user_id}: {self.pid.num_tokens} "
                                    f"tokens named, events of shape {tuple(self.items.shape)}")
        if self.timestamps is not None and self.timestamps.shape != self.items.shape:
            raise InvalidInputError(f"prefix of user {self.pid.user_id}: timestamps of shape "
                                    f"{tuple(self.timestamps.shape)} for "
                                    f"{self.items.numel()} events")
        if self.next_timestamp is not None and (self.timestamps is None
                                                or type(self.next_timestamp) is not int):
            raise InvalidInputError(f"prefix of user {self.pid.user_id}: next_timestamp "
                                    f"{self.next_timestamp!r} must be an int, for a timed prefix")

    @property
    def num_tokens(self) -> int:
        return self.pid.num_tokens


@dataclass(frozen=True)
class RankJob:
    """One ranking request: candidates against prefix + suffix (the visit's recent events, after
    the stored event a ``time_query="next"`` prefix holds back: ``cascade.window``).

    ``grown`` names the prefix this visit leaves behind (prefix + suffix, once the cascade
    appends the suffix to the store): the key under which the ranked K/V is kept for the next
    visit. None when the visit adds no events. For a prefix with a continuation time
    (``PrefixSpec.next_timestamp``) the suffix starts with the event the prefix held back, and
    the kept K/V stops one token short of its end (``model.hstu.RankOutput``), so ``grown`` is
    one token shorter than prefix + suffix.
    """

    prefix: PrefixSpec
    candidates: Tensor              # [C] int64
    suffix_items: Tensor | None = None
    suffix_timestamps: Tensor | None = None
    query_ts: int | None = None
    grown: PrefixId | None = None

    def __post_init__(self) -> None:
        # grown keys the K/V this ranking computes (prefix + suffix): any other name would
        # file it under the wrong events, or fail after the prefix was pinned
        user = self.prefix.pid.user_id
        expected = self.prefix.num_tokens + self.suffix_tokens - self.unkept_tokens
        if self.grown is not None and (self.grown.user_id != user
                                       or self.grown.num_tokens != expected):
            raise InvalidInputError(f"grown prefix {self.grown} of user {user}: must be user "
                                    f"{user} with {expected} tokens (prefix + suffix, less "
                                    f"{self.unkept_tokens} not kept)")
        suffix = None if self.suffix_items is None else tuple(self.suffix_items.shape)
        if self.suffix_timestamps is not None and \
                tuple(self.suffix_timestamps.shape) != suffix:
            raise InvalidInputError(f"suffix timestamps of shape "
                                    f"{tuple(self.suffix_timestamps.shape)} for suffix {suffix}")

    @property
    def suffix_tokens(self) -> int:
        return 0 if self.suffix_items is None else int(self.suffix_items.numel())

    @property
    def unkept_tokens(self) -> int:
        """History tokens at the end whose K/V is not kept (``grown``): 1 under a continuation
        time, else 0."""
        return int(self.prefix.next_timestamp is not None)


@dataclass(frozen=True)
class RankTiming:
    """Where one ranking request's time went inside its instance, in seconds.

    ``lookup_s``: finding the prefix (waiting for its pre-infer or reload when one is still
    running); ``queue_s``: queued behind other compute until its batch started; ``compute_s``:
    its batch's compute (shared by the ``batch_size`` requests of the batch); ``total_s``: the
    whole call inside the instance. ``transport_s``: what a caller in another process saw on
    top of ``total_s`` (0 in process).
    """

    lookup_s: float
    queue_s: float
    compute_s: float
    batch_size: int
    total_s: float
    transport_s: float = 0.0


@dataclass(frozen=True)
class RankResult:
    scores: Tensor                  # [C], aligned with RankJob.candidates
    path: RankPath
    instance: str
    timing: RankTiming | None = None


class PreinferAction(str, enum.Enum):
    """What the pre-infer signal did on the instance."""

    ON_DEVICE = "on_device"        # the prefix is already resident: nothing to do
    IN_FLIGHT = "in_flight"        # it is already being computed or loaded
    PREFILL = "prefill"            # a pre-infer job started
    RELOAD = "reload"              # a reload (and extension) from the host tier started
    # admitted (or a host hit), but the device pool could not take it; for a reload also:
    # another prefix of the user is loading, or the host's copy expired meanwhile
    REFUSED = "refused"
    FAILED = "failed"              # admitted, but its job or reload could not start (logged)
    SKIPPED = "skipped"            # the trigger said no (see the reason)


@dataclass(frozen=True)
class PreinferResult:
    action: PreinferAction
    reason: TriggerReason | None
    tokens: int                    # prefix tokens this signal will compute (0 for a reload copy)


# What a shed or lost pre-infer signal did: nothing (the ranking leg recomputes).
SKIPPED = PreinferResult(PreinferAction.SKIPPED, None, 0)
FAILED = PreinferResult(PreinferAction.FAILED, None, 0)
