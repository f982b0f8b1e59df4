"""One HSTU layer (Zhai et al., ICML 2024, eq. 1-3), split so the serving path can drive it.

    U, V, Q, K = Split(φ1(f1(Norm(X))))            pointwise projection, φ1 = SiLU
    A(X)V(X)   = φ2(Q Kᵀ + rab^{p,t}) V / n         SiLU attention, constant normaliser n
    Y          = X + f2(Norm(A(X)V(X)) ⊙ U)         gated output, residual

The layer owns its weights and its relative bias tables (position and time bucket, shared across
heads); it does not own keys or values, which the caller passes in and keeps.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relaygr.model.config import HSTUConfig

# The part of a layer that depends on which keys each token sees: ``(Q, K, V)`` of the layer's
# tokens, each ``[..., d]``, to their attention output ``[..., d]``. Training supplies dense
# masked attention over padded batches (``HSTU._dense_forward``), serving blocked attention over a
# cached prefix's segments (``Pass._attend``, which also keeps the keys and values it is given).
Attend = Callable[[Tensor, Tensor, Tensor], Tensor]


# The LayerNorm epsilon of the "reference" layer style: the open-source HSTU's default.
_REFERENCE_NORM_EPS = 1e-6
# The std of the reference's uvqk projection and relative bias tables at initialisation.
_REFERENCE_INIT_STD = 0.02


def _layer_norm(cfg: HSTUConfig) -> nn.LayerNorm:
    """A Norm of the layer: affine under ``layer_style="ours"``; under ``"reference"`` a plain
    standardisation (no weight, no bias, eps 1e-6), as the open-source HSTU normalises."""
    if cfg.reference_layers:
        return nn.LayerNorm(cfg.dim, eps=_REFERENCE_NORM_EPS, elementwise_affine=False)
    return nn.LayerNorm(cfg.dim)


class HSTULayer(nn.Module):
    def __init__(self, cfg: HSTUConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.dim
        self.norm_in = _layer_norm(cfg)
        self.f1 = nn.Linear(d, 4 * d, bias=not cfg.reference_layers)   # → U, V, Q, K
        self.norm_attn = _layer_norm(cfg)
        self.f2 = nn.Linear(d, d)
        self.dropout = nn.Dropout(cfg.dropout)
        # rab^p: one weight per causal distance 0..max_seq_len; rab^t: one per time bucket.
        self.pos_w = nn.Parameter(torch.zeros(cfg.max_seq_len + 1))
        self.time_w = nn.Parameter(torch.zeros(cfg.num_time_buckets))

    def init_weights(self) -> None:
        """Initialise the projections and bias tables as ``cfg.layer_style`` says (config.py).

        "reference" keeps the open-source HSTU's scale: its residual branch starts small beside
        the token it adds to, where xavier-uniform f1 (std ~4.5x larger) lets it dominate.
        """
        if not self.cfg.reference_layers:
            nn.init.xavier_uniform_(self.f1.weight)
            nn.init.xavier_uniform_(self.f2.weight)
            assert self.f1.bias is not None
            nn.init.zeros_(self.f1.bias)
            nn.init.zeros_(self.f2.bias)
            return
        nn.init.normal_(self.f1.weight, std=_REFERENCE_INIT_STD)
        nn.init.xavier_uniform_(self.f2.weight)
        bound = 1.0 / math.sqrt(self.cfg.dim)             # nn.Linear's default bias, fan_in d
        nn.init.uniform_(self.f2.bias, -bound, bound)
        nn.init.normal_(self.pos_w, std=_REFERENCE_INIT_STD)
        nn.init.normal_(self.time_w, std=_REFERENCE_INIT_STD)

    def forward(self, x: Tensor, attend: Attend) -> Tensor:
        """``Y = X + f2(Norm(attend(Q, K, V)) * U)`` for tokens ``x [..., d]``: the layer of the
        module docstring around the attention the caller supplies (``Attend``)."""
        u, v, q, k = self.project(x)
        return self.finish(x, attend(q, k, v), u)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``x [..., d]`` → U, V, Q, K, each ``[..., d]``."""
        uvqk = F.silu(self.f1(self.norm_in(x)))
        u, v, q, k = uvqk.split(self.cfg.dim, dim=-1)
        return u, v, q, k

    def finish(self, x: Tensor, attn: Tensor, u: Tensor) -> Tensor:
        """Residual output from the attention result ``attn [..., d]`` gated by ``u``."""
        return x + self.f2(self.dropout(self.norm_attn(attn) * u))

    def position_bias(self, distance: Tensor) -> Tensor:
        """rab^p at each causal ``distance`` (any shape of int32 or int64 in 0..max_seq_len)."""
        return table_lookup(self.pos_w, distance)

    def time_bias(self, buckets: Tensor) -> Tensor:
        """rab^t at each time bucket (any shape of int32 or int64 in 0..num_time_buckets-1)."""
        return table_lookup(self.time_w, buckets)

    def self_bias(self, with_time: bool) -> Tensor:
        """Bias of a token attending to itself (distance 0, time gap 0)."""
        return self.pos_w[0] + self.time_w[0] if with_time else self.pos_w[0]


def table_lookup(table: Tensor, index: Tensor) -> Tensor:
    """``table[index]`` for a 1-D bias table (int32 or int64 ``index`` of any shape).

    A ``[B, T, T]`` distance matrix indexes a table of ``T + 1`` weights, so each weight repeats
    thousands of times. The backward of advanced indexing accumulates repeated indices one by
    one on CUDA (139 ms per call for a 128 x 200-token batch on an H100: 98% of a `paper`
    preset training step); ``index_select``'s backward is an atomic index-add, the pattern of
    gather's scatter-add, with which the same step measured 1-2 s an epoch instead of 13. On CPU,
    one thread, that batch: forward+backward 12-19 ms against 150 ms for advanced indexing and
    270 ms for ``F.embedding``; a serving lookup (256 x 4,096 buckets) 0.8-1.6 ms against 4-6 ms
    for gather. The forward values are the same elements, bit for bit.
    """
    return torch.index_select(table, 0, index.reshape(-1)).view(index.shape)
