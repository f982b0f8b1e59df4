"""Scores depend only on the user's own history and the candidate itself."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relaygr.model import PrefillInput, RankInput
from tests.model.helpers import assert_close, make_model, random_history


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(1, 600), min_size=2, max_size=5),
       timed=st.lists(st.booleans(), min_size=5, max_size=5), seed=st.integers(0, 2**16))
def test_batch_composition_does_not_change_scores(lengths: list[int], timed: list[bool],
                                                  seed: int) -> None:
    model = make_model(seed)
    gen = torch.Generator().manual_seed(seed)
    requests, kvs = [], []
    for i, length in enumerate(lengths):
        items, ts = random_history(gen, length, 500, timed[i])
        cands = torch.randint(1, 501, (int(torch.randint(1, 60, (1,), generator=gen)),),
                              generator=gen)
        requests.append(RankInput(cands, prefix_items=items, prefix_timestamps=ts))
        kvs.append(PrefillInput(items, ts))
    alone = [model.rank_batch([r])[0] for r in requests]
    together = model.rank_batch(requests)
    reversed_batch = model.rank_batch(requests[::-1])[::-1]
    prefixes = model.prefill_batch(kvs)
    cached = model.rank_batch([RankInput(r.candidates, prefix=kv)
                               for r, kv in zip(requests, prefixes, strict=True)])
    for a, b, c, d in zip(alone, together, reversed_batch, cached, strict=True):
        assert_close(b, a)
        assert_close(c, a)
        assert_close(d, a)


@settings(max_examples=15, deadline=None)
@given(length=st.integers(1, 500), num_candidates=st.integers(2, 120),
       block=st.integers(1, 50), seed=st.integers(0, 2**16))
def test_candidate_order_and_micro_batches(length: int, num_candidates: int, block: int,
                                           seed: int) -> None:
    model = make_model(seed)
    gen = torch.Generator().manual_seed(seed)
    items, _ = random_history(gen, length, 500, timed=False)
    cands = torch.randint(1, 501, (num_candidates,), generator=gen)
    kv = model.prefill(items)
    scores = model.rank(cands, prefix=kv)
    perm = torch.randperm(num_candidates, generator=gen)
    assert_close(model.rank(cands[perm], prefix=kv), scores[perm])
    pieces = [model.rank(cands[i:i + block], prefix=kv) for i in range(0, num_candidates, block)]
    assert_close(torch.cat(pieces), scores)
    # a duplicated candidate gets the same score twice: candidates never see each other
    doubled = model.rank(torch.cat([cands, cands]), prefix=kv)
    assert_close(doubled[:num_candidates], doubled[num_candidates:])


def test_padding_does_not_change_dense_scores() -> None:
    """The padded training path gives each user the scores it gets alone."""
    model = make_model(5)
    gen = torch.Generator().manual_seed(5)
    lengths = [7, 30, 1, 18]
    histories = [random_history(gen, n, 500, timed=False)[0] for n in lengths]
    cands = torch.randint(1, 501, (len(lengths), 9), generator=gen)
    padded = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
    for row, items in enumerate(histories):
        padded[row, :len(items)] = items
    with torch.no_grad():
        batch_scores = model.rank_padded(padded, cands)
        for row, items in enumerate(histories):
            alone = model.rank_padded(items[None], cands[row:row + 1])[0]
            assert_close(batch_scores[row], alone)
            assert_close(alone, model.rank(cands[row], prefix_items=items))


def test_eval_mode_is_deterministic() -> None:
    model = make_model(9, dropout=0.3)
    gen = torch.Generator().manual_seed(9)
    items, ts = random_history(gen, 321, 500, timed=True)
    cands = torch.randint(1, 501, (50,), generator=gen)
    first = model.rank(cands, prefix_items=items, prefix_timestamps=ts)
    for _ in range(3):
        assert torch.equal(model.rank(cands, prefix_items=items, prefix_timestamps=ts), first)
    kv_a, kv_b = model.prefill(items, ts), model.prefill(items, ts)
    assert torch.equal(kv_a.k, kv_b.k) and torch.equal(kv_a.v, kv_b.v)


def test_prefill_job_runs_in_chunk_rounds() -> None:
    """A prefill can be advanced one chunk round at a time (the scheduler's unit of work)."""
    model = make_model(2, query_block=64)
    items = torch.randint(1, 501, (300,), generator=torch.Generator().manual_seed(2))
    job = model.prefill_job([PrefillInput(items)])
    rounds = 0
    with torch.inference_mode():
        while not job.done:
            job.step()
            rounds += 1
    assert rounds == 5  # ceil(300 / 64)
    assert_close(job.tracks[0].prefix().k, model.prefill(items).k)
