"""The serving modes compared side by side: one switch selects a whole system design.

| mode                | pre-infer (trigger)   | routing             | device cache | host tier |
|---------------------|-----------------------|---------------------|--------------|-----------|
| `baseline`          | none                  | least-loaded        | no           | no        |
| `reactive`          | none (fill at ranking)| user-id (affinity)  | yes          | yes       |
| `relay`             | sequence-aware        | affinity + spill    | yes          | yes       |
| `relay-no-trigger`  | pre-infer everything  | affinity + spill    | yes          | yes       |
| `relay-no-affinity` | sequence-aware        | round-robin per leg | yes          | yes       |
| `relay-no-expander` | sequence-aware        | affinity + spill    | yes          | no        |

`baseline` is today's production path (full recompute at ranking, stateless load balancing).
`reactive` is the NVIDIA recsys-examples design: a user-keyed KV cache filled by the ranking pass
itself, LRU, host offload, user-id routing, no pre-inference. Every caching mode also fills the
cache on a ranking-time miss, so `relay` is `reactive` plus the relay's three techniques.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass

from relaygr.errors import ConfigError
from relaygr.routing.affinity import AffinityConfig


class Mode(enum.Enum):
    BASELINE = "baseline"
    REACTIVE = "reactive"
    RELAY = "relay"
    RELAY_NO_TRIGGER = "relay-no-trigger"
    RELAY_NO_AFFINITY = "relay-no-affinity"
    RELAY_NO_EXPANDER = "relay-no-expander"

    @classmethod
    def parse(cls, name: str) -> Mode:
        try:
            return cls(name)
        except ValueError:
            raise ConfigError(f"unknown mode {name!r}; choose one of "
                              f"{[m.value for m in cls]}") from None


@dataclass(frozen=True)
class ModeSpec:
    """What a mode turns on; derived from ``Mode`` by ``spec_for``."""

    mode: Mode
    trigger: str | None     # trigger policy name, None: no pre-inference
    router: str             # router name (see relaygr.routing.make_router)
    router_options: tuple[tuple[str, object], ...]
    device_cache: bool
    host_tier: bool

    @property
    def preinfer(self) -> bool:
        return self.trigger is not None

    def router_settings(self, affinity: AffinityConfig) -> dict[str, object]:
        """The options of this mode's router: a system's ``affinity`` settings where it routes
        by affinity, the mode's own options over them."""
        options = dict(self.router_options)
        if self.router == "affinity":
            options = {**asdict(affinity), **options}
        return options


def spec_for(mode: Mode) -> ModeSpec:
    no_spill = (("max_spill_hops", 0),)
    specs = {
        Mode.BASELINE: ModeSpec(mode, None, "least-loaded", (), False, False),
        Mode.REACTIVE: ModeSpec(mode, None, "affinity", no_spill, True, True),
        Mode.RELAY: ModeSpec(mode, "sequence-aware", "affinity", (), True, True),
        Mode.RELAY_NO_TRIGGER: ModeSpec(mode, "preinfer-all", "affinity", (), True, True),
        Mode.RELAY_NO_AFFINITY: ModeSpec(mode, "sequence-aware", "round-robin", (), True, True),
        Mode.RELAY_NO_EXPANDER: ModeSpec(mode, "sequence-aware", "affinity", (), True, False),
    }
    return specs[mode]
