"""The cascade head of the evaluation: retrieval's top K, ordered by the ranker, over the whole
catalogue; and the retrieval stage that proposes the K."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from relaygr.data import leave_one_out
from relaygr.data.split import EvalCases
from relaygr.errors import ConfigError
from relaygr.model import HSTU
from relaygr.train import TrainConfig, serving_ranks
from relaygr.train.evaluate import CascadeSpec, cascade_ranks, subset_cases
from relaygr.train.stages import HeadRetrieval, Proposals, RetrievalQuery, retrieval_stage
from tests.train.helpers import cyclic_sequences

NUM = 10


def test_cascade_ranks_order_the_proposals_and_miss_what_retrieval_missed() -> None:
    # user 0: proposals 4, 2, 9; the ranker puts 9 first, then 4, then 2
    # user 1: proposals 1, 3, 5; its target 7 was not proposed
    proposals = Proposals(torch.tensor([[4, 2, 9], [1, 3, 5]]),
                          torch.tensor([[3.0, 2.0, 1.0], [3.0, 2.0, 1.0]]))
    ranked = [torch.tensor([0.5, 0.1, 0.9]), torch.tensor([0.0, 0.0, 0.0])]
    histories = [np.array([6]), np.array([8])]
    ranks = cascade_ranks(proposals, ranked, torch.tensor([4, 7]), histories, NUM)
    # 4 is second; 7 ties with every other unproposed, unseen item (2, 4, 6, 9, 10) and ties
    # count against it: rank 3 + 5 = 8, below all K = 3 proposals
    assert ranks.tolist() == [1, 8]
    ranks = cascade_ranks(proposals, ranked, torch.tensor([9, 1]), histories, NUM)
    assert ranks.tolist() == [0, 2]   # ties among proposals count against the target


def test_a_row_of_proposals_drops_what_was_not_proposed() -> None:
    proposals = Proposals(torch.tensor([[4, 2, 0]]), torch.tensor([[3.0, 2.0, -np.inf]]))
    items, scores = proposals.row(0)
    assert items.tolist() == [4, 2] and scores.tolist() == [3.0, 2.0]


def _model(tmp_path: Path, **changes: object):  # type: ignore[no-untyped-def]
    seqs = cyclic_sequences(tmp_path, num_users=24)
    config = TrainConfig(dim=16, num_layers=1, num_heads=2, max_seq_len=24, dropout=0.0,
                         similarity="cosine", temperature=0.05, **changes)  # type: ignore[arg-type]
    torch.manual_seed(0)
    return seqs, HSTU(config.model_config(seqs.num_items)).eval()


def test_head_retrieval_proposes_the_top_k_unseen_items(tmp_path: Path) -> None:
    seqs, model = _model(tmp_path)
    history = seqs.sequence(0)
    kv = model.prefill(torch.from_numpy(history[-24:]))
    query = RetrievalQuery(np.array([0]), [history], [kv])
    proposals = HeadRetrieval(model).propose(query, 15)
    scores = model.retrieval_scores(kv.last_hidden)
    scores[0] = -np.inf
    scores[torch.from_numpy(history)] = -np.inf
    expected = torch.argsort(scores, descending=True, stable=True)[:15]
    assert proposals.items[0].tolist() == expected.tolist()
    assert not set(proposals.items[0].tolist()) & set(history.tolist())
    with pytest.raises(ConfigError):
        HeadRetrieval(model).propose(query, 0)
    whole = HeadRetrieval(model).propose(query, seqs.num_items + 5)   # the whole catalogue
    assert whole.items.shape == (1, seqs.num_items)
    assert len(whole.row(0)[0]) == seqs.num_items - len(set(history.tolist()))
    with pytest.raises(ConfigError, match="unknown retrieval stage"):
        retrieval_stage("faiss", model)


def test_cascade_whose_ranker_is_retrieval_is_retrieval_truncated_at_k(tmp_path: Path) -> None:
    """Residual head with a silent MLP: the ranker scores what retrieval scores, so the cascade
    ranks every target retrieval put in its top K where retrieval did, and the rest >= K."""
    seqs, model = _model(tmp_path, rank_score="retrieval_residual")
    with torch.no_grad():
        model.rank_head[-1].weight.zero_()
        model.rank_head[-1].bias.zero_()
    cases = leave_one_out(seqs).test
    # the stage never proposes a seen item, the metric never masks the target: a target the
    # user saw before (this data repeats items) is a cascade miss by design, so leave those out
    fresh = np.array([t not in seqs.sequence(u)[:n] for u, n, t in
                      zip(cases.users, cases.history_lengths, cases.targets, strict=True)])
    cases = EvalCases(cases.users[fresh], cases.history_lengths[fresh], cases.targets[fresh])
    k = 20
    ranks = serving_ranks(model, seqs, cases, 24, False, ("retrieval", "cascade"),
                          cascade=CascadeSpec(HeadRetrieval(model), k))
    retrieval, cascade, stage = ranks["retrieval"], ranks["cascade"], ranks["stage"]
    hit = retrieval < k
    assert 0 < int(hit.sum()) < len(cases)      # both kinds of case occur
    assert torch.equal(cascade[hit], retrieval[hit])
    assert bool((cascade[~hit] >= k).all())
    # the stage alone: its own order of its K proposals, the retrieval head's ranks below K
    assert torch.equal(stage[hit], retrieval[hit]) and bool((stage[~hit] >= k).all())


def test_subset_of_users_is_seeded_and_ordered(tmp_path: Path) -> None:
    cases = leave_one_out(cyclic_sequences(tmp_path, num_users=30)).test
    a, b = subset_cases(cases, 10, seed=3), subset_cases(cases, 10, seed=3)
    assert len(a) == 10 and a.users.tolist() == b.users.tolist()
    assert a.users.tolist() == sorted(a.users.tolist())
    assert subset_cases(cases, 10, seed=4).users.tolist() != a.users.tolist()
    assert subset_cases(cases, 1000, seed=3) is cases
    with pytest.raises(ConfigError):
        subset_cases(cases, 0, seed=3)
