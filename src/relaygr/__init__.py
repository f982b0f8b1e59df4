"""relaygr: relay-race inference for long-sequence generative recommendation ranking.

The user's long behaviour prefix is pre-inferred while the earlier cascade stages run, its
per-layer K/V stays resident on the ranking device, and the ranking pass computes only the short
suffix and the candidates against it. See docs/architecture.md for the map of the package.
"""

__version__ = "0.1.0"
