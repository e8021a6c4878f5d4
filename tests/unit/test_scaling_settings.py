"""WEBHOOK_WORKERS and the start-up checks of many workers (SPEC section 16), without I/O."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from fluxora_webhooks import host
from fluxora_webhooks.errors import ConfigError
from fluxora_webhooks.settings import Settings
from fluxora_webhooks.supervisor import (
    METRICS_DIR_PREFIX,
    ConnectionBudget,
    _remove_orphaned_metrics_dirs,
    check_budget,
    connections_needed,
)

GOOD = {
    "WEBHOOK_URL": "https://hooks.example.com/in",
    "WEBHOOK_SECRET": "a-long-enough-secret-for-hmac-0123",
}


def test_workers_default_to_the_usable_cpus_at_most_16() -> None:
    assert Settings.from_env(GOOD).workers == min(len(os.sched_getaffinity(0)), 16)
    assert Settings.from_env({**GOOD, "WEBHOOK_WORKERS": "3"}).workers == 3
    assert Settings.from_env({**GOOD, "WEBHOOK_WORKERS": "64"}).workers == 64
    # Settings built in code describe one process, as before.
    assert Settings(webhook_url=GOOD["WEBHOOK_URL"], secret=b"x" * 32).workers == 1


def test_the_default_follows_the_affinity_mask_and_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(40)))
    assert host.default_workers() == 16
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert host.default_workers() == 1


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("0", "at least 1"),
        ("65", "at most 64"),
        ("two", "not a whole number"),
        ("", "set but empty"),
        ("-1", "must be at least 1, got -1"),
    ],
)
def test_invalid_workers_name_the_variable(value: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Settings.from_env({**GOOD, "WEBHOOK_WORKERS": value})
    assert caught.value.variable == "WEBHOOK_WORKERS"
    assert fragment in str(caught.value)


def test_connections_per_worker_are_its_claim_loops_its_spare_and_its_listener() -> None:
    assert connections_needed(1, 4) == 6 + 4
    assert connections_needed(8, 4) == 8 * 6 + 4


def test_workers_that_fit_pass_and_those_that_do_not_say_what_to_change() -> None:
    settings = Settings.from_env({**GOOD, "WEBHOOK_WORKERS": "4", "WEBHOOK_CLAIM_LOOPS": "4"})
    check_budget(settings, ConnectionBudget(max_connections=100, reserved=3, in_use=69))  # 28
    with pytest.raises(ConfigError) as caught:
        check_budget(settings, ConnectionBudget(max_connections=100, reserved=3, in_use=75))
    message = str(caught.value)
    assert caught.value.variable == "WEBHOOK_WORKERS"
    assert "4 workers x (4 claim loops + 2) + 4 = 28 database connections" in message
    assert "22 free (max_connections 100 - 3 reserved - 75 in use)" in message
    assert "lower WEBHOOK_WORKERS or WEBHOOK_CLAIM_LOOPS, or raise max_connections" in message


def test_the_open_files_limit_is_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        now = host.raise_open_files_limit()
        expected = hard if hard != resource.RLIM_INFINITY else 1 << 20
        assert now == expected
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == expected
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app:pw@db1:5432,db2:5433/app?target_session_attrs=read-write",
        "postgresql://app@db1,db2,db3/app?target_session_attrs=primary&connect_timeout=5",
        "host=db1,db2 port=5432,5433 dbname=app target_session_attrs=read-write",
    ],
)
def test_multi_host_database_urls_are_accepted(url: str) -> None:
    assert Settings.from_env({**GOOD, "DATABASE_URL": url}).database_url == url


def test_a_multi_host_url_is_scrubbed_like_any_other() -> None:
    from fluxora_webhooks import logs

    url = "postgresql://app:pw-not-shown-7@db1:5432,db2:5433/app?target_session_attrs=read-write"
    logs.add_sensitive_url(url)
    try:
        text = logs.scrub(f"cannot reach {url}; password=pw-not-shown-7")
    finally:
        logs.clear_sensitive()
    assert "pw-not-shown-7" not in text
    assert "postgresql://db1:5432,db2:5433" in text


def test_a_killed_supervisors_metrics_directory_is_removed_by_the_next_start(
    tmp_path: Path,
) -> None:
    """A supervisor killed with SIGKILL never removes its metrics directory; the next
    supervisor removes those whose supervisor is gone, and nothing else."""
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead_pid = int(gone.stdout)
    parent = str(tmp_path)
    orphan = os.path.join(parent, f"{METRICS_DIR_PREFIX}{dead_pid}-abc123")
    running = os.path.join(parent, f"{METRICS_DIR_PREFIX}{os.getppid()}-def456")
    # Named after this process's pid but not made by it: an earlier pid 1's in a container.
    earlier = os.path.join(parent, f"{METRICS_DIR_PREFIX}{os.getpid()}-ghi012")
    unnamed = os.path.join(parent, f"{METRICS_DIR_PREFIX}xyz789")
    other = os.path.join(parent, "something-else-1")
    for path in (orphan, running, earlier, unnamed, other):
        os.mkdir(path)
    with open(os.path.join(orphan, "counter_1.db"), "wb") as f:
        f.write(b"x")

    assert sorted(_remove_orphaned_metrics_dirs(parent)) == sorted([orphan, earlier])
    assert sorted(os.listdir(parent)) == sorted(
        os.path.basename(p) for p in (running, unnamed, other)
    )
