"""Default cache budgets follow from the model's bytes per token and the users' lengths."""

from __future__ import annotations

import torch

from relaygr.kvcache import KVLayout
from relaygr.kvcache.sizing import (
    DEVICE_RESIDENT_USERS,
    HOST_TO_DEVICE,
    MEMORY_FRACTION,
    available_host_bytes,
    size_budgets,
)

LAYOUT = KVLayout(num_layers=2, num_heads=1, head_dim=50, dtype=torch.float32)
GIB = 1 << 30


def test_budgets_are_resident_prefixes_of_the_users_mean_length() -> None:
    # 100 users of 1..100 events: a resident prefix is expected to be 50.5 tokens
    budgets = size_budgets(LAYOUT, list(range(1, 101)), max_seq_len=200, page_tokens=16,
                           num_instances=2, available_bytes=64 * GIB)
    # K and V of 2 layers x 50 float32s (800 B), an int64 timestamp, 1/16 of a hidden slot
    per_token = LAYOUT.page_bytes(16) / 16
    assert per_token == 800 + 8 + 50 * 4 / 16
    assert budgets.mean_tokens == 50.5 and budgets.token_bytes == 821
    assert budgets.device_bytes == int(DEVICE_RESIDENT_USERS * 50.5 * per_token)
    assert budgets.host_bytes == HOST_TO_DEVICE * budgets.device_bytes
    assert not budgets.capped
    assert budgets.describe() == (
        "cache per instance: device 10 MiB, host 40 MiB (256 prefixes of 50 tokens (the users' "
        "mean) x 821 B on the device, 4x that on the host)")


def test_a_history_longer_than_the_model_reads_counts_as_max_seq_len() -> None:
    budgets = size_budgets(LAYOUT, [50, 150, 1000], max_seq_len=200, page_tokens=16,
                           num_instances=1, available_bytes=64 * GIB)
    assert budgets.mean_tokens == (50 + 150 + 200) / 3
    unknown = size_budgets(LAYOUT, [], max_seq_len=200, page_tokens=16, num_instances=1,
                           available_bytes=64 * GIB)
    assert unknown.mean_tokens == 200


def test_budgets_fit_the_memory_and_always_hold_a_longest_request() -> None:
    small = size_budgets(LAYOUT, [4000] * 10, max_seq_len=4096, page_tokens=16,
                         num_instances=4, available_bytes=GIB)
    assert small.capped
    assert 4 * (small.device_bytes + small.host_bytes) <= MEMORY_FRACTION * GIB * 1.001
    floor = size_budgets(LAYOUT, [10], max_seq_len=4096, page_tokens=16, num_instances=1,
                         available_bytes=0)
    assert floor.device_bytes == 2 * (4096 // 16) * LAYOUT.page_bytes(16)   # two full prefixes
    assert available_host_bytes() > 0
