"""The host process of ``relaygr.engine.transport.processes``: framing and the serving loop.

A host process holds one copy of the model and serves any number of ``RankingInstance``s by id,
each built from a system's config by the builder its ``HostSpec`` carries (the cascade's
``build_instance``, passed in: this layer does not know the modes), all driven by the process's
own event loop (each instance computes on its own worker thread, as in-process).

The messages are the one set of every transport (``engine.transport.messages``: ``Open``,
``PreinferCall``, ``RankCall``, ``ControlCall``; ``Reply`` wrapping ``PreinferReply`` or
``RankReply``; ``Push``). Frames are ``(seq, message)`` pairs, pickled and length-prefixed, over a
socket pair. The parent numbers its calls; a reply carries its call's number; a snapshot push
carries 0. Messages are read in order and a ``PreinferCall`` is decided as it is read
(``FrameProtocol`` hands each frame over in the loop's read callback), so a ranking request read
after its pre-infer signal always finds the signal's effect. The loop writes at least
one frame every ``push_interval_s`` (a ``Push`` per instance, or a ``Heartbeat``) and keeps slow
work (building the model and the arenas) off itself, so a host whose loop runs is never judged
silent by the parent (``engine.transport.liveness``). Each instance answers the legs through its
``InstanceEnd`` (``engine.transport.instance_end``, as a Ray replica's does).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as load_weights
from safetensors.torch import save as save_weights

from relaygr.engine.hostmem import tune_host_allocator
from relaygr.engine.instance import RankingInstance
from relaygr.engine.scheduler import InstanceStoppedError
from relaygr.engine.snapshot import InstanceSnapshot
from relaygr.engine.transport.instance_end import InstanceEnd
from relaygr.engine.transport.messages import (
    AbandonCall,
    ControlCall,
    Heartbeat,
    Open,
    PreinferCall,
    PreinferReply,
    Push,
    RankCall,
    RankReply,
    Reply,
)
from relaygr.engine.types import SKIPPED
from relaygr.errors import ConfigError
from relaygr.model import HSTU, HSTUConfig
from relaygr.model.digest import model_digest
from relaygr.relay.costmodel import LatencyCostModel

_HEADER_BYTES = 8

# Builds instance ``name`` on ``device`` for a system's config (the cascade's ``build_instance``:
# a module-level function, so it pickles by name and the host imports it).
InstanceBuilder = Callable[[Any, str, str, HSTU, LatencyCostModel], RankingInstance]


def write_frame(transport: asyncio.WriteTransport, seq: int, message: object) -> None:
    data = pickle.dumps((seq, message), protocol=pickle.HIGHEST_PROTOCOL)
    transport.write(len(data).to_bytes(_HEADER_BYTES, "little") + data)


class FrameProtocol(asyncio.Protocol):
    """The reading end of a frame connection: each ``(seq, message)`` frame is handed to
    ``on_frame`` inside the loop's read callback, as soon as its last byte arrives. There is no
    reader task to wake (a stream reader's readiness future, two reads and a task step per
    frame, 0.1-0.2 ms each way on the 2-vCPU box when the loop wakes from idle:
    docs/runs/2026-11-27-relay-overhead-taken-apart.md). ``closed`` resolves when the
    connection ends; an exception in ``on_frame`` ends it."""

    def __init__(self, on_frame: Callable[[int, object], None]) -> None:
        self.on_frame = on_frame
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        while len(buffer) - start >= _HEADER_BYTES:
            body = start + _HEADER_BYTES
            end = body + int.from_bytes(buffer[start:body], "little")
            if len(buffer) < end:
                break
            seq, message = pickle.loads(buffer[body:end])
            start = end
            self.on_frame(seq, message)
        del buffer[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles, else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # any failure to round-trip means: send a description
        return RuntimeError(f"{type(exc).__name__}: {exc}")


# ---- the host ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class HostSpec:
    """What a host process needs to serve the parent's model: built once, sent at spawn."""

    model_config: HSTUConfig
    dtype: str
    weights: bytes                  # safetensors
    digest: str
    cost_model: LatencyCostModel
    build: InstanceBuilder
    torch_threads: int | None = 1
    # As often as the benchmark samples snapshots (``RunOptions.snapshot_interval_s``).
    push_interval_s: float = 0.25
    # Cached ranking batches up to this many attention scores per layer compute on the host's
    # event loop thread (``RankingInstance.rank_short_on_loop``): this loop serves only its
    # instances, and the two thread hand-offs (~0.3 ms each when the threads sleep) cost ~0.6 ms
    # of a ~8 ms pass on the 2-vCPU box (docs/runs/2026-11-27-relay-overhead-taken-apart.md).
    # 2 Mi scores: 256 candidates on an 8,192-token prefix, a 46 ms pass at two threads there
    # (docs/runs/2026-11-27-key-tiles.md), so about 0.1 s at one: under push_interval_s.
    loop_rank_elems: int = 1 << 21

    @classmethod
    def of(cls, model: HSTU, cost_model: LatencyCostModel, build: InstanceBuilder,
           torch_threads: int | None = 1) -> HostSpec:
        state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
        return cls(model.cfg, str(model.dtype).removeprefix("torch."), save_weights(state),
                   model_digest(model), cost_model, build, torch_threads)

    def build_model(self, device: str) -> HSTU:
        model = HSTU(self.model_config).to(dtype=getattr(torch, self.dtype))
        model.load_state_dict(load_weights(self.weights))
        model = model.to(device).eval()
        if model_digest(model) != self.digest:
            raise ConfigError("the instance process rebuilt a different model than its parent's")
        return model


