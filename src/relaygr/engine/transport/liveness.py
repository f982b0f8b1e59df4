"""Whether an instance host process still answers: the deadlines behind hang detection.

A host (``engine.transport.host``) writes at least one frame every ``push_interval_s`` while its
event loop runs (a snapshot push per instance it holds, or a ``Heartbeat`` when it holds none),
and answers every ranking call it is sent. ``HostLiveness`` (one per ``HostLink``, fed by it)
records when the parent last heard from the host and, per instance it hosts, which ranking calls
are unanswered since when (``RankProgress``); ``check`` judges the host hung when, at a check,

* nothing came from it for ``silent_s`` (its process is stopped, e.g. by SIGSTOP, or its loop
  is blocked), or
* one of its instances has a ranking call unanswered for ``rank_deadline_s`` and answered no
  other ranking call of its own in that time either (stuck in a call while the loop still
  beats). An instance that answers calls is making progress, however long its queue: 64 queued
  full passes of long prefixes take longer than any fixed deadline, and killing such a host
  would lose its queue and its cache for being busy. Each instance is judged on its own calls:
  its own scheduler and worker thread answer them, so another instance's answers on the same
  host say nothing of it (a stuck instance beside a busy one is judged; the busy one is not),

and the same suspicion (the same silence, or the same call) held at an earlier check at least
``confirm_s`` before. The second look keeps a parent whose own loop stalled from judging a
healthy host: the host's frames then wait unread in the socket, the parent's reader runs
between the two checks, and what it reads ends the silence (or answers the call).

A ranking call answered with an error is answered: these rules judge hangs only. An instance
whose calls keep raising is the cascade's circuit breaker's to take out of routing
(``cascade.breaker``), not a reason to kill its host.

Time is the caller's clock (the event loop's ``loop.time()``), passed in, so the rules are
tested on virtual time. Checked every ``interval_s`` (``SupervisorPolicy``), a host that stops
writing is judged within ``silent_s + interval_s + max(interval_s, confirm_s)`` of its last
frame: 0.6 + 0.2 + 0.2 = 1.0 s with the defaults. ``RankProgress`` is the ranking-call rule
alone, for a caller that has no frames to hear (a Ray replica judging its own instance,
``distributed.health``).
"""

from __future__ import annotations

from dataclasses import dataclass

from relaygr.errors import ConfigError


@dataclass(frozen=True)
class LivenessPolicy:
    # A host writes every 0.25 s (``HostSpec.push_interval_s``): 0.6 s is two frames missed and
    # most of a third, short enough to judge a stopped host within a second.
    silent_s: float = 0.6
    # Five seconds without a single ranking answer while a call waits: no batch of the
    # passes we serve takes that long on any machine we run, so it is a stuck call, not a busy
    # host (a busy host answers its queue one batch after another).
    rank_deadline_s: float = 5.0
    # The second look (see the module docstring): at least one turn of the parent's loop.
    confirm_s: float = 0.1

    def __post_init__(self) -> None:
        for name in ("silent_s", "rank_deadline_s", "confirm_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"LivenessPolicy.{name} must be > 0")


@dataclass(frozen=True)
class Suspicion:
    """What a check found wrong: ``kind`` "silent" (``since``: the last frame heard) or
    "rank call" (``since``: when call ``seq`` of instance ``iid`` was sent, or that instance's
    last ranking answer if later). Equal suspicions are the same fault."""

    kind: str
    since: float
    seq: int = 0
    iid: int = 0


class RankProgress:
    """One instance's ranking calls: which are unanswered since when, and when it last
    answered one. ``stuck`` is the ranking-call rule of the module docstring."""

    def __init__(self, now: float) -> None:
        self._sent: dict[int, float] = {}           # call -> sent at, oldest first
        self.last_answer = now                      # the last ranking call answered

    def sent(self, key: int, now: float) -> None:
        self._sent[key] = now

    def answered(self, key: int, now: float) -> None:
        if self._sent.pop(key, None) is not None:
            self.last_answer = max(self.last_answer, now)

    def withdraw(self, key: int) -> None:
        """``key`` no longer waits, but was not answered by the instance (no progress)."""
        self._sent.pop(key, None)

    @property
    def unanswered(self) -> int:
        return len(self._sent)

    def stuck(self, now: float, deadline_s: float) -> tuple[int, float] | None:
        """The oldest unanswered call and the time it has waited since (it was sent, or the
        last answer if later), when that is at least ``deadline_s`` ago; else None."""
        for key, sent in self._sent.items():        # the oldest call is the first
            waiting = max(sent, self.last_answer)   # since it was sent or the instance progressed
            return (key, waiting) if now - waiting >= deadline_s else None
        return None


class HostLiveness:
    """See the module docstring. Fed by one ``HostLink``; checked by the supervisor."""

    def __init__(self, now: float) -> None:
        self.last_heard = now
        self._ranks: dict[int, RankProgress] = {}      # iid -> its calls, while it has some
        self._iid_of: dict[int, int] = {}              # seq -> iid, while unanswered
        self._suspect: tuple[Suspicion, float] | None = None   # and when first seen

    def heard(self, now: float) -> None:
        """A frame (any frame) came from the host."""
        self.last_heard = now

    def rank_sent(self, seq: int, now: float, iid: int = 0) -> None:
        """Ranking call ``seq`` went to instance ``iid`` of the host."""
        self._iid_of[seq] = iid
        self._ranks.setdefault(iid, RankProgress(now)).sent(seq, now)

    def answered(self, seq: int, now: float) -> None:
        iid = self._iid_of.pop(seq, None)
        if iid is None:
            return
        progress = self._ranks[iid]
        progress.answered(seq, now)
        if not progress.unanswered:
            # Its next call starts a fresh wait: sent after this answer, it is measured from
            # when it was sent either way.
            del self._ranks[iid]

    @property
    def unanswered_ranks(self) -> int:
        return len(self._iid_of)

    def suspicion(self, now: float, policy: LivenessPolicy) -> Suspicion | None:
        """What is wrong now at first sight (not yet a verdict: see ``check``)."""
        if now - self.last_heard >= policy.silent_s:
            return Suspicion("silent", self.last_heard)
        for iid, progress in self._ranks.items():
            stuck = progress.stuck(now, policy.rank_deadline_s)
            if stuck is not None:
                seq, waiting = stuck
                return Suspicion("rank call", waiting, seq, iid)
        return None

    def check(self, now: float, policy: LivenessPolicy, iid: int | None = None) -> str | None:
        """Why the host is hung (a sentence for the log), or None: the suspicion seen now, if
        it was seen at an earlier check at least ``confirm_s`` ago. ``iid``: the instance
        asking; a stuck ranking call of another instance is then not its answer (that
        instance's own check, in the same turn, gets it), so the log names the stuck one."""
        seen = self.suspicion(now, policy)
        if seen is None:
            self._suspect = None
            return None
        if self._suspect is None or self._suspect[0] != seen:
            self._suspect = (seen, now)
            return None
        if now - self._suspect[1] < policy.confirm_s:
            return None
        if seen.kind == "silent":
            return f"nothing heard from it for {now - seen.since:.2f} s"
        if iid is not None and seen.iid != iid:
            return None
        return (f"ranking call {seen.seq} unanswered, and no ranking call of its instance "
                f"answered, for {now - seen.since:.2f} s")
