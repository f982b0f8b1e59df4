"""SCCDR training configuration: one frozen dataclass, validated at construction, and presets.

The paper (Chang et al., WWW 2025) is only public as an abstract; every choice it leaves open is a
field here (stop-gradient placement, Katz order and decay, pacing function, view augmentation,
loss weights), chosen by measurement on a validation split (docs/retrieval.md).

Presets name the variants compared in the harness:

- ``sccdr``: separated intra/inter CL (distinct views per domain, stop-gradient on the partner
  side of inter-CL) and the Katz curriculum for inter-CL negatives.
- ``mixed``: the same losses in one objective, no stop-gradient, uniform inter-CL negatives.
- ``single``: each domain's GraphSAGE alone, matching loss only.
- ``lightgcn``: each domain's LightGCN alone, matching loss only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from relaygr.errors import ConfigError
from relaygr.settings import changed, load


class Encoder(str, Enum):
    SAGE = "sage"           # GraphSAGE (aggregator: SCCDRConfig.sage_aggregation), one per domain
    LIGHTGCN = "lightgcn"   # LightGCN (no weights besides the embeddings)


class Aggregation(str, Enum):
    """How a GraphSAGE layer weighs node v's neighbours u (``SCCDRConfig.sage_aggregation``)."""

    MEAN = "mean"           # 1 / deg(v): the neighbours' mean, blind to their degrees
    SYM = "sym"             # 1 / sqrt(deg(v) deg(u)): LightGCN's D^-1/2 A D^-1/2, so a rarely
                            # seen item weighs more in its users' vectors than a popular one


class StopGradient(str, Enum):
    NONE = "none"           # inter-CL gradients reach both towers (the "mixed" objective)
    PARTNER = "partner"     # each inter-CL direction updates only its anchor's tower


class Pacing(str, Enum):
    NONE = "none"           # inter-CL negatives drawn uniformly from all users, no curriculum
    LINEAR = "linear"       # available share of the difficulty-ordered pool grows linearly
    ROOT = "root"           # ... as a square root (more hard negatives early)
    STEP = "step"           # ... in three equal stages


class Similarity(str, Enum):
    COSINE = "cosine"       # unit vectors, logit = cos / temperature
    DOT = "dot"             # raw inner product / temperature (norms may carry popularity)


class LRSchedule(str, Enum):
    CONSTANT = "constant"   # learning_rate throughout
    COSINE = "cosine"       # cosine decay per epoch from learning_rate to 0 at max_epochs


class MatchingLoss(str, Enum):
    SOFTMAX = "softmax"     # sampled softmax over uniform negatives shared by the batch
    BPR = "bpr"             # pairwise BPR with one uniform negative per positive


