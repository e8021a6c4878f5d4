"""The partitioned outbox (SPEC 16): installed or converted in place with every row kept,
delivering as before; partitions made ahead; retention dropping whole partitions while
deliveries continue, never one that holds an unprocessed row."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
from typing import Any

import psycopg
import pytest

from fluxora_webhooks import partitions
from fluxora_webhooks.migrations import check_schema
from fluxora_webhooks.ops import read_backlog
from fluxora_webhooks.service import warn_if_not_vacuumed
from tests.support.dispatch import (
    delivered,
    enqueue_many,
    make_settings,
    pending,
    rows,
    running_dispatcher,
    scalar,
    wait_until,
)
from tests.support.procs import command_env, run_command
from tests.support.receiver import Receiver

pytestmark = pytest.mark.integration

DAY = 86_400_000


async def _partitions(database_url: str) -> list[str]:
    found = await rows(
        database_url,
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " WHERE i.inhparent = 'webhook_outbox'::regclass ORDER BY 1",
    )
    return [r[0] for r in found]


async def test_an_existing_outbox_is_converted_in_place_with_every_row_kept(
    database_url: str, receiver: Receiver
) -> None:
    settings = make_settings(receiver.url)
    async with running_dispatcher(settings, database_url):
        await enqueue_many(database_url, 50)
        await receiver.wait_for(50)
        await wait_until(lambda: _eq(delivered(database_url), 50), what="delivered")
    await enqueue_many(database_url, 30)  # pending while the outbox is converted
    before = await rows(database_url, "SELECT id, delivery_id, processed FROM webhook_outbox")
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        assert (await read_backlog(conn)).default_partition_rows is None  # not partitioned
        assert await partitions.convert(conn, interval_ms=DAY) is True
        assert await partitions.convert(conn, interval_ms=DAY) is False  # idempotent
        assert (await read_backlog(conn)).default_partition_rows == 0
        assert (await partitions.layout(conn)).interval_ms == DAY
        await check_schema(conn)
    after = await rows(database_url, "SELECT id, delivery_id, processed FROM webhook_outbox")
    assert sorted(before) == sorted(after)
    names = await _partitions(database_url)
    assert partitions.LEGACY in names and partitions.DEFAULT in names
    assert len(names) >= 3  # legacy, default, and partitions ahead of the legacy range
    async with running_dispatcher(settings, database_url):
        await receiver.wait_for(80)
        await enqueue_many(database_url, 20)  # written into the new partitions
        await receiver.wait_for(100)
        await wait_until(lambda: _eq(delivered(database_url), 100), what="delivered")
    assert await pending(database_url) == 0
    # The old table's range runs a little ahead (rows written while converting fit it);
    # a row written after it lands in its own partition, never in the default one.
    in_legacy = await scalar(database_url, f"SELECT count(*) FROM {partitions.LEGACY}")
    assert in_legacy == 100
    await scalar(
        database_url,
        "INSERT INTO webhook_outbox (stream_id, event_type, payload, partition_at, processed)"
        " SELECT 'later', 'stream.updated', '{}', legacy_until + interval '1 hour', true"
        " FROM fluxora_outbox_partitioning RETURNING tableoid::regclass::text",
    )
    later = await scalar(
        database_url,
        "SELECT tableoid::regclass::text FROM webhook_outbox WHERE stream_id = 'later'",
    )
    assert later.startswith("webhook_outbox_p")
    assert await scalar(database_url, f"SELECT count(*) FROM {partitions.DEFAULT}") == 0


async def _partitioned_from_five_days_ago(conn: psycopg.AsyncConnection[Any]) -> dt.datetime:
    """The outbox converted to daily partitions from the day five days ago (returned)."""
    cur = await conn.execute("SELECT date_trunc('day', now()) - interval '5 days'")
    row = await cur.fetchone()
    assert row is not None
    day: dt.datetime = row[0]
    await partitions.convert(conn, interval_ms=DAY, first_partition_at=day)
    return day


async def test_retention_drops_old_processed_partitions_and_keeps_one_with_a_pending_row(
    database_url: str, receiver: Receiver
) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        five_days_ago = await _partitioned_from_five_days_ago(conn)
        for day in range(5):  # the partitions of the last five days (as time would have)
            await partitions.create_partition(conn, five_days_ago + dt.timedelta(days=day), DAY)
        # Processed history on each past day; one row on day -4 is still pending (parked).
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, partition_at,"
            " processed, processed_at, outcome, endpoint_id)"
            " SELECT 's', 'stream.updated', '{}', %s + d * interval '1 day' + interval '1 hour',"
            " true, %s + d * interval '1 day' + interval '2 hours', 'delivered', 'default'"
            " FROM generate_series(0, 4) d, generate_series(1, 100) n",
            (five_days_ago, five_days_ago),
        )
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, partition_at,"
            " endpoint_id, hold, created_at)"
            " VALUES ('kept', 'stream.updated', '{}', %s, 'gone-endpoint', 'parked', 'infinity')",
            (five_days_ago + dt.timedelta(days=1, hours=3),),
        )
    settings = make_settings(receiver.url)
    async with running_dispatcher(settings, database_url):
        producing = asyncio.create_task(_produce(database_url, 200))
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            dropped, kept = await partitions.drop_expired(conn, older_than_ms=2 * DAY)
        await producing
        await receiver.wait_for(200)
    names = {d.name for d in dropped}
    days = [partitions.partition_name(five_days_ago + dt.timedelta(days=i)) for i in range(5)]
    assert names == {days[0], days[2]}  # day -4 holds a parked row; -2 and -1 are recent
    assert kept == [days[1]]
    assert all(d.rows == 100 for d in dropped)
    assert (
        await scalar(database_url, "SELECT count(*) FROM webhook_outbox WHERE stream_id = 'kept'")
        == 1
    )
    # Nothing unprocessed was dropped, and the deliveries that ran meanwhile are all there.
    assert await delivered(database_url) == 200 + 300  # the new ones + days -4, -2 and -1
    remaining = set(await _partitions(database_url))
    assert not names & remaining and days[1] in remaining


async def test_prune_drops_expired_partitions_and_leaves_the_later_ones_rows_to_their_drop(
    database_url: str,
) -> None:
    """`prune` on a partitioned outbox: the partitions whose range ended before the cutoff
    go whole; the rows of the partition that holds the cutoff (and of later ones) are not
    deleted one by one, though processed before the cutoff, since their partition will be
    dropped whole once it expires; the old table's rows from before the conversion, which
    no drop ever takes, are deleted as rows."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, partition_at,"
            " processed, processed_at, outcome, endpoint_id)"
            " SELECT 'old', 'stream.updated', '{}', now() - interval '11 days', true,"
            " now() - interval '10 days', 'delivered', 'default' FROM generate_series(1, 30)"
        )
        cur = await conn.execute("SELECT date_trunc('day', now()) - interval '5 days', now()")
        row = await cur.fetchone()
        assert row is not None
        five_days_ago, now = row
        await partitions.convert(conn, interval_ms=DAY, first_partition_at=five_days_ago)
        for day in range(5):
            await partitions.create_partition(conn, five_days_ago + dt.timedelta(days=day), DAY)
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, partition_at,"
            " processed, processed_at, outcome, endpoint_id)"
            " SELECT 'day' || d, 'stream.updated', '{}',"
            " %s + d * interval '1 day' + interval '1 hour', true,"
            " %s + d * interval '1 day' + interval '2 hours', 'delivered', 'default'"
            " FROM generate_series(0, 4) d, generate_series(1, 100) n",
            (five_days_ago, five_days_ago),
        )
        # Day 0 still holds a parked delivery: kept, said so, its processed rows deleted.
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, partition_at,"
            " endpoint_id, hold, created_at)"
            " VALUES ('kept', 'stream.updated', '{}', %s, 'gone-endpoint', 'parked', 'infinity')",
            (five_days_ago + dt.timedelta(hours=3),),
        )
    # The cutoff at noon of day 2 (of 0-4): days 0 and 1 have ended before it.
    cutoff = five_days_ago + dt.timedelta(days=2, hours=12)
    older_than_ms = int((now - cutoff).total_seconds() * 1000)
    env = command_env(DATABASE_URL=database_url)
    days = [partitions.partition_name(five_days_ago + dt.timedelta(days=i)) for i in range(5)]
    args = ("prune", "--older-than", f"{older_than_ms}ms", "--json")
    code, out = await run_command(*args, "--dry-run", env=env)
    assert code == 0, out
    dry = json.loads(out.strip().splitlines()[-1])
    # The rows it would delete: the old table's and the kept day 0's processed ones.
    assert dry["dry_run"] is True and dry["outbox_rows"] == 130
    assert [(d["name"], d["rows"]) for d in dry["partitions_dropped"]] == [(days[1], 100)]
    assert dry["partitions_kept"] == [days[0]]
    code, out = await run_command(*args[:-1], "--dry-run", env=env)
    assert f"kept outbox partition {days[0]}: it still holds a row not processed" in out, out
    assert await scalar(database_url, "SELECT count(*) FROM webhook_outbox") == 531
    # A dispatcher making partitions holds their lock a moment: prune waits for it, rather
    # than skip the drops and delete those partitions' rows one by one.
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as holder:
        await holder.execute("SELECT pg_advisory_lock(%s)", (partitions.PARTITION_LOCK_KEY,))
        pruning = asyncio.ensure_future(run_command(*args, env=env))

        async def waits() -> bool:
            waiting = await scalar(
                database_url,
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory'"
                " AND datname = current_database()",
            )
            return bool(waiting == 1)

        await wait_until(waits, 30, "prune waiting for the partitions' lock")
        await holder.execute("SELECT pg_advisory_unlock(%s)", (partitions.PARTITION_LOCK_KEY,))
    code, out = await asyncio.wait_for(pruning, 60)
    assert code == 0, out
    assert "waiting for another process to finish with the outbox's partitions" in out, out
    result = json.loads(out.strip().splitlines()[-1])  # after the log lines (stderr)
    assert [(d["name"], d["rows"]) for d in result["partitions_dropped"]] == [(days[1], 100)]
    assert result["partitions_kept"] == [days[0]]
    assert result["outbox_rows"] == 130  # the old table's and day 0's, and no row of day 2
    left = dict(
        await rows(database_url, "SELECT stream_id, count(*) FROM webhook_outbox GROUP BY 1")
    )
    assert left == {"kept": 1, "day2": 100, "day3": 100, "day4": 100}
    remaining = set(await _partitions(database_url))
    assert days[1] not in remaining and days[0] in remaining


