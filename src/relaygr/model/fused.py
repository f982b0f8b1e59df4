"""The serving attention with its element-wise work fused: ``AttentionKernel`` and its two forms.

``EagerAttention`` is ``attention.block_attention`` / ``candidate_attention``: the reference, and
what runs where compilation is unavailable; on a CPU it already splits keys into tiles, with eager
ops per tile (the bias written into the score tile, then SiLU in place: two element-wise passes).
``FusedAttention`` computes the same function over the same tiles: for each tile ``S = Q Kᵀ`` (a
matmul), then one compiled pass adds
the bias (the position bias read from the Toeplitz view, ``MASKED`` on future keys; for candidates
the bias row, time bias included), applies SiLU and writes the tile back, which the second matmul
``S V`` reads while it is still in cache. No full score matrix, bias matrix or copy of either is
made: a tile holds about ``tile_elems`` scores whatever the prefix length, so query blocks and
candidate micro-batches need not shrink at long prefixes. History blocks with a time bias (a
gather per tile) run eagerly: fused, that gather measured slower than the eager passes.

The compiled part is ``torch.compile`` (inductor's CPU backend) of one small function with
dynamic shapes, so one graph serves every block and tile size (and a handful of graphs every input
layout the passes make). It is compiled on the kernel's first use on a CPU (a probe call on small
shapes); ``HSTU.warm_up`` then runs each kind of pass once so that the graphs exist before the
first request (10-30 s cold, less with inductor's on-disk cache). Where compilation fails (no C++
toolchain, an unsupported platform) or the tensors are on CUDA, the kernel runs ``EagerAttention``
instead, logs why once, and says so in ``describe``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from relaygr.model.attention import block_attention, candidate_attention, tile_width

log = logging.getLogger("relaygr.model.fused")


@dataclass(frozen=True)
class TimeBias:
    """rab^t of a query block: ``table[buckets]``, ``table`` the layer's ``[num_buckets]``
    weights and ``buckets`` ``[n, e]`` int32 (rows in the block's query order)."""

    table: Tensor
    buckets: Tensor


class AttentionKernel(Protocol):
    """How a pass computes one block's attention (``Pass._attend`` calls it per track)."""

    def history(self, q_rev: Tensor, segments: list[tuple[Tensor, Tensor]], position_bias: Tensor,
                time_bias: TimeBias | None, normalizer: float) -> Tensor:
        """``block_attention`` with its bias split: ``position_bias`` ``[n, e]`` (the Toeplitz
        view, ``MASKED`` on future keys) plus ``time_bias`` when given."""
        ...

    def candidates(self, q: Tensor, k_self: Tensor, v_self: Tensor,
                   segments: list[tuple[Tensor, Tensor]], bias: Tensor, self_bias: Tensor,
                   normalizer: float) -> Tensor:
        """``candidate_attention``, same arguments and result."""
        ...

    def describe(self, device: torch.device) -> str:
        """What runs on ``device``: the kernel's name, and why it fell back if it did."""
        ...

    def score_budget(self, configured: int, device: torch.device) -> int:
        """Most scores a pass's query block or candidate micro-batch may span on ``device``,
        given the configured ``score_block_elems``."""
        ...


class EagerAttention:
    """The reference kernel: per key tile (``attention.key_tiles``) one matmul with the bias,
    one SiLU pass and one matmul, in eager ops.

    On a CPU keys go in tiles of about ``tile_elems`` scores, so blocks need no bound of their
    own (``score_budget``); elsewhere (a GPU, whose kernels want few large operations, or
    ``tile_elems=None``) each key segment is one tile and blocks keep the configured bound.
    """

    def __init__(self, tile_elems: int | None = None) -> None:
        if tile_elems is not None and tile_elems <= 0:
            raise ValueError(f"tile_elems must be positive, got {tile_elems}")
        self.tile_elems = tile_elems

    def history(self, q_rev: Tensor, segments: list[tuple[Tensor, Tensor]], position_bias: Tensor,
                time_bias: TimeBias | None, normalizer: float) -> Tensor:
        time = None if time_bias is None else (time_bias.table, time_bias.buckets)
        width = self._width(q_rev.device, q_rev.shape[0] * q_rev.shape[1])
        return block_attention(q_rev, segments, position_bias, normalizer, width, time)

    def candidates(self, q: Tensor, k_self: Tensor, v_self: Tensor,
                   segments: list[tuple[Tensor, Tensor]], bias: Tensor, self_bias: Tensor,
                   normalizer: float) -> Tensor:
        width = self._width(q.device, q.shape[0] * q.shape[1])
        return candidate_attention(q, k_self, v_self, segments, bias, self_bias, normalizer,
                                   width)

    def describe(self, device: torch.device) -> str:
        return "eager"

    def score_budget(self, configured: int, device: torch.device) -> int:
        """Tiles keep the scores in cache where they run; elsewhere the configured bound."""
        return _UNBOUNDED if self._tiles(device) else configured

    def _tiles(self, device: torch.device) -> bool:
        return self.tile_elems is not None and device.type == "cpu"

    def _width(self, device: torch.device, rows: int) -> int | None:
        if not self._tiles(device):
            return None
        assert self.tile_elems is not None
        return tile_width(self.tile_elems, rows)


def _columns(bias: Tensor, start: int, m: int) -> Tensor:
    # Columns start .. start + m of a bias view whose strides are (1, 1) or (0, 1): made
    # contiguous, a copy the compiled pass fuses away, so that no layout is inferred from those
    # strides (that inference compares sizes, and every comparison would fix the graph's sizes).
    return bias.narrow(1, start, m).contiguous()


def _tile(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, key_start: int, bias_start: int,
          m: int) -> Tensor:
    # q [H, n, dh]; keys key_start .. key_start + m of the segment k, v [H, e_seg, dh], whose
    # bias is columns bias_start .. bias_start + m of bias [n, e] → [H, n, dh]
    k, v = k.narrow(1, key_start, m), v.narrow(1, key_start, m)
    scores = torch.bmm(q, k.transpose(1, 2)) + _columns(bias, bias_start, m)
    return torch.bmm(F.silu(scores), v)


Tile = Callable[..., Tensor]


def _run_tiles(tile: Tile, out: Tensor, q: Tensor, segments: list[tuple[Tensor, Tensor]],
               bias: Tensor, width: int) -> None:
    """``out += `` the attention of ``q`` over every key of ``segments``, ``width`` keys a tile.

    The compiled ``tile`` always sees whole tensors (segments, the block's bias) and the tile's
    place in them as integers, so its inputs have the same layout on every call: a compiled
    graph assumes the layouts its first call showed. Where a dimension is 1 (a block's single
    query, a segment's last key) ``_tile`` runs eagerly: a graph would specialise on the 1, and
    such tiles cost nothing.
    """
    col = 0
    for k, v in segments:
        for start in range(0, k.shape[1], width):
            m = min(width, k.shape[1] - start)
            run = tile if q.shape[1] > 1 and m > 1 else _tile
            out += run(q, k, v, bias, start, col + start, m)
        col += k.shape[1]
    assert col == bias.shape[1], "segments must cover the bias columns"


class FusedAttention:
    """Key-tiled attention with one compiled element-wise pass per tile (module docstring).

    ``tile_elems`` bounds a tile's scores (heads x queries x keys): small enough that the tile
    stays in a core's L2 cache between the two matmuls and the pass between them.
    """

    def __init__(self, tile_elems: int) -> None:
        self._eager = EagerAttention(tile_elems)   # checks tile_elems
        self.tile_elems = tile_elems

    def ready(self, device: torch.device) -> bool:
        """Whether the fused form runs on ``device``; compiles it on the first CPU call."""
        return device.type == "cpu" and _COMPILED.tile() is not None

    def describe(self, device: torch.device) -> str:
        if device.type != "cpu":
            return f"eager (the fused kernel is CPU-only; {device.type} runs eager)"
        if self.ready(device):
            return "fused (torch.compile, inductor CPU)"
        return f"eager (fused unavailable: {_COMPILED.failure})"

    def score_budget(self, configured: int, device: torch.device) -> int:
        """Tiles bound the scores in memory on a CPU, fused or (a history block with a time bias,
        or where compilation failed) eager; elsewhere the eager kernel's configured bound."""
        return self._eager.score_budget(configured, device)

    # ---- the kernel ----------------------------------------------------------------------

    def history(self, q_rev: Tensor, segments: list[tuple[Tensor, Tensor]], position_bias: Tensor,
                time_bias: TimeBias | None, normalizer: float) -> Tensor:
        if time_bias is not None or not self.ready(q_rev.device):
            # A block's time bias is a [n, e] gather; the passes around it cost as much fused
            # as eager, and the prefill measured 10-20 % slower fused, so it stays eager.
            return self._eager.history(q_rev, segments, position_bias, time_bias, normalizer)
        tile = _COMPILED.require()
        q_rev = q_rev.contiguous()   # one layout for every call (q_rev is a flipped copy already)
        out = torch.zeros_like(q_rev)
        _run_tiles(tile, out, q_rev, segments, position_bias,
                   tile_width(self.tile_elems, q_rev.shape[0] * q_rev.shape[1]))
        return out.flip(1).div_(normalizer)

    def candidates(self, q: Tensor, k_self: Tensor, v_self: Tensor,
                   segments: list[tuple[Tensor, Tensor]], bias: Tensor, self_bias: Tensor,
                   normalizer: float) -> Tensor:
        if not self.ready(q.device):
            return self._eager.candidates(q, k_self, v_self, segments, bias, self_bias,
                                          normalizer)
        tile = _COMPILED.require()
        q = q.contiguous()           # [H, C, dh]: one layout for every call
        self_scores = (q * k_self).sum(-1, keepdim=True).add_(self_bias)
        out = F.silu(self_scores) * v_self                                    # [H, C, dh]
        # the bias row repeated over the candidates, a [C, e] view: a block's shape, no 1 in it
        rows = bias.as_strided((q.shape[1], bias.shape[0]), (0, 1))
        _run_tiles(tile, out, q, segments, rows,
                   tile_width(self.tile_elems, q.shape[0] * q.shape[1]))
        return out.div_(normalizer)


class _CompiledTiles:
    """The compiled tile function, shared by every ``FusedAttention`` of the process (so a
    model stays picklable and compiles once), or why they could not be compiled."""

    def __init__(self) -> None:
        self._tile: Tile | None = None
        self.failure: str | None = None

    def tile(self) -> Tile | None:
        if self._tile is None and self.failure is None:
            self._compile()
        return self._tile

    def require(self) -> Tile:
        tile = self.tile()
        assert tile is not None, "the fused kernel runs only where it compiled"
        return tile

    def _compile(self) -> None:
        tile = _with_graph_limits(torch.compile(_tile, dynamic=True))
        try:
            _probe(tile)
        except Exception as exc:  # any failure to compile or to agree means: run eager
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            self.failure = f"{type(exc).__name__}: {first_line}"
            log.warning("fused attention unavailable, running eager: %s", self.failure)
            return
        log.info("fused attention compiled")
        self._tile = tile


def _with_graph_limits(compiled: Tile) -> Tile:
    """``compiled`` called under the compile settings its graphs need (only while it runs).

    One graph serves all sizes, but a graph still assumes what its first call showed of the
    inputs' layouts: whether a key tile is contiguous (a whole segment) or a slice, whether a view
    starts at offset 0, whether a tensor was made in inference mode. The passes produce a dozen or
    so such combinations, more than dynamo's default of 8 graphs a function, past which it would
    run eager; and two sizes that happen to be equal must not be assumed equal from then on."""
    limits = torch._dynamo.config.patch(recompile_limit=_GRAPHS_PER_TILE)
    no_duck_sizes = torch.fx.experimental._config.patch(  # type: ignore[attr-defined]
        use_duck_shape=False)

    def call(*args: Tensor | int) -> Tensor:
        with limits, no_duck_sizes:
            return compiled(*args)

    return call


# Graphs one tile function may keep (see _with_graph_limits): room for every layout combination
# the passes make, with margin.
_GRAPHS_PER_TILE = 64
_COMPILED = _CompiledTiles()
# A score budget no block reaches: what the fused kernel tells a pass (its tiles bound scores).
_UNBOUNDED = 1 << 62


def _probe(tile: Tile) -> None:
    """Compile the tile function on small shapes and check it against eager: whether this
    machine can compile at all. (``HSTU.warm_up`` makes the graphs the passes need.)"""
    gen = torch.Generator().manual_seed(0)
    heads, n, m, dh = 3, 5, 37, 7
    q, k, v = (torch.randn(heads, rows, dh, generator=gen) for rows in (n, m, m))
    bias = torch.randn(n + m, generator=gen).as_strided((n, m), (1, 1), 1)
    with torch.inference_mode():
        got, want = tile(q, k, v, bias, 3, 3, 31), _tile(q, k, v, bias, 3, 3, 31)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise RuntimeError("compiled attention tile disagrees with eager")


def attention_kernel(name: str, tile_elems: int) -> AttentionKernel:
    """The kernel ``HSTUConfig.attention`` names (``config.ATTENTION_KERNELS``); ``tile_elems``
    bounds a fused tile's scores (``FusedAttention``)."""
    if name == "fused":
        return FusedAttention(tile_elems)
    assert name == "eager", f"unknown attention kernel {name!r}"
    return EagerAttention(tile_elems)