@dataclass(frozen=True)
class SCCDRConfig:
    """Everything that decides a retrieval training run besides the data and the seed."""

    encoder: Encoder = Encoder.SAGE
    dim: int = 64
    num_layers: int = 2
    # GraphSAGE's neighbour weights (Aggregation); "mean" is the paper's aggregator and what
    # a run.json written before the option was trained with
    sage_aggregation: Aggregation = Aggregation.MEAN
    # one layer-0 user embedding table for both towers (users are shared): the towers then
    # differ only in their item embeddings and layers; off keeps each domain's tower separate
    share_user_embedding: bool = False
    # each domain's tower also reads the user's items of the partner domain (extra item nodes
    # with embeddings of the tower's own): a user's vector in one domain sees its whole history;
    # only the domain's own items are scored. Off: a tower sees its own domain's graph alone
    partner_items: bool = False
    # item bridges: a partner item bought by (nearly) the same users as an item of this domain
    # (Jaccard of their training users >= bridge_jaccard, >= 2 in common) is taken for the same
    # product, and a user's partner purchase of it becomes an edge to that item in this domain's
    # propagation graph (never a matching positive). Off: the catalogues are not linked
    bridges: bool = False
    bridge_jaccard: float = 0.5
    # matching (recommendation) loss
    matching_loss: MatchingLoss = MatchingLoss.SOFTMAX
    similarity: Similarity = Similarity.COSINE
    # 0.6 by validation on sport_cloth (0.1 / 0.3 / 0.6 / 1.0): sharper temperatures memorise
    # the sparse training graph and fall below popularity (docs/retrieval.md)
    temperature: float = 0.6        # similarity / temperature is the matching logit
    # add alpha * log(1 + training degree) of the item to its logit (alpha learnt): the mean
    # aggregator and cosine scoring both discard an item's popularity, which sampled-negative
    # protocols reward
    popularity_prior: bool = True
    num_negatives: int = 256        # uniform negatives per batch (softmax)
    # intra-domain CL: BCE between two edge-dropout views of the same node (label 1) and of a
    # shuffled node (label 0)
    lambda_intra: float = 0.1
    edge_dropout: float = 0.1
    intra_temperature: float = 0.5
    # inter-domain CL: aligned-user InfoNCE with curriculum negatives, and neighbour similarity
    lambda_inter: float = 0.1
    neighbour_weight: float = 0.5   # share of the neighbour-similarity term in the inter loss
    inter_temperature: float = 0.2
    inter_negatives: int = 32       # negatives per anchor user
    stop_gradient: StopGradient = StopGradient.PARTNER
    # Katz curriculum: S = sum_{k=1..katz_hops} beta^(2k) (R R^T)^k on the joint user-item graph
    pacing: Pacing = Pacing.LINEAR
    katz_beta: float = 0.1
    katz_hops: int = 2
    pool_size: int = 64             # difficulty-ordered negatives kept per anchor
    start_share: float = 0.25       # share of the pool (easiest first) available at epoch 0
    curriculum_epochs: int = 8      # epochs until the whole pool is available (of max_epochs)
    # optimisation
    batch_size: int = 8192          # a step costs a full-graph pass: few, large batches
    learning_rate: float = 1e-2
    weight_decay: float = 0.0
    lr_schedule: LRSchedule = LRSchedule.CONSTANT
    # L2 on the layer-0 embeddings a step uses (its users, positives and negatives), per row:
    # unlike weight decay it leaves the embeddings of items a batch never touches alone
    embedding_l2: float = 0.0
    # 20 by validation: at 12 every run was still rising; past ~20 it is flat (docs/retrieval.md)
    max_epochs: int = 20
    patience: int = 3               # validations without a better score before stopping
    valid_share: float = 0.25       # share of users who give one training item to validation
    # In a single-domain run whose training rows are in time order (MovieLens;
    # ``DomainSplit.train_pos``) with the GraphSAGE encoder: the matching loss's user side of a
    # positive is the user tower on the user's causal_window training items just before it,
    # the k-th newest weighing causal_recency ** k (as serving computes it from the latest
    # events), instead of the full-graph user vector, which averages the positive in; a user's
    # first item is then no positive. 0 (the dataclass default, so that a run.json written
    # before the option loads as trained): the full-graph vector. The GraphSAGE presets set 32
    # (CAUSAL_WINDOW).
    causal_window: int = 0
    causal_recency: float = 0.7

    def __post_init__(self) -> None:
        for name, kind in (("encoder", Encoder), ("sage_aggregation", Aggregation),
                           ("stop_gradient", StopGradient),
                           ("pacing", Pacing), ("matching_loss", MatchingLoss),
                           ("similarity", Similarity), ("lr_schedule", LRSchedule)):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, kind(value))
            except ValueError:
                choices = ", ".join(k.value for k in kind)
                raise ConfigError(f"{name} must be one of {choices}; got {value!r}") from None
        positive = ("dim", "num_layers", "num_negatives", "inter_negatives", "pool_size",
                    "batch_size", "max_epochs", "patience", "katz_hops", "curriculum_epochs")
        for name in positive:
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} must be >= 1; got {getattr(self, name)}")
        for name in ("temperature", "intra_temperature", "inter_temperature", "learning_rate",
                     "katz_beta"):
            if not float(getattr(self, name)) > 0:
                raise ConfigError(f"{name} must be > 0; got {getattr(self, name)}")
        for name in ("lambda_intra", "lambda_inter", "weight_decay", "embedding_l2"):
            if float(getattr(self, name)) < 0:
                raise ConfigError(f"{name} must be >= 0; got {getattr(self, name)}")
        for name in ("edge_dropout", "neighbour_weight", "start_share"):
            if not 0.0 <= float(getattr(self, name)) <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1]; got {getattr(self, name)}")
        if not 0.0 < float(self.valid_share) < 1.0:     # epochs are chosen on it: never empty
            raise ConfigError(f"valid_share must be in (0, 1); got {self.valid_share}")
        if self.causal_window < 0 or not 0.0 < self.causal_recency <= 1.0:
            raise ConfigError("causal_window must be >= 0 and causal_recency in (0, 1]; got "
                              f"{self.causal_window} and {self.causal_recency}")
        if self.sage_aggregation is not Aggregation.MEAN and self.encoder is not Encoder.SAGE:
            raise ConfigError("sage_aggregation applies to the GraphSAGE encoder only (LightGCN "
                              f"always propagates with D^-1/2 A D^-1/2); got "
                              f"{self.sage_aggregation.value!r} with {self.encoder.value!r}")
        if not 0.0 < self.bridge_jaccard <= 1.0:
            raise ConfigError(f"bridge_jaccard must be in (0, 1]; got {self.bridge_jaccard}")
        if self.edge_dropout >= 1.0:
            raise ConfigError("edge_dropout must be < 1 (a view needs edges)")
        if self.inter_negatives > self.pool_size:
            raise ConfigError(f"inter_negatives ({self.inter_negatives}) exceeds pool_size "
                              f"({self.pool_size})")

    @property
    def normalize(self) -> bool:
        return self.similarity is Similarity.COSINE

    @property
    def uses_inter(self) -> bool:
        return self.lambda_inter > 0

    @property
    def uses_intra(self) -> bool:
        return self.lambda_intra > 0

    def with_(self, **changes: Any) -> SCCDRConfig:
        return changed(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {k: (v.value if isinstance(v, Enum) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SCCDRConfig:
        return load(cls, data)


# The GraphSAGE presets' causal window (SCCDRConfig.causal_window; time-ordered single-domain
# runs only, so the cross-domain pairs train as before): on ML-1M's clean validation the served
# stage's recall@200 went 0.561 -> 0.596 in two seeds (docs/retrieval.md, "Causal matching").
CAUSAL_WINDOW = 32

PRESETS: dict[str, SCCDRConfig] = {
    # no item bridges (``bridges``): with the held-out pairs kept out of them they move the
    # validation score by -0.0011 to +0.0007 on sport_cloth (docs/retrieval.md, "Bridges
    # without the held-out twins"); their earlier gain was the held-out pair itself
    "sccdr": SCCDRConfig(causal_window=CAUSAL_WINDOW),
    "mixed": SCCDRConfig(stop_gradient=StopGradient.NONE, pacing=Pacing.NONE,
                         causal_window=CAUSAL_WINDOW),
    "single": SCCDRConfig(lambda_intra=0.0, lambda_inter=0.0, pacing=Pacing.NONE,
                          causal_window=CAUSAL_WINDOW),
    "lightgcn": SCCDRConfig(encoder=Encoder.LIGHTGCN, lambda_intra=0.0, lambda_inter=0.0,
                            pacing=Pacing.NONE, num_layers=3),
}


def preset(name: str) -> SCCDRConfig:
    """The named variant's config (see the module doc); unknown names raise ``ConfigError``."""
    if name not in PRESETS:
        raise ConfigError(f"unknown retrieval preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]
