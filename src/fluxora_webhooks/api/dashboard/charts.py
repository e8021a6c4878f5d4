"""The overview's charts as data for server-rendered SVG (``templates/chart.html``): no
JavaScript library, nothing from elsewhere. Each line is a polyline scaled into the
chart's box; the template draws it with CSS classes (the CSP allows no inline style): a
colour and a dash pattern of its own (told apart without the colour), and the same values
as a table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .render import _when  # the times as the chart's axis shows them

WIDTH, HEIGHT = 560, 160
LEFT, RIGHT, TOP, BOTTOM = 48, 8, 10, 22  # LEFT: the least left margin
# The scale's labels (app.css: .tick, 10px) are drawn this far left of the plot; the left
# margin is their width at CHAR_W a character (more than the 10px glyphs of the fonts in
# use: "20,000 ms" is 53 wide in Chromium, 9 x 5.9) plus the gap and PAD.
GAP, PAD, CHAR_W = 4, 2, 7
# Each line's dash pattern, in the order of the chart's lines (app.css: stroke-dasharray).
PATTERNS = ("p-solid", "p-dash", "p-dot")
# The most rows a chart's table has (the stats have 30 buckets): the latest ones.
TABLE_ROWS = 60


@dataclass(frozen=True)
class Line:
    label: str
    css: str
    points: str
    shown: str  # the legend's value and what it is ("15 in the last 1 hour")
    dots: tuple[tuple[str, str], ...] = ()  # a lone value shows as a dot, not a line
    pattern: str = PATTERNS[0]


@dataclass(frozen=True)
class Chart:
    title: str
    unit: str
    top: str  # the value at the top of the scale
    lines: tuple[Line, ...]
    start: str
    end: str
    rows: tuple[tuple[Any, tuple[str, ...]], ...] = ()  # (bucket's end, each line's value)
    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    bottom_y: int = HEIGHT - BOTTOM
    right_x: int = WIDTH - RIGHT
    top_y: int = TOP


def _nice(value: float) -> float:
    """The next round number at or above ``value`` (1, 2, 5 x a power of ten)."""
    if value <= 0:
        return 1.0
    power = 1.0
    while power * 10 <= value:
        power *= 10
    while power > value:
        power /= 10
    for step in (1, 2, 5, 10):
        if step * power >= value:
            return step * power
    return 10 * power


def _fmt(value: float, unit: str) -> str:
    text = f"{value:,.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"
    return f"{text} {unit}".strip()


def _span(seconds: float) -> str:
    """A bucket's length, short: 30 s, 2 min, 48 min, 5.6 h."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f}".removesuffix(".0") + " h"


def left_margin(*labels: str) -> int:
    """The left margin that holds the longest of the scale's ``labels``."""
    return max(LEFT, CHAR_W * max(map(len, labels), default=0) + GAP + PAD)


def chart(
    title: str,
    unit: str,
    series: list[dict[str, Any]],
    keys: list[tuple[str, str, str]],
    *,
    summary: str = "latest",
    window: str = "",
    bucket: str = "",
) -> Chart:
    """One chart of ``keys`` = [(field, label, css class)] over the buckets of ``series``;
    a bucket without a value (no delivery in it) leaves a gap in its line. The legend
    shows, by ``summary``: "total", the sum of the buckets (``window`` names the window:
    "1 hour"); "now", the last bucket's value (it ends now); "latest", the last value in a
    bucket (``bucket`` is a bucket's length: "2 min"), and which bucket that is."""
    values = [float(b[k]) for b in series for k, _, _ in keys if b.get(k) is not None]
    top = _nice(max(values, default=0.0))
    top_label = _fmt(top, unit)
    left = left_margin(top_label, "0")
    span_x = WIDTH - left - RIGHT
    span_y = HEIGHT - TOP - BOTTOM
    n = max(1, len(series) - 1)
    lines = []
    for index, (key, label, css) in enumerate(keys):
        points: list[tuple[str, str]] = []
        for i, part in enumerate(series):
            value = part.get(key)
            if value is None:
                continue
            x = left + span_x * i / n
            y = TOP + span_y * (1 - float(value) / top)
            points.append((f"{x:.1f}", f"{y:.1f}"))
        shown = _summary(series, key, unit, summary, window, bucket)
        line = " ".join(f"{x},{y}" for x, y in points)
        dots = tuple(points) if len(points) <= 60 else ()
        pattern = PATTERNS[index % len(PATTERNS)]
        lines.append(Line(label, css, line, shown, dots, pattern))
    start = series[0]["at"] if series else ""
    end = series[-1]["at"] if series else ""
    rows = tuple(
        (b["at"], tuple("-" if b.get(k) is None else _fmt(float(b[k]), unit) for k, _, _ in keys))
        for b in series[-TABLE_ROWS:]
    )
    return Chart(title, unit, top_label, tuple(lines), start, end, rows, left=left)


def _summary(
    series: list[dict[str, Any]], key: str, unit: str, summary: str, window: str, bucket: str
) -> str:
    """The legend's value of one line, and what it is (see :func:`chart`)."""
    window = window.removeprefix("1 ")  # "in the last hour"
    if summary == "total":
        total = sum(float(b[key]) for b in series if b.get(key) is not None)
        return f"{_fmt(total, unit)} in the last {window}".strip()
    if summary == "now":
        last = series[-1].get(key) if series else None
        return "-" if last is None else f"{_fmt(float(last), unit)} now"
    with_value = [i for i, b in enumerate(series) if b.get(key) is not None]
    found = with_value[-1] if with_value else None
    if found is None:
        return f"- in the last {window}".strip()
    value = _fmt(float(series[found][key]), unit)
    if found == len(series) - 1:
        return f"{value} in the last {bucket}"
    return f"{value} in the {bucket} to {_when(series[found]['at'])}"


def overview_charts(
    series: list[dict[str, Any]], window_ms: int = 3_600_000, window: str = "1 hour"
) -> list[Chart]:
    """The overview's four charts of ``series`` (the window of ``window_ms``, named
    ``window``, in equal buckets)."""
    bucket = _span(window_ms / 1000 / max(1, len(series)))
    named = {"window": window, "bucket": bucket}
    return [
        chart(
            "Throughput (attempts per bucket)",
            "",
            series,
            [
                ("delivered", "delivered", "c-ok"),
                ("retry", "retry", "c-warn"),
                ("dead_letter", "dead letter", "c-bad"),
            ],
            summary="total",
            **named,
        ),
        chart(
            "Latency, enqueue to delivery",
            "ms",
            series,
            [("latency_p50_ms", "p50", "c-ok"), ("latency_p95_ms", "p95", "c-warn")],
            summary="latest",
            **named,
        ),
        chart(
            "Backlog",
            "",
            series,
            [("backlog", "pending deliveries", "c-info")],
            summary="now",
            **named,
        ),
        chart(
            "Dead letters",
            "",
            series,
            [("dead_letters", "dead-lettered", "c-bad")],
            summary="total",
            **named,
        ),
    ]
