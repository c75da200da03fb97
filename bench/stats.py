"""Percentiles and the summary of one scenario's samples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


def percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of sorted data, interpolating linearly between ranks."""
    if not ordered:
        raise ValueError("no samples")
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class Series:
    """Every timed decision of one scenario, in nanoseconds, plus per-round figures."""

    samples_ns: list[int] = field(default_factory=list)
    wall_ns: int = 0
    round_p50_us: list[float] = field(default_factory=list)
    #: Redis-side microseconds spent in this scenario's commands (INFO commandstats).
    server_usec: int = 0
    server_calls: int = 0
    #: Commands other than the expected ones seen during timed blocks (e.g. a reconnect's HELLO).
    other_commands: dict[str, int] = field(default_factory=dict)
    #: Commands run inside the scenario's Lua script (their time is inside the EVALSHA's).
    script_commands: dict[str, int] = field(default_factory=dict)
    #: The server process's CPU time during the timed blocks (``INFO cpu``, user + system): its
    #: network work too, whatever commands a design uses.
    server_cpu_us: int = 0

    def add_round(
        self,
        samples: list[int],
        wall_ns: int,
        server_usec: int,
        server_calls: int,
        other: dict[str, int],
        script: dict[str, int],
        server_cpu_us: int,
    ) -> None:
        self.samples_ns += samples
        self.wall_ns += wall_ns
        self.round_p50_us.append(percentile(sorted(samples), 50) / 1000)
        self.server_usec += server_usec
        self.server_calls += server_calls
        self.server_cpu_us += server_cpu_us
        for command, calls in other.items():
            self.other_commands[command] = self.other_commands.get(command, 0) + calls
        for command, calls in script.items():
            self.script_commands[command] = self.script_commands.get(command, 0) + calls

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.samples_ns)
        n = len(ordered)

        def us(q: float) -> float:
            return round(percentile(ordered, q) / 1000, 1)

        return {
            "decisions": n,
            "p50_us": us(50),
            "p90_us": us(90),
            "p99_us": us(99),
            "p99_9_us": us(99.9),
            "max_us": round(ordered[-1] / 1000, 1),
            "mean_us": round(sum(ordered) / n / 1000, 1),
            "throughput_per_s": round(n / (self.wall_ns / 1e9)),
            "round_p50_us": [round(v, 1) for v in self.round_p50_us],
            "redis_us_per_decision": round(self.server_usec / n, 1),
            "redis_calls_per_decision": round(self.server_calls / n, 2),
            "redis_cpu_us_per_decision": round(self.server_cpu_us / n, 1),
            "other_redis_commands": self.other_commands,
            "script_commands_per_decision": {c: round(k / n, 2) for c, k in sorted(self.script_commands.items())},
        }
