"""Non-negative linear least squares for latency models, with the fit's error attached.

A latency model is ``latency_ms = coef · features`` with every coefficient >= 0: each feature
counts work (tokens, attention pairs, candidates), so a negative coefficient would mean "more
work is faster" and would break the model's monotonicity. The fit minimises *relative* error
(each row is divided by its measured latency) because the trigger compares predictions across
two orders of magnitude of latency.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Any

import numpy as np

from relaygr.errors import ConfigError


def nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``argmin ||a x - b||`` subject to ``x >= 0``, exactly, for a handful of columns.

    The optimum's non-zero coefficients are the unconstrained least-squares solution on their
    own columns, so the best feasible solution over every column subset is the optimum. With
    at most ~8 features that is at most 255 tiny ``lstsq`` calls (no iterative solver to tune).
    """
    rows, cols = a.shape
    assert b.shape == (rows,), f"b has shape {b.shape}, expected ({rows},)"
    assert cols <= 10, "subset enumeration is only for small feature counts"
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    scaled = a / scale                                  # unit columns: well-conditioned lstsq
    best, best_cost = np.zeros(cols), float(b @ b)
    for size in range(1, cols + 1):
        for subset in combinations(range(cols), size):
            idx = list(subset)
            x_sub = np.linalg.lstsq(scaled[:, idx], b, rcond=None)[0]
            if np.any(x_sub < 0):
                continue
            cost = float(np.sum((scaled[:, idx] @ x_sub - b) ** 2))
            if cost < best_cost - 1e-12 * max(best_cost, 1.0):
                best = np.zeros(cols)
                best[idx] = x_sub
                best_cost = cost
    return best / scale


@dataclass(frozen=True)
class LinearFit:
    """``latency_ms = sum(coef_ms[i] * features[i])`` with non-negative coefficients.

    ``rmse_ms`` and ``max_rel_error`` describe the fit on the points it was fitted to
    (``num_points`` of them); ``max_rel_error`` is ``max |predicted - measured| / measured``.
    """

    feature_names: tuple[str, ...]
    coef_ms: tuple[float, ...]
    rmse_ms: float
    max_rel_error: float
    num_points: int

    def __post_init__(self) -> None:
        if len(self.feature_names) != len(self.coef_ms):
            raise ConfigError(f"{len(self.feature_names)} features but {len(self.coef_ms)} "
                              "coefficients")
        if any(not np.isfinite(c) or c < 0 for c in self.coef_ms):
            raise ConfigError(f"latency coefficients must be finite and >= 0, got {self.coef_ms}")

    def predict_ms(self, features: np.ndarray) -> np.ndarray:
        """``[..., F]`` feature rows → ``[...]`` predicted milliseconds."""
        return np.asarray(features, dtype=np.float64) @ np.asarray(self.coef_ms)

    @classmethod
    def fit(cls, feature_names: tuple[str, ...], features: np.ndarray,
            latency_ms: np.ndarray) -> LinearFit:
        """Fit ``latency_ms`` (``[P]``, all > 0) on ``features`` (``[P, F]``)."""
        x = np.asarray(features, dtype=np.float64)
        y = np.asarray(latency_ms, dtype=np.float64)
        if x.ndim != 2 or x.shape != (y.shape[0], len(feature_names)):
            raise ConfigError(f"features {x.shape} do not match {len(feature_names)} names and "
                              f"{y.shape[0]} latencies")
        if y.shape[0] == 0 or not np.all(np.isfinite(y)) or np.any(y <= 0):
            raise ConfigError("latency samples must be a non-empty set of finite values > 0")
        coef = nonnegative_lstsq(x / y[:, None], np.ones_like(y))
        pred = x @ coef
        rmse = float(np.sqrt(np.mean((pred - y) ** 2)))
        rel = float(np.max(np.abs(pred - y) / y))
        return cls(tuple(feature_names), tuple(float(c) for c in coef), rmse, rel, int(y.shape[0]))

    def to_dict(self) -> dict[str, Any]:
        return {"feature_names": list(self.feature_names), "coef_ms": list(self.coef_ms),
                "rmse_ms": self.rmse_ms, "max_rel_error": self.max_rel_error,
                "num_points": self.num_points}
