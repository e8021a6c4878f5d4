"""The benchmark's table (Markdown, so docs/performance.md can quote it), the targets of
the performance rounds (issues 8 and 16), and the PNG chart."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchlib import dig

# What a run must show (issue 8, raised by issue 16 for one `run` with its defaults).
RAW_RATIO_MIN = 0.6
TUNED_RAW_RATIO_MIN = 0.8
PEER_RATIO_MIN = 1.5
P50_MAX_MS = 5.0
P99_MAX_MS = 25.0
CLAIM_RATIO_MAX = 2.0
RSS_MAX_MB = 150.0
RSS_GROWTH_MAX = 1.2  # peak with the largest backlog / peak with the smallest


def targets(out: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each target of the issue: the measured value, the bound, met or not (None: not run)."""
    defaults = dig(out, "ours", "defaults", "rate")
    tuned = dig(out, "ours", "tuned", "rate")
    raw = dig(out, "raw", "best", "rate")
    peer = dig(out, "pgqueuer", "best", "rate")
    celery = dig(out, "celery", "best", "rate")
    peaks = [
        dig(run, "memory", "peak_mb")
        for run in (dig(out, "ours", "defaults"), dig(out, "ours", "tuned"))
        if run
    ]
    mem_points = dig(out, "memory", "points") or []
    peaks += [dig(p, "memory", "peak_mb") for p in mem_points]
    peak = max((v for v in peaks if v), default=None)
    growth = None
    if len(mem_points) >= 2:
        first, last = (dig(p, "memory", "peak_mb") for p in (mem_points[0], mem_points[-1]))
        growth = last / first if first and last else None
    p50 = dig(out, "latency", "p50_ms")
    p99 = dig(out, "latency", "p99_ms")
    points = dig(out, "claim", "points") or []
    claim_ratio = None
    if len(points) >= 2 and points[0]["processed_rows"] == 0:
        claim_ratio = points[-1]["p50_ms"] / points[0]["p50_ms"]

    def check(value: float | None, bound: float, at_least: bool) -> dict[str, Any]:
        met = None if value is None else (value >= bound if at_least else value < bound)
        return {"value": value, "bound": bound, "met": met}

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    return {
        "one run, defaults / raw HTTP": check(ratio(defaults, raw), RAW_RATIO_MIN, True),
        "one run, batch 100 / raw HTTP": check(ratio(tuned, raw), TUNED_RAW_RATIO_MIN, True),
        "one run, defaults / pgqueuer best": check(ratio(defaults, peer), PEER_RATIO_MIN, True),
        "one run, defaults / Celery best": check(ratio(defaults, celery), PEER_RATIO_MIN, True),
        "latency p50 (ms)": check(p50, P50_MAX_MS, False),
        "latency p99 (ms)": check(p99, P99_MAX_MS, False),
        "claim, most rows / empty": check(claim_ratio, CLAIM_RATIO_MAX, False),
        "resident memory per process, peak (MB)": check(peak, RSS_MAX_MB, False),
        "memory, largest backlog / smallest": check(growth, RSS_GROWTH_MAX, False),
    }


