"""``fluxora-webhooks run`` with a dispatcher whose wall clock is ``CHAOS_CLOCK_SHIFT_S``
seconds off, injected (``python -m tests.support.skewed_run``)."""

from __future__ import annotations

import os
import sys
import time

from fluxora_webhooks import logs
from fluxora_webhooks.cli import main
from fluxora_webhooks.commands import run as run_command


def skewed_clock(shift_s: float) -> float:
    return time.time() + shift_s


if __name__ == "__main__":
    shift = float(os.environ.get("CHAOS_CLOCK_SHIFT_S") or 0)
    env = dict(os.environ)
    logs.configure(env.get("LOG_FORMAT", "text").strip().lower() or "text")
    if shift:
        print(f"tests.support.skewed_run: wall clock shifted by {shift:.0f}s", flush=True)
        sys.exit(run_command.serve(env, clock=lambda: skewed_clock(shift)))
    sys.exit(main(["run"]))
