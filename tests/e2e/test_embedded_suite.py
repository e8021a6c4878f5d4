"""The suite runs where neither PostgreSQL nor Redis is installed: on the embedded engines."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


async def test_a_slice_of_the_suite_passes_on_the_embedded_engines() -> None:
    # Under /tmp, not pytest's tmp_path: the embedded PostgreSQL's own account must reach it.
    home = Path(tempfile.mkdtemp(prefix="fluxora-embedded-suite-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLUXORA_TEST_", "PYTEST_"))}
    env.update(FLUXORA_TEST_ENGINES="embedded", FLUXORA_TEST_HOME=str(home / "engines"))
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
            "tests/integration/test_delivery_basic.py", "tests/e2e/test_cli.py",
            "tests/integration/test_breaker.py",
            cwd=ROOT, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(proc.communicate(), 240)
        text = out.decode(errors="replace")
        assert proc.returncode == 0, text
        assert " passed" in text and "skipped" not in text, text
        # It really ran on the embedded engines, and stopped them when it was done.
        assert (home / "engines" / "postgres" / "PG_VERSION").exists()
        assert (home / "engines" / "redis").is_dir()
    finally:
        shutil.rmtree(home, ignore_errors=True)
