"""relaygr: relay-race inference for long-sequence generative recommendation ranking.

The user's long behaviour prefix is pre-inferred while the earlier cascade stages run, its
per-layer K/V stays resident on the ranking device, and the ranking pass computes only the short
suffix and the candidates against it. See docs/architecture.md for the map of the package.
"""

import os

__version__ = "0.1.0"

# OpenMP threads that stop spinning soon. libgomp (PyTorch's and FAISS's CPU thread pools) by
# default keeps a thread that finished its share of a parallel operation spinning for the next one
# (GOMP_SPINCOUNT, 300,000 iterations); where another process keeps a core busy (the serving
# parent, an instance beside it, Redis, a neighbour), the spinner holds the core a late thread or
# a woken process needs, and every operation waits about a scheduler slice. 1,000 iterations (what
# libgomp itself uses when it has more threads than cores) loses the collapse on both CPU kinds
# measured, at a cost on some quiet ones (docs/runs/2026-11-27-openmp-spinning.md,
# docs/runs/2026-11-29-openmp-spin-busy-neighbour-on-intel.md). Set here, before
# anything imports torch, so that every relaygr process and the instance processes it spawns
# inherit it; a wait policy or spin count the user set is kept, and a process that imported
# torch before relaygr keeps what it had.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")
