"""A trained retrieval run (``relaygr train-retrieval``) as the cascade's retrieval stage.

At load: the run's item tower gives every item's vector (``RetrievalModel.item_vectors``, the
popularity prior in its last column); the vectors of the items the ranker also knows go into a
FAISS inner-product index (``Retriever``), so an item the ranker cannot score is never proposed.

At request time, the user tower: GraphSAGE's user side recomputed from the user's latest
``recent_events`` events of items the run knows (``RetrievalModel.user_vector``; events of items
it does not know are passed over, so the window still holds ``recent_events`` of them where the
history has that many): each layer combines the user's own state with the mean of its recent
items' states of that layer, the k-th newest weighing ``recency ** k`` (1: the graph's plain
mean). The user's own layer-0 state is its trained ID embedding when the run trained on that
user (``dataset_users``: the cascade's user ids are the dataset's, as when serving a dataset's
users), else zero (an unseen user: the tower's cold-start rule). So the vector follows the events
the user has now, not those it had at training time; with the user's training items and a plain
mean it is exactly the trained vector. A user with no event of an item the run knows gets
``EmptyInputError``.

As the cascade serves it (``beside_the_default``: ``relaygr serve --retrieval-run``, the
benchmark's replay, ``relaygr eval --retrieval RUN``), the run proposes its share of the list
(``StagesConfig.retrieval_run_share``), interleaved with the default stage, the ranker's item
embeddings, and with an item-to-item channel built from the run's own training interactions
(``cascade.item_cf``, ``item_neighbours``; ``retrieval_item_cf_rest_share`` of what the run
leaves) (``proposals.InterleavedRetrieval``); at a share of 1 it serves alone, and only then
may a stage weight fuse its scores (``check_run_share``).

Ids: the run numbers users and items its own way; ``catalogue.npz`` holds the dataset's id of
each. The ranker's ids are mapped through the dataset's ids (``RankerCatalogue``). Runs on another
dataset, or sharing too few items, are refused (``CatalogueMismatchError``, naming the mismatch).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from relaygr.cascade.config import StagesConfig
from relaygr.cascade.item_cf import ItemCFRetrieval, ItemNeighbours
from relaygr.cascade.proposals import EmbeddingRetrieval, ExcludingStage, InterleavedRetrieval
from relaygr.cascade.retrieval import RetrievalConfig, Retriever
from relaygr.errors import CatalogueMismatchError, ConfigError, EmptyInputError
from relaygr.model import HSTU
from relaygr.retrieval import RetrievalModel
from relaygr.retrieval.checkpoint import RunCatalogue, load_catalogue, load_seed, read_run_info

# Below this share of the ranker's items known to the run, the two runs are taken to number
# different catalogues (another dataset or a different filtering of it): most of the ranker's
# items could never be proposed, and an accidental overlap of small integer ids is likely.
MIN_SHARED_FRACTION = 0.5
_NAMED = 5   # ids an error names


@dataclass(frozen=True)
class RankerCatalogue:
    """What the ranker's ids mean: ``items[i]`` is the dataset's id of ranker item ``i + 1``
    (``relaygr.data.IdMap.items``); ``dataset`` its dataset's name (``relaygr.data`` names,
    e.g. ``ml-1m``); ``dataset_users``: whether the cascade's user ids are the dataset's."""

    dataset: str
    items: np.ndarray
    dataset_users: bool = True


def _lookup(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Position of each of ``values`` in ``keys`` (distinct ids), -1 where absent."""
    if len(keys) == 0:
        return np.full(len(values), -1, dtype=np.int64)
    order = np.argsort(keys, kind="stable")
    where = np.searchsorted(keys[order], values).clip(max=len(keys) - 1)
    return np.where(keys[order][where] == values, order[where], -1).astype(np.int64)


