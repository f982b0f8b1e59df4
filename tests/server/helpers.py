"""Server-test helpers: a small embedded service, and driving its app in-process (no sockets)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import httpx

from relaygr.cascade.config import SystemConfig
from relaygr.server import ModelSource, RelayService, ServerConfig, build_embedded, create_app
from relaygr.server.build import load_model
from tests.engine.helpers import flops_cost_model

T = TypeVar("T")

SOURCE = ModelSource(size="tiny", num_items=500, max_seq_len=512, num_users=24, min_events=16,
                     max_events=300, seed=0)


def system_config(**changes: object) -> SystemConfig:
    # A tiny SLO puts every prefix at risk, so the relay pre-infers; short stage delays.
    base = SystemConfig(num_instances=2, slo_ms=0.01, retrieval_k=64, num_candidates=16,
                        retrieval_delay_ms=1, preprocess_delay_ms=1,
                        device_budget_bytes=8 << 20, host_budget_bytes=16 << 20, page_tokens=16)
    return base.with_(**changes)


def make_service(system: SystemConfig | None = None, server: ServerConfig | None = None,
                 source: ModelSource = SOURCE, instance_processes: bool = False) -> RelayService:
    model = load_model(source)
    return build_embedded(source, system or system_config(), server or ServerConfig(),
                          flops_cost_model(model.cfg), instance_processes=instance_processes)


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
