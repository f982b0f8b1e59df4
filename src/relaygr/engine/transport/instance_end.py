"""The instance's side of the two legs, written once for every transport that crosses a boundary.

``InstanceEnd`` is one ``RankingInstance`` answering the legs' messages
(``engine.transport.messages``): a worker process (``engine.transport.host``) holds one per
instance it hosts, a Ray Serve replica (``distributed.replica``) holds its one. It rebuilds the
prefix a call carries as events (``PrefixPayload.to_spec``) and keeps the spec a pre-infer signal
rebuilt for that prefix's ranking leg, so the version hashing and the tensor copies are not redone
on the critical path.

It sheds nothing: shedding happens once per leg, where the queue is seen. A worker process leaves
it to the caller's ``InstanceFleet``; a Ray replica (whose ingress cannot see its queue) uses
``cascade.instance_end.SheddingEnd``, this end with the cascade's shed rules in front.
"""

from __future__ import annotations

from collections import OrderedDict

from relaygr.engine.instance import RankingInstance
from relaygr.engine.transport.messages import (
    AbandonCall,
    PreinferCall,
    PreinferReply,
    RankCall,
    RankReply,
)
from relaygr.engine.types import PrefixSpec
from relaygr.kvcache import PrefixId

# Pre-infer signals whose ranking request has not come (it went elsewhere, or was shed).
_MAX_KEPT_SPECS = 1024


class InstanceEnd:
    """See the module docstring. Driven by the event loop of the instance's process."""

    def __init__(self, instance: RankingInstance) -> None:
        self.instance = instance
        self._specs: OrderedDict[PrefixId, PrefixSpec] = OrderedDict()

    def preinfer(self, call: PreinferCall) -> PreinferReply:
        """The first leg: the instance's pre-infer signal (decided now)."""
        inst = self.instance
        spec = call.prefix.to_spec()
        self._specs[spec.pid] = spec
        while len(self._specs) > _MAX_KEPT_SPECS:
            self._specs.popitem(last=False)
        return PreinferReply(inst.name, inst.preinfer(spec, call.suffix_tokens, call.candidates),
                             False, call.note)

    def abandon(self, call: AbandonCall) -> bool:
        """The pre-infer of ``call.pid`` will see no ranking leg here (``RankingInstance.abandon``);
        its kept spec is dropped."""
        self._specs.pop(call.pid, None)
        return self.instance.abandon(call.pid)

    async def rank(self, call: RankCall, with_snapshot: bool = False) -> RankReply:
        """The second leg: the instance ranks (consuming the relayed prefix when it is here).
        ``with_snapshot``: the reply carries the instance's snapshot."""
        inst = self.instance
        result = await inst.rank(call.to_job(self._specs.pop(call.prefix.pid, None)))
        return RankReply.ranked(result, inst.snapshot() if with_snapshot else None, call.note)
