"""PrefixKV is a self-describing value that can move between devices."""

from __future__ import annotations

import pytest
import torch

from relaygr.model import PrefixKV
from tests.model.helpers import assert_close, make_model


def test_prefix_kv_describes_itself() -> None:
    model = make_model(1)
    kv = model.prefill(list(range(1, 51)), timestamps=list(range(100, 150)))
    assert kv.num_tokens == 50 and kv.num_layers == 2 and kv.has_timestamps
    assert kv.k.shape == (2, 4, 50, 8)
    per_token = PrefixKV.bytes_per_token(2, 32, torch.float32, with_timestamps=True)
    assert per_token == 2 * 2 * 32 * 4 + 8
    assert kv.nbytes == 50 * per_token + 32 * 4
    assert kv.device == torch.device("cpu") and kv.dtype == torch.float32
    assert kv.to("cpu") is kv


def test_strided_views_are_accepted() -> None:
    """The cache may hand the model views into a larger arena; results are unchanged."""
    model = make_model(4)
    items = torch.randint(1, 501, (77,), generator=torch.Generator().manual_seed(4))
    kv = model.prefill(items)
    arena_k = torch.zeros(2, 4, 200, 8)
    arena_v = torch.zeros(2, 4, 200, 8)
    arena_k[:, :, 50:127] = kv.k
    arena_v[:, :, 50:127] = kv.v
    view = PrefixKV(arena_k[:, :, 50:127], arena_v[:, :, 50:127], None, kv.last_hidden)
    cands = torch.arange(1, 30)
    assert_close(model.rank(cands, prefix=view), model.rank(cands, prefix=kv))


@pytest.mark.gpu
def test_moves_to_cuda_and_back() -> None:
    model = make_model(1)
    kv = model.prefill([1, 2, 3], timestamps=[1, 2, 3])
    on_gpu = kv.to("cuda")
    assert on_gpu.device.type == "cuda" and on_gpu.num_tokens == 3
    back = on_gpu.to("cpu")
    assert back.timestamps is not None and kv.timestamps is not None
    assert torch.equal(back.k, kv.k) and torch.equal(back.timestamps, kv.timestamps)
    pinned = kv.pin_memory()
    assert pinned.k.is_pinned()
