"""The latency cost model: predicted prefill, full-pass and cached ranking latency.

Each latency is a non-negative combination of work counts (``relay.fitting``):

- prefill of T new tokens after P cached ones: const, T, attention pairs T·P + T(T+1)/2;
- full ranking pass over a history of H = N + S tokens with C candidates: const, H, H(H+1)/2,
  C, and candidate-key pairs C·(H+1) (each candidate reads the history and itself);
- cached ranking (prefix N cached, suffix S computed): const, N (reading the cached K/V), S,
  suffix pairs S·N + S(S+1)/2, C, C·(N+S+1).

Non-negative coefficients on non-decreasing features make every prediction monotone in N, S and
C. When the points never vary the suffix (a ``relaygr profile`` JSON measures cached ranking at
S = 0), the suffix terms of the cached model are taken from the prefill fit: computing S suffix
tokens against a cached prefix is the same work as extending that prefill by S tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from relaygr.errors import ConfigError, InvalidInputError
from relaygr.model.config import HSTUConfig
from relaygr.relay.fitting import LinearFit
from relaygr.settings import load

PREFILL_FEATURES = ("const", "tokens", "attn_pairs")
FULL_FEATURES = ("const", "tokens", "attn_pairs", "candidates", "candidate_keys")
CACHED_FEATURES = ("const", "prefix_tokens", "suffix_tokens", "suffix_pairs", "candidates",
                   "candidate_keys")
FORMAT = "relaygr-latency-cost-model/1"


def prefill_features(new_tokens: np.ndarray, past_tokens: np.ndarray) -> np.ndarray:
    t, p = np.asarray(new_tokens, np.float64), np.asarray(past_tokens, np.float64)
    return np.stack([np.ones_like(t), t, t * p + t * (t + 1) / 2], axis=-1)


def full_features(prefix: np.ndarray, suffix: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    h = np.asarray(prefix, np.float64) + np.asarray(suffix, np.float64)
    c = np.asarray(candidates, np.float64)
    return np.stack([np.ones_like(h), h, h * (h + 1) / 2, c, c * (h + 1)], axis=-1)


def cached_features(prefix: np.ndarray, suffix: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    n, s = np.asarray(prefix, np.float64), np.asarray(suffix, np.float64)
    c = np.asarray(candidates, np.float64)
    return np.stack([np.ones_like(n), n, s, s * n + s * (s + 1) / 2, c, c * (n + s + 1)], axis=-1)


@dataclass(frozen=True)
class LatencySample:
    """One measured point: a prefill of ``prefix_tokens``, and both ranking passes with
    ``suffix_tokens`` recent events and ``candidates`` candidates on top of it."""

    prefix_tokens: int
    suffix_tokens: int
    candidates: int
    prefill_ms: float
    full_rank_ms: float
    cached_rank_ms: float


@dataclass(frozen=True)
class CostModelSource:
    """Where the coefficients came from: ``origin`` is ``"measured"`` (fitted at start-up) or
    ``"profile"`` (a ``relaygr profile`` JSON); ``model`` is the profiled model's config."""

    origin: str
    device: str
    dtype: str
    model: HSTUConfig | None


@dataclass(frozen=True)
class LatencyPrediction:
    """Predicted milliseconds of each path for one request shape."""

    prefill_ms: float
    full_rank_ms: float
    cached_rank_ms: float


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise InvalidInputError(f"{name} must be an int >= 0, got {value!r}")


