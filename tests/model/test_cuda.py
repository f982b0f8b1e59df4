"""The serving path on CUDA: exact against the CPU result in float32, close in bfloat16."""

from __future__ import annotations

import pytest
import torch

from tests.model.helpers import assert_close, make_model, random_history
from tests.tolerance import stored_rounding_tolerance

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("timed", [False, True])
def test_cuda_float32_cached_equals_full_and_cpu(timed: bool) -> None:
    cpu = make_model(11)
    gpu = make_model(11).to("cuda")
    gen = torch.Generator().manual_seed(11)
    items, ts = random_history(gen, 1500, 500, timed)
    cands = torch.randint(1, 501, (300,), generator=gen)
    kv = gpu.prefill(items, ts)
    assert kv.device.type == "cuda"
    cached = gpu.rank(cands, prefix=kv).cpu()
    full = gpu.rank(cands, prefix_items=items, prefix_timestamps=ts).cpu()
    assert_close(cached, full)
    # another device reorders every reduction, as another split does: the same bound
    assert_close(cached, cpu.rank(cands, prefix_items=items, prefix_timestamps=ts))


def test_cuda_bfloat16_cached_equals_full() -> None:
    gpu = make_model(12).to(device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(12)
    items, ts = random_history(gen, 2000, 500, timed=True)
    cands = torch.randint(1, 501, (256,), generator=gen)
    kv = gpu.prefill(items, ts)
    assert kv.dtype == torch.bfloat16
    cached = gpu.rank(cands, prefix=kv).float().cpu()
    full = gpu.rank(cands, prefix_items=items, prefix_timestamps=ts).float().cpu()
    # both paths accumulate in float32 and store bfloat16; they round differently where their
    # shapes differ: the attention output and the stored scores of each layer, and the head
    tol = stored_rounding_tolerance(roundings=2 * 2 + 1)
    assert_close(cached, full, atol=tol, rtol=tol)
