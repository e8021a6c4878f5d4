"""A library's logger that writes a line per retry is thinned out: one line per kind a
minute, the next one saying how many were left out (logs.Repeats, installed by
logs.configure on psycopg_pool's logger)."""

from __future__ import annotations

import logging

import pytest

from fluxora_webhooks import logs


def test_repeats_of_a_kind_are_left_out_and_counted_on_the_next_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    logger = logging.getLogger("test.repeats")
    repeats = logs.Repeats(window_s=60, clock=lambda: now[0])
    logger.addFilter(repeats)
    try:
        with caplog.at_level(logging.INFO, logger="test.repeats"):
            for attempt in range(5):
                logger.warning("error connecting in %r: %s", "pool-1", f"refused {attempt}")
                now[0] += 1
            logger.warning("discarding broken connection: %s", "c1")  # another kind
            logger.info("growing pool %r to %s", "pool-1", 2)  # below WARNING: all kept
            logger.info("growing pool %r to %s", "pool-1", 3)
            now[0] += 60
            logger.warning("error connecting in %r: %s", "pool-1", "refused 5")
            logger.warning("error connecting in %r: %s", "pool-1", "refused 6")
    finally:
        logger.removeFilter(repeats)
    assert [r.getMessage() for r in caplog.records] == [
        "error connecting in 'pool-1': refused 0",
        "discarding broken connection: c1",
        "growing pool 'pool-1' to 2",
        "growing pool 'pool-1' to 3",
        "error connecting in 'pool-1': refused 5 (4 more like it since the last one, not logged)",
    ]


def test_configure_thins_out_psycopg_pool_once() -> None:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        logs.configure("text", "INFO")
        logs.configure("text", "INFO")
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    pool = logging.getLogger("psycopg.pool")
    assert sum(isinstance(f, logs.Repeats) for f in pool.filters) == 1
