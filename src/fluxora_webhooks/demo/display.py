"""What the demo shows: a live progress display (or plain lines), then the summary table."""

from __future__ import annotations

import time

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn
from rich.table import Table
from rich.text import Text

from ..terminal import cell
from .runner import DemoReport, Display, Snapshot

_PLAIN_EVERY_S = 1.0
_WIDTH = 78
_OK = "[green]✓[/]"
_FAILED = "[bold red]✗[/]"


class DemoDisplay(Display):
    """Live progress on a terminal; with ``live`` False, a plain line about once a second."""

    def __init__(self, console: Console, *, live: bool) -> None:
        self.console = console
        self.live = live
        self._live: Live | None = None
        self._progress = Progress(
            TextColumn("{task.description:<11}"),
            BarColumn(bar_width=36),
            MofNCompleteColumn(),
            console=console,
            auto_refresh=False,
        )
        self._writing: TaskID | None = None
        self._delivering: TaskID | None = None
        self._printed_at = 0.0
        self._last_line = ""

    def start(self, consumer_url: str) -> None:
        self.console.print(
            f"Consumer on {consumer_url}: verifies every signature, de-duplicates by delivery"
            " id, answers 503 to some first attempts."
        )
        if self.live:
            self._writing = self._progress.add_task("Writing", total=None)
            self._delivering = self._progress.add_task("Delivering", total=None)
            self._live = Live(console=self.console, auto_refresh=False, transient=False)
            self._live.start()

    def update(self, snapshot: Snapshot) -> None:
        if self._live is not None:
            self._live.update(self._render(snapshot), refresh=True)
            return
        now = time.monotonic()
        if now - self._printed_at >= _PLAIN_EVERY_S:
            self._printed_at = now
            self._print_line(snapshot)

    def stop(self, snapshot: Snapshot) -> None:
        if self._live is not None:
            self._live.update(self._render(snapshot), refresh=True)
            self._live.stop()
            self._live = None
        else:
            self._print_line(snapshot)

    def _render(self, s: Snapshot) -> Group:
        assert self._writing is not None and self._delivering is not None
        self._progress.update(self._writing, completed=s.written, total=s.planned)
        self._progress.update(self._delivering, completed=s.delivered, total=s.committed)
        return Group(self._progress, Text(_counters(s), style="dim"))

    def _print_line(self, s: Snapshot) -> None:
        line = (
            f"written {s.written}/{s.planned} · delivered {s.delivered}/{s.committed} · "
            + _counters(s)
        )
        if line != self._last_line:
            self._last_line = line
            self.console.print(line, highlight=False)


def _counters(s: Snapshot) -> str:
    return (
        f"rolled back {s.rolled_back} · 503s {s.refused} · retries {s.retries} · "
        f"duplicates {s.duplicates} · signature failures {s.signature_failures} · "
        f"{s.elapsed_s:.1f} s"
    )


def summary_table(report: DemoReport) -> Table:
    """The summary: counts, and a mark on each line a guarantee speaks about."""
    s = report.snapshot
    table = Table(title="Summary", title_justify="left", min_width=_WIDTH)
    table.add_column("what happened", no_wrap=True)
    table.add_column("count", justify="right", no_wrap=True)
    table.add_column("", no_wrap=True)

    def mark(ok: bool) -> str:
        return _OK if ok else _FAILED

    table.add_row("stream writes committed", str(s.committed), "each with its event")
    table.add_row("stream writes rolled back", str(s.rolled_back), "event enqueued, then undone")
    table.add_row(
        "delivered, signatures verified",
        f"{s.delivered}/{s.committed}",
        mark(report.missing == 0 and report.altered == 0),
    )
    table.add_row(
        "received from rolled-back writes",
        str(report.from_rolled_back + report.unknown),
        mark(report.from_rolled_back == 0 and report.unknown == 0),
    )
    table.add_row("first attempts answered 503", str(s.refused), "by the consumer, on purpose")
    table.add_row("retried", str(s.retries), "same delivery id, next attempt")
    table.add_row(
        "deferred by the rate limit", str(report.rate_limit_deferrals), "Redis, no attempt used"
    )
    table.add_row("duplicates seen by the consumer", str(s.duplicates), "de-duplicated by id")
    table.add_row("dead letters", str(report.dead_letters), mark(report.dead_letters == 0))
    table.add_row("signature failures", str(s.signature_failures), mark(s.signature_failures == 0))
    return table


def latency_table(report: DemoReport) -> Table:
    table = Table(title="Latency from commit to receipt", title_justify="left", min_width=_WIDTH)
    table.add_column("", no_wrap=True)
    for name in ("p50", "p95", "p99"):
        table.add_column(name, justify="right", no_wrap=True)
    for label, p in (
        ("first attempt received", report.latency_first_ms),
        ("delivered (retries included)", report.latency_delivered_ms),
    ):
        if p is None:
            table.add_row(label, "-", "-", "-")
        else:
            table.add_row(label, _ms(p.p50), _ms(p.p95), _ms(p.p99))
    return table


def _ms(value: float) -> str:
    return f"{value:.1f} ms" if value < 10 else f"{value:.0f} ms"


def print_summary(console: Console, report: DemoReport) -> None:
    console.print()
    console.print(summary_table(report))
    console.print(latency_table(report))
    o = report.options
    console.print(
        f"A retry waits for its delay ({o.retry_delay_ms} ms, +0-20 % jitter) and for its turn"
        f" under the Redis rate limit ({o.retry_rps} retries/s per consumer, first attempts"
        " included): hence the tail of the second line.",
        highlight=False,
    )
    checkers = "fluxora_webhooks.verify (both schemes)"
    if report.standard_library:
        checkers += " and the standardwebhooks package"
    console.print(f"Signatures checked with {checkers}.", highlight=False)
    if report.ok:
        console.print(
            "[bold green]OK[/]: every committed event was delivered and verified, nothing"
            " from a rolled-back write was sent, no dead letters, no signature failures.",
            highlight=False,
        )
        return
    console.print("[bold red]FAILED[/]: the result is not what the guarantees promise:")
    for problem in report.problems:
        # A problem may quote what a consumer or the database said: shown as data.
        console.print(cell(f"  - {problem}"), highlight=False)
