"""The table ``python -m bench.shedding`` prints: every phase's figures, its CPU, and the targets met or not."""

from __future__ import annotations

from typing import Any

from ..load import CHARGE_RATE, EXPORT_SECONDS, FLOOD_CLIENTS, FLOOD_PERIOD, NOISY_OTHER_CPUS

PHASE_TITLES = {
    "unloaded": "1 unloaded, shedding off",
    "flood-off": "2 flood, shedding off",
    "unloaded-on": "1b unloaded, shedding on",
    "flood-on": "3 flood, shedding on",
    "exports32-on": "4 32 conns of exports, on",
    "abusive32-on": "5 32 conns, 1 abusive key",
    "cpu-idle": "6 cpu: idle",
    "cpu-idle-central": "7a cpu: idle",
    "cpu-admitted": "6a cpu: admitted GETs",
    "cpu-early-429": "6b cpu: 429s from memory",
    "cpu-early-503": "6c cpu: exports shed",
    "abusive32-central": "7 as 5, no local path",
    "cpu-429-central": "7b cpu: 429s, no local path",
    "flood-fleet": "3f flood, fleet shedder only",
}


def render(report: dict[str, Any]) -> str:
    def num(value: float | None) -> str:
        return "-" if value is None else f"{value:,.1f}"

    header = (
        f"{'phase':<28} {'class':<8} {'sent':>6} {'2xx %':>6} {'429':>5} {'503':>5} {'fleet':>5} {'worker':>6} "
        f"{'err':>4} | {'ok p50':>8} {'ok p99':>8} | {'all p50':>8} {'all p99':>8}"
    )
    lines = [
        f"Load shedding under a flood: gunicorn {report['config']['gunicorn']}, "
        f"{report['machine']['cpus']} CPUs{' (--quick)' if report['quick'] else ''}",
        f"critical: POST /v1/charges at {CHARGE_RATE:g}/s; low: POST /v1/reports/export "
        f"({EXPORT_SECONDS:g} s each) from {FLOOD_CLIENTS} keys, one per {FLOOD_PERIOD:g} s each",
        "latency in ms (charges: from when due; exports: from when sent)",
        "",
        header,
        "-" * len(header),
    ]
    for name, phase in report["phases"].items():
        for i, klass in enumerate(k for k in ("critical", "low", "normal", "abusive") if k in phase):
            s = phase[klass]
            ok = s["latency_successes"] or {}
            every = s["latency_all"] or {}
            rate = "-" if s["success_rate"] is None else f"{s['success_rate'] * 100:.1f}"
            lines.append(
                f"{PHASE_TITLES[name] if i == 0 else '':<28} {klass:<8} {s['requests']:>6} {rate:>6} "
                f"{s['status_429']:>5} {s['status_503']:>5} {s['shed_by_fleet']:>5} {s['shed_by_worker']:>6} "
                f"{sum(s['errors'].values()):>4} | {num(ok.get('p50_ms')):>8} {num(ok.get('p99_ms')):>8} | "
                f"{num(every.get('p50_ms')):>8} {num(every.get('p99_ms')):>8}"
            )
    lines += ["", "CPU seconds used during each phase (2 vCPUs; 'other' is the rest of the machine):"]
    for name, phase in report["phases"].items():
        cpu = phase["cpu"]
        lines.append(
            f"  {PHASE_TITLES[name]:<28} gunicorn {cpu['gunicorn_s']:5.2f}  redis {cpu['redis_s']:5.2f}  "
            f"generator {cpu['generator_s']:5.2f}  other {cpu['other_s']:5.2f}  over {phase['wall_s']:4.1f} s "
            f"(machine {cpu['machine_busy_percent']} % busy, load {phase['load_average_1m_at_start']} at start)"
            f"{'  NOISY' if phase['noisy'] else ''}"
        )
    t = report["targets"]

    def verdict(met: bool) -> str:
        return "met" if met else "NOT met"

    success = "-" if t["critical_success_rate"] is None else f"{t['critical_success_rate'] * 100:.2f} %"
    lines += [
        "",
        f"target: critical success with shedding on >= 99 %: {success}, {verdict(t['critical_success_met'])}",
        f"target: critical p99 with shedding on <= 2 x unloaded p99: {num(t['critical_p99_ms'])} ms vs "
        f"{num(t['unloaded_p99_ms'])} ms = {t['p99_ratio']}x, {verdict(t['p99_met'])} "
        f"(vs unloaded with shedding on, {num(t['unloaded_on_p99_ms'])} ms: {t['p99_ratio_to_unloaded_on']}x)",
    ]
    for name, flood in t["local_path_floods"].items():
        lines.append(
            f"target: critical p99 during {PHASE_TITLES[name].split(' ', 1)[1]} <= 3 x unloaded p99: "
            f"{num(flood['critical_p99_ms'])} ms = {flood['ratio']}x, {verdict(flood['met'])} "
            f"(critical success {flood['critical_success_rate']})"
        )
    if t["central_429_cpu_us_per_request"] is not None:
        lines.append(
            f"without the local path: a 429 costs {num(t['central_429_cpu_us_per_request'])} µs of gunicorn CPU; "
            f"critical p99 during the abusive flood {num(t['abusive_central_critical_p99_ms'])} ms"
        )
    for name, cpu in t["early_refusal_cpu"].items():
        lines.append(
            f"target: {PHASE_TITLES[name].split(': ', 1)[1]} cost <= 15 % of an admitted request's CPU "
            f"({num(t['admitted_cpu_us_per_request'])} µs): {num(cpu['cpu_us_per_request'])} µs = "
            f"{cpu['share_of_admitted']}, {verdict(cpu['met'])}"
        )
    if t["noisy_phases"]:
        lines.append(
            f"WARNING: other work used more than {NOISY_OTHER_CPUS:g} CPU on average during "
            f"{', '.join(t['noisy_phases'])}: their latencies are suspect, run again on a quieter machine"
        )
    for shedding, details in report["servers"].items():
        if shedding == "off":
            continue
        probe = details["export_probe_after_flood"]
        slots = details["fleet_slots_after_flood"]
        lines.append(
            f"after the flood (shedding {shedding}): fleet slots held {slots['at_drain']} when the last "
            f"response arrived, {slots['after_wait']} {slots['waited_s']:g} s later; "
            f"{probe['admitted']}/{probe['exports']} probe exports admitted"
        )
    for shedding, details in report["servers"].items():
        counts = ", ".join(f"{k} {v}" for k, v in details["log"].items())
        lines.append(f"server log (shedding {shedding}): {counts}")
    return "\n".join(lines)