async def test_a_new_installation_can_be_partitioned_from_the_start(
    empty_database_url: str,
) -> None:
    env = command_env(DATABASE_URL=empty_database_url)
    code, out = await run_command("migrate", "--partitioned", "--partition-interval", "1h", env=env)
    assert code == 0, out
    assert "partitioned (converted now)" in out
    # Nothing to keep: the first partition is the current hour's, no legacy range ahead
    # (whose rows retention could only delete one by one).
    assert await scalar(
        empty_database_url,
        "SELECT legacy_until = to_timestamp(floor(extract(epoch FROM now()) / 3600) * 3600)"
        f" FROM {partitions.CONFIG}",
    )
    code, out = await run_command("migrate", "--partitioned", env=env)
    assert code == 0 and "(converted now)" not in out, out
    assert "its partitions are 1h each" in out and "not applied" not in out
    # A 1d asked of an outbox partitioned by the hour: said, not done.
    code, out = await run_command("migrate", "--partitioned", "--partition-interval", "1d", env=env)
    assert code == 0 and "its partitions stay 1h each" in out and "1d is not applied" in out
    # Without --partitioned the interval would be ignored: refused instead.
    code, out = await run_command("migrate", "--partition-interval", "2h", env=env)
    assert code == 2 and "--partition-interval: applies only with --partitioned" in out, out
    code, out = await run_command(
        "migrate", "--partition-interval", "10m", "--partitioned", env=env
    )
    assert code == 2 and "--partition-interval" in out, out
    async with await psycopg.AsyncConnection.connect(empty_database_url, autocommit=True) as c:
        assert (await partitions.layout(c)).interval_ms == 3_600_000


