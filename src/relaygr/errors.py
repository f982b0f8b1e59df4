"""Typed errors a caller can act on (bad input, bad config, capacity).

Internal invariants use assertions; everything a user or a client can cause raises one of these,
so servers can map them to 4xx answers and tests can assert the exact failure.
"""

from __future__ import annotations


class RelayGRError(Exception):
    """Base class of every error relaygr raises on purpose."""


class InvalidInputError(RelayGRError, ValueError):
    """A request or tensor argument is malformed; nothing was changed."""


class EmptyInputError(InvalidInputError):
    """A sequence that must hold at least one element is empty (no candidates, no history)."""


class NoCandidatesError(EmptyInputError):
    """Retrieval found no item the user has not already seen: nothing to rank."""


class ItemOutOfRangeError(InvalidInputError):
    """An item id is outside the model's catalogue (valid ids are 1..num_items)."""


class SequenceTooLongError(InvalidInputError):
    """A sequence is longer than the model reads: a model input (prefix + suffix) past its
    ``max_seq_len``, or a visit's own events past what the history window leaves them."""


class TimestampError(InvalidInputError):
    """Timestamps are missing where required, or their length does not match the items."""


class IncompatiblePrefixError(InvalidInputError):
    """A cached prefix does not belong to this model (shape, dtype or device differ)."""


class ConfigError(RelayGRError, ValueError):
    """A configuration value is invalid or unknown."""


class PreinferDisabledError(InvalidInputError):
    """A pre-infer signal was sent to a mode that does not pre-infer (``baseline``,
    ``reactive``, ...); nothing was done."""


class UnknownUserError(InvalidInputError):
    """The user id is not in the history store; nothing was changed."""


class NoHealthyInstanceError(RelayGRError):
    """No healthy ranking instance is available to route a request to."""


class HistoryStoreUnavailableError(RelayGRError):
    """The history store cannot be reached or refused the operation (a shared store's server is
    down, out of memory, read-only): retry later (HTTP 503). A read changed nothing; an append
    that fails this way may or may not have been kept (the store never holds part of one)."""


class HistoryConflictError(RelayGRError):
    """An append's precondition failed: the caller expected the user to have
    ``expected_events`` events before it, the store holds ``num_events`` (a retry of an append
    that was applied, or another writer's append in between). Nothing was appended (HTTP 409)."""

    def __init__(self, user_id: int, expected_events: int, num_events: int) -> None:
        super().__init__(f"user {user_id} has {num_events} events, not the {expected_events} "
                         "this request expected (expected_events): nothing appended")
        self.expected_events = expected_events
        self.num_events = num_events


class BenchProtocolError(RelayGRError):
    """A measured system broke the benchmark protocol (a malformed or inconsistent record)."""


class CacheStateError(RelayGRError):
    """A KV-cache operation does not fit the entry's state: an unknown or already settled
    pending handle, a release without an acquire, a prefix that is already cached. Nothing was
    changed."""


class OverloadedError(RelayGRError):
    """The ranking instance's queue is full: retry after ``retry_after_s`` (HTTP 503)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DataError(InvalidInputError):
    """A dataset cannot be used. ``path`` and ``line`` (1-based, when known) locate the cause."""

    def __init__(self, message: str, path: str | None = None, line: int | None = None) -> None:
        self.path = path
        self.line = line
        where = "" if path is None else (f"{path}:{line}: " if line is not None else f"{path}: ")
        super().__init__(where + message)


class DataFormatError(DataError):
    """A row of a dataset file is malformed (wrong field count, a non-integer id, ...)."""


class EmptyDatasetError(DataError):
    """A dataset file (or what is left of it after filtering) holds no interactions."""


class UnknownFormatError(DataError):
    """A dataset name or file format is not one relaygr can read."""


class DatasetNotFoundError(DataError, FileNotFoundError):
    """The files a dataset needs are not where the caller said they are."""


class CheckpointError(RelayGRError):
    """A training run directory is missing, incomplete, or does not match what it is used with."""


class TrainingDivergedError(RelayGRError):
    """A training loss became NaN or infinite: the weights are no longer a model, and every
    later evaluation of them would be meaningless (NaN scores), so training stops."""


class CatalogueMismatchError(ConfigError):
    """Two trained runs served together number items of different catalogues (another dataset,
    or too few items in common), or a checkpoint is served data other than what it was trained
    on: their ids cannot be reconciled."""
