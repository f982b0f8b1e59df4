"""Ranking instances in processes of their own: one interpreter, so one GIL, per instance.

Why: in one process the instances' worker threads share a GIL, and a ranking pass spends much
of its time in Python between the ops (the model's per-layer code, the scheduler, the cache
bookkeeping). On the 2-core CPU box a cached ranking pass (cpu profile, 512-token prefix,
256 candidates) took 5.2-6.7 ms alone, 7.5-9.9 ms each when two threads of one process ran it
at once, and 5.1-7.7 ms each in two processes (docs/benchmark.md, "What limits the relay's
throughput"). A production ranking server runs one process per accelerator for the same
reason.

``InstanceProcesses`` starts K host processes once (spawned: model weights and the fitted cost
model are sent over once, and the weights' digest is checked there) and hands out
``ProcessInstance`` handles through ``factory``, the ``InstanceFactory`` that ``RelaySystem``
takes. Each handle's instance is today's ``RankingInstance``, built by ``build_instance`` in
the host process from the system's config, so trigger, scheduler, device pool and host tier
run there unchanged; a host can carry several instances (of different systems) at once, and a
system's ``stop`` drops its instances from their hosts, so every benchmark point still starts
from empty caches without paying a process start.

Messages are pickled frames over a socket pair, each side driven by its own event loop:

* ``preinfer`` is sent and answered later (the handle returns an awaitable); the ranking leg
  may be sent right after it, because a host reads one instance's messages in order and starts
  each ranking request only after the signals read before it;
* ``rank`` carries the prefix as events (``PrefixPayload``: the host rebuilds ``version_at``
  with the store's hash and checks the version), the candidates and the suffix, and comes back
  with the scores (bit-exact: the model's dtype travels with them) and the path;
* the host pushes each instance's ``InstanceSnapshot`` every ``push_interval_s`` while it
  serves, and with every control reply, so ``snapshot()`` stays synchronous and cheap.

Failure model: a host that dies (or is killed) fails every call in flight and every later one
with ``InstanceStoppedError``, so the cascade fails over to the user's next choice exactly as
for a failed in-process instance. ``fail``/``restart`` go to the instance in the host.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import pickle
import signal
import socket
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_weights
from safetensors.torch import save as save_weights

from relaygr.cascade.config import SystemConfig
from relaygr.cascade.payload import PrefixPayload
from relaygr.cascade.system import InstanceFactory, build_instance
from relaygr.engine.hostmem import tune_host_allocator
from relaygr.engine.instance import RankingInstance
from relaygr.engine.scheduler import InstanceStoppedError
from relaygr.engine.snapshot import InstanceSnapshot
from relaygr.engine.types import (
    PrefixSpec,
    PreinferAction,
    PreinferResult,
    RankJob,
    RankPath,
    RankResult,
)
from relaygr.errors import ConfigError
from relaygr.kvcache import PrefixId
from relaygr.model import HSTU, HSTUConfig
from relaygr.relay.costmodel import LatencyCostModel
from relaygr.server.build import model_digest

_HEADER_BYTES = 8


# ---- messages (parent -> host unless said otherwise) ----------------------------------------
@dataclass(frozen=True)
class _Open:
    seq: int
    iid: int
    config: SystemConfig
    name: str
    device: str


@dataclass(frozen=True)
class _Preinfer:
    seq: int
    iid: int
    prefix: PrefixPayload
    suffix_tokens: int
    candidates: int


@dataclass(frozen=True)
class _Rank:
    seq: int
    iid: int
    prefix: PrefixPayload
    candidates: np.ndarray
    suffix_items: np.ndarray | None
    suffix_timestamps: np.ndarray | None
    query_ts: int | None
    grown: PrefixId | None

    def to_job(self) -> RankJob:
        def tensor(a: np.ndarray | None) -> torch.Tensor | None:
            return None if a is None else torch.from_numpy(a)
        return RankJob(self.prefix.to_spec(), torch.from_numpy(self.candidates),
                       tensor(self.suffix_items), tensor(self.suffix_timestamps), self.query_ts,
                       self.grown)


@dataclass(frozen=True)
class _Control:
    seq: int
    iid: int
    op: str        # stop | fail | restart | idle | integrity | snapshot


@dataclass(frozen=True)
class _Reply:
    """host -> parent: the answer to message ``seq`` (``error`` set when it raised)."""

    seq: int
    value: Any = None
    error: BaseException | None = None
    snapshot: InstanceSnapshot | None = None


@dataclass(frozen=True)
class _Push:
    """host -> parent: an instance's latest snapshot (``iid``), sent while it serves."""

    iid: int
    snapshot: InstanceSnapshot


