"""PrefixKV: the per-layer keys and values of a user's behaviour prefix, as a value.

The model never keeps cache state: ``HSTU.prefill`` returns a ``PrefixKV`` and ``HSTU.rank``
takes one back. The cache layer (``relaygr.kvcache``) owns where the tensors live.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from relaygr.errors import IncompatiblePrefixError


@dataclass(frozen=True)
class PrefixKV:
    """Keys and values of every layer for the first ``num_tokens`` positions of a history.

    Shapes: ``k`` and ``v`` are ``[num_layers, num_heads, num_tokens, head_dim]`` (views with any
    stride are allowed as long as the last dimension is contiguous); ``timestamps`` is
    ``[num_tokens]`` int64 seconds or None when the history carries no time; ``last_hidden`` is
    ``[dim]``, the final-layer output of the last prefix token (the user representation that
    retrieval uses). Positions are implicit: token i sits at position i, and never moves.

    ``next_timestamp``: under ``HSTUConfig.time_query="next"`` (a timed history), the time the
    last token's time bias was measured from: that of the event after the prefix, or the request
    time when nothing follows. The last token's keys and values (from the second layer on) and
    ``last_hidden`` depend on it, so the prefix is valid only for a continuation that starts at
    that time (checked where it is read, ``model.inputs.with_continuation``, and where two
    prefixes are joined, ``model.passes.concat_prefix``). None for any other model or an untimed
    prefix.
    """

    k: Tensor
    v: Tensor
    timestamps: Tensor | None
    last_hidden: Tensor
    next_timestamp: int | None = None

    def __post_init__(self) -> None:
        if self.k.shape != self.v.shape or self.k.dim() != 4:
            raise IncompatiblePrefixError(f"k {tuple(self.k.shape)} and v {tuple(self.v.shape)}"
                                          " must be one [layers, heads, tokens, head_dim] shape")
        if self.timestamps is not None and (self.timestamps.shape != (self.k.shape[2],)
                                            or self.timestamps.dtype != torch.int64):
            raise IncompatiblePrefixError(
                f"timestamps must be {self.k.shape[2]} int64 seconds (one per prefix token), "
                f"got {self.timestamps.dtype} of shape {tuple(self.timestamps.shape)}")
        if self.next_timestamp is not None:
            if self.timestamps is None:
                raise IncompatiblePrefixError("an untimed prefix has no next_timestamp")
            if type(self.next_timestamp) is not int:
                raise IncompatiblePrefixError(f"next_timestamp must be an int (seconds), got "
                                              f"{type(self.next_timestamp).__name__}")

    @property
    def num_tokens(self) -> int:
        return int(self.k.shape[2])

    @property
    def num_layers(self) -> int:
        return int(self.k.shape[0])

    @property
    def has_timestamps(self) -> bool:
        return self.timestamps is not None

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held by this prefix's tensors (K, V, timestamps, user representation)."""
        total = self.k.numel() * self.k.element_size() * 2
        total += self.last_hidden.numel() * self.last_hidden.element_size()
        if self.timestamps is not None:
            total += self.timestamps.numel() * self.timestamps.element_size()
        return total

    @staticmethod
    def bytes_per_token(num_layers: int, dim: int, dtype: torch.dtype,
                        with_timestamps: bool) -> int:
        """K+V bytes one prefix token adds (what a cache budget is measured in)."""
        item = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * dim * item + (8 if with_timestamps else 0)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PrefixKV:
        """A copy on ``device`` (the same object when it is already there)."""
        device = torch.device(device)
        if device == self.device:
            return self

        def move(t: Tensor) -> Tensor:
            return t.to(device, non_blocking=non_blocking)

        ts = None if self.timestamps is None else move(self.timestamps)
        return replace(self, k=move(self.k), v=move(self.v), timestamps=ts,
                       last_hidden=move(self.last_hidden))

    def pin_memory(self) -> PrefixKV:
        """A copy in page-locked host memory (for asynchronous host-to-device reloads)."""
        ts = None if self.timestamps is None else self.timestamps.pin_memory()
        return replace(self, k=self.k.pin_memory(), v=self.v.pin_memory(), timestamps=ts,
                       last_hidden=self.last_hidden.pin_memory())

    def contiguous(self) -> PrefixKV:
        ts = None if self.timestamps is None else self.timestamps.contiguous()
        return replace(self, k=self.k.contiguous(), v=self.v.contiguous(), timestamps=ts,
                       last_hidden=self.last_hidden.contiguous())
