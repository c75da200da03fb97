"""Warm-up, calibration and interleaved timed rounds."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import redis

from .scenarios import Scenario
from .stats import Series

#: The harness's own commands (INFO, CONFIG RESETSTAT) are not part of any decision.
IGNORED_COMMANDS = {"info", "config", "config|resetstat"}
#: Commands a client sends on its own (a new connection's handshake): never part of a script.
CONNECTION_COMMANDS = {"auth", "client", "client|setinfo", "hello", "select"}
#: Top-level commands of a script-based decision: a Redis Function's call, or a script's (EVAL
#: only after a NOSCRIPT).
SCRIPT_COMMANDS = ("fcall", "evalsha", "eval")


def timed_block(call: Callable[[int], None], start: int, n: int) -> tuple[list[int], int]:
    """``n`` decisions, each timed alone with ``perf_counter_ns``; also the block's wall time."""
    clock = time.perf_counter_ns
    samples = [0] * n
    began = clock()
    for j in range(n):
        i = start + j
        t0 = clock()
        call(i)
        samples[j] = clock() - t0
    return samples, clock() - began


def warm(scenario: Scenario, seconds: float, minimum: int) -> float:
    """Run untimed until ``seconds`` and ``minimum`` calls have passed; mean µs of the second half."""
    call = scenario.call
    with scenario.active():
        began = time.perf_counter()
        i = 0
        while i < minimum or time.perf_counter() - began < seconds:
            call(i)
            i += 1
        half = max(i // 2, 1)
        t0 = time.perf_counter()
        for j in range(half):
            call(i + j)
        return (time.perf_counter() - t0) / half * 1e6


def command_stats(admin: redis.Redis) -> dict[str, tuple[int, int]]:
    """``{command: (calls, usec)}`` from ``INFO commandstats`` (lower-case names)."""
    info: dict[str, Any] = admin.info("commandstats")
    stats = {}
    for name, value in info.items():
        command = name.removeprefix("cmdstat_").lower()
        if command not in IGNORED_COMMANDS:
            stats[command] = (int(value["calls"]), int(value["usec"]))
    return stats


def server_cpu_s(admin: redis.Redis) -> float:
    """The server process's CPU time so far (``INFO cpu``: user + system, all threads), in seconds."""
    info: dict[str, Any] = admin.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def run_rounds(
    scenarios: list[Scenario],
    admin: redis.Redis,
    *,
    rounds: int,
    iterations: int,
    block_warmup: int,
    deadline: float,
    log: Callable[[str], None],
) -> tuple[dict[str, Series], int]:
    """Rounds of every scenario in turn (the order rotates each round), so noise hits all alike.

    Before each block: switch settings if the scenario needs it, a few untimed calls (re-warm
    after the previous scenario), a full GC, and ``CONFIG RESETSTAT`` for the server-side column;
    ``INFO cpu`` just before and after it gives the server's whole CPU time for the block.
    Stops early (fewer rounds, reported) if the wall-clock deadline would be passed.
    """
    series = {scenario.key: Series() for scenario in scenarios}
    offsets = {scenario.key: 0 for scenario in scenarios}
    done = 0
    for r in range(rounds):
        if time.monotonic() > deadline:
            log(f"  deadline reached: stopping after {done} of {rounds} rounds")
            break
        shift = r % len(scenarios)
        order = scenarios[shift:] + scenarios[:shift]
        round_began = time.monotonic()
        for scenario in order:
            with scenario.active():
                start = offsets[scenario.key]
                for j in range(block_warmup):
                    scenario.call(start + j)
                start += block_warmup
                gc.collect()
                admin.config_resetstat()
                cpu_before = server_cpu_s(admin)
                samples, wall_ns = timed_block(scenario.call, start, iterations)
                cpu_s = server_cpu_s(admin) - cpu_before
                stats = command_stats(admin)
                if scenario.observe is not None:
                    scenario.observations = scenario.observe()
            offsets[scenario.key] = start + iterations
            calls = sum(stats.get(c, (0, 0))[0] for c in scenario.commands)
            usec = sum(stats.get(c, (0, 0))[1] for c in scenario.commands)
            # Commands a script runs appear in commandstats too, but their time is already inside
            # the FCALL's (or EVALSHA's) own usec: they are tallied apart (per decision), never added.
            scripted = any(c in SCRIPT_COMMANDS for c in scenario.commands)
            rest = {c: v[0] for c, v in stats.items() if c not in scenario.commands and v[0]}
            inner = {c: n for c, n in rest.items() if scripted and c not in CONNECTION_COMMANDS}
            unexpected = {c: n for c, n in rest.items() if c not in inner}
            if unexpected:
                log(f"  note: {scenario.key} sent other Redis commands during its block: {unexpected}")
            series[scenario.key].add_round(samples, wall_ns, usec, calls, unexpected, inner, round(cpu_s * 1e6))
        done += 1
        log(f"  round {done}/{rounds}: {time.monotonic() - round_began:.1f}s")
    return series, done