@dataclass(frozen=True)
class _Ranked:
    scores: np.ndarray
    dtype: str
    path: RankPath


def _write(writer: asyncio.StreamWriter, message: object) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(len(data).to_bytes(_HEADER_BYTES, "little") + data)


async def _read(reader: asyncio.StreamReader) -> object:
    size = int.from_bytes(await reader.readexactly(_HEADER_BYTES), "little")
    return pickle.loads(await reader.readexactly(size))


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles, else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # any failure to round-trip means: send a description
        return RuntimeError(f"{type(exc).__name__}: {exc}")


# ---- the host process --------------------------------------------------------------------------
@dataclass(frozen=True)
class HostSpec:
    """What a host process needs to serve the parent's model: built once, sent at spawn."""

    model_config: HSTUConfig
    dtype: str
    weights: bytes                  # safetensors
    digest: str
    cost_model: LatencyCostModel
    torch_threads: int | None = 1
    push_interval_s: float = 0.1

    @classmethod
    def of(cls, model: HSTU, cost_model: LatencyCostModel, torch_threads: int | None = 1
           ) -> HostSpec:
        state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
        return cls(model.cfg, str(model.dtype).removeprefix("torch."), save_weights(state),
                   model_digest(model), cost_model, torch_threads)

    def build_model(self, device: str) -> HSTU:
        model = HSTU(self.model_config).to(dtype=getattr(torch, self.dtype))
        model.load_state_dict(load_weights(self.weights))
        model = model.to(device).eval()
        if model_digest(model) != self.digest:
            raise ConfigError("the instance process rebuilt a different model than its parent's")
        return model


class _Host:
    """The host side: instances by id, each driven by this process's event loop."""

    def __init__(self, spec: HostSpec, writer: asyncio.StreamWriter) -> None:
        self.spec = spec
        self.writer = writer
        self.models: dict[str, HSTU] = {}
        self.instances: dict[int, RankingInstance] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    def model(self, device: str) -> HSTU:
        if device not in self.models:
            self.models[device] = self.spec.build_model(device)
        return self.models[device]

    def reply(self, seq: int, value: Any = None, error: BaseException | None = None,
              iid: int | None = None) -> None:
        inst = None if iid is None else self.instances.get(iid)
        _write(self.writer, _Reply(seq, value, None if error is None else _portable(error),
                                   None if inst is None else inst.snapshot()))

    def spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def handle(self, msg: object) -> None:
        if isinstance(msg, _Preinfer):
            self.preinfer(msg)
        elif isinstance(msg, _Rank):
            self.spawn(self.rank(msg))
        elif isinstance(msg, _Open):
            self.spawn(self.open(msg))
        elif isinstance(msg, _Control):
            self.spawn(self.control(msg))
        else:
            raise TypeError(f"unexpected message {type(msg).__name__}")

    async def open(self, msg: _Open) -> None:
        try:
            model = self.model(msg.device)
            # The arenas (hundreds of MB of zeroed memory) are allocated off the loop.
            inst = await asyncio.to_thread(build_instance, msg.config, msg.name, msg.device,
                                           model, self.spec.cost_model)
            await inst.start()
            self.instances[msg.iid] = inst
            self.reply(msg.seq, iid=msg.iid)
        except Exception as exc:  # the parent raises it
            self.reply(msg.seq, error=exc)

    def preinfer(self, msg: _Preinfer) -> None:
        inst = self.instances.get(msg.iid)
        if inst is None:
            self.reply(msg.seq, PreinferResult(PreinferAction.SKIPPED, None, 0))
            return
        try:
            result = inst.preinfer(msg.prefix.to_spec(), msg.suffix_tokens, msg.candidates)
            self.reply(msg.seq, result)
        except Exception as exc:  # the parent raises it
            self.reply(msg.seq, error=exc)

    async def rank(self, msg: _Rank) -> None:
        inst = self.instances.get(msg.iid)
        try:
            if inst is None:
                raise InstanceStoppedError(f"instance {msg.iid} is not open in this process")
            result = await inst.rank(msg.to_job())
            scores = result.scores.detach().to("cpu")
            self.reply(msg.seq, _Ranked(scores.float().numpy(),
                                        str(scores.dtype).removeprefix("torch."), result.path))
        except Exception as exc:  # the parent raises it
            self.reply(msg.seq, error=exc)

    async def control(self, msg: _Control) -> None:
        inst = self.instances.get(msg.iid)
        try:
            if inst is None:
                raise InstanceStoppedError(f"instance {msg.iid} is not open in this process")
            if msg.op == "stop":
                del self.instances[msg.iid]
                await inst.stop()
                self.reply(msg.seq, inst.snapshot())
                return
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
            self.reply(msg.seq, iid=msg.iid)
        except Exception as exc:  # the parent raises it
            self.reply(msg.seq, error=exc)

    async def push(self) -> None:
        while True:
            await asyncio.sleep(self.spec.push_interval_s)
            for iid, inst in list(self.instances.items()):
                _write(self.writer, _Push(iid, inst.snapshot()))

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for inst in self.instances.values():
            await inst.stop()
        self.instances.clear()


