"""An instance's end of the two legs with the cascade's shed rules in front (a Ray replica's).

``SheddingEnd`` is ``engine.transport.instance_end.InstanceEnd`` checking the shed rules
(``cascade.fleet``: ``sheds_preinfer``, ``rank_shed``) on the instance's own queue before each
leg. A Ray Serve replica (``distributed.replica``) answers its legs through one, because its
ingress cannot see the replica's queue; a worker process uses the plain ``InstanceEnd``, since
the caller's ``InstanceFleet`` sheds there. Shedding so happens once per leg, where the queue is
seen.
"""

from __future__ import annotations

from relaygr.cascade.config import SystemConfig
from relaygr.cascade.fleet import rank_shed, sheds_preinfer
from relaygr.engine.instance import RankingInstance
from relaygr.engine.transport.instance_end import InstanceEnd
from relaygr.engine.transport.messages import PreinferCall, PreinferReply, RankCall, RankReply
from relaygr.engine.types import SKIPPED


class SheddingEnd(InstanceEnd):
    """See the module docstring: ``shed_by`` is the system whose shed rules apply."""

    def __init__(self, instance: RankingInstance, shed_by: SystemConfig) -> None:
        super().__init__(instance)
        self.shed_by = shed_by

    def preinfer(self, call: PreinferCall) -> PreinferReply:
        """The first leg, unless shed (then SKIPPED, marked shed)."""
        inst = self.instance
        if sheds_preinfer(inst.scheduler.rank_queue_depth, self.shed_by):
            return PreinferReply(inst.name, SKIPPED, True, call.note)
        return super().preinfer(call)

    async def rank(self, call: RankCall, with_snapshot: bool = False) -> RankReply:
        """The second leg, unless shed (then a reply with ``overloaded_retry_s``)."""
        inst = self.instance
        shed = rank_shed(inst.name, inst.scheduler.rank_queue_depth, self.shed_by)
        if shed is not None:
            return RankReply(inst.name, None, snapshot=inst.snapshot(), note=call.note,
                             overloaded_retry_s=shed.retry_after_s, detail=str(shed))
        return await super().rank(call, with_snapshot)
