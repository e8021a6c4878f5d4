"""The many-endpoint benchmark runs end to end in its tiny mode: every section gives its
row, every delivery arrives, the ordered endpoint's streams arrive in order. No timings
are asserted: the benchmark measures, the test only checks that it can."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.procs import run_benchmark

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("raw", "fanout", "fanout_latency", "ordered", "ordered_head", "isolation")


def test_many_tiny_gives_every_section(tmp_path: Path) -> None:
    text = run_benchmark([str(ROOT / "benchmarks" / "many.py"), "--tiny"], tmp_path)
    (saved,) = tmp_path.glob("many-*.json")
    result = json.loads(saved.read_text())
    for section in SECTIONS:
        assert section in result, f"{section} missing:\n{text}"
    fanout = result["fanout"]["runs"]
    assert [r["label"] for r in fanout] == [
        "one run, batch 100",
        "one run, defaults",
        "1 process, batch 100",
        "1 process, defaults",
    ]
    assert all(r["received"] >= r["deliveries"] for r in fanout)
    # One `run` as a user starts it: its workers' CPU is counted, not only the supervisor's.
    assert all(r["dispatcher_cpu_us_per_delivery"] > 0 for r in fanout)
    # The raw limit as run.py takes it: one client process and one per CPU.
    assert {r["processes"] for r in result["raw"]["runs"]} == {1, os.cpu_count() or 1}
    latency = result["fanout_latency"]
    assert latency["received"] == latency["events"] * latency["endpoints"]
    ordered = result["ordered"]
    assert ordered["in_order"], ordered
    assert ordered["ord"]["received"] == ordered["ord"]["deliveries"]
    assert ordered["ord"]["out_of_order"] == 0
    head = result["ordered_head"]
    assert head["in_order"], head
    stuck = head["head_retrying"]
    assert stuck["received"] == stuck["events"] and stuck["refused"] >= 1
    # The stream behind the refused head waited for its retry; the others did not.
    assert stuck["stuck_events"] > 0 and stuck["stuck_max_ms"] > stuck["others_p99_ms"]
    isolation = result["isolation"]
    assert isolation["beside_dead"]["received"] >= isolation["beside_dead"]["deliveries"]
    assert isolation["dead_requests_seen"] > 0, "the hanging endpoint was never tried"
    assert isolation["healthy_left_pending"] == 0
    # One table: a row per section, and the targets.
    for row in (
        "| raw HTTP",
        "| fan-out x100",
        "| fan-out x10 at",
        "| ordered endpoint",
        "| unordered endpoint",
        "one stream's head refused",
        "healthy endpoints, beside a hanging endpoint",
    ):
        assert row in text, f"no {row!r} row:\n{text}"
    assert "| target |" in text
