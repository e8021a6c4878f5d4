"""Privileges on a partitioned outbox (docs/operations.md, "Partitions and roles"), with an
owner role that migrates and producer, dispatcher and API roles that have GRANTs: the
conversion keeps every grant on ``webhook_outbox`` (on the parent and each partition, the
default one included), a partition made later takes the parent's, a role that is not the
owner reads the partitions it needs, and is told what to do when it may not make or drop
them."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import pytest_asyncio
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from fluxora_webhooks import enqueue, partitions
from fluxora_webhooks.migrations import migrate
from fluxora_webhooks.ops import read_backlog
from fluxora_webhooks.service import Service
from tests.support.dispatch import make_settings, wait_until
from tests.support.procs import command_env, run_command

pytestmark = pytest.mark.integration

DAY = 86_400_000
ROOT = Path(__file__).resolve().parents[2]

# (column, or "" for the table's own; grantee, "PUBLIC" for 0; privilege; grant option):
# the grants of a table and its columns, whoever granted them.
ACL = """
SELECT '', CASE a.grantee WHEN 0 THEN 'PUBLIC' ELSE pg_get_userbyid(a.grantee)::text END,
       a.privilege_type, a.is_grantable
FROM pg_class c, aclexplode(coalesce(c.relacl, acldefault('r', c.relowner))) a
WHERE c.oid = to_regclass(%(name)s)
UNION ALL
SELECT t.attname::text,
       CASE a.grantee WHEN 0 THEN 'PUBLIC' ELSE pg_get_userbyid(a.grantee)::text END,
       a.privilege_type, a.is_grantable
FROM pg_attribute t, aclexplode(t.attacl) a
WHERE t.attrelid = to_regclass(%(name)s) AND t.attnum > 0 AND NOT t.attisdropped
"""
SEQUENCE_ACL = """
SELECT pg_get_userbyid(a.grantee), a.privilege_type, a.is_grantable
FROM pg_class c, aclexplode(c.relacl) a WHERE c.oid = 'webhook_outbox_id_seq'::regclass
"""


@dataclasses.dataclass(frozen=True)
class Roles:
    """The test's roles (cluster-wide: named after its database) and URLs to connect as
    each; ``admin``: the superuser's URL to the test's database."""

    admin: str
    owner: str
    producer: str
    dispatcher: str
    api: str

    def url(self, role: str) -> str:
        return make_conninfo(self.admin, user=role)


def _producer_grants() -> str:
    """The first SQL block under "The grants of a producer role" in examples/README.md."""
    text = (ROOT / "examples" / "README.md").read_text("utf-8")
    section = text.split("\n### The grants of a producer role\n", 1)[1]
    block: str = re.findall(r"```sql\n(.*?)```", section, re.S)[0]
    return block


@pytest_asyncio.fixture
async def roles(empty_database_url: str, pg_admin_url: str) -> AsyncIterator[Roles]:
    """An owner role that migrates the test's database, and the producer (the documented
    grants), dispatcher and API roles with their grants on the outbox; all dropped after
    the test, whatever its end."""
    db = conninfo_to_dict(empty_database_url)["dbname"]
    made = Roles(empty_database_url, f"{db}_own", f"{db}_prod", f"{db}_disp", f"{db}_api")
    names = [made.owner, made.producer, made.dispatcher, made.api]
    created: list[str] = []
    try:
        with psycopg.connect(empty_database_url, autocommit=True) as admin:
            for role in names:
                admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
                created.append(role)
            admin.execute(
                sql.SQL("GRANT CREATE ON SCHEMA public TO {}").format(sql.Identifier(made.owner))
            )
        async with await psycopg.AsyncConnection.connect(
            made.url(made.owner), autocommit=True
        ) as conn:
            await migrate(conn)
            for statement in _grants(made):
                await conn.execute(statement)
        yield made
    finally:
        with psycopg.connect(empty_database_url, autocommit=True) as admin:
            for role in created:
                admin.execute(sql.SQL("DROP OWNED BY {} CASCADE").format(sql.Identifier(role)))
        with psycopg.connect(pg_admin_url, autocommit=True) as cluster:
            for role in created:
                cluster.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def _grants(roles: Roles) -> list[bytes | sql.Composed]:
    """The grants the owner makes: the producer's as documented; the dispatcher's on the
    outbox, the dead letters and the schema's record; the API's reads, with a grant option
    on the outbox, and a column's update."""
    ident = sql.Identifier
    return [
        _producer_grants().replace("app_producer", roles.producer).encode(),
        sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON webhook_outbox TO {}").format(
            ident(roles.dispatcher)
        ),
        sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON webhook_dead_letter TO {}").format(
            ident(roles.dispatcher)
        ),
        sql.SQL("GRANT SELECT ON webhook_dead_letter TO {}").format(ident(roles.api)),
        sql.SQL("GRANT SELECT ON fluxora_schema_migrations TO {}").format(ident(roles.dispatcher)),
        sql.SQL("GRANT USAGE ON SEQUENCE webhook_outbox_id_seq TO {}").format(
            ident(roles.dispatcher)
        ),
        sql.SQL("GRANT SELECT ON webhook_outbox TO {} WITH GRANT OPTION").format(ident(roles.api)),
        sql.SQL("GRANT UPDATE (hold) ON webhook_outbox TO {}").format(ident(roles.api)),
    ]


