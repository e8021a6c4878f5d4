"""docs/prometheus-alerts.yml as Prometheus reads it: promtool checks the rules and runs
their unit tests (tests/alerts/prometheus-alerts.test.yml: each alert fires on the series it
is about, stays quiet where it should, with the labels and texts an operator gets).
``make promtool`` puts promtool in .tools/ (``make test`` does it first)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "docs" / "prometheus-alerts.yml"
TESTS = ROOT / "tests" / "alerts" / "prometheus-alerts.test.yml"


@pytest.fixture(scope="module")
def promtool() -> str:
    found = ROOT / ".tools" / "promtool"
    if found.exists():
        return str(found)
    on_path = shutil.which("promtool")
    assert on_path, "promtool is missing: run `make promtool` (make test does)"
    return on_path


def _run(promtool: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def test_the_rules_load_and_their_unit_tests_pass(promtool: str) -> None:
    checked = _run(promtool, "check", "rules", str(RULES), cwd=ROOT)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    rules = RULES.read_text().count("- alert: ")
    assert f"SUCCESS: {rules} rules found" in checked.stdout, checked.stdout
    tested = _run(promtool, "test", "rules", TESTS.name, cwd=TESTS.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    # Every alert of the file is tested firing.
    fired = set(re.findall(r"alertname: (\w+)\n\s*exp_alerts:\n\s*- exp_labels", TESTS.read_text()))
    alerts = set(re.findall(r"- alert: (\w+)", RULES.read_text()))
    assert len(alerts) == rules and alerts <= fired, sorted(alerts - fired)


def test_a_rule_that_no_longer_fires_fails_its_unit_test(promtool: str, tmp_path: Path) -> None:
    """The unit tests can fail: the failure-ratio threshold raised past the test's 30 %."""
    text = RULES.read_text()
    assert "> 0.2\n" in text
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / RULES.name).write_text(text.replace("> 0.2\n", "> 0.5\n"))
    (tmp_path / "alerts").mkdir()
    (tmp_path / "alerts" / TESTS.name).write_text(TESTS.read_text())
    tested = _run(promtool, "test", "rules", TESTS.name, cwd=tmp_path / "alerts")
    assert tested.returncode != 0
    assert "FluxoraWebhooksFailureRatio" in tested.stdout + tested.stderr
