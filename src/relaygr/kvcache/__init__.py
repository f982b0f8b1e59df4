"""The relay's KV cache: a device pool per ranking instance and a host-DRAM expander tier.

Layers, lowest first; **a module imports only from layers below it, never above** (the engine
that uses the cache sits on top and is not part of this package)::

    0  pools       KVLayout, KVArena: preallocated tensors cut into token pages; views, copies
       integrity   require(): checks that survive ``python -O``
    1  allocator   PageRun, RunAllocator: free pages as coalesced runs, first-fit, planning
    2  index       PrefixId, EntryState, CacheIndex: entries, states, pins, leases, LRU,
                   admission (which IDLE entries to evict, or a Refusal)
    3  tiering     store (PagedStore: arena+allocator+index, validation, TierStats)
                   device (DeviceKVPool), host (HostKVTier), transfer (side-stream copies),
                   expander (Expander: reload with dedup and extension, demotion)

Public API: ``PrefixId``, ``EntryState``, ``EntryInfo``, ``Refusal``, ``KVLayout``,
``DeviceKVPool``, ``PendingEntry``, ``HostKVTier``, ``HostHit``, ``Expander``,
``ReloadOutcome``, ``ExpanderStats``, ``TierStats``. See ``README.md`` beside this file.
"""

from relaygr.kvcache.device import DeviceKVPool
from relaygr.kvcache.expander import Expander, ExpanderStats, ReloadOutcome
from relaygr.kvcache.host import HostHit, HostKVTier
from relaygr.kvcache.index import EntryInfo, EntryState, PrefixId, Refusal
from relaygr.kvcache.pools import KVLayout
from relaygr.kvcache.store import PendingEntry, TierStats

__all__ = ["DeviceKVPool", "EntryInfo", "EntryState", "Expander", "ExpanderStats", "HostHit",
           "HostKVTier", "KVLayout", "PendingEntry", "PrefixId", "Refusal", "ReloadOutcome",
           "TierStats"]