async def _acl(conn: psycopg.AsyncConnection[Any], name: str) -> set[tuple[str, str, str, bool]]:
    cur = await conn.execute(ACL, {"name": name})
    return {tuple(row) for row in await cur.fetchall()}


async def _owner(conn: psycopg.AsyncConnection[Any], name: str) -> str:
    cur = await conn.execute(
        "SELECT pg_get_userbyid(relowner) FROM pg_class WHERE oid = to_regclass(%s)", (name,)
    )
    row = await cur.fetchone()
    assert row is not None, name
    return str(row[0])


async def _partition_names(conn: psycopg.AsyncConnection[Any]) -> list[str]:
    cur = await conn.execute(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " WHERE i.inhparent = 'webhook_outbox'::regclass ORDER BY 1"
    )
    return [str(r[0]) for r in await cur.fetchall()]


async def _same_as_parent(conn: psycopg.AsyncConnection[Any], owner: str) -> list[str]:
    """Every partition, checked to have the parent's owner and grants."""
    parent = await _acl(conn, partitions.PARENT)
    names = await _partition_names(conn)
    for name in names:
        assert await _acl(conn, name) == parent, name
        assert await _owner(conn, name) == owner, name
    return names


async def _one(conn: psycopg.AsyncConnection[Any], query: str, *params: Any) -> Any:
    cur = await conn.execute(query, params)
    row = await cur.fetchone()
    assert row is not None
    return row[0]


def warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The warnings captured (what an earlier test's logging set-up lets through at INFO,
    such as the partitions a maintenance made, is not what these tests look at)."""
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("how", ["empty", "with-rows", "with-rows-by-a-superuser"])
async def test_the_conversion_keeps_every_grant_on_the_parent_and_each_partition(
    roles: Roles, how: str
) -> None:
    async with await psycopg.AsyncConnection.connect(
        roles.url(roles.owner), autocommit=True
    ) as owner:
        # Every kind of grant: PUBLIC's on a column, and the owner's own reduced.
        await owner.execute("GRANT REFERENCES (tenant) ON webhook_outbox TO PUBLIC")
        await owner.execute("REVOKE TRUNCATE ON webhook_outbox FROM CURRENT_USER")
        if how != "empty":
            await owner.execute(
                "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
                " SELECT 's', 't', '{}' FROM generate_series(1, 30)"
            )
        before = await _acl(owner, "webhook_outbox")
        sequence = await (await owner.execute(SEQUENCE_ACL)).fetchall()
    # The producer's are its columns' (docs/operations.md, "Roles and privileges").
    for column in ("tenant", "stream_id", "event_type", "payload", "created_at"):
        assert (column, roles.producer, "INSERT", False) in before, column
    assert ("endpoint_id", roles.producer, "INSERT", False) not in before
    assert ("delivery_id", roles.producer, "SELECT", False) in before
    assert ("", roles.api, "SELECT", True) in before
    assert ("tenant", "PUBLIC", "REFERENCES", False) in before
    assert ("", roles.owner, "TRUNCATE", False) not in before
    converter = roles.admin if how.endswith("superuser") else roles.url(roles.owner)
    async with await psycopg.AsyncConnection.connect(converter, autocommit=True) as conn:
        assert await partitions.convert(conn, interval_ms=DAY) is True
    async with await psycopg.AsyncConnection.connect(roles.admin, autocommit=True) as admin:
        assert await _owner(admin, partitions.PARENT) == roles.owner
        assert await _acl(admin, partitions.PARENT) == before
        names = await _same_as_parent(admin, roles.owner)
        assert partitions.DEFAULT in names and partitions.LEGACY in names
        assert len(names) >= 4  # and the partitions made ahead
        assert await (await admin.execute(SEQUENCE_ACL)).fetchall() == sequence
        assert await _owner(admin, partitions.CONFIG) == roles.owner
        for role in (roles.producer, roles.dispatcher, roles.api, "public"):
            assert await _one(
                admin, "SELECT has_table_privilege(%s, %s, 'SELECT')", role, partitions.CONFIG
            ), role
        assert not await _one(
            admin, "SELECT has_table_privilege(%s, %s, 'INSERT')", roles.api, partitions.CONFIG
        )


async def test_a_producer_with_the_documented_grants_enqueues_after_migrate_partitioned(
    roles: Roles,
) -> None:
    """As the QA walk did: `migrate --partitioned` by the owner on an outbox with rows, and
    the producer's transaction goes on committing its events."""
    async with await psycopg.AsyncConnection.connect(
        roles.url(roles.producer), autocommit=True
    ) as producer:
        first = await enqueue(producer, stream_id="s-1", event_type="t", payload={"n": 1})
    code, out = await run_command(
        "migrate", "--partitioned", env=command_env(DATABASE_URL=roles.url(roles.owner))
    )
    assert code == 0, out
    assert "the outbox is partitioned (converted now)" in out
    async with await psycopg.AsyncConnection.connect(roles.url(roles.producer)) as producer:
        async with producer.transaction():
            second = await enqueue(producer, stream_id="s-1", event_type="t", payload={"n": 2})
            await producer.execute(
                "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
                " VALUES ('s-2', 't', '{}')"
            )
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            await producer.execute("SELECT payload FROM webhook_outbox")  # still no more
    async with await psycopg.AsyncConnection.connect(roles.admin, autocommit=True) as admin:
        cur = await admin.execute(
            "SELECT delivery_id::text, tableoid::regclass::text FROM webhook_outbox ORDER BY id"
        )
        found = await cur.fetchall()
    assert [d for d, _ in found[:2]] == [first, second]
    assert len(found) == 3
    assert found[0][1] == partitions.LEGACY


async def test_a_partition_made_later_takes_the_parents_owner_and_grants(roles: Roles) -> None:
    async with await psycopg.AsyncConnection.connect(
        roles.url(roles.owner), autocommit=True
    ) as owner:
        await partitions.convert(owner, interval_ms=DAY)
        parent = await _acl(owner, partitions.PARENT)
        made = await partitions.ensure_ahead(owner, ahead=6)  # by the owner's maintenance
        assert len(made) == 3
        now = await _one(owner, "SELECT date_trunc('day', now(), 'UTC')")
    async with await psycopg.AsyncConnection.connect(roles.admin, autocommit=True) as admin:
        # By a superuser: the partition is the owner's all the same.
        by_superuser = await partitions.create_partition(admin, now + dt.timedelta(days=20), DAY)
        # Rows of a range no partition covers wait in the default one; the partition made
        # for them is filled, then attached.
        await admin.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, partition_at)"
            " VALUES ('later', 't', '{}', %s)",
            (now + dt.timedelta(days=30, hours=1),),
        )
        moved = await partitions.create_partition(admin, now + dt.timedelta(days=30), DAY)
        assert (
            await _one(
                admin,
                "SELECT tableoid::regclass::text FROM webhook_outbox WHERE stream_id = 'later'",
            )
            == moved
        )
        names = await _same_as_parent(admin, roles.owner)
        assert {*made, by_superuser, moved} <= set(names)
        assert await _acl(admin, partitions.PARENT) == parent
    async with await psycopg.AsyncConnection.connect(
        roles.url(roles.owner), autocommit=True
    ) as owner:
        # A GRANT and a REVOKE on the parent since: the maintenance gives them to every
        # partition, and takes back a grant made on one partition alone.
        await owner.execute(
            sql.SQL("GRANT DELETE ON webhook_outbox TO {} WITH GRANT OPTION").format(
                sql.Identifier(roles.api)
            )
        )
        await owner.execute(
            sql.SQL("REVOKE UPDATE (hold) ON webhook_outbox FROM {}").format(
                sql.Identifier(roles.api)
            )
        )
        await owner.execute(
            sql.SQL("GRANT TRUNCATE ON {} TO {}").format(
                sql.Identifier(partitions.DEFAULT), sql.Identifier(roles.producer)
            )
        )
        assert await partitions.ensure_ahead(owner) == []
        names = await _same_as_parent(owner, roles.owner)
        assert ("", roles.api, "DELETE", True) in await _acl(owner, names[-1])
        assert not any(c == "hold" for c, *_ in await _acl(owner, names[0]))


