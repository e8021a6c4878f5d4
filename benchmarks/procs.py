"""Child processes of the benchmark (receiver, clients, dispatchers, peers) and their CPU.

Every child is started here, remembered, and stopped by its own pid when the run ends,
however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import psutil
except ImportError:  # pragma: no cover - psutil is optional: CPU shares are then omitted
    psutil = None

HERE = Path(__file__).resolve().parent


@dataclass
class Child:
    name: str
    proc: asyncio.subprocess.Process
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    async def wait_for_line(self, prefix: str, timeout: float) -> str:
        """The first line of the child's output starting with ``prefix``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log().splitlines():
                if line.startswith(prefix):
                    return line
            if self.proc.returncode is not None:
                break
            await asyncio.sleep(0.02)
        raise RuntimeError(f"{self.name} did not print {prefix!r}:\n{self.log()[-3000:]}")

    async def stop(self, timeout: float = 20.0, sig: int = signal.SIGTERM) -> int | None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
        return self.proc.returncode


@dataclass
class Children:
    log_dir: Path
    started: list[Child] = field(default_factory=list)

    async def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                env=env if env is not None else dict(os.environ),
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL,
            )
        child = Child(name, proc, log_path)
        self.started.append(child)
        return child

    async def script(self, name: str, script: str, *args: str) -> Child:
        return await self.spawn(name, [sys.executable, str(HERE / script), *args])

    async def stop_all(self) -> None:
        await asyncio.gather(*(c.stop() for c in self.started), return_exceptions=True)


class CpuMeter:
    """CPU seconds spent by groups of processes between :meth:`start` and :meth:`stop`.

    PostgreSQL and Redis are found by process name (their backends come and go); our
    children by pid. The shares say what is busy when a run tops out.
    """

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self.begin: dict[str, dict[int, float]] = {}
        self.wall = 0.0
        self.result: dict[str, float] = {}

    @staticmethod
    def available() -> bool:
        return psutil is not None

    def _sample(self) -> dict[str, dict[int, float]]:
        """CPU seconds per process, by group; ``machine`` is the whole machine (pid 0)."""
        out: dict[str, dict[int, float]] = {}
        if psutil is None:
            return out
        by_name: dict[str, dict[int, float]] = {"postgres": {}, "redis": {}}
        for proc in psutil.process_iter(["name", "cpu_times"]):
            name = proc.info["name"] or ""
            times = proc.info["cpu_times"]
            if times is None:
                continue
            for prefix, group in by_name.items():
                if name.startswith(prefix):
                    group[proc.pid] = times.user + times.system
        out.update(by_name)
        # Everything the machine did, ours or not: when this is well above the sum of the
        # groups, something else (another test run) was competing for the cores.
        cpu = psutil.cpu_times()
        busy = (
            cpu.user
            + cpu.system
            + sum(getattr(cpu, f, 0.0) for f in ("nice", "irq", "softirq", "steal"))
        )
        out["machine"] = {0: busy}
        for group, pids in self.groups.items():
            found: dict[int, float] = {}
            for pid in pids:
                with contextlib.suppress(Exception):
                    t: Any = psutil.Process(pid).cpu_times()
                    found[pid] = t.user + t.system
            out[group] = found
        return out

    def start(self) -> None:
        self.begin = self._sample()
        self.wall = time.perf_counter()

    def stop(self) -> dict[str, float]:
        end = self._sample()
        wall = time.perf_counter() - self.wall
        if wall <= 0:
            return {}
        # Per process: a process that started meanwhile counts from 0, one that ended
        # meanwhile is left out (it cannot be read any more), so no share goes negative.
        # CPU share of one core, in percent (200 % is both cores of this machine).
        self.result = {}
        for group, procs in end.items():
            before = self.begin.get(group, {})
            spent = sum(max(0.0, t - before.get(pid, 0.0)) for pid, t in procs.items())
            self.result[group] = round(100 * spent / wall, 1)
        return self.result


def process_tree(pid: int) -> list[int]:
    """The pid and every descendant's (a ``run`` supervisor and its workers)."""
    if psutil is None:
        return [pid]
    try:
        parent = psutil.Process(pid)
        return [pid, *(c.pid for c in parent.children(recursive=True))]
    except psutil.Error:
        return [pid]


class RssSampler:
    """Resident memory of processes, sampled every ``interval`` seconds while it runs.

    ``peak_mb`` is each process's highest sample; ``first_mb``/``last_mb`` the first and last
    sample, so a run shows whether memory stays flat or grows while a backlog drains.
    """

    def __init__(self, pids: list[int], interval: float = 0.25) -> None:
        self.pids = pids
        self.interval = interval
        self.samples: dict[int, list[float]] = {pid: [] for pid in pids}
        self._task: asyncio.Task[None] | None = None

    def _sample(self) -> None:
        if psutil is None:
            return
        for pid in self.pids:
            with contextlib.suppress(psutil.Error):
                self.samples[pid].append(psutil.Process(pid).memory_info().rss / 2**20)

    async def _loop(self) -> None:
        while True:
            self._sample()
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._sample()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> dict[str, Any]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._sample()
        kept = {pid: s for pid, s in self.samples.items() if s}
        if not kept:
            return {}
        return {
            "processes": len(kept),
            "peak_mb": round(max(max(s) for s in kept.values()), 1),
            "per_process_peak_mb": [round(max(s), 1) for s in kept.values()],
            "first_mb": [round(s[0], 1) for s in kept.values()],
            "last_mb": [round(s[-1], 1) for s in kept.values()],
        }
