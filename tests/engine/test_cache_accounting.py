"""What an instance's cache counters say, request by request: each ranking request is one lookup
of each tier it asks (the device: a hit when it ranks from K/V computed there ahead of it; the
host: for a request the device did not serve, a hit when the host's copy serves it), each
pre-infer signal one action that says what it started, and the host's figures live entries
only."""

from __future__ import annotations

import torch

from relaygr.engine.instance import RankingInstance
from relaygr.engine.snapshot import TierSnapshot
from relaygr.engine.types import PreinferAction, RankJob, RankPath
from relaygr.kvcache import PrefixId
from tests.engine.helpers import spec_from_store
from tests.engine.test_instance import CANDIDATES, full_scores, idle, make_instance, run, store_with
from tests.model.helpers import assert_close, make_model


def _lookups(tier: TierSnapshot | None) -> tuple[int, int, int]:
    assert tier is not None
    return tier.hits, tier.misses, tier.stale_misses


def _counted(inst: RankingInstance, path: RankPath, device: tuple[int, int, int],
             host: tuple[int, int, int]) -> None:
    """The last request took ``path``; the tiers' (hits, misses, stale misses) are exactly
    ``device`` and ``host``, and they add up to the requests, path by path."""
    snap = inst.snapshot()
    assert (_lookups(snap.device), _lookups(snap.host)) == (device, host), path
    paths = snap.paths
    assert sum(device) == sum(paths.values())                     # one lookup per request
    assert device[0] == paths.get("device_hit", 0) + paths.get("pending_wait", 0)
    assert host[0] == paths.get("host_hit", 0)
    assert sum(host) == device[1] + device[2]                     # what the device missed


def test_each_ranking_request_is_one_lookup_of_each_tier_it_asks() -> None:
    model = make_model(1, query_block=32)
    store = store_with({1: 400, 2: 150, 3: 200})
    spec = spec_from_store(store, 1)

    async def rank(inst: RankingInstance, job: RankJob, path: RankPath) -> None:
        ranked = await inst.rank(job)
        assert ranked.path is path
        await idle(inst)

    async def scenario(inst: RankingInstance) -> None:
        res = inst.residency
        assert res is not None
        # waited on its pre-infer: a device hit, once (not a miss and then a hit)
        assert inst.preinfer(spec, 0, 40).action is PreinferAction.PREFILL
        await rank(inst, RankJob(spec, CANDIDATES), RankPath.PENDING_WAIT)
        _counted(inst, RankPath.PENDING_WAIT, (1, 0, 0), (0, 0, 0))
        await rank(inst, RankJob(spec, CANDIDATES), RankPath.DEVICE_HIT)
        _counted(inst, RankPath.DEVICE_HIT, (2, 0, 0), (0, 0, 0))
        # reloaded from the host by the ranking request: a device miss and a host hit
        assert res.pool.discard(spec.pid)
        await rank(inst, RankJob(spec, CANDIDATES), RankPath.HOST_HIT)
        _counted(inst, RankPath.HOST_HIT, (2, 1, 0), (1, 0, 0))
        # reloaded by its pre-infer, READY when ranking came: the same, counted at ranking
        assert res.pool.discard(spec.pid)
        assert inst.preinfer(spec, 0, 40).action is PreinferAction.RELOAD
        await idle(inst)
        _counted(inst, RankPath.HOST_HIT, (2, 1, 0), (1, 0, 0))
        await rank(inst, RankJob(spec, CANDIDATES), RankPath.HOST_HIT)
        _counted(inst, RankPath.HOST_HIT, (2, 2, 0), (2, 0, 0))
        # nothing anywhere: a miss of both
        await rank(inst, RankJob(spec_from_store(store, 2), CANDIDATES), RankPath.FULL)
        _counted(inst, RankPath.FULL, (2, 3, 0), (2, 1, 0))
        # user 3's full pass keeps prefix + suffix (device and host); other events follow:
        # both hold another prefix of the user, a stale miss of each
        suffix = torch.tensor([7, 8, 9])
        grown = PrefixId(3, 203, store.version_after(3, 200, suffix.numpy()))
        await rank(inst, RankJob(spec_from_store(store, 3), CANDIDATES, suffix, grown=grown),
                   RankPath.FULL)
        _counted(inst, RankPath.FULL, (2, 4, 0), (2, 2, 0))
        store.append(3, [17, 18, 19])
        other = spec_from_store(store, 3)
        assert other.num_tokens == 203 and other.pid != grown
        await rank(inst, RankJob(other, CANDIDATES), RankPath.FULL)
        _counted(inst, RankPath.FULL, (2, 4, 1), (2, 2, 1))

    run(scenario, make_instance(model))


