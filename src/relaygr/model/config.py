"""HSTU hyper-parameters: a frozen dataclass validated at construction, and named sizes."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from relaygr.errors import ConfigError
from relaygr.settings import changed, load, require_positive_ints

RETRIEVAL_SIMILARITIES = ("dot", "cosine")
RANK_SCORES = ("state", "retrieval_residual")
ATTENTION_KERNELS = ("fused", "eager")
LAYER_STYLES = ("ours", "reference")
TIME_QUERIES = ("own", "next")
# The fields that take one of a few named values, and those values.
_CHOICES = {"attention": ATTENTION_KERNELS, "retrieval_similarity": RETRIEVAL_SIMILARITIES,
            "rank_score": RANK_SCORES, "layer_style": LAYER_STYLES, "time_query": TIME_QUERIES}
# Time buckets a model may have: bucket b starts at a gap of ceil(1.5^b - 1) seconds, and the
# last start must stay within 2^61 (model.inputs.MAX_ABS_TIMESTAMP: gaps and timestamps less a
# start then fit int64).
MAX_TIME_BUCKETS = 105


@dataclass(frozen=True)
class HSTUConfig:
    """Shape of an HSTU ranking model.

    Item ids run from 1 to ``num_items``; id 0 is reserved (padding) and never valid as input.
    ``max_seq_len`` bounds the history (prefix + suffix) one ranking request may carry.
    """

    num_items: int
    dim: int = 128
    num_layers: int = 4
    num_heads: int = 4
    max_seq_len: int = 8192
    # Time buckets are log-spaced in seconds (base 1.5: one bucket spans ~1 s at the short end
    # and covers ~30 years by bucket 63), so 64 buckets span every realistic gap.
    num_time_buckets: int = 64
    # The attention normaliser n of SiLU(QKᵀ + rab)·V / n. It is a constant of the model so a
    # token's output never depends on how much padding or how many other tokens share a batch.
    # None means max_seq_len (the paper's choice of the padded length, made constant).
    attention_normalizer: float | None = None
    dropout: float = 0.0
    # A LayerNorm on the last layer's output (before both heads). The open-source HSTU has none
    # (its retrieval head L2-normalises the output instead).
    final_norm: bool = True
    # Most tokens per query block in the history pass (large enough to keep matmuls efficient).
    query_block: int = 256
    # Most scores (heads x block x keys) of a history chunk in a resumable prefill
    # (HSTU.prefill_job): the unit of pre-infer work the instance scheduler interleaves with
    # ranking, so chunks shrink at long prefixes and a ranking request waits behind at most one
    # bounded chunk. Where the attention kernel does not tile keys (eager on a GPU), every block
    # and candidate micro-batch also keeps its score matrix within this bound (4 MB in float32).
    score_block_elems: int = 1 << 20
    # Most candidates per micro-batch in the candidate pass (fewer at long prefixes only where
    # the kernel does not tile keys, see score_block_elems).
    candidate_block: int = 512
    # How the serving passes compute attention (model/fused.py): "eager", the reference, or
    # "fused", which tiles the keys and does each tile's bias, SiLU and mask in one compiled pass
    # between its two matmuls (on CPU, where torch.compile works; elsewhere it runs eager and says
    # so). "eager" is the default: on the 2-core CPU measured, "fused" made the cached ranking
    # pass 1.08-1.29x faster without timestamps (0.91x with) and prefill and full no faster, for
    # a compilation of 10-30 s per process (docs/runs/2026-11-27-fused-attention.md).
    attention: str = "eager"
    # Scores per key tile on a CPU, eager or fused (heads x queries x keys): 512 Ki float32 =
    # 2 MiB, which two threads split by heads into one 1 MiB L2 each on the machine measured;
    # fused, 128 Ki measured slower (more tiles, each a compiled call) and 2 Mi no faster
    # (docs/runs/2026-11-27-fused-attention.md); eager, 128 Ki to 1 Mi within 10 %.
    attention_tile_elems: int = 1 << 19
    # Retrieval head: "dot" scores the raw inner product of user representation and item
    # embedding; "cosine" L2-normalises both first (the open-source HSTU recipe). Either is
    # divided by retrieval_temperature (the HSTU ML-1M recipe uses cosine / 0.05; 1.0 = no-op).
    retrieval_similarity: str = "dot"
    retrieval_temperature: float = 1.0
    # What the ranking head scores a candidate token with. "state": an MLP on its final state
    # alone. "retrieval_residual": the retrieval head's logit of the candidate (the last
    # history state's query against the item vector, as ``retrieval_scores``) plus that MLP as
    # a learned correction, so the ranker starts from retrieval's order and learns where to
    # depart from it. "state" is the default because every checkpoint saved before this field
    # existed was trained so (its config has no such key and must load as what it was).
    rank_score: str = "state"
    # How each HSTU layer is parameterised and initialised (HSTULayer, HSTU._init_weights).
    # "ours": f1 with a bias, both LayerNorms affine (eps 1e-5), f1 and f2 xavier-uniform with
    # zero biases, the position embedding N(0, 0.02), the relative bias tables zero.
    # "reference": as Meta's open-source HSTU initialises its layers: f1 without a bias,
    # N(0, 0.02); both LayerNorms without affine parameters, eps 1e-6; the position embedding
    # xavier-normal; the relative bias tables N(0, 0.02); f2's bias PyTorch's default
    # U(+-1/sqrt(dim)). "ours" is the default: every checkpoint saved before this field existed
    # was trained so, and a "reference" state dict lacks the biases and norm weights it holds.
    layer_style: str = "ours"
    # Whose time a query's time bias measures gaps from. "own": the query token's own timestamp
    # (a token attending to itself is at gap 0). "next": the timestamp of the item the position
    # predicts (the next event's; at the last position the request's), as the open-source HSTU
    # does: the model then knows how long after each history event the prediction is made.
    # Under "next" a cached prefix depends on the time after it (PrefixKV.next_timestamp): the
    # model's passes compute it so, and the relay holds each timed prefix's newest event back
    # for the ranking pass (cascade.window). "own" is the default: every checkpoint saved
    # before this field existed was trained so.
    time_query: str = "own"

    def __post_init__(self) -> None:
        require_positive_ints(self, "num_items", "dim", "num_layers", "num_heads", "max_seq_len",
                              "num_time_buckets", "query_block", "score_block_elems",
                              "candidate_block", "attention_tile_elems")
        if self.num_time_buckets > MAX_TIME_BUCKETS:
            raise ConfigError(f"HSTUConfig.num_time_buckets must be at most {MAX_TIME_BUCKETS} "
                              f"(the last starts at a gap of 1.5^{MAX_TIME_BUCKETS - 1} s, about "
                              f"2^61: int64 seconds), got {self.num_time_buckets}")
        if self.dim % self.num_heads:
            raise ConfigError(
                f"HSTUConfig.dim ({self.dim}) must be divisible by num_heads ({self.num_heads})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"HSTUConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.final_norm, bool):
            raise ConfigError(f"HSTUConfig.final_norm must be a bool, got {self.final_norm!r}")
        if self.attention_normalizer is not None and not self.attention_normalizer > 0:
            raise ConfigError("HSTUConfig.attention_normalizer must be > 0 when given")
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ConfigError(f"HSTUConfig.{name} must be one of {choices}, got "
                                  f"{getattr(self, name)!r}")
        if not self.retrieval_temperature > 0:
            raise ConfigError("HSTUConfig.retrieval_temperature must be > 0, got "
                              f"{self.retrieval_temperature!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def cosine_retrieval(self) -> bool:
        return self.retrieval_similarity == "cosine"

    @property
    def rank_adds_retrieval(self) -> bool:
        return self.rank_score == "retrieval_residual"

    @property
    def reference_layers(self) -> bool:
        return self.layer_style == "reference"

    @property
    def next_time_query(self) -> bool:
        return self.time_query == "next"

    @property
    def normalizer(self) -> float:
        """The constant n dividing the attention output."""
        if self.attention_normalizer is not None:
            return float(self.attention_normalizer)
        return float(self.max_seq_len)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HSTUConfig:
        return load(cls, data)

    def with_(self, **changes: Any) -> HSTUConfig:
        return changed(self, **changes)


# Named sizes. "small" is the size of the reference point in the foundation issue (Meta's STU
# stack measured on our 2-core machine); "dlrmv3" follows the MLPerf Inference DLRMv3 HSTU.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"dim": 32, "num_layers": 2, "num_heads": 2},
    "small": {"dim": 128, "num_layers": 4, "num_heads": 4},
    "medium": {"dim": 256, "num_layers": 4, "num_heads": 4},
    "dlrmv3": {"dim": 512, "num_layers": 5, "num_heads": 4},
}


def config_for_size(size: str, num_items: int, max_seq_len: int = 8192,
                    **overrides: Any) -> HSTUConfig:
    """The config of a named size (see ``MODEL_SIZES``) over a catalogue of ``num_items``."""
    if size not in MODEL_SIZES:
        raise ConfigError(f"unknown model size {size!r}; choose one of {sorted(MODEL_SIZES)}")
    shape: dict[str, Any] = dict(MODEL_SIZES[size])
    return HSTUConfig(num_items=num_items, max_seq_len=max_seq_len, **shape, **overrides)
