"""The parent's end of one instance host process: spawn, framed calls, pushed snapshots.

``HostLink`` starts its host process (``engine.transport.host.host_main``) on first use, numbers
every call and resolves its future with the host's ``Reply``, and hands the snapshots the host
pushes to the handles of the instances it carries (``SnapshotSink``: ``ProcessInstance``,
``engine.transport.process_instance``). When the host exits, every call in flight and every later
one fails with ``InstanceStoppedError``; ``respawn`` starts a fresh host in its place (once, however
many of its instances ask), and the handles open their instances there again.

A host that is alive but does not answer (stopped, or stuck) is seen by ``hang`` (the deadlines of
``engine.transport.liveness``: every frame read and every ranking call sent and answered is
recorded) and ended by ``kill``, after which it is down like a host that died.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import socket
from typing import Protocol

from relaygr.engine.scheduler import InstanceStoppedError
from relaygr.engine.snapshot import InstanceSnapshot
from relaygr.engine.transport.host import FrameProtocol, HostSpec, host_main, write_frame
from relaygr.engine.transport.liveness import HostLiveness, LivenessPolicy
from relaygr.engine.transport.messages import Push, RankCall, Reply, RoutedCall
from relaygr.errors import ConfigError


class SnapshotSink(Protocol):
    """Where a host's pushed snapshot of one instance lands (the instance's handle)."""

    last: InstanceSnapshot


class HostLink:
    """The parent's end of one host process: calls by sequence number, snapshots pushed to the
    handles of the instances it hosts."""

    def __init__(self, index: int, spec: HostSpec, start_timeout_s: float) -> None:
        self.index = index
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self.process: multiprocessing.process.BaseProcess | None = None
        self.writer: asyncio.WriteTransport | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.alive = False
        self.calls: dict[int, asyncio.Future[Reply]] = {}
        self.handles: dict[int, SnapshotSink] = {}      # iid -> handle, while it is open
        self._seq = itertools.count(1)
        self._reader_task: asyncio.Task[None] | None = None
        self._starting: asyncio.Future[None] | None = None
        self._sock: socket.socket | None = None
        self.liveness = HostLiveness(0.0)       # replaced when the host is ready

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

    async def respawn(self) -> None:
        """A fresh host process in place of one that exited (once, however many of its
        instances ask): the instances it hosted are opened again by their handles."""
        if self.alive:
            return
        if self._starting is not None and not self._starting.done():
            await asyncio.shield(self._starting)        # another handle is respawning it
            return
        self.terminate()
        self.process, self.writer, self._sock, self._starting = None, None, None, None
        await self.ensure_started()

    async def _start(self) -> None:
        assert self._starting is not None
        loop = asyncio.get_running_loop()
        parent_end, child_end = socket.socketpair()
        self._sock = parent_end
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(target=host_main, args=(child_end,), daemon=True,
                                   name=f"relaygr-instances-{self.index}")
        ready: asyncio.Future[object] = loop.create_future()
        frames = FrameProtocol(lambda seq, msg: self._on_frame(loop, ready, seq, msg))
        try:
            await asyncio.to_thread(self.process.start)   # a small payload: the socket only
            child_end.close()
            self.writer, _ = await loop.create_connection(lambda: frames, sock=parent_end)
            write_frame(self.writer, 0, self.spec)         # what it serves (host._read_spec)
            await asyncio.wait((ready, frames.closed), timeout=self.start_timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
            if not ready.done():
                raise ConfigError(f"instance process {self.index} "
                                  + ("exited" if frames.closed.done() else "did not answer")
                                  + " before it was ready")
            first = ready.result()
            if not isinstance(first, Reply) or first.value != "ready":
                raise ConfigError(f"instance process {self.index} did not start: {first!r}")
        except BaseException as exc:
            self._starting.set_exception(InstanceStoppedError(
                f"instance process {self.index} failed to start: {exc!r}"))
            self.terminate()
            return
        self.liveness = HostLiveness(loop.time())
        self.alive = True
        self._starting.set_result(None)
        try:
            await frames.closed
        finally:
            self.alive = False
            for future in self.calls.values():
                if not future.done():
                    future.set_exception(InstanceStoppedError(
                        f"instance process {self.index} exited"))
            self.calls.clear()

    def _on_frame(self, loop: asyncio.AbstractEventLoop, ready: asyncio.Future[object],
                  seq: int, msg: object) -> None:
        """One frame from the host, in the loop's read callback: the first answers the start;
        a reply resolves its call's future, a push updates its instance's handle."""
        if not ready.done():
            ready.set_result(msg)
            return
        self.liveness.heard(loop.time())
        if isinstance(msg, Push):
            handle = self.handles.get(msg.iid)
            if handle is not None:
                handle.last = msg.snapshot
        elif isinstance(msg, Reply):
            self.liveness.answered(seq, loop.time())
            future = self.calls.pop(seq, None)
            if future is not None and not future.done():
                future.set_result(msg)

    def call(self, message: RoutedCall) -> asyncio.Future[Reply]:
        """Send ``message``; the future resolves with its reply (or the host's exit)."""
        assert self.loop is not None
        future: asyncio.Future[Reply] = self.loop.create_future()
        if not self.alive or self.writer is None:
            future.set_exception(InstanceStoppedError(f"instance process {self.index} is down"))
            return future
        seq = next(self._seq)
        self.calls[seq] = future
        if isinstance(message, RankCall):
            self.liveness.rank_sent(seq, self.loop.time(), message.iid)
        write_frame(self.writer, seq, message)
        return future

    def hang(self, policy: LivenessPolicy, iid: int | None = None) -> str | None:
        """Why this live host counts as hung (``HostLiveness.check``; ``iid``: the instance
        asking), or None."""
        if not self.alive or self.loop is None:
            return None
        return self.liveness.check(self.loop.time(), policy, iid)

    def kill(self) -> None:
        """End a host that does not answer: SIGKILL (a stopped process ends too), and the
        socket is shut so every call in flight fails over now (``InstanceStoppedError``)."""
        self.alive = False
        if self.process is not None and self.process.is_alive():
            self.process.kill()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)

    def terminate(self) -> None:
        """End the host: its socket is shut now (so its loop sees the end at once), then
        SIGTERM, then SIGKILL if it is still there."""
        self.alive = False
        if self._sock is not None:
            with contextlib.suppress(OSError):      # now, not when the loop gets to the close
                self._sock.shutdown(socket.SHUT_RDWR)
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
