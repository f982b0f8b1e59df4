"""Layer 0 of the cache, raw pools: preallocated tensors cut into fixed-size token pages.

A ``KVArena`` is allocated once, at construction, to fit a hard byte budget; nothing here ever
allocates again, so the serving hot path never asks the device allocator for memory. The arena
knows nothing about entries, users or states (layers above decide which pages hold what): it only
copies a ``PrefixKV`` into a run of pages and hands out zero-copy views of a run.

Layout (``capacity_tokens = num_pages * page_tokens``)::

    k, v         [num_layers, num_heads, capacity_tokens, head_dim]   (dtype of the layout)
    timestamps   [capacity_tokens] int64                               (unix seconds)
    last_hidden  [num_pages, dim]   one slot per page; an entry uses its first page's slot

A run of pages ``[start, start + n)`` is a contiguous token range, so a view of it is an ordinary
strided tensor whose last dimension is contiguous: exactly what ``HSTU.rank(prefix=...)`` takes.
Views alias the arena: they stay valid only while the layers above keep those pages reserved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from relaygr.errors import ConfigError, IncompatiblePrefixError, InvalidInputError
from relaygr.model import HSTUConfig, PrefixKV

# Timestamps are int64 unix seconds (PrefixKV's convention).
TIMESTAMP_BYTES = 8


@dataclass(frozen=True)
class KVLayout:
    """Shape and dtype of the K/V one model produces (``PrefixKV.k`` is ``[L, H, N, dh]``)."""

    num_layers: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if not self.dtype.is_floating_point:
            raise ConfigError(f"KVLayout.dtype must be a floating dtype, got {self.dtype}")

    @classmethod
    def for_model(cls, cfg: HSTUConfig, dtype: torch.dtype = torch.float32) -> KVLayout:
        return cls(cfg.num_layers, cfg.num_heads, cfg.head_dim, dtype)

    @property
    def dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def item_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def kv_token_bytes(self) -> int:
        """K+V bytes of one token over all layers."""
        return 2 * self.num_layers * self.dim * self.item_bytes

    def page_bytes(self, page_tokens: int) -> int:
        """Arena bytes one page costs: K, V and timestamps of its tokens plus one hidden slot."""
        per_token = self.kv_token_bytes + TIMESTAMP_BYTES
        return page_tokens * per_token + self.dim * self.item_bytes

    def check(self, kv: PrefixKV) -> None:
        """Raise ``IncompatiblePrefixError`` unless ``kv`` has this layout (any device)."""
        got = (kv.num_layers, int(kv.k.shape[1]), int(kv.k.shape[3]), kv.dtype)
        want = (self.num_layers, self.num_heads, self.head_dim, self.dtype)
        if got != want:
            raise IncompatiblePrefixError(
                f"prefix has (layers, heads, head_dim, dtype) {got}, the cache holds {want}")
        self.check_hidden(kv.last_hidden)

    def check_hidden(self, hidden: Tensor) -> None:
        """Raise ``IncompatiblePrefixError`` unless ``hidden`` is a ``[dim]`` vector of the
        cache's dtype (a copy would cast it silently)."""
        if tuple(hidden.shape) != (self.dim,) or hidden.dtype != self.dtype:
            raise IncompatiblePrefixError(
                f"last_hidden is {hidden.dtype} of shape {tuple(hidden.shape)}, expected "
                f"{self.dtype} of shape ({self.dim},)")