def test_a_pre_infer_counts_a_reload_only_when_its_copy_started() -> None:
    """A host hit whose reload cannot start (another prefix of the user is loading; the device
    pool cannot take it) is REFUSED, as a pre-infer the pool refuses, not RELOAD."""
    model = make_model(2)
    store = store_with({5: 200})
    spec = spec_from_store(store, 5)

    async def scenario(inst: RankingInstance) -> None:
        res = inst.residency
        assert res is not None and res.expander is not None
        inst.preinfer(spec, 0, 40)
        await inst.rank(RankJob(spec, CANDIDATES))
        await idle(inst)                                  # demoted: the host holds it
        assert res.pool.discard(spec.pid)
        assert inst.preinfer(spec, 0, 40).action is PreinferAction.RELOAD
        # a longer prefix of the same user while that reload is in flight: BUSY
        store.append(5, [11, 12])
        longer = spec_from_store(store, 5)
        busy = inst.preinfer(longer, 0, 40)
        assert (busy.action, busy.tokens) == (PreinferAction.REFUSED, 0)
        await idle(inst)
        assert res.expander.stats.busy == 1
        await inst.rank(RankJob(spec, CANDIDATES))       # the reloaded entry's lease, consumed
        await idle(inst)
        # the device pool cannot take it: every page held by a pending entry of another user
        assert res.pool.discard(spec.pid)
        pages = res.pool.stats.num_pages
        blocker = res.pool.begin(PrefixId(99, pages * inst.config.page_tokens, 0), timed=False)
        assert blocker is not None
        refused = inst.preinfer(longer, 0, 40)
        assert (refused.action, refused.tokens) == (PreinferAction.REFUSED, 0)
        assert res.expander.stats.refused == 1
        res.pool.abort(blocker)
        assert dict(inst.preinfer_actions) == {"prefill": 1, "reload": 1, "refused": 2}
        assert res.counters.reloads_started == 1
        # the request then reloads and extends the host's copy itself
        ranked = await inst.rank(RankJob(longer, CANDIDATES))
        assert ranked.path is RankPath.HOST_HIT
        assert_close(ranked.scores, full_scores(model, longer))

    run(scenario, make_instance(model))


def test_the_host_tiers_figures_leave_out_copies_past_their_ttl() -> None:
    """Expiry is lazy; a snapshot read after the TTL shows no bytes or entries for copies
    no lookup would return, though nothing has stored or reloaded since."""
    model = make_model(3)
    store = store_with({4: 150})
    spec = spec_from_store(store, 4)

    async def scenario(inst: RankingInstance) -> None:
        res = inst.residency
        assert res is not None and res.host is not None
        now = [1000.0]
        res.host.clock = lambda: now[0]
        inst.preinfer(spec, 0, 40)
        await inst.rank(RankJob(spec, CANDIDATES))
        await idle(inst)
        host = inst.snapshot().host
        assert host is not None and host.entries == 1 and host.used_bytes > 0
        now[0] += inst.config.host_ttl_s
        host = inst.snapshot().host
        assert host is not None
        assert (host.entries, host.used_bytes, host.expired) == (0, 0, 1)
        assert res.host.lookup(4) is None
        res.host.check_integrity()

    run(scenario, make_instance(model))
