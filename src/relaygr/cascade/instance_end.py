"""The instance's side of the two legs, written once for every transport that crosses a boundary.

``InstanceEnd`` is one ``RankingInstance`` answering the legs' messages (``cascade.messages``):
a worker process (``cascade.instance_host``) holds one per instance it hosts, a Ray Serve
replica (``distributed.replica``) holds its one. It rebuilds the prefix a call carries as events
(``PrefixPayload.to_spec``) and keeps the spec a pre-infer signal rebuilt for that prefix's
ranking leg, so the version hashing and the tensor copies are not redone on the critical path.

Shedding happens once per leg, where the queue is seen: ``shed_by`` set (the Ray replica: its
ingress cannot see the replica's queue) applies the cascade's shed rules (``cascade.fleet``)
here; ``shed_by`` None (the worker process) leaves them to the caller's ``InstanceFleet``.
"""

from __future__ import annotations

from collections import OrderedDict

from relaygr.cascade.config import SystemConfig
from relaygr.cascade.fleet import SKIPPED, rank_shed, sheds_preinfer
from relaygr.cascade.messages import PreinferCall, PreinferReply, RankCall, RankReply
from relaygr.engine.instance import RankingInstance
from relaygr.engine.types import PrefixSpec
from relaygr.kvcache import PrefixId

# Pre-infer signals whose ranking request has not come (it went elsewhere, or was shed).
_MAX_KEPT_SPECS = 1024


class InstanceEnd:
    """See the module docstring. Driven by the event loop of the instance's process."""

    def __init__(self, instance: RankingInstance, shed_by: SystemConfig | None = None) -> None:
        self.instance = instance
        self.shed_by = shed_by
        self._specs: OrderedDict[PrefixId, PrefixSpec] = OrderedDict()

    def preinfer(self, call: PreinferCall) -> PreinferReply:
        """The first leg: the instance's pre-infer signal (decided now), unless shed."""
        inst = self.instance
        if self.shed_by is not None and sheds_preinfer(inst.scheduler.rank_queue_depth,
                                                       self.shed_by):
            return PreinferReply(inst.name, SKIPPED, True, call.note)
        spec = call.prefix.to_spec()
        self._specs[spec.pid] = spec
        while len(self._specs) > _MAX_KEPT_SPECS:
            self._specs.popitem(last=False)
        return PreinferReply(inst.name, inst.preinfer(spec, call.suffix_tokens, call.candidates),
                             False, call.note)

    async def rank(self, call: RankCall, with_snapshot: bool = False) -> RankReply:
        """The second leg: the instance ranks (consuming the relayed prefix when it is here),
        unless shed. ``with_snapshot``: the reply carries the instance's snapshot."""
        inst = self.instance
        if self.shed_by is not None:
            shed = rank_shed(inst.name, inst.scheduler.rank_queue_depth, self.shed_by)
            if shed is not None:
                return RankReply(inst.name, None, snapshot=inst.snapshot(), note=call.note,
                                 overloaded_retry_s=shed.retry_after_s, detail=str(shed))
        result = await inst.rank(call.to_job(self._specs.pop(call.prefix.pid, None)))
        return RankReply.ranked(result, inst.snapshot() if with_snapshot else None, call.note)
