"""The frame connection between a parent and an instance process: frames come out whole and in
order however the bytes are cut, each as soon as its last byte is in."""

from __future__ import annotations

import asyncio
import pickle
import random

import numpy as np
import pytest

from relaygr.engine.transport.host import FrameProtocol, write_frame


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
    chunks = [bytes(wire.data[a:b]) for a, b in zip([0, *cuts], [*cuts, len(wire.data)])]

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
