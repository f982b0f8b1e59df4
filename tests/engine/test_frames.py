"""The frame connection between a parent and an instance process: frames come out whole and in
order however the bytes are cut, each as soon as its last byte is in; the ranking leg's
messages cross a frame unchanged."""

from __future__ import annotations

import asyncio
import pickle
import random

import numpy as np
import pytest
import torch

from relaygr.engine.transport.host import FrameProtocol, write_frame
from relaygr.engine.transport.messages import RankCall, RankReply, Reply, RouteNote
from relaygr.engine.transport.payload import PrefixPayload
from relaygr.engine.types import RankPath, RankResult, RankTiming
from relaygr.kvcache import PrefixId


class _Sink:
    """A write transport that keeps what is written."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data


def _frames() -> list[tuple[int, object]]:
    rng = np.random.default_rng(0)
    return [(0, "ready"), (1, {"scores": rng.standard_normal(256).astype(np.float32)}),
            (2, b""), (3, rng.integers(0, 1 << 40, 5000)), (0, ("push", 7)), (4, None)]


def _same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("seed", range(5))
def test_frames_come_out_whole_and_in_order_however_the_bytes_are_cut(seed: int) -> None:
    sent = _frames()
    wire = _Sink()
    for seq, message in sent:
        write_frame(wire, seq, message)     # type: ignore[arg-type]
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(wire.data)), 12)) if seed else []
    chunks = [bytes(wire.data[a:b]) for a, b in zip([0, *cuts], [*cuts, len(wire.data)],
                                                            strict=True)]

    async def main() -> list[tuple[int, object]]:
        got: list[tuple[int, object]] = []
        frames = FrameProtocol(lambda seq, msg: got.append((seq, msg)))
        for chunk in chunks:
            frames.data_received(chunk)
        assert not frames.closed.done()
        frames.connection_lost(None)
        assert frames.closed.done()
        return got

    got = asyncio.run(main())
    assert [seq for seq, _ in got] == [seq for seq, _ in sent]
    assert all(_same(a, b) for (_, a), (_, b) in zip(sent, got, strict=True))


def test_a_partial_frame_waits_for_its_last_byte() -> None:
    data = pickle.dumps((9, "x" * 100), protocol=pickle.HIGHEST_PROTOCOL)
    wire = len(data).to_bytes(8, "little") + data

    async def main() -> list[object]:
        got: list[object] = []
        frames = FrameProtocol(lambda seq, msg: got.append(msg))
        frames.data_received(wire[:-1])
        assert got == []
        frames.data_received(wire[-1:])
        return got

    assert asyncio.run(main()) == ["x" * 100]


def test_the_ranking_leg_crosses_the_wire_unchanged() -> None:
    # What arrives of a ranking call and its reply is the same message, its arrays writable
    # (torch.from_numpy takes them without a warning), the scores bit-exact in every dtype.
    rng = np.random.default_rng(1)
    note = RouteNote("rank-1", "affinity", True)
    call = RankCall(request_id="r7", iid=3, user_id=42, follow=note, avoid=("rank-0",),
                    target=None, note=note,
                    prefix=PrefixPayload(PrefixId(42, 300, 987654321),
                                         rng.integers(1, 500, 300), rng.integers(0, 1 << 40, 300),
                                         window_start=12),
                    candidates=rng.integers(1, 500, 64), suffix_items=rng.integers(1, 500, 3),
                    suffix_timestamps=None, query_ts=1_700_000_000,
                    grown=PrefixId(42, 303, 5))
    got = pickle.loads(pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL))
    assert isinstance(got, RankCall)
    for name in ("request_id", "iid", "user_id", "follow", "avoid", "target", "note",
                 "suffix_timestamps", "query_ts", "grown"):
        assert getattr(got, name) == getattr(call, name), name
    assert (got.prefix.pid, got.prefix.window_start) == (call.prefix.pid, 12)
    for a, b in ((got.prefix.items, call.prefix.items),
                 (got.prefix.timestamps, call.prefix.timestamps),
                 (got.candidates, call.candidates), (got.suffix_items, call.suffix_items)):
        assert _same(a, b) and a is not None and a.flags.writeable
    job = got.to_job()
    assert torch.equal(job.candidates, torch.from_numpy(call.candidates))

    timing = RankTiming(0.001, 0.0, 0.007, 2, 0.0085)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        scores = torch.randn(64).to(dtype)
        reply = Reply(RankReply.ranked(RankResult(scores, RankPath.HOST_HIT, "rank-1", timing),
                                       None, note))
        back = pickle.loads(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        assert isinstance(back, Reply) and isinstance(back.value, RankReply)
        assert (back.error, back.snapshot) == (None, None)
        value = back.value
        assert (value.instance, value.path, value.timing, value.note) == (
            "rank-1", RankPath.HOST_HIT, timing, note)
        assert value.tensor().dtype == dtype and torch.equal(value.tensor(), scores)
    shed = RankReply("rank-0", None, overloaded_retry_s=0.5, detail="queue full")
    assert pickle.loads(pickle.dumps(shed)) == shed
