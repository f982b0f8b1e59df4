"""A real server on loopback in a child process, with a control channel (for reliability runs).

``LoopbackServer`` starts ``relaygr serve``'s embedded server (uvicorn, the same app) in a
spawned process, so load from this process goes through real sockets and a real HTTP stack.
Through a pipe the parent can fail and restart instances mid-load and, after a run, ask for a
``ServerReport``: memory, in-flight requests, counters, and the cache integrity check of every
instance taken once background work has settled. ``close()`` asks uvicorn to exit, which drains
in-flight requests before the instances stop.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import socket
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from relaygr.cascade.config import SystemConfig
from relaygr.relay.costmodel import LatencyCostModel
from relaygr.server.config import ModelSource, ServerConfig
from relaygr.server.snapshot import InstanceSnapshot, ServingCounters, StateFingerprint


@dataclass(frozen=True)
class LoopbackSpec:
    model: ModelSource
    system: SystemConfig
    server: ServerConfig
    cost_model: dict[str, Any] | None = None    # None: fit on the model at start-up
    torch_threads: int | None = None


@dataclass(frozen=True)
class ServerReport:
    """The server's state after a run (taken once its background work has settled)."""

    rss_bytes: int
    in_flight: int
    user_locks: int
    refused_at_door: int
    counters: ServingCounters
    instances: tuple[InstanceSnapshot, ...]
    integrity_error: str | None      # None: every pool and host tier passed check_integrity()
    fingerprint: StateFingerprint    # what a request could change (equal across rejections)

    @property
    def pinned_entries(self) -> int:
        """Entries still PENDING or in use on a device tier (0 at rest: nothing leaked)."""
        return sum(i.device.pending + i.device.in_use for i in self.instances
                   if i.device is not None)


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (Linux ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LoopbackServer:
    """See the module docstring. Use as a context manager."""

    def __init__(self, spec: LoopbackSpec, start_timeout_s: float = 300.0) -> None:
        port = spec.server.port if spec.server.port else free_port()
        self.url = f"http://127.0.0.1:{port}"
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_child_main, args=(spec, port, child), daemon=True)
        self.process.start()
        if not self._conn.poll(start_timeout_s):
            self.process.kill()
            raise RuntimeError("the loopback server did not start")
        message = self._conn.recv()
        if message != "ready":
            raise RuntimeError(f"the loopback server failed to start: {message}")

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def _ask(self, command: str, *args: Any) -> Any:
        self._conn.send((command, args))
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(f"server {command} failed: {value}")
        return value

    def report(self) -> ServerReport:
        report: ServerReport = self._ask("report")
        return report

    def fail(self, instance: str) -> None:
        self._ask("fail", instance)

    def restart(self, instance: str) -> None:
        self._ask("restart", instance)

    def close(self, timeout_s: float = 60.0) -> int:
        """Graceful shutdown (drain, then stop); the child's exit code."""
        if self.process.is_alive():
            self._conn.send(("exit", ()))
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        return int(self.process.exitcode or 0)

    def __enter__(self) -> LoopbackServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- the child process -----------------------------------------------------------------------
def _child_main(spec: LoopbackSpec, port: int, conn: Connection) -> None:
    try:
        import os

        import torch
        import uvicorn

        from relaygr.engine.hostmem import tune_host_allocator
        from relaygr.server.app import create_app
        from relaygr.server.build import build_embedded, load_model

        tune_host_allocator()
        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        cost = LatencyCostModel.from_dict(spec.cost_model) if spec.cost_model else None
        if cost is None:
            from relaygr.relay.measure import fit_on_model
            cost = fit_on_model(load_model(spec.model, spec.system.devices[0]),
                                spec.system.devices[0])
        service = build_embedded(spec.model, spec.system, spec.server, cost)
        config = uvicorn.Config(create_app(service), host="127.0.0.1", port=port,
                                log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=int(spec.server.drain_timeout_s))
        server = uvicorn.Server(config)
        loop = asyncio.new_event_loop()
        threading.Thread(target=_control, args=(conn, loop, server, service, os.getpid()),
                         daemon=True).start()
        loop.run_until_complete(_serve(server, conn))
    except BaseException as exc:      # the parent must hear why, whatever it was
        conn.send(f"{type(exc).__name__}: {exc}")
        raise


async def _serve(server: Any, conn: Connection) -> None:
    task = asyncio.ensure_future(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    conn.send("ready" if server.started else "uvicorn did not start")
    await task


def _control(conn: Connection, loop: asyncio.AbstractEventLoop, server: Any, service: Any,
             pid: int) -> None:
    system = service.backend.system

    async def report() -> ServerReport:
        await service.backend.quiesce()
        error = None
        try:
            for inst in system.instances:
                await inst.check_integrity()
        except AssertionError as exc:
            error = str(exc)
        snap = service.backend.snapshot()
        return ServerReport(rss_bytes(pid), service.admission.in_flight, len(service.users),
                            service.admission.refused, snap.counters, snap.instances, error,
                            await service.fingerprint())

    commands = {"report": report, "fail": system.fail_instance,
                "restart": system.restart_instance}
    while True:
        command, args = conn.recv()
        if command == "exit":
            server.should_exit = True
            return
        try:
            value = asyncio.run_coroutine_threadsafe(commands[command](*args), loop).result()
            conn.send((True, value))
        except Exception as exc:
            conn.send((False, f"{type(exc).__name__}: {exc}"))