def _n(value: float | None, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def _cpu(run: dict[str, Any]) -> str:
    cpu = run.get("cpu_pct") or {}
    if not cpu:
        return ""
    return ", ".join(f"{k} {v:.0f}%" for k, v in cpu.items() if v >= 1)


def render_table(out: dict[str, Any]) -> str:
    raw = dig(out, "raw", "best", "rate")
    peer = dig(out, "pgqueuer", "best", "rate")
    rows: list[tuple[str, str, str, str, str]] = []

    def ratio(value: float | None, base: float | None) -> str:
        return f"{value / base:.2f}" if value and base else "-"

    for r in dig(out, "raw", "runs") or []:
        procs = r.get("processes", 1)
        rows.append(
            (
                f"raw HTTP, aiohttp client, {procs} process{'es' if procs > 1 else ''} x "
                f"{r['concurrency']} connections",
                f"{_n(r['rate'])} req/s",
                ratio(r["rate"], raw),
                "",
                _cpu(r),
            )
        )
    ours_runs = list(dig(out, "ours", "runs") or [])
    extra = [dig(out, "ours", k) for k in ("gate_off_1p", "defaults", "tuned")]
    for r in [*ours_runs, *(e for e in extra if e)]:
        if r.get("default_workers"):
            what = f"ours, one `run` (supervisor + {r['os_processes'] - 1} workers)"
        else:
            what = f"ours, {r['processes']} process{'es' if r['processes'] > 1 else ''}"
            what += " (WEBHOOK_WORKERS=1)"
        if r.get("memory"):
            what += f", RSS peak {r['memory']['peak_mb']:.0f} MB/process"
        if not r["gate"]:
            what += ", Redis gate off"
        tuned = {k: v for k, v in (r.get("env") or {}).items()}
        if tuned:
            what += ", " + ", ".join(f"{k}={v}" for k, v in tuned.items())
        else:
            what += ", defaults"
        rows.append(
            (what, f"{_n(r['rate'])} ev/s", ratio(r["rate"], raw), ratio(r["rate"], peer), _cpu(r))
        )
    peers = [
        (
            f"pgqueuer {dig(out, 'pgqueuer', 'version')}, batch {r['batch']}, "
            f"{r['processes']} process{'es' if r['processes'] > 1 else ''}, {r['driver']}",
            "jobs/s",
            r,
        )
        for r in dig(out, "pgqueuer", "runs") or []
    ] + [
        (
            f"Celery {dig(out, 'celery', 'version')}, {r['pool']} pool x "
            f"{r['concurrency']}, Redis broker, acks late",
            "tasks/s",
            r,
        )
        for r in dig(out, "celery", "runs") or []
    ]
    for what, unit, r in peers:
        rows.append(
            (
                what,
                f"{_n(r['rate'])} {unit}",
                ratio(r["rate"], raw),
                ratio(r["rate"], peer),
                _cpu(r),
            )
        )
    for m in dig(out, "memory", "points") or []:
        mem = m.get("memory") or {}
        rows.append(
            (
                f"ours, one `run`, {m['backlog']:,} rows pending, {m['seconds']:g} s: resident"
                " memory per process",
                f"peak {_n(mem.get('peak_mb'), 1)} MB",
                "",
                "",
                f"first {mem.get('first_mb')} last {mem.get('last_mb')} MB; "
                f"{_n(m.get('rate'))} ev/s meanwhile",
            )
        )
    lines = [
        "| measurement | result | / raw HTTP | / pgqueuer best | CPU (100% = 1 core) |",
        "|---|---:|---:|---:|---|",
    ]
    lines += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows]
    lat = out.get("latency")
    if lat:
        lines.append(
            f"| commit-to-receipt at {lat['rate']}/s for {_n(lat['seconds'], 0)} s, "
            f"poll {lat['poll_interval_ms']} ms | p50 {_n(lat['p50_ms'], 2)} ms, "
            f"p95 {_n(lat['p95_ms'], 2)} ms, p99 {_n(lat['p99_ms'], 2)} ms, "
            f"max {_n(lat['max_ms'], 1)} ms |  |  | commit itself p50 "
            f"{_n(lat['commit_p50_ms'], 2)} ms |"
        )
    points = dig(out, "claim", "points") or []
    base = points[0]["p50_ms"] if points and points[0]["processed_rows"] == 0 else None
    for p in points:
        lines.append(
            f"| claim (batch 10), {p['processed_rows']:,} processed rows | "
            f"p50 {_n(p['p50_ms'], 3)} ms, p95 {_n(p['p95_ms'], 3)} ms | "
            f"x{p['p50_ms'] / base:.2f} of empty |  | "
            f"{'index' if p['uses_index'] else 'NO INDEX'} |"
            if base
            else f"| claim, {p['processed_rows']:,} processed rows | "
            f"p50 {_n(p['p50_ms'], 3)} ms |  |  |  |"
        )
    churn = dig(out, "claim", "churn")
    if churn:
        lines.append(
            f"| claim after {churn['updated_rows_not_vacuumed']:,} rows were marked processed"
            f" and not vacuumed | first {_n(churn['first_ms'], 2)} ms, then p50 "
            f"{_n(churn['p50_ms'], 3)} ms | "
            + (f"x{churn['p50_ms'] / base:.2f} of empty" if base else "")
            + f" |  | after VACUUM: p50 {_n(churn.get('after_vacuum_p50_ms'), 3)} ms |"
        )
    for label, g in (dig(out, "gate", "per_batch") or {}).items():
        lines.append(
            f"| Redis gate round trip ({label}, batch of {g['batch']}) | "
            f"p50 {_n(g['p50_ms'], 3)} ms, p99 {_n(g['p99_ms'], 3)} ms |  |  |  |"
        )
    lines.append("")
    lines.append("| target | measured | bound | met |")
    lines.append("|---|---:|---:|---|")
    for name, t in (out.get("targets") or {}).items():
        met = {True: "yes", False: "**no**", None: "not run"}[t["met"]]
        lines.append(f"| {name} | {_n(t['value'], 2)} | {t['bound']} | {met} |")
    meta = out.get("meta", {})
    lines.append("")
    lines.append(
        f"{meta.get('mode')} run, {meta.get('events'):,} events per throughput run, "
        f"body {meta.get('body_bytes')} bytes, {meta.get('machine', {}).get('cpus')} CPUs, "
        f"PostgreSQL {meta.get('postgres')}, {meta.get('seconds')} s in all"
    )
    if meta.get("dispatcher_env"):
        lines.append(f"dispatcher environment: {meta['dispatcher_env']}")
    return "\n".join(lines)


