"""The serving path on CUDA: exact against the CPU result in float32, close in bfloat16."""

from __future__ import annotations

import pytest
import torch

from tests.model.helpers import assert_close, make_model, random_history

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
    assert_close(cached, cpu.rank(cands, prefix_items=items, prefix_timestamps=ts), 1e-3, 1e-3)


def test_cuda_bfloat16_cached_equals_full() -> None:
    gpu = make_model(12).to(device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(12)
    items, ts = random_history(gen, 2000, 500, timed=True)
    cands = torch.randint(1, 501, (256,), generator=gen)
    kv = gpu.prefill(items, ts)
    assert kv.dtype == torch.bfloat16
    cached = gpu.rank(cands, prefix=kv).float().cpu()
    full = gpu.rank(cands, prefix_items=items, prefix_timestamps=ts).float().cpu()
    assert_close(cached, full, atol=5e-2, rtol=5e-2)