class TrainedRetrieval:
    """A retrieval run's towers behind ``RetrievalStage`` (see the module docstring)."""

    def __init__(self, model: RetrievalModel, domain: str, run_ids: RunCatalogue,
                 ranker: RankerCatalogue, recent_events: int, name: str = "trained",
                 index: RetrievalConfig | None = None, *, recency: float,
                 train_rows: np.ndarray | None = None) -> None:
        """``train_rows``: the run's training interactions in ``domain`` (``(n, 2)`` run user
        and item ids), what its item-to-item channel is built from (``item_neighbours``)."""
        if recent_events < 1 or not 0 < recency <= 1:
            raise ConfigError(f"TrainedRetrieval needs recent_events >= 1 and recency in "
                              f"(0, 1], got {recent_events} and {recency}")
        self.model, self.domain, self.name = model, domain, name
        self.recent_events, self.recency = recent_events, recency
        self.dataset_users = ranker.dataset_users
        self.train_rows = train_rows
        run_items = run_ids.items[domain]
        ranker_items = np.asarray(ranker.items, dtype=np.int64)
        # run item j -> ranker id (0: the ranker does not know it); ranker id -> run item (-1)
        self.to_ranker = _lookup(ranker_items, run_items) + 1
        self.to_run = np.full(len(ranker_items) + 1, -1, dtype=np.int64)
        known = np.flatnonzero(self.to_ranker > 0)
        self.to_run[self.to_ranker[known]] = known
        _check_shared(len(known), run_items, ranker_items, name)
        self._run_users = {int(u): i for i, u in enumerate(run_ids.users.tolist())}
        vectors = model.item_vectors(domain)              # (num_items, vector_dim)
        self.index_items = self.to_ranker[known]          # ranker id of the index's row r
        self.to_index_row = np.full(len(ranker_items) + 1, -1, dtype=np.int64)
        self.to_index_row[self.index_items] = np.arange(len(known))
        self.retriever = Retriever(vectors[known], index)
        # the full-graph pass, once, now (a LightGCN run has no user tower: ConfigError here)
        model.user_vector(domain, [int(known[0])])

    @classmethod
    def load(cls, run_dir: Path, ranker: RankerCatalogue, recent_events: int,
             seed: int | None = None, index: RetrievalConfig | None = None, *,
             recency: float) -> TrainedRetrieval:
        """Seed ``seed`` (default: the run's first) of the run in ``run_dir``, its target
        domain; ``CatalogueMismatchError`` when its data is not the ranker's."""
        info = read_run_info(run_dir)
        if info.pair != ranker.dataset:
            raise CatalogueMismatchError(
                f"retrieval run {run_dir} was trained on {info.pair!r}, the ranker on "
                f"{ranker.dataset!r}: their item ids name different catalogues")
        if seed is None:
            seed = info.seeds[0]
        elif seed not in info.seeds:
            raise ConfigError(f"{run_dir} has seeds {list(info.seeds)}, not {seed}")
        if len(info.domains) == 2 and (info.config.partner_items or info.config.bridges):
            raise ConfigError(f"{run_dir} was trained with partner-domain items in its user "
                              "tower (partner_items or bridges); the served stage reads the "
                              "cascade's one domain, so it would serve other vectors than the "
                              "run was evaluated with")
        trained = load_seed(run_dir, info, seed)
        return cls(trained.model, info.domains[0], load_catalogue(run_dir, info), ranker,
                   recent_events, f"{Path(run_dir).name} (seed {seed})", index,
                   recency=recency, train_rows=trained.splits[info.domains[0]].train)

    def item_neighbours(self, neighbours: int) -> ItemNeighbours:
        """The item-to-item table of the run's training interactions (``cascade.item_cf``),
        over the ranker's ids (items the ranker does not know are left out)."""
        if self.train_rows is None:
            raise ConfigError(f"retrieval run {self.name} was loaded without its training "
                              "rows: no item-to-item channel can be built from it")
        items = self.to_ranker[self.train_rows[:, 1]]
        known = items > 0
        return ItemNeighbours.of_rows(self.train_rows[known, 0], items[known],
                                      len(self.to_run) - 1, neighbours)

    def user_vector(self, history: np.ndarray, user_id: int | None = None) -> np.ndarray:
        """``(vector_dim,)`` float32: the user tower on the latest ``recent_events`` events of
        items the run knows, the k-th newest weighing ``recency ** k`` in its mean."""
        known = self.to_run[np.asarray(history, dtype=np.int64)]
        recent = known[known >= 0][-self.recent_events:]
        if recent.size == 0:
            raise EmptyInputError(f"none of the user's {len(history)} events is an item of "
                                  f"retrieval run {self.name}")
        return self.model.user_vector(self.domain, recent.tolist(), self.run_user(user_id),
                                      recency=self.recency)

    def trained_on(self, user_ids: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Whether each (cascade user id, ranker item id) pair is one of the run's training
        interactions (all False without them): a target it held is no test of the stage."""
        if self.train_rows is None or not self.dataset_users:
            return np.zeros(len(user_ids), dtype=bool)
        # (run user, ranker item) as one int64 key: run users x (ranker ids + 1) fits easily
        width = len(self.to_run)
        trained = self.train_rows[:, 0] * width + self.to_ranker[self.train_rows[:, 1]]
        run_users = np.array([self._run_users.get(int(u), -1) for u in user_ids.tolist()],
                             dtype=np.int64)
        return (run_users >= 0) & np.isin(run_users * width + np.asarray(items), trained)

    def run_user(self, user_id: int | None) -> int | None:
        """The run's id of the cascade's user ``user_id`` (None: not one the run trained on)."""
        if user_id is None or not self.dataset_users:
            return None
        return self._run_users.get(int(user_id))

    def propose(self, history: np.ndarray, k: int, user_id: int | None = None) -> np.ndarray:
        """Up to ``k`` ranker ids, best first: the index's top ``k`` by inner product."""
        return self.scored(history, k, user_id)[0]

    def scored(self, history: np.ndarray, k: int, user_id: int | None = None,
               exclude: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``propose`` with the inner products: ``(ids, scores)``, up to ``k`` each, best
        first, none of the ranker ids in ``exclude`` (e.g. the whole history, as an offline
        cascade removes it) among them."""
        vec = self.user_vector(np.asarray(history, dtype=np.int64), user_id)
        skip = None
        if exclude is not None and len(exclude):
            rows = self.to_index_row[np.asarray(exclude, dtype=np.int64)]
            skip = [np.unique(rows[rows >= 0]) + 1]          # search ids are 1-based rows
        most = self.retriever.num_items - (0 if skip is None else len(skip[0]))
        if min(k, most) < 1:                 # nothing asked for, or every item excluded
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        found = self.retriever.search(vec[None], min(k, most), skip)
        rows = found.item_ids[0][found.valid[0]] - 1
        ids: np.ndarray = self.index_items[rows]
        return ids, found.scores[0][found.valid[0]]


def check_run_share(stages: StagesConfig, run_name: str) -> None:
    """``ConfigError`` where a stage weight would fuse a retrieval run's scores while the run
    serves beside other channels (several score scales; ``beside_the_default``)."""
    if stages.stage_weight and stages.retrieval_run_share < 1:
        raise ConfigError(
            f"a stage weight ({stages.stage_weight:g}) fuses one stage's scores with the "
            f"ranker's; retrieval run {run_name} serves {stages.retrieval_run_share:g} of the "
            "candidates beside other channels (the item embeddings, its item-to-item channel), "
            "each on a scale of its own: set StagesConfig.retrieval_run_share to 1 "
            "(--retrieval-run-share 1) to fuse the run's scores, or the stage weight to 0 to "
            "serve the channels")


def beside_the_default(run: TrainedRetrieval, stages: StagesConfig, model: HSTU,
                       default: EmbeddingRetrieval | None = None
                       ) -> TrainedRetrieval | InterleavedRetrieval:
    """``run`` as the cascade serves it (``check_run_share`` first): interleaved with the
    default stage (``default``, or ``model``'s item embeddings with the stages' window and
    recency) at ``stages.retrieval_run_share``, and with the item-to-item channel of its
    training interactions (``cascade.item_cf``) at ``retrieval_item_cf_rest_share`` of the
    rest when that is above 0 (``StagesConfig.retrieval_shares``); alone at a run share of 1."""
    check_run_share(stages, run.name)
    rest, share, cf_share = stages.retrieval_shares
    channels: list[tuple[ExcludingStage, float]] = []
    if rest > 1e-9:
        channels.append((default or EmbeddingRetrieval.of(model, stages.retrieval_history,
                                                          recency=stages.retrieval_recency),
                         rest))
    channels.append((run, share))
    if cf_share > 1e-9:
        table = run.item_neighbours(stages.retrieval_item_cf_neighbours)
        channels.append((ItemCFRetrieval(table, stages.retrieval_history,
                                         recency=stages.retrieval_recency,
                                         name=f"item-cf of {run.name}"), cf_share))
    return run if len(channels) == 1 else InterleavedRetrieval(channels)


def _check_shared(shared: int, run_items: np.ndarray, ranker_items: np.ndarray,
                  name: str) -> None:
    if shared >= MIN_SHARED_FRACTION * len(ranker_items) and shared > 0:
        return
    unknown = ranker_items[_lookup(run_items, ranker_items) < 0][:_NAMED].tolist()
    raise CatalogueMismatchError(
        f"retrieval run {name} knows {shared} of the ranker's {len(ranker_items)} items "
        f"(needs {MIN_SHARED_FRACTION:.0%}); ranker ids it lacks include {unknown}: the two "
        "runs number different catalogues")