def render_cpu_table(out: dict[str, Any]) -> str:
    """CPU microseconds per delivery, by process group, for the throughput runs."""
    rows = []
    candidates: list[tuple[str, dict[str, Any] | None]] = [
        ("raw HTTP (best)", dig(out, "raw", "best"))
    ]
    for r in dig(out, "ours", "runs") or []:
        candidates.append((f"ours, {r['processes']}p, defaults", r))
    candidates.append(("ours, 1p, gate off", dig(out, "ours", "gate_off_1p")))
    candidates.append(("ours, one run, defaults", dig(out, "ours", "defaults")))
    tuned = dig(out, "ours", "tuned")
    if tuned:
        env = ", ".join(f"{k}={v}" for k, v in (tuned.get("env") or {}).items())
        candidates.append((f"ours, one run, {env}", tuned))
    for r in dig(out, "pgqueuer", "runs") or []:
        candidates.append((f"pgqueuer, batch {r['batch']}, {r['processes']}p", r))
    for r in dig(out, "celery", "runs") or []:
        candidates.append((f"Celery, {r['pool']} x {r['concurrency']}", r))
    for label, run in candidates:
        if not run or not run.get("rate"):
            continue
        cpu = run.get("cpu_pct") or {}
        per = {k: 10_000 * v / run["rate"] for k, v in cpu.items()}
        sender = per.get("client", per.get("dispatchers", per.get("workers")))
        others = per.get("machine", 0) - sum(v for k, v in per.items() if k != "machine")
        rows.append(
            f"| {label} | {_n(run['rate'])} | {_n(sender)} | {_n(per.get('postgres'))} | "
            f"{_n(per.get('redis'))} | {_n(per.get('receiver'))} | {_n(max(others, 0))} |"
        )
    head = [
        "| run | deliveries/s | sender (us) | PostgreSQL (us) | Redis (us) | receiver (us) |"
        " anything else on the machine (us) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    return "\n".join(head + rows)


def render_chart(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5.5))
    # Throughput.
    labels: list[str] = []
    values: list[float] = []
    colours: list[str] = []
    raw = dig(out, "raw", "best")
    if raw:
        labels.append(f"raw HTTP\n({raw.get('processes', 1)}x c={raw['concurrency']})")
        values.append(raw["rate"])
        colours.append("#999999")
    for r in dig(out, "ours", "runs") or []:
        labels.append(f"ours\n{r['processes']}p")
        values.append(r["rate"])
        colours.append("#1f77b4")
    off = dig(out, "ours", "gate_off_1p")
    if off:
        labels.append("ours 1p\nno gate")
        values.append(off["rate"])
        colours.append("#6baed6")
    defaults = dig(out, "ours", "defaults")
    if defaults:
        labels.append("ours run\ndefaults")
        values.append(defaults["rate"])
        colours.append("#08519c")
    tuned = dig(out, "ours", "tuned")
    if tuned:
        batch = (tuned.get("env") or {}).get("WEBHOOK_BATCH_SIZE", "?")
        labels.append(f"ours run\nb{batch}")
        values.append(tuned["rate"])
        colours.append("#08306b")
    for r in dig(out, "pgqueuer", "runs") or []:
        labels.append(f"pgq\nb{r['batch']} {r['processes']}p")
        values.append(r["rate"])
        colours.append("#ff7f0e")
    for r in dig(out, "celery", "runs") or []:
        labels.append(f"celery\n{r['pool']} {r['concurrency']}")
        values.append(r["rate"])
        colours.append("#d62728")
    ax = axes[0]
    bars = ax.bar(range(len(values)), values, color=colours)
    ax.set_xticks(range(len(values)), labels, fontsize=8)
    ax.set_ylabel("deliveries per second")
    ax.set_title("Throughput (loopback receiver, 2 cores)")
    for bar, v in zip(bars, values, strict=True):
        ax.annotate(
            f"{v:,.0f}",
            (bar.get_x() + bar.get_width() / 2, v),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    if raw:
        ax.axhline(raw["rate"] * RAW_RATIO_MIN, color="#999999", ls="--", lw=1)
        ax.annotate("0.6 x raw", (0, raw["rate"] * RAW_RATIO_MIN), fontsize=7, va="bottom")
    # Latency.
    ax = axes[1]
    lat = out.get("latency")
    if lat:
        edges = [e for e, _ in lat["histogram_ms"]]
        counts = [c for _, c in lat["histogram_ms"]]
        names = [f"<={e:g}" if e < 1e8 else ">1000" for e in edges]
        ax.bar(range(len(counts)), counts, color="#2ca02c")
        ax.set_xticks(range(len(counts)), names, fontsize=7, rotation=45)
        ax.set_xlabel("commit-to-receipt, ms")
        ax.set_ylabel("events")
        ax.set_title(
            f"Latency at {lat['rate']}/s: p50 {lat['p50_ms']:.2f}, p95 {lat['p95_ms']:.2f}, "
            f"p99 {lat['p99_ms']:.2f} ms",
            fontsize=10,
        )
    # Claim.
    ax = axes[2]
    points = dig(out, "claim", "points") or []
    if points:
        names = [f"{p['processed_rows']:,}" for p in points]
        ax.bar(range(len(points)), [p["p50_ms"] for p in points], color="#9467bd", label="p50")
        ax.plot(
            range(len(points)), [p["p95_ms"] for p in points], "o", color="#333333", label="p95"
        )
        ax.set_xticks(range(len(points)), names, fontsize=8)
        ax.set_xlabel("processed rows in the table")
        ax.set_ylabel("claim of 10 rows, ms")
        ax.set_title("Claim time")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
