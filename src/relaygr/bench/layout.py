"""How the ranking instances split a machine's cores (``Layout``): the serving layout the
benchmark's instances run on, and the others the operating point times the baseline on
(``relaygr.bench.operating``)."""

from __future__ import annotations

from dataclasses import dataclass

from relaygr.errors import ConfigError


@dataclass(frozen=True, order=True)
class Layout:
    """How the ranking instances split the cores: ``instances`` of ``threads`` threads each."""

    instances: int
    threads: int

    def __post_init__(self) -> None:
        if self.instances < 1 or self.threads < 1:
            raise ConfigError(f"a layout needs >= 1 instance and >= 1 thread, got {self}")

    def __str__(self) -> str:
        return f"{self.instances} x {self.threads} threads"

    def splits(self) -> tuple[Layout, ...]:
        """Every layout over the same cores (instances x threads constant), most instances
        first."""
        cores = self.instances * self.threads
        return tuple(Layout(cores // t, t) for t in range(1, cores + 1) if cores % t == 0)