class _Host:
    """The host side: instances by id, each driven by this process's event loop."""

    def __init__(self, spec: HostSpec, writer: asyncio.WriteTransport) -> None:
        self.spec = spec
        self.writer = writer
        self.models: dict[str, HSTU] = {}
        self.instances: dict[int, RankingInstance] = {}
        self.ends: dict[int, InstanceEnd] = {}       # the legs' side of each instance
        self.tasks: set[asyncio.Task[None]] = set()
        self._building = asyncio.Lock()

    async def model(self, device: str) -> HSTU:
        """The model on ``device``, built once (off the loop: loading weights takes a while)."""
        async with self._building:
            if device not in self.models:
                self.models[device] = await asyncio.to_thread(self.spec.build_model, device)
        return self.models[device]

    def instance(self, iid: int) -> RankingInstance:
        inst = self.instances.get(iid)
        if inst is None:
            raise InstanceStoppedError(f"instance {iid} is not open in this process")
        return inst

    def reply(self, seq: int, value: Any = None, error: Exception | None = None,
              snapshot_of: int | None = None) -> None:
        inst = None if snapshot_of is None else self.instances.get(snapshot_of)
        write_frame(self.writer, seq, Reply(value, None if error is None else _portable(error),
                                            None if inst is None else inst.snapshot()))

    def answer(self, seq: int, decide: Callable[[], Any]) -> None:
        try:
            value = decide()
        except Exception as exc:  # the parent raises it
            self.reply(seq, error=exc)
            return
        self.reply(seq, value)

    async def answer_later(self, seq: int, work: Awaitable[Any],
                           snapshot_of: int | None = None) -> None:
        try:
            value = await work
        except Exception as exc:  # the parent raises it
            self.reply(seq, error=exc)
            return
        self.reply(seq, value, snapshot_of=snapshot_of)

    def spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def handle(self, seq: int, msg: object) -> None:
        if isinstance(msg, PreinferCall):
            self.answer(seq, lambda: self.preinfer(msg))
        elif isinstance(msg, RankCall):
            self.spawn(self.answer_later(seq, self.rank(msg)))
        elif isinstance(msg, AbandonCall):
            self.answer(seq, lambda: self.abandon(msg))
        elif isinstance(msg, Open):
            self.spawn(self.answer_later(seq, self.open(msg), snapshot_of=msg.iid))
        elif isinstance(msg, ControlCall):
            snapshot_of = None if msg.op == "stop" else msg.iid
            self.spawn(self.answer_later(seq, self.control(msg), snapshot_of))
        else:
            raise TypeError(f"unexpected message {type(msg).__name__}")

    async def open(self, msg: Open) -> None:
        model = await self.model(msg.device)
        # The arenas (hundreds of MB of zeroed memory) are allocated off the loop.
        inst = await asyncio.to_thread(self.spec.build, msg.config, msg.name, msg.device, model,
                                       self.spec.cost_model)
        inst.rank_short_on_loop(self.spec.loop_rank_elems)
        await inst.start()
        self.instances[msg.iid] = inst
        self.ends[msg.iid] = InstanceEnd(inst)   # the parent's InstanceFleet sheds

    def preinfer(self, msg: PreinferCall) -> PreinferReply:
        end = self.ends.get(msg.iid)
        return PreinferReply("", SKIPPED) if end is None else end.preinfer(msg)

    def abandon(self, msg: AbandonCall) -> bool:
        end = self.ends.get(msg.iid)
        return False if end is None else end.abandon(msg)

    async def rank(self, msg: RankCall) -> RankReply:
        self.instance(msg.iid)          # raises if it is not open
        return await self.ends[msg.iid].rank(msg)

    async def control(self, msg: ControlCall) -> InstanceSnapshot | None:
        inst = self.instance(msg.iid)
        if msg.op == "stop":
            del self.instances[msg.iid], self.ends[msg.iid]
            await inst.stop()
            return inst.snapshot()
        if msg.op == "fail":
            await inst.fail()
        elif msg.op == "restart":
            await inst.restart()
        elif msg.op == "idle":
            await inst.idle()
        elif msg.op == "integrity":
            await inst.idle()
            await inst.check_integrity()
        elif msg.op != "snapshot":
            raise ValueError(f"unknown control {msg.op!r}")
        return None

    async def push(self) -> None:
        while True:
            await asyncio.sleep(self.spec.push_interval_s)
            for iid, inst in list(self.instances.items()):
                write_frame(self.writer, 0, Push(iid, inst.snapshot()))
            if not self.instances:
                write_frame(self.writer, 0, Heartbeat())

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for inst in self.instances.values():
            await inst.stop()
        self.instances.clear()
        self.ends.clear()


