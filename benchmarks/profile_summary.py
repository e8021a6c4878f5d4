"""Summarise a py-spy ``--format raw`` profile (collapsed stacks) of a dispatcher process.

    python benchmarks/profile_summary.py benchmarks/results/profile-<id>-1p.txt

Idle samples (the event loop waiting in epoll) are left out; what remains is where the
dispatcher's CPU goes, grouped by the part of the work it belongs to.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

# First matching marker (searched in the stack from the innermost frame out) names the part.
PARTS = (
    ("Signer.headers", "signing (two HMAC-SHA256)"),
    ("redis", "Redis gate (redis-py)"),
    ("psycopg", "PostgreSQL (psycopg)"),
    ("aiohttp", "HTTP client (aiohttp)"),
    ("fluxora_webhooks/httpclient.py", "HTTP client (ours, httptools)"),
    ("fluxora_webhooks/delivery.py", "HTTP client (ours, httptools)"),
    ("prometheus_client", "metrics"),
    ("logging", "logging"),
    ("fluxora_webhooks", "dispatcher's own code"),
    ("asyncio", "event loop (asyncio/uvloop)"),
)
IDLE = ("epoll_wait", "epoll_pwait", "select (selectors", "Runner.run (asyncio/runners.py")


def part_of(frames: list[str]) -> str:
    for frame in reversed(frames):
        for marker, name in PARTS:
            if marker in frame:
                return name
    return "other"


def summarise(path: Path, top: int) -> str:
    parts: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    total = idle = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        if frames[-1].startswith(IDLE):
            idle += n
            continue
        parts[part_of(frames)] += n
        leaves[frames[-1]] += n
    busy = total - idle
    out = [f"{total} samples, {busy} busy ({100 * busy / max(total, 1):.0f} %)", ""]
    out.append("| part | share of busy samples |")
    out.append("|---|---:|")
    out += [f"| {name} | {100 * n / busy:.1f} % |" for name, n in parts.most_common()]
    out.append("")
    out.append("top functions (self):")
    out += [f"  {100 * n / busy:5.1f} %  {name}" for name, n in leaves.most_common(top)]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    print(summarise(args.profile, args.top))


if __name__ == "__main__":
    main()
