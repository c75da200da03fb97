"""A configuration of the shedders: one gunicorn start, with its environment, and the phases run on it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..load import FLEET_CAPACITY, WORKER_CAPACITY

#: The environment of ``bench/shedding_settings.py`` with both shedders on (empty: that shedder off).
SHEDDING_ON = {
    "BENCH_SHEDDING_FLEET_CAPACITY": str(FLEET_CAPACITY),
    "BENCH_SHEDDING_WORKER_CAPACITY": str(WORKER_CAPACITY),
}


@dataclass(frozen=True)
class Configuration:
    """``name`` (the JSON's ``shedding``), the environment over the base one, and the phases in order.

    A phase is ``(name, flood)``: ``flood`` is ``None`` (charges only, or nothing for a ``cpu-``
    phase), ``"periodic"`` or one of ``bench.load.CLOSED_FLOODS``.
    """

    name: str
    env: dict[str, str]
    phases: tuple[tuple[str, str | None], ...]


def combined(*scenarios: Iterable[Configuration]) -> list[Configuration]:
    """The scenarios' configurations in order, those of one name made one start with every phase of it."""
    found: dict[str, Configuration] = {}
    for configuration in (c for scenario in scenarios for c in scenario):
        before = found.get(configuration.name)
        if before is None:
            found[configuration.name] = configuration
            continue
        if before.env != configuration.env:
            raise ValueError(f"configuration {configuration.name!r} named with two environments")
        found[configuration.name] = Configuration(before.name, before.env, before.phases + configuration.phases)
    return list(found.values())
