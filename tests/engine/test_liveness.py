"""The hang deadlines of ``engine.transport.liveness``, on a clock the test moves (exact times)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from relaygr.engine.transport.host_link import HostLink
from relaygr.engine.transport.liveness import HostLiveness, LivenessPolicy, Suspicion
from relaygr.engine.transport.messages import Heartbeat, RankCall, Reply
from relaygr.engine.transport.payload import PrefixPayload
from relaygr.errors import ConfigError
from relaygr.kvcache import PrefixId
from tests.virtual_time import run_virtual

POLICY = LivenessPolicy(silent_s=0.5, rank_deadline_s=2.0, confirm_s=0.125)
TICK = 0.25         # the checks' interval (exact in binary, so every time below is exact)


def _first_verdict(liveness: HostLiveness, start: float, end: float,
                   beats_until: float | None = None) -> tuple[float, str] | None:
    """Check every TICK from ``start`` to ``end``; the host writes a frame at each tick up to
    ``beats_until``. The first verdict and its time, or None."""
    now = start
    while now <= end:
        if beats_until is not None and now <= beats_until:
            liveness.heard(now)
        why = liveness.check(now, POLICY)
        if why is not None:
            return now, why
        now += TICK
    return None



def work_through(liveness: HostLiveness, count: int) -> float:
    """Answer calls 1..``count`` in turn, one every half second from 0, hearing from the host
    every tick and checking it is never judged meanwhile; returns the time of the last answer."""
    answered, now = 0, 0.0
    while answered < count:
        now += TICK
        liveness.heard(now)
        if now % 0.5 == 0:
            answered += 1
            liveness.answered(answered, now)
        assert liveness.check(now, POLICY) is None
    return now

def test_a_silent_host_is_judged_at_the_second_check_past_the_deadline() -> None:
    liveness = HostLiveness(0.0)
    assert _first_verdict(liveness, 0.0, 10.0, beats_until=3.0) == (
        3.75, "nothing heard from it for 0.75 s")
    # 3.5: silent 0.5 s, suspected; 3.75: the same silence again, 0.25 s later: hung


def test_a_frame_between_the_two_checks_clears_the_suspicion() -> None:
    liveness = HostLiveness(0.0)
    assert liveness.check(2.0, POLICY) is None       # silent 2 s: a parent that stalled
    assert liveness.suspicion(2.0, POLICY) == Suspicion("silent", 0.0)
    liveness.heard(2.0)                              # its reader runs: the frames were there
    assert liveness.check(2.25, POLICY) is None
    assert liveness.check(2.5, POLICY) is None       # silent 0.5 s again: a new suspicion
    assert liveness.check(2.75, POLICY) == "nothing heard from it for 0.75 s"


def test_the_second_look_must_come_confirm_s_later() -> None:
    liveness = HostLiveness(0.0)
    assert liveness.check(1.0, POLICY) is None
    assert liveness.check(1.0, POLICY) is None       # a second supervisor, the same turn
    assert liveness.check(1.0625, POLICY) is None    # too soon
    assert liveness.check(1.125, POLICY) == "nothing heard from it for 1.12 s"


def test_a_stuck_ranking_call_is_judged_while_the_host_still_beats() -> None:
    liveness = HostLiveness(0.0)
    liveness.rank_sent(7, 1.0)                       # never answered
    liveness.rank_sent(8, 1.25)
    liveness.answered(8, 1.5)                        # answered: never judged
    # waiting since the last answer (1.5): suspected at 3.5, judged at the next check
    assert _first_verdict(liveness, 0.0, 10.0, beats_until=10.0) == (
        3.75, "ranking call 7 unanswered, and no ranking call of its instance answered, for 2.25 s")


def test_a_busy_host_that_answers_its_queue_is_not_judged() -> None:
    """Forty calls sent at once, answered one every half second: the last waits 20 s, ten
    times the deadline, but the host makes progress all along. Once it stops answering, the
    deadline runs from its last answer."""
    liveness = HostLiveness(0.0)
    for seq in range(1, 41):
        liveness.rank_sent(seq, 0.0)
    now = work_through(liveness, 30)
    assert liveness.unanswered_ranks == 10 and now == 15.0
    assert _first_verdict(liveness, now, now + 10.0, beats_until=now + 10.0) == (
        now + 2.25,
        "ranking call 31 unanswered, and no ranking call of its instance answered, for 2.25 s")


def test_calls_answered_in_time_are_not_judged() -> None:
    liveness = HostLiveness(0.0)
    for seq in range(1, 40):     # each answered 1.75 s after it was sent (under the deadline)
        sent = seq * TICK
        liveness.rank_sent(seq, sent)
        if seq > 7:
            liveness.answered(seq - 7, sent)
    assert liveness.unanswered_ranks == 7
    assert _first_verdict(liveness, 0.0, 9.75, beats_until=9.75) is None


def test_a_call_answered_after_a_stall_clears_its_suspicion() -> None:
    liveness = HostLiveness(0.0)
    liveness.rank_sent(1, 0.0)
    liveness.heard(2.5)
    assert liveness.check(2.5, POLICY) is None       # overdue at first sight
    liveness.answered(1, 2.5)                        # the reply was waiting unread
    liveness.heard(2.75)
    assert liveness.check(2.75, POLICY) is None
    assert liveness.unanswered_ranks == 0


@pytest.mark.parametrize("field", ["silent_s", "rank_deadline_s", "confirm_s"])
def test_a_deadline_must_be_positive(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        LivenessPolicy(**{field: 0.0})


def test_a_stuck_instance_is_judged_while_another_on_its_host_answers() -> None:
    """Instance 1's call is never answered; instance 2, on the same host, answers a call every
    half second all along. The host's answers are not instance 1's progress."""
    liveness = HostLiveness(0.0)
    liveness.rank_sent(1, 0.0, iid=1)
    verdict, now, seq = None, 0.0, 1
    while verdict is None and now < 10.0:
        now += TICK
        liveness.heard(now)
        if now % 0.5 == 0:
            seq += 1
            liveness.rank_sent(seq, now - 0.25, iid=2)
            liveness.answered(seq, now)
        verdict = liveness.check(now, POLICY)
    assert (now, verdict) == (2.25, "ranking call 1 unanswered, and no ranking call of its "
                                    "instance answered, for 2.25 s")


def test_a_busy_instance_beside_an_idle_one_is_not_judged() -> None:
    """Instance 2 works through twenty calls sent at once, one every half second (the last
    waits 10 s); instance 1 has no call. Neither is judged."""
    liveness = HostLiveness(0.0)
    for seq in range(1, 21):
        liveness.rank_sent(seq, 0.0, iid=2)
    work_through(liveness, 20)
    assert liveness.unanswered_ranks == 0


def test_a_host_link_tracks_each_instances_ranking_calls() -> None:
    """The parent's end of a host records whose ranking call each sequence number is, so a
    stuck instance is judged from its own calls, and reported to its own handle (virtual
    time, a fake socket)."""

    class Writer:
        def write(self, data: bytes) -> None:
            pass

    async def main() -> str | None:
        loop = asyncio.get_running_loop()
        link = HostLink(0, None, 1.0)  # type: ignore[arg-type]   # never spawned here
        link.loop, link.writer, link.alive = loop, Writer(), True  # type: ignore[assignment]
        link.liveness = HostLiveness(loop.time())
        ready: asyncio.Future[object] = loop.create_future()
        ready.set_result(None)
        stuck = link.call(_rank_call(iid=1))
        for _ in range(20):                 # instance 2 answers a call every half second
            await asyncio.sleep(0.25)
            link._on_frame(loop, ready, 0, Heartbeat())
            answered = link.call(_rank_call(iid=2))
            await asyncio.sleep(0.25)
            seq = max(link.calls)
            link._on_frame(loop, ready, seq, Reply(value=None))
            assert answered.done()
            assert link.hang(POLICY, iid=2) is None     # the answering instance: never
            why = link.hang(POLICY, iid=1)
            if why is not None:
                stuck.cancel()
                return why
        stuck.cancel()
        return None

    assert run_virtual(main()) == ("ranking call 1 unanswered, and no ranking call of its "
                                   "instance answered, for 2.50 s")


def _rank_call(iid: int) -> RankCall:
    return RankCall(iid=iid, prefix=PrefixPayload(PrefixId(iid, 2, 3), np.array([1, 2]), None),
                    candidates=np.array([4]))


def test_a_silent_host_is_the_verdict_of_every_instance_on_it() -> None:
    liveness = HostLiveness(0.0)
    liveness.rank_sent(1, 0.0, iid=1)
    assert liveness.check(1.0, POLICY, iid=2) is None
    assert liveness.check(1.25, POLICY, iid=2) == "nothing heard from it for 1.25 s"
    assert liveness.check(1.25, POLICY, iid=1) == "nothing heard from it for 1.25 s"
