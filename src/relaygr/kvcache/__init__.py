"""The relay's KV cache: a device pool per ranking instance and a host-DRAM expander tier.

Layers, lowest first; **a module imports only from layers below it, never above** (the engine
that uses the cache sits on top and is not part of this package; ``tests/kvcache/test_layers.py``
enforces the rule)::

    0  pools       KVLayout, KVArena: preallocated tensors cut into token pages; views, copies
       integrity   require(): checks that survive ``python -O``
    1  allocator   PageRun, RunAllocator: free pages as coalesced runs, first-fit, planning
    2  index       PrefixId, EntryState, CacheIndex: entries, states, pins, leases, LRU,
                   admission (which IDLE entries to evict, or a Refusal)
    3  tiering     store (PagedStore: arena+allocator+index, validation, TierStats)
                   device (DeviceKVPool), host (HostKVTier), transfer (side-stream copies),
                   expander (Expander: reload with dedup and extension, demotion)

Threads: bookkeeping (begin, commit, abort, lookup, acquire, release, expiry, waiting, stats,
the Expander) belongs to the event-loop thread. ``write``/``written_view`` of a PENDING entry
may also run on the instance's compute thread: they touch only that entry's pages and write
mark, which nothing else changes while it is PENDING.

Public API: ``PrefixId``, ``EntryState``, ``EntryInfo``, ``Refusal``, ``KVLayout``,
``DeviceKVPool``, ``PendingEntry``, ``HostKVTier``, ``HostHit``, ``Expander``,
``ExtendedPrefix``, ``ReloadOutcome``, ``ExpanderStats``, ``TierStats``, ``Lookup`` (see
``README.md``).
"""

from relaygr.kvcache.device import DeviceKVPool
from relaygr.kvcache.expander import Expander, ExpanderStats, ExtendedPrefix, ReloadOutcome
from relaygr.kvcache.host import HostHit, HostKVTier
from relaygr.kvcache.index import EntryInfo, EntryState, PrefixId, Refusal
from relaygr.kvcache.pools import KVLayout
from relaygr.kvcache.store import Lookup, PendingEntry, TierStats

__all__ = ["DeviceKVPool", "EntryInfo", "EntryState", "Expander", "ExpanderStats",
           "ExtendedPrefix", "HostHit", "HostKVTier", "KVLayout", "Lookup", "PendingEntry",
           "PrefixId", "Refusal", "ReloadOutcome", "TierStats"]
