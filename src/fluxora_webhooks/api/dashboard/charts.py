"""The overview's charts as data for server-rendered SVG (``templates/chart.html``): no
JavaScript library, nothing from elsewhere. Each line is a polyline scaled into the
chart's box; the template draws it with CSS classes (the CSP allows no inline style): a
colour and a dash pattern of its own (told apart without the colour), and the same values
as a table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

WIDTH, HEIGHT = 560, 160
LEFT, RIGHT, TOP, BOTTOM = 48, 8, 10, 22
# Each line's dash pattern, in the order of the chart's lines (app.css: stroke-dasharray).
PATTERNS = ("p-solid", "p-dash", "p-dot")
# The most rows a chart's table has (the stats have 30 buckets): the latest ones.
TABLE_ROWS = 60


@dataclass(frozen=True)
class Line:
    label: str
    css: str
    points: str
    last: str
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


def chart(
    title: str, unit: str, series: list[dict[str, Any]], keys: list[tuple[str, str, str]]
) -> Chart:
    """One chart of ``keys`` = [(field, label, css class)] over the buckets of ``series``;
    a bucket without a value (no delivery in it) leaves a gap in its line."""
    values = [float(b[k]) for b in series for k, _, _ in keys if b.get(k) is not None]
    top = _nice(max(values, default=0.0))
    span_x = WIDTH - LEFT - RIGHT
    span_y = HEIGHT - TOP - BOTTOM
    n = max(1, len(series) - 1)
    lines = []
    for index, (key, label, css) in enumerate(keys):
        points: list[tuple[str, str]] = []
        for i, bucket in enumerate(series):
            value = bucket.get(key)
            if value is None:
                continue
            x = LEFT + span_x * i / n
            y = TOP + span_y * (1 - float(value) / top)
            points.append((f"{x:.1f}", f"{y:.1f}"))
        last = next((b[key] for b in reversed(series) if b.get(key) is not None), None)
        shown = "-" if last is None else _fmt(float(last), unit)
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
    return Chart(title, unit, _fmt(top, unit), tuple(lines), start, end, rows)


def overview_charts(series: list[dict[str, Any]]) -> list[Chart]:
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
        ),
        chart(
            "Latency, enqueue to delivery",
            "ms",
            series,
            [("latency_p50_ms", "p50", "c-ok"), ("latency_p95_ms", "p95", "c-warn")],
        ),
        chart("Backlog", "", series, [("backlog", "pending deliveries", "c-info")]),
        chart("Dead letters", "", series, [("dead_letters", "dead-lettered", "c-bad")]),
    ]