class KVArena:
    """The preallocated tensors of one tier (see the module docstring for the layout).

    Invariant: ``allocated_bytes() == arena_bytes <= budget_bytes`` for the arena's whole life.
    """

    def __init__(self, layout: KVLayout, budget_bytes: int, page_tokens: int,
                 device: torch.device | str = "cpu", pin_memory: bool = False) -> None:
        if not isinstance(page_tokens, int) or page_tokens <= 0:
            raise ConfigError(f"page_tokens must be a positive int, got {page_tokens!r}")
        if not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ConfigError(f"budget_bytes must be a non-negative int, got {budget_bytes!r}")
        self.layout = layout
        self.page_tokens = page_tokens
        self.page_bytes = layout.page_bytes(page_tokens)
        self.budget_bytes = budget_bytes
        self.num_pages = budget_bytes // self.page_bytes
        if self.num_pages == 0:
            raise ConfigError(f"budget_bytes {budget_bytes} is below one page "
                              f"({self.page_bytes} bytes at page_tokens={page_tokens})")
        self.device = torch.device(device)
        cap = self.capacity_tokens
        shape = (layout.num_layers, layout.num_heads, cap, layout.head_dim)
        pin = pin_memory and self.device.type == "cpu"

        def zeros(size: tuple[int, ...], dtype: torch.dtype) -> Tensor:
            # zeros, not empty: every page is touched now, not on the serving path
            return torch.zeros(size, dtype=dtype, device=self.device, pin_memory=pin)

        self.k = zeros(shape, layout.dtype)
        self.v = zeros(shape, layout.dtype)
        self.timestamps = zeros((cap,), torch.int64)
        self.last_hidden = zeros((self.num_pages, layout.dim), layout.dtype)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_tokens

    @property
    def arena_bytes(self) -> int:
        """What the arena should hold by construction: ``num_pages * page_bytes``."""
        return self.num_pages * self.page_bytes

    @property
    def is_pinned(self) -> bool:
        return bool(self.k.is_pinned())

    def allocated_bytes(self) -> int:
        """What the tensors actually hold (checked against ``arena_bytes`` for integrity)."""
        tensors = (self.k, self.v, self.timestamps, self.last_hidden)
        return sum(t.numel() * t.element_size() for t in tensors)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_tokens)

    def view(self, start_page: int, num_tokens: int, timed: bool,
             next_timestamp: int | None = None) -> PrefixKV:
        """Zero-copy ``PrefixKV`` over ``num_tokens`` tokens from page ``start_page`` (its
        ``next_timestamp`` is the caller's: the arena keeps none)."""
        first = start_page * self.page_tokens
        assert first >= 0 and first + num_tokens <= self.capacity_tokens, "view outside arena"
        end = first + num_tokens
        ts = self.timestamps[first:end] if timed else None
        return PrefixKV(self.k[:, :, first:end], self.v[:, :, first:end], ts,
                        self.last_hidden[start_page], next_timestamp)

    def timestamp(self, start_page: int, token: int) -> int:
        """The timestamp of token ``token`` of the run at ``start_page``."""
        index = start_page * self.page_tokens + token
        assert 0 <= index < self.capacity_tokens, "token outside arena"
        return int(self.timestamps[index])

    def write(self, start_page: int, kv: PrefixKV, start_token: int, timed: bool,
              non_blocking: bool = False) -> None:
        """Copy ``kv``'s K/V (and timestamps when ``timed``) to tokens ``start_token..`` of the
        run at ``start_page``, and ``kv.last_hidden`` to the run's hidden slot. ``kv`` may live
        on another device; the caller checked its layout.
        """
        first = start_page * self.page_tokens + start_token
        end = first + kv.num_tokens
        assert first >= 0 and end <= self.capacity_tokens, "write outside arena"
        if timed != kv.has_timestamps:
            raise InvalidInputError(
                f"the entry is {'timed' if timed else 'untimed'} but the prefix "
                f"{'has' if kv.has_timestamps else 'lacks'} timestamps")
        with torch.no_grad():
            copy_blocks(self.k[:, :, first:end], kv.k, non_blocking)
            copy_blocks(self.v[:, :, first:end], kv.v, non_blocking)
            if kv.timestamps is not None:
                self.timestamps[first:end].copy_(kv.timestamps, non_blocking=non_blocking)
            self.last_hidden[start_page].copy_(kv.last_hidden, non_blocking=non_blocking)

    def write_hidden(self, start_page: int, hidden: Tensor, non_blocking: bool = False) -> None:
        self.layout.check_hidden(hidden)
        with torch.no_grad():
            self.last_hidden[start_page].copy_(hidden, non_blocking=non_blocking)


def copy_blocks(dst: Tensor, src: Tensor, non_blocking: bool = False,
                per_block: bool | None = None) -> None:
    """``dst.copy_(src)`` for ``[L, H, N, dh]`` K or V.

    Within a device, one strided copy. Across devices, one copy per ``(layer, head)`` block:
    an arena slice is not contiguous as a whole, and a cross-device copy of a non-contiguous
    tensor goes through freshly allocated contiguous temporaries (pageable on the host side, so
    not asynchronous), whereas each ``[N, dh]`` block is contiguous on both sides and moves as
    one direct DMA from or to page-locked memory. ``per_block`` overrides the choice (tests).
    """
    if not (dst.device != src.device if per_block is None else per_block):
        dst.copy_(src, non_blocking=non_blocking)
        return
    for layer in range(dst.shape[0]):
        for head in range(dst.shape[1]):
            dst[layer, head].copy_(src[layer, head], non_blocking=non_blocking)


def slice_tokens(kv: PrefixKV, start: int) -> PrefixKV:
    """Tokens ``start..`` of ``kv`` as views (``last_hidden`` is kept: it belongs to the end)."""
    assert 0 <= start < kv.num_tokens, f"slice start {start} outside {kv.num_tokens} tokens"
    ts = None if kv.timestamps is None else kv.timestamps[start:]
    return PrefixKV(kv.k[:, :, start:], kv.v[:, :, start:], ts, kv.last_hidden, kv.next_timestamp)