async def _serve(sock: socket.socket, spec: HostSpec) -> None:
    reader, writer = await asyncio.open_connection(sock=sock)
    host = _Host(spec, writer)
    pusher = asyncio.create_task(host.push())
    _write(writer, _Reply(0, "ready"))
    try:
        while True:
            try:
                msg = await _read(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return                      # the parent closed its end (or died)
            host.handle(msg)
    finally:
        pusher.cancel()
        await host.close()
        writer.close()


def host_main(sock: socket.socket, spec: HostSpec) -> None:
    """Entry point of a host process (spawned by ``InstanceProcesses``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the parent decides when we stop
    tune_host_allocator()
    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    asyncio.run(_serve(sock, spec))


# ---- the parent side ---------------------------------------------------------------------------
class _Link:
    """The parent's end of one host process: calls by sequence number, pushed snapshots."""

    def __init__(self, index: int, spec: HostSpec, start_timeout_s: float) -> None:
        self.index = index
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self.process: multiprocessing.process.BaseProcess | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.alive = False
        self.calls: dict[int, asyncio.Future[_Reply]] = {}
        self.pushed: dict[int, InstanceSnapshot] = {}
        self._seq = itertools.count(1)
        self._reader_task: asyncio.Task[None] | None = None
        self._starting: asyncio.Future[None] | None = None
        self._sock: socket.socket | None = None

    async def ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self.loop is not None and self.loop is not loop:
            raise ConfigError("instance processes serve the event loop that started them")
        if self.alive:
            return
        if self.process is not None:
            raise InstanceStoppedError(f"instance process {self.index} has exited")
        if self._starting is None:
            self.loop = loop
            self._starting = loop.create_future()
            self._reader_task = loop.create_task(self._start())
        await asyncio.shield(self._starting)

    async def _start(self) -> None:
        assert self._starting is not None
        parent_end, child_end = socket.socketpair()
        self._sock = parent_end
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(target=host_main, args=(child_end, self.spec), daemon=True,
                                   name=f"relaygr-instances-{self.index}")
        try:
            await asyncio.to_thread(self.process.start)
            child_end.close()
            reader, self.writer = await asyncio.open_connection(sock=parent_end)
            first = await asyncio.wait_for(_read(reader), self.start_timeout_s)
            if not isinstance(first, _Reply) or first.value != "ready":
                raise ConfigError(f"instance process {self.index} did not start: {first!r}")
        except BaseException as exc:
            self._starting.set_exception(InstanceStoppedError(
                f"instance process {self.index} failed to start: {exc!r}"))
            self.terminate()
            return
        self.alive = True
        self._starting.set_result(None)
        await self._read_replies(reader)

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                msg = await _read(reader)
                if isinstance(msg, _Push):
                    self.pushed[msg.iid] = msg.snapshot
                elif isinstance(msg, _Reply):
                    future = self.calls.pop(msg.seq, None)
                    if future is not None and not future.done():
                        future.set_result(msg)
        except (asyncio.IncompleteReadError, ConnectionError, EOFError):
            pass
        finally:
            self.alive = False
            for future in self.calls.values():
                if not future.done():
                    future.set_exception(InstanceStoppedError(
                        f"instance process {self.index} exited"))
            self.calls.clear()

    def next_seq(self) -> int:
        return next(self._seq)

    def call(self, message: _Open | _Preinfer | _Rank | _Control) -> asyncio.Future[_Reply]:
        """Send ``message``; the future resolves with its reply (or the host's exit)."""
        assert self.loop is not None
        future: asyncio.Future[_Reply] = self.loop.create_future()
        if not self.alive or self.writer is None:
            future.set_exception(InstanceStoppedError(f"instance process {self.index} is down"))
            return future
        self.calls[message.seq] = future
        _write(self.writer, message)
        return future

    def terminate(self) -> None:
        self.alive = False
        if self.writer is not None:
            if self.loop is not None and not self.loop.is_closed():
                self.writer.close()
            elif self._sock is not None:
                self._sock.close()          # the loop is gone: close the socket itself
        if self.process is not None and self.process.is_alive():
            self.process.terminate()
            self.process.join(5.0)
            if self.process.is_alive():
                self.process.kill()


class ProcessInstance:
    """The parent's handle for one instance in a host process (``InstanceHandle``).

    ``rank_queue_depth`` counts the ranking requests sent and not yet answered (the one being
    computed included), which is what the parent can know without asking; ``queue_depth`` adds
    the host's last reported pre-infer queue.
    """

    def __init__(self, link: _Link, iid: int, config: SystemConfig, name: str,
                 device: str) -> None:
        self.link = link
        self.iid = iid
        self.config = config
        self._name = name
        self.device = device
        self._up = False
        self._ranks = 0
        self._last = InstanceSnapshot(name, False, 0, 0, None, None)

    @property
    def name(self) -> str:
        return self._name

    @property
    def healthy(self) -> bool:
        return self._up and self.link.alive

    @property
    def rank_queue_depth(self) -> int:
        return self._ranks

    @property
    def queue_depth(self) -> int:
        return self._ranks + self.snapshot().prefill_queue_depth

    def snapshot(self) -> InstanceSnapshot:
        pushed = self.link.pushed.get(self.iid)
        return pushed if pushed is not None else self._last

    def _remember(self, reply: _Reply) -> _Reply:
        if reply.snapshot is not None:
            self._last = reply.snapshot
            self.link.pushed[self.iid] = reply.snapshot
        if reply.error is not None:
            raise reply.error
        return reply

    async def _control(self, op: str) -> Any:
        reply = await self.link.call(_Control(self.link.next_seq(), self.iid, op))
        return self._remember(reply).value

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        await self.link.ensure_started()
        reply = await self.link.call(_Open(self.link.next_seq(), self.iid, self.config,
                                           self._name, self.device))
        self._remember(reply)
        self._up = True

    async def stop(self) -> None:
        was_up, self._up = self._up, False
        if was_up and self.link.alive:
            final = await self._control("stop")
            if isinstance(final, InstanceSnapshot):
                self._last = final
        self.link.pushed.pop(self.iid, None)

    async def fail(self) -> None:
        self._up = False
        await self._control("fail")

    async def restart(self) -> None:
        await self._control("restart")
        self._up = True

    async def idle(self) -> None:
        if self.link.alive and self._up:
            await self._control("idle")

    async def check_integrity(self) -> None:
        if self.link.alive and self._up:
            await self._control("integrity")

    async def refresh(self) -> InstanceSnapshot:
        """Ask the host for this instance's snapshot now (``snapshot()`` is the last pushed)."""
        if self.link.alive and self._up:
            await self._control("snapshot")
        return self.snapshot()

    # ---- the two legs ------------------------------------------------------------------------
    def preinfer(self, spec: PrefixSpec, suffix_tokens: int, candidates: int
                 ) -> Awaitable[PreinferResult]:
        """Sends the signal now; the task resolves with the host's decision (a host that went
        down meanwhile counts as skipped: the ranking leg then fails over and recomputes)."""
        loop = asyncio.get_running_loop()
        if not self.healthy:
            done: asyncio.Future[PreinferResult] = loop.create_future()
            done.set_result(PreinferResult(PreinferAction.SKIPPED, None, 0))
            return done
        sent = self.link.call(_Preinfer(self.link.next_seq(), self.iid, PrefixPayload.of(spec),
                                        suffix_tokens, candidates))
        return loop.create_task(self._preinfer_result(sent))

    async def _preinfer_result(self, sent: asyncio.Future[_Reply]) -> PreinferResult:
        try:
            result = self._remember(await sent).value
        except InstanceStoppedError:
            return PreinferResult(PreinferAction.SKIPPED, None, 0)
        assert isinstance(result, PreinferResult)
        return result

    async def rank(self, job: RankJob) -> RankResult:
        if not self.healthy:
            raise InstanceStoppedError(f"{self._name} is down")

        def array(t: torch.Tensor | None) -> np.ndarray | None:
            return None if t is None else t.numpy()

        candidates = job.candidates.numpy()
        assert candidates is not None
        message = _Rank(self.link.next_seq(), self.iid, PrefixPayload.of(job.prefix), candidates,
                        array(job.suffix_items), array(job.suffix_timestamps), job.query_ts,
                        job.grown)
        self._ranks += 1
        try:
            ranked = self._remember(await self.link.call(message)).value
        finally:
            self._ranks -= 1
        assert isinstance(ranked, _Ranked)
        scores = torch.from_numpy(ranked.scores).to(getattr(torch, ranked.dtype))
        return RankResult(scores, ranked.path, self._name)


@dataclass
class InstanceProcesses:
    """K host processes for ranking instances (see the module docstring).

    ``factory`` places each instance name on a host, the first K names in turn and then round
    robin, so ``rank-i`` of every system lands on the same host. The processes start with the
    first instance started on them (inside the serving event loop), or all at once with
    ``start``; ``close`` ends them (they are daemons, so the interpreter's exit also does).
    """

    spec: HostSpec
    num_processes: int
    start_timeout_s: float = 120.0
    _links: list[_Link] = field(default_factory=list, init=False, repr=False)
    _by_name: dict[str, _Link] = field(default_factory=dict, init=False, repr=False)
    _iids: itertools.count[int] = field(default_factory=lambda: itertools.count(1),
                                       init=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_processes <= 0:
            raise ConfigError("InstanceProcesses needs at least one process")
        self._links = [_Link(i, self.spec, self.start_timeout_s)
                       for i in range(self.num_processes)]

    @classmethod
    def for_model(cls, model: HSTU, cost_model: LatencyCostModel, num_processes: int,
                  torch_threads: int | None = 1) -> InstanceProcesses:
        return cls(HostSpec.of(model, cost_model, torch_threads), num_processes)

    @property
    def factory(self) -> InstanceFactory:
        def make(config: SystemConfig, name: str, device: str, model: HSTU,
                 cost_model: LatencyCostModel) -> ProcessInstance:
            if model_digest(model) != self.spec.digest:
                raise ConfigError("these instance processes serve a different model")
            link = self._by_name.get(name)
            if link is None:
                link = self._by_name[name] = self._links[len(self._by_name) % len(self._links)]
            return ProcessInstance(link, next(self._iids), config, name, device)
        return make

    async def start(self) -> None:
        """Start every process now (otherwise each starts with its first instance)."""
        await asyncio.gather(*(link.ensure_started() for link in self._links))

    def pids(self) -> list[int | None]:
        return [None if link.process is None else link.process.pid for link in self._links]

    def close(self) -> None:
        for link in self._links:
            link.terminate()
