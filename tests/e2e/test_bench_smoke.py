"""The benchmark runs end to end in its tiny mode and writes every section. No timings are
asserted: the benchmark measures, the test only checks that it can."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.procs import run_benchmark

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SECTIONS = ("raw", "ours", "pgqueuer", "celery", "latency", "memory", "claim", "gate")


def test_bench_tiny_writes_every_section(tmp_path: Path) -> None:
    text = run_benchmark(["-m", "fluxora_webhooks", "bench", "--tiny"], tmp_path)
    (saved,) = tmp_path.glob("2*.json")
    result = json.loads(saved.read_text())
    for section in SECTIONS:
        assert section in result, f"{section} missing:\n{text}"
    assert result["ours"]["best"]["received"] >= result["meta"]["events"]
    assert all(run["left_pending"] == 0 for run in result["ours"]["runs"])
    # One `run` as a user starts it: the supervisor and its default workers, all measured.
    defaults = result["ours"]["defaults"]
    assert defaults["default_workers"] and defaults["os_processes"] >= 2
    assert defaults["left_pending"] == 0 and defaults["memory"]["peak_mb"] > 0
    assert result["celery"]["best"]["received"] >= result["meta"]["events"]
    assert result["memory"]["points"][0]["memory"]["processes"] >= 2
    assert len({(r["processes"], r["concurrency"]) for r in result["raw"]["runs"]}) >= 2
    assert result["latency"]["received"] == result["latency"]["events"]
    assert result["claim"]["points"][0]["processed_rows"] == 0
    assert all(p["uses_index"] for p in result["claim"]["points"])
    assert set(result["targets"]) >= {
        "one run, defaults / raw HTTP",
        "one run, batch 100 / raw HTTP",
        "one run, defaults / pgqueuer best",
        "one run, defaults / Celery best",
        "latency p99 (ms)",
        "resident memory per process, peak (MB)",
    }
    assert list(tmp_path.glob("2*.png")), "no chart"
    assert "| measurement |" in text
