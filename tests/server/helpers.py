"""Server-test helpers: a small embedded service, and driving its app in-process (no sockets)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx

from relaygr.cascade.config import StagesConfig, SystemConfig
from relaygr.data import load_sequences
from relaygr.engine.instance import InstanceConfig
from relaygr.server import ModelSource, RelayService, ServerConfig, build_embedded, create_app
from relaygr.server.build import load_model
from relaygr.train import Trainer
from tests.engine.helpers import flops_cost_model
from tests.train.helpers import TINY, write_cyclic_udata

T = TypeVar("T")

SOURCE = ModelSource(size="tiny", num_items=500, max_seq_len=512, num_users=24, min_events=16,
                     max_events=300, seed=0)


def system_config(**changes: object) -> SystemConfig:
    # A tiny SLO puts every prefix at risk, so the relay pre-infers; short stage delays.
    base = SystemConfig(num_instances=2, slo_ms=0.01,
                        stages=StagesConfig(retrieval_k=64, num_candidates=16,
                                            retrieval_delay_ms=1, preprocess_delay_ms=1),
                        instance=InstanceConfig(device_budget_bytes=8 << 20,
                                                host_budget_bytes=16 << 20, page_tokens=16))
    return base.with_(**changes)


def make_service(system: SystemConfig | None = None, server: ServerConfig | None = None,
                 source: ModelSource = SOURCE, instance_processes: bool = False) -> RelayService:
    model = load_model(source)
    return build_embedded(source, system or system_config(), server or ServerConfig(),
                          flops_cost_model(model.cfg), instance_processes=instance_processes)


def make_untimed_service(root: Path) -> RelayService:
    """A service of a tiny checkpoint trained under ``root`` without time (the training
    default): its users, and every user the API adds, are untimed."""
    write_cyclic_udata(root / "u.data", num_users=24)
    seqs = load_sequences("ml-100k", root / "u.data")
    Trainer(TINY.with_(max_epochs=1), seqs, root / "run", dataset="ml-100k",
            progress_bar=False, log=lambda _: None).fit()
    source = ModelSource(checkpoint=root / "run")
    return build_embedded(source, system_config(), ServerConfig(),
                          flops_cost_model(load_model(source).cfg))


@asynccontextmanager
async def client_for(service: RelayService) -> AsyncIterator[httpx.AsyncClient]:
    """The service's app, started (lifespan), behind an in-process httpx client."""
    app = create_app(service)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://relaygr") as client:
            yield client


def run_with_client(service: RelayService,
                    body: Callable[[httpx.AsyncClient], Coroutine[Any, Any, T]]) -> T:
    async def main() -> T:
        async with client_for(service) as client:
            return await body(client)
    return asyncio.run(main())


@asynccontextmanager
async def held_compute(service: RelayService) -> AsyncIterator[None]:
    """Every in-process instance's worker thread blocked until the block ends: work queues up
    exactly as on a machine far slower than any real one, so overload is a state a test sets,
    not a race it hopes to win."""
    release = threading.Event()
    system = service.backend.system  # type: ignore[attr-defined]
    holds = [asyncio.ensure_future(inst.executor.run(release.wait)) for inst in system.instances]
    try:
        yield
    finally:
        release.set()
        await asyncio.gather(*holds)


async def until(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Yield to the loop until ``condition()`` holds. The timeout only turns a hang into a
    failure (a condition that should hold at once on any machine); it decides nothing."""
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), timeout_s)
