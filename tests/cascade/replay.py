"""Serving a plan of visits one at a time, each beside a reference computed from the history it
found (the exactness tests' harness)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from relaygr.cascade.store import HistoryStore
from relaygr.cascade.system import RelaySystem
from relaygr.cascade.visit import Recommendation, Visit

T = TypeVar("T")
History = tuple[np.ndarray, np.ndarray]


def replay(system: RelaySystem, store: HistoryStore, visits: list[Visit],
           reference: Callable[[History, Visit, Recommendation], T]
           ) -> list[tuple[Recommendation, T]]:
    """Each visit's recommendation and ``reference(history, visit, rec)``, the history being
    the user's (items, timestamps) before the visit; the system started and stopped around the
    plan, idle and its caches checked after every visit."""

    async def main() -> list[tuple[Recommendation, T]]:
        await system.start()
        try:
            out = []
            for visit in visits:
                h = store.get(visit.user_id)
                history = (h.items.copy(), np.asarray(h.timestamps).copy())
                rec = await system.recommend(visit)
                out.append((rec, reference(history, visit, rec)))
                await system.wait_idle()
                for inst in system.instances:
                    await inst.check_integrity()
            return out
        finally:
            await system.stop()

    return asyncio.run(main())