async def _rows_in_the_default_partition(
    url: str, ahead: str, first: int, last: int
) -> list[tuple[Any, ...]]:
    """An outbox partitioned by the hour with no partition made ahead yet, and rows ``g``
    from ``first`` to ``last`` written ``ahead`` of now (SQL, of ``g``): they go to the
    default partition. Returns their (id, delivery_id)."""
    code, out = await run_command(
        "migrate", "--partitioned", "--partition-interval", "1h",
        env=command_env(DATABASE_URL=url),
    )  # fmt: skip
    assert code == 0, out
    await scalar(
        url,
        "INSERT INTO webhook_outbox (stream_id, event_type, payload, partition_at)"
        f" SELECT 's' || g, 'stream.updated', '{{}}', now() + {ahead}"
        f" FROM generate_series({first}, {last}) g RETURNING 1",
    )
    in_default = await scalar(url, "SELECT count(*) FROM webhook_outbox_default")
    assert in_default == last - first + 1
    return await rows(url, "SELECT id, delivery_id FROM webhook_outbox ORDER BY id")


async def test_rows_in_the_default_partition_move_into_the_partition_made_for_them(
    empty_database_url: str,
) -> None:
    """No dispatcher made partitions ahead for a while (all of them down), so producers'
    rows went to the default partition: the partition of their range is still made (they
    move into it), and so is every later one; nothing is lost."""
    url = empty_database_url
    before = await _rows_in_the_default_partition(url, "interval '5 hours 30 minutes'", 1, 3)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        # What the gauge fluxora_webhook_outbox_default_partition_rows reads.
        assert (await read_backlog(conn)).default_partition_rows == 3
        made = await partitions.ensure_ahead(conn, ahead=8)
        await check_schema(conn)
        assert (await read_backlog(conn)).default_partition_rows == 0
        at = await (await conn.execute("SELECT now() + interval '5 hours 30 minutes'")).fetchone()
    assert at is not None
    home = partitions.partition_name(partitions._bounds(at[0], 3_600_000)[0])
    assert home in made and len(made) >= 4  # it, and the ones after it
    assert await scalar(url, "SELECT count(*) FROM webhook_outbox_default") == 0
    placed = await rows(url, "SELECT DISTINCT tableoid::regclass::text FROM webhook_outbox")
    assert placed == [(home,)]
    assert await rows(url, "SELECT id, delivery_id FROM webhook_outbox ORDER BY id") == before
    assert await scalar(url, "SELECT count(*) FROM webhook_outbox WHERE NOT processed") == 3


