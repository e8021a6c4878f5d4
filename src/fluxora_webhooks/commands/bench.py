"""``fluxora-webhooks bench``: run the benchmark in ``benchmarks/`` of a source checkout.

The benchmark is not part of the installed package (it drives pgqueuer, matplotlib and
child processes); this command finds ``benchmarks/run.py`` and runs it with the same
interpreter, passing the remaining arguments through (``--quick``, ``--help``, ...).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

NAME = "bench"
HELP = "measure throughput and latency against the raw HTTP limit and a peer"
# Every argument after "bench" goes to benchmarks/run.py as it is (its own --help too).
PASSTHROUGH = True

_WHERE = "run from a source checkout (make bench), or set FLUXORA_BENCH_DIR"


def find_benchmarks(env: Mapping[str, str]) -> Path | None:
    """``$FLUXORA_BENCH_DIR``, else ``benchmarks/`` under the working directory, else beside
    the source tree this package was installed from (an editable install)."""
    candidates = []
    if env.get("FLUXORA_BENCH_DIR", "").strip():
        candidates.append(Path(env["FLUXORA_BENCH_DIR"].strip()))
    candidates.append(Path.cwd() / "benchmarks")
    candidates.append(Path(__file__).resolve().parents[3] / "benchmarks")
    for folder in candidates:
        if (folder / "run.py").is_file():
            return folder
    return None


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="options of benchmarks/run.py")


def run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    folder = find_benchmarks(env)
    if folder is None:
        print(f"fluxora-webhooks bench: benchmarks/run.py not found; {_WHERE}", file=sys.stderr)
        return 2
    rest = list(args.rest or [])
    if rest[:1] == ["--"]:  # `fluxora-webhooks bench -- --quick`: argparse keeps the "--"
        rest = rest[1:]
    try:
        return subprocess.call([sys.executable, str(folder / "run.py"), *rest], env=dict(env))
    except KeyboardInterrupt:
        return 130