async def test_a_role_that_is_not_the_owner_reads_the_partitions_it_needs(
    roles: Roles, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dispatcher's housekeeping (`pending_since`, which reads each partition) and
    `status` (the default partition's rows) as roles granted on the outbox only."""
    async with await psycopg.AsyncConnection.connect(
        roles.url(roles.owner), autocommit=True
    ) as owner:
        await partitions.convert(owner, interval_ms=DAY)
        # (The conversion lets them read it: given here too, for the partitions alone.)
        await owner.execute(
            sql.SQL("GRANT SELECT ON fluxora_outbox_partitioning TO {}, {}").format(
                sql.Identifier(roles.dispatcher), sql.Identifier(roles.api)
            )
        )
        await owner.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload)"
            " VALUES ('pending', 't', '{}')"
        )
        expected = await partitions.pending_since(owner)
    assert expected is not None
    async with await psycopg.AsyncConnection.connect(
        roles.url(roles.dispatcher), autocommit=True
    ) as dispatcher:
        with caplog.at_level(logging.WARNING, logger="fluxora_webhooks.partitions"):
            assert await partitions.pending_since(dispatcher) == expected
        assert not warnings(caplog)
    async with await psycopg.AsyncConnection.connect(roles.url(roles.api), autocommit=True) as api:
        backlog = await read_backlog(api)
        assert backlog.default_partition_rows == 0 and backlog.pending == 1
    # A partition the role may not read (a grant made on a partition's own, taken back):
    # the claim looks everywhere meanwhile, and the warning names the table.
    async with await psycopg.AsyncConnection.connect(roles.admin, autocommit=True) as admin:
        await admin.execute(
            sql.SQL("REVOKE ALL ON {} FROM {}").format(
                sql.Identifier(partitions.DEFAULT), sql.Identifier(roles.dispatcher)
            )
        )
    monkeypatch.setattr(partitions, "_unreadable_warned", -partitions.UNREADABLE_WARNING_S)
    async with await psycopg.AsyncConnection.connect(
        roles.url(roles.dispatcher), autocommit=True
    ) as dispatcher:
        with caplog.at_level(logging.WARNING, logger="fluxora_webhooks.partitions"):
            assert await partitions.pending_since(dispatcher) is None
            assert await partitions.pending_since(dispatcher) is None  # said once
    [warning] = warnings(caplog)
    said = warning.getMessage()
    assert "permission denied for table webhook_outbox_default" in said
    assert "migrate --partitioned" in said
    async with await psycopg.AsyncConnection.connect(
        roles.url(roles.owner), autocommit=True
    ) as owner:
        await partitions.ensure_ahead(owner)  # the maintenance gives it back
    async with await psycopg.AsyncConnection.connect(
        roles.url(roles.dispatcher), autocommit=True
    ) as dispatcher:
        assert await partitions.pending_since(dispatcher) == expected


