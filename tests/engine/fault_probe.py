"""Run by test_hostmem in a fresh process: page faults of timed ranking passes on a worker thread.

Prints one integer. ``python fault_probe.py tuned|default``."""

from __future__ import annotations

import resource
import sys
import threading

import torch

from relaygr.engine.hostmem import tune_host_allocator
from relaygr.model import HSTU, HSTUConfig


def main(tuned: bool) -> int:
    if tuned:
        tune_host_allocator()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = HSTU(HSTUConfig(num_items=1000, max_seq_len=1024, dim=32, num_layers=1,
                            num_heads=1)).eval()
    items, candidates = torch.randint(1, 1000, (512,)), torch.randint(1, 1000, (256,))
    times = 10**9 + 60 * torch.arange(512)
    faults: list[int] = []

    def serve() -> None:  # an instance's worker thread, as in relaygr.engine.executor
        with torch.inference_mode():
            kv = model.prefill(items, times)
            model.rank(candidates, prefix=kv)
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(5):
                model.rank(candidates, prefix=model.prefill(items, times))
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    worker = threading.Thread(target=serve)
    worker.start()
    worker.join()
    return faults[0]


if __name__ == "__main__":
    print(main(sys.argv[1] == "tuned"))