async def test_rows_of_intervals_passed_while_no_dispatcher_ran_get_their_partitions_too(
    empty_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows that went to the default partition for intervals that have passed by the time
    a dispatcher makes partitions again (all of them down past those intervals) move into
    partitions made for them, not only rows of the intervals ahead: the default partition
    is left empty (its gauge and alert at rest), nothing lost."""
    url = empty_database_url
    before = await _rows_in_the_default_partition(url, "g * interval '1 hour 50 minutes'", 3, 4)
    real_now = partitions._db_now

    async def later(conn: psycopg.AsyncConnection[Any]) -> dt.datetime:
        # Ten hours on: the dispatchers start again after those rows' intervals passed.
        return await real_now(conn) + dt.timedelta(hours=10)

    monkeypatch.setattr(partitions, "_db_now", later)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        made = await partitions.ensure_ahead(conn, ahead=2)
        await check_schema(conn)
        assert (await read_backlog(conn)).default_partition_rows == 0
        cur = await conn.execute(
            "SELECT now() + interval '5 hours 30 minutes', now() + interval '7 hours 20 minutes'"
        )
        at = await cur.fetchone()
        current = partitions.partition_name(partitions._bounds(await later(conn), 3_600_000)[0])
    assert at is not None
    homes = [partitions.partition_name(partitions._bounds(t, 3_600_000)[0]) for t in at]
    assert set(homes) <= set(made), (homes, made)
    placed = await rows(url, "SELECT tableoid::regclass::text FROM webhook_outbox ORDER BY id")
    assert [p for (p,) in placed] == homes
    assert await rows(url, "SELECT id, delivery_id FROM webhook_outbox ORDER BY id") == before
    # Only the intervals that held rows were made among the past ones: not every hour.
    assert [name for name in made if name < current] == homes, made


async def _produce(database_url: str, n: int) -> None:
    for _ in range(n // 20):
        await enqueue_many(database_url, 20)
        await asyncio.sleep(0.02)


async def _eq(value: Any, wanted: int) -> bool:
    return bool(await value == wanted)


async def test_a_partitioned_outbox_fans_out_and_sends_in_the_routing_transaction(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Routing looks its events up in the partitions they are in: on a partitioned outbox an
    event reaches each endpoint of its tenant, sent by the transaction that routed it."""
    import ipaddress

    from fluxora_webhooks import batch, endpoints, enqueue

    # The batch waits for its requests whatever the machine's load: on a loaded one a
    # request that outlived the batch's patience was recorded by another transaction.
    monkeypatch.setattr(batch, "PATIENCE_S", 30.0)
    monkeypatch.setattr(batch, "STRAGGLER_MIN_S", 30.0)

    loopback = (ipaddress.ip_network("127.0.0.0/8"),)
    targets = [Receiver(), Receiver()]
    for r in targets:
        await r.start()
    try:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            assert await partitions.convert(c, interval_ms=DAY) is True
            for r in targets:
                await endpoints.create(c, url=r.url, tenant="acme", allowed_networks=loopback)
            for n in range(5):
                await enqueue(c, tenant="acme", stream_id=f"s{n}", event_type="e", payload={})
        settings = make_settings("", allowed_networks=loopback, secret=b"", claim_loops=1)
        async with running_dispatcher(settings, database_url):
            for r in targets:
                await r.wait_for(5)
            await wait_until(lambda: _eq(pending(database_url), 0), what="all processed")
    finally:
        for r in targets:
            await r.stop()
    found = await rows(
        database_url,
        "SELECT e.outcome, count(d.*), count(DISTINCT d.xmin::text),"
        " bool_and(d.xmin::text = e.xmin::text), bool_and(d.outcome = 'delivered')"
        " FROM webhook_outbox e JOIN webhook_outbox d ON d.event_id = e.id"
        " WHERE e.event_id IS NULL GROUP BY e.id, e.outcome",
    )
    assert found == [("routed", 2, 1, True, True)] * 5


async def test_run_says_when_a_partition_of_the_outbox_is_not_vacuumed(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Partitioned, the partitions are the tables autovacuum visits: one with its own
    autovacuum off is named at run's start, as the whole table's setting is."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        assert await partitions.convert(conn, interval_ms=DAY) is True
        cur = await conn.execute("SELECT current_setting('autovacuum') = 'off'")
        server_off = (await cur.fetchone()) == (True,)
        (first, *_) = await _partitions(database_url)
        caplog.clear()  # the conversion's own lines name its partitions
        said = "partition(s) of webhook_outbox have autovacuum_enabled = false"
        with caplog.at_level(logging.WARNING, logger="fluxora_webhooks"):
            assert await warn_if_not_vacuumed(conn) is server_off
            assert said not in caplog.text
            await conn.execute(f'ALTER TABLE "{first}" SET (autovacuum_enabled = off)')
            assert await warn_if_not_vacuumed(conn) is True
            assert f"1 {said} ({first})" in caplog.text
            caplog.clear()
            await conn.execute(f'ALTER TABLE "{first}" RESET (autovacuum_enabled)')
            assert await warn_if_not_vacuumed(conn) is server_off
            assert said not in caplog.text


async def test_retention_waits_for_the_partitions_lock_and_drops_the_partition_whole(
    database_url: str, receiver: Receiver
) -> None:
    """The partitions' lock held a moment (the partitions loop making partitions ahead,
    another instance) when a run's retention started: the expired partition's rows were
    deleted one by one, the write load partitioning is there to avoid. It waits, then
    drops the partition whole."""
    import dataclasses

    from fluxora_webhooks.service import Service

    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        old_day = await _partitioned_from_five_days_ago(conn)
        await partitions.create_partition(conn, old_day, DAY)
        await conn.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, partition_at,"
            " processed, processed_at, outcome, endpoint_id)"
            " SELECT 's', 'e', '{}', %s + interval '1 hour', true, %s + interval '2 hours',"
            " 'delivered', 'default' FROM generate_series(1, 300)",
            (old_day, old_day),
        )
    settings = dataclasses.replace(make_settings(receiver.url), retention_ms=2 * DAY)
    service = Service(settings, database_url=database_url, redis_url=None)
    async with (
        await psycopg.AsyncConnection.connect(database_url, autocommit=True) as holder,
        await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn,
    ):
        await holder.execute("SELECT pg_advisory_lock(%s)", (partitions.PARTITION_LOCK_KEY,))
        run = asyncio.create_task(service._retention_run(conn))
        await asyncio.sleep(1.0)
        assert not run.done()  # waiting for the lock, nothing deleted meanwhile
        await holder.execute("SELECT pg_advisory_unlock(%s)", (partitions.PARTITION_LOCK_KEY,))
        result = await asyncio.wait_for(run, 30)
    assert partitions.partition_name(old_day) not in await _partitions(database_url)
    assert result.outbox_rows == 0  # dropped whole, not deleted row by row