async def test_a_dispatcher_that_may_not_make_partitions_says_what_to_do(
    roles: Roles, caplog: pytest.LogCaptureFixture
) -> None:
    async with await psycopg.AsyncConnection.connect(
        roles.url(roles.owner), autocommit=True
    ) as owner:
        await partitions.convert(owner, interval_ms=DAY)
        last = (await _partition_names(owner))[-1]
        await owner.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(last)))
    service = Service(
        make_settings("http://127.0.0.1:9/"),
        database_url=roles.url(roles.dispatcher),
        redis_url=None,
    )
    service.partitions_interval_s = 3600.0

    async def warned() -> bool:
        return bool(warnings(caplog))

    with caplog.at_level(logging.WARNING, logger="fluxora_webhooks.service"):
        task = asyncio.create_task(service._partitions_loop())
        try:
            await wait_until(warned, what="the warning")
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    said = warnings(caplog)[0].getMessage()
    # PostgreSQL's own words: the schema it may not create in (15 on), or the table.
    assert re.match(
        r"outbox partitions not checked \(InsufficientPrivilege: (permission denied for schema"
        r" public|must be owner of table webhook_outbox); ",
        said,
    ), said
    assert "the owner of webhook_outbox or a member of its role" in said
    assert "fluxora-webhooks migrate --partitioned" in said
    # As the owner, the documented command makes it.
    code, out = await run_command(
        "migrate", "--partitioned", env=command_env(DATABASE_URL=roles.url(roles.owner))
    )
    assert code == 0, out
    async with await psycopg.AsyncConnection.connect(roles.admin, autocommit=True) as admin:
        assert last in await _same_as_parent(admin, roles.owner)


async def test_partition_drops_by_a_role_that_is_not_the_owner_say_who_may(
    roles: Roles, caplog: pytest.LogCaptureFixture
) -> None:
    """`prune` stops with PostgreSQL's message and what to do; a dispatcher's retention
    says so and deletes the expired partitions' rows one by one instead."""
    async with await psycopg.AsyncConnection.connect(
        roles.url(roles.owner), autocommit=True
    ) as owner:
        five_days_ago = await _one(
            owner, "SELECT date_trunc('day', now(), 'UTC') - interval '5 days'"
        )
        await partitions.convert(owner, interval_ms=DAY, first_partition_at=five_days_ago)
        for day in range(5):
            await partitions.create_partition(owner, five_days_ago + dt.timedelta(days=day), DAY)
        await owner.execute(
            "INSERT INTO webhook_outbox (stream_id, event_type, payload, partition_at,"
            " processed, processed_at, outcome, endpoint_id)"
            " SELECT 's', 't', '{}', %s + interval '1 hour', true, %s + interval '2 hours',"
            " 'delivered', 'default' FROM generate_series(1, 10)",
            (five_days_ago, five_days_ago),
        )
    env = command_env(DATABASE_URL=roles.url(roles.dispatcher))
    code, out = await run_command("prune", "--older-than", "2d", env=env)
    assert code == 1, out
    assert "outbox partitions not dropped (InsufficientPrivilege: must be owner of table" in out
    assert "the owner of webhook_outbox or a member of its role" in out
    async with await psycopg.AsyncConnection.connect(roles.admin, autocommit=True) as admin:
        assert await _one(admin, "SELECT count(*) FROM webhook_outbox") == 10
    service = Service(
        make_settings("http://127.0.0.1:9/", retention_ms=2 * DAY),
        database_url=roles.url(roles.dispatcher),
        redis_url=None,
    )
    async with await psycopg.AsyncConnection.connect(
        roles.url(roles.dispatcher), autocommit=True
    ) as dispatcher:
        with caplog.at_level(logging.WARNING, logger="fluxora_webhooks.service"):
            result = await service._retention_run(dispatcher)
    assert result.outbox_rows == 10
    [warning] = warnings(caplog)
    assert "must be owner of table webhook_outbox" in warning.getMessage()
    async with await psycopg.AsyncConnection.connect(roles.admin, autocommit=True) as admin:
        assert await _one(admin, "SELECT count(*) FROM webhook_outbox") == 0
        assert partitions.partition_name(five_days_ago) in await _partition_names(admin)