@dataclass(frozen=True)
class LatencyCostModel:
    """Fitted latency predictions for one model on one device (immutable; share freely)."""

    prefill: LinearFit
    full: LinearFit
    cached: LinearFit
    source: CostModelSource

    def __post_init__(self) -> None:
        for name, features in (("prefill", PREFILL_FEATURES), ("full", FULL_FEATURES),
                               ("cached", CACHED_FEATURES)):
            found = getattr(self, name).feature_names
            if found != features:
                raise ConfigError(f"LatencyCostModel.{name} fits the features {found}, not "
                                  f"this model's {features}")

    def prefill_ms(self, new_tokens: int, past_tokens: int = 0) -> float:
        """Pre-infer ``new_tokens`` tokens after ``past_tokens`` already cached ones."""
        _check_counts(new_tokens=new_tokens, past_tokens=past_tokens)
        return float(self.prefill.predict_ms(prefill_features(np.array(new_tokens),
                                                              np.array(past_tokens))))

    def full_rank_ms(self, prefix_tokens: int, suffix_tokens: int, candidates: int) -> float:
        """Ranking with nothing cached: the whole history is computed in the ranking pass."""
        _check_counts(prefix_tokens=prefix_tokens, suffix_tokens=suffix_tokens,
                      candidates=candidates)
        return float(self.full.predict_ms(full_features(np.array(prefix_tokens),
                                                        np.array(suffix_tokens),
                                                        np.array(candidates))))

    def cached_rank_ms(self, prefix_tokens: int, suffix_tokens: int, candidates: int) -> float:
        """Ranking against a cached prefix: only the suffix and the candidates are computed."""
        _check_counts(prefix_tokens=prefix_tokens, suffix_tokens=suffix_tokens,
                      candidates=candidates)
        return float(self.cached.predict_ms(cached_features(np.array(prefix_tokens),
                                                            np.array(suffix_tokens),
                                                            np.array(candidates))))

    def predict(self, prefix_tokens: int, suffix_tokens: int, candidates: int) -> LatencyPrediction:
        return LatencyPrediction(self.prefill_ms(prefix_tokens),
                                 self.full_rank_ms(prefix_tokens, suffix_tokens, candidates),
                                 self.cached_rank_ms(prefix_tokens, suffix_tokens, candidates))

    # ---- fitting -------------------------------------------------------------------------

    @classmethod
    def fit(cls, samples: list[LatencySample], source: CostModelSource) -> LatencyCostModel:
        """Least-squares fit (non-negative, relative error) of all three latencies."""
        if len(samples) < 2:
            raise ConfigError(f"a cost model needs at least 2 samples, got {len(samples)}")
        n = np.array([s.prefix_tokens for s in samples])
        s_ = np.array([s.suffix_tokens for s in samples])
        c = np.array([s.candidates for s in samples])
        if np.any(n < 1) or np.any(s_ < 0) or np.any(c < 1):
            raise ConfigError("samples need prefix_tokens >= 1, suffix_tokens >= 0, "
                              "candidates >= 1")
        prefill = LinearFit.fit(PREFILL_FEATURES, prefill_features(n, np.zeros_like(n)),
                                np.array([x.prefill_ms for x in samples]))
        full = LinearFit.fit(FULL_FEATURES, full_features(n, s_, c),
                             np.array([x.full_rank_ms for x in samples]))
        cached_ms = np.array([x.cached_rank_ms for x in samples])
        cached_x = cached_features(n, s_, c)
        if np.any(s_ > 0):
            cached = LinearFit.fit(CACHED_FEATURES, cached_x, cached_ms)
        else:
            cached = _fit_cached_without_suffix(cached_x, cached_ms, prefill)
        return cls(prefill, full, cached, source)

    # ---- persistence ---------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        model = None if self.source.model is None else self.source.model.to_dict()
        return {"format": FORMAT,
                "source": {"origin": self.source.origin, "device": self.source.device,
                           "dtype": self.source.dtype, "model": model},
                "prefill": self.prefill.to_dict(), "full": self.full.to_dict(),
                "cached": self.cached.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LatencyCostModel:
        """The cost model ``to_dict`` wrote, read by ``settings.load`` (unknown keys refused at
        any depth, every failure a ``ConfigError`` naming the field's path)."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ConfigError(f"not a cost model file (expected format {FORMAT!r})")
        return load(cls, {k: v for k, v in data.items() if k != "format"})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LatencyCostModel:
        return cls.from_dict(_read_json(path))

    @classmethod
    def from_profile_json(cls, path: str | Path) -> LatencyCostModel:
        """Fit on the points of a ``relaygr profile`` JSON (see ``profile_samples``)."""
        data = _read_json(path)
        samples, source = profile_samples(data)
        return cls.fit(samples, source)


def _fit_cached_without_suffix(features: np.ndarray, latency_ms: np.ndarray,
                               prefill: LinearFit) -> LinearFit:
    """Fit the cached model's suffix-free terms; take its suffix terms from the prefill fit."""
    keep = [CACHED_FEATURES.index(n) for n in ("const", "prefix_tokens", "candidates",
                                               "candidate_keys")]
    part = LinearFit.fit(tuple(CACHED_FEATURES[i] for i in keep), features[:, keep], latency_ms)
    coef = dict(zip(part.feature_names, part.coef_ms, strict=True))
    coef["suffix_tokens"] = prefill.coef_ms[PREFILL_FEATURES.index("tokens")]
    coef["suffix_pairs"] = prefill.coef_ms[PREFILL_FEATURES.index("attn_pairs")]
    return LinearFit(CACHED_FEATURES, tuple(coef[n] for n in CACHED_FEATURES), part.rmse_ms,
                     part.max_rel_error, part.num_points)


def _read_json(path: str | Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read JSON from {path}: {exc}") from exc


def profile_samples(data: Any) -> tuple[list[LatencySample], CostModelSource]:
    """Samples and source of a profile JSON: top-level ``device``, ``dtype``, ``model`` (an
    ``HSTUConfig`` dict) and ``points``, each point with ``prefix_tokens``, ``candidates``,
    ``prefill_ms``, ``full_rank_ms``, ``cached_rank_ms`` and optionally ``suffix_tokens``
    (default 0). Other keys are ignored; missing or malformed ones are ``ConfigError``."""
    if not isinstance(data, dict):
        raise ConfigError("a profile JSON must be an object")
    missing = [k for k in ("device", "dtype", "model", "points") if k not in data]
    if missing:
        raise ConfigError(f"profile JSON lacks {missing}")
    if not isinstance(data["points"], list) or not data["points"]:
        raise ConfigError("profile JSON 'points' must be a non-empty list")
    samples = []
    need = ("prefix_tokens", "candidates", "prefill_ms", "full_rank_ms", "cached_rank_ms")
    for i, point in enumerate(data["points"]):
        if not isinstance(point, dict) or any(k not in point for k in need):
            raise ConfigError(f"profile point {i} needs the keys {list(need)}")
        try:
            samples.append(LatencySample(
                int(point["prefix_tokens"]), int(point.get("suffix_tokens", 0)),
                int(point["candidates"]), float(point["prefill_ms"]),
                float(point["full_rank_ms"]), float(point["cached_rank_ms"])))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"profile point {i} is malformed: {exc}") from exc
    model = HSTUConfig.from_dict(data["model"]) if isinstance(data["model"], dict) else None
    return samples, CostModelSource("profile", str(data["device"]), str(data["dtype"]), model)