async def _serve(sock: socket.socket, spec: HostSpec) -> None:
    host: _Host | None = None

    def on_frame(seq: int, msg: object) -> None:
        assert host is not None, "the parent calls only after the ready frame"
        host.handle(seq, msg)

    frames = FrameProtocol(on_frame)
    writer, _ = await asyncio.get_running_loop().create_connection(lambda: frames, sock=sock)
    host = _Host(spec, writer)
    pusher = asyncio.create_task(host.push())
    write_frame(writer, 0, Reply("ready"))
    try:
        await frames.closed             # the parent closed its end (or died)
    finally:
        pusher.cancel()
        await host.close()
        writer.close()


def _read_spec(sock: socket.socket) -> HostSpec:
    """The parent's first frame, read before the loop starts: what this host serves."""
    def read(n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("the parent closed the socket before sending the spec")
            data += chunk
        return bytes(data)

    _, spec = pickle.loads(read(int.from_bytes(read(_HEADER_BYTES), "little")))
    if not isinstance(spec, HostSpec):
        raise TypeError(f"the first frame must be a HostSpec, got {type(spec).__name__}")
    return spec


def host_main(sock: socket.socket) -> None:
    """Entry point of a host process (spawned by ``InstanceProcesses``). The ``HostSpec``
    comes as the socket's first frame, not with the spawn: spawning writes its arguments into a
    pipe the parent holds open until the child has read them all, so a child that died with
    the model's weights half read would block the parent's start for good."""
    # The parent decides when we stop: it still has requests to drain through us when a
    # terminal's Ctrl-C or a wrapper's SIGTERM reaches its process group, so we leave the group
    # (a service manager that signals a whole cgroup should signal the main process only,
    # e.g. systemd's KillMode=mixed; the parent then ends us itself).
    if hasattr(os, "setpgrp"):
        os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tune_host_allocator()
    spec = _read_spec(sock)
    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    asyncio.run(_serve(sock, spec))
