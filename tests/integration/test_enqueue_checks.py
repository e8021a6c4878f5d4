"""The producer's side as a producer meets it: enqueue on a connection with any row factory,
its checks made before anything reaches the database, a schema older than the code, the
connections of other libraries, and the recipes of examples/README.md run as written."""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import pytest_asyncio
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from fluxora_webhooks import enqueue, inbox
from fluxora_webhooks.errors import SchemaError
from fluxora_webhooks.outbox import MAX_PAYLOAD_BYTES

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
STREAMS = "CREATE TABLE streams (id text PRIMARY KEY, status text NOT NULL DEFAULT 'active')"


def snippet(heading: str, lang: str = "python", index: int = 0) -> str:
    """The ``index``-th ``lang`` code block under ``### heading`` of examples/README.md."""
    text = (ROOT / "examples" / "README.md").read_text("utf-8")
    section = text.split(f"\n### {heading}\n", 1)[1]
    section = re.split(r"\n##+ ", section, maxsplit=1)[0]
    blocks: list[str] = re.findall(rf"```{lang}\n(.*?)```", section, re.S)
    return blocks[index]


def rows(conn: psycopg.Connection[Any]) -> list[tuple[str, str, Any]]:
    return [
        (str(r[0]), str(r[1]), r[2])
        for r in conn.execute(
            "SELECT delivery_id::text, stream_id, payload FROM webhook_outbox ORDER BY id"
        ).fetchall()
    ]


@pytest.fixture
def conn(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(database_url, autocommit=True) as connection:
        yield connection


@pytest_asyncio.fixture
async def aconn(database_url: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
        yield c


# -- row factories --------------------------------------------------------------------------


def test_enqueue_returns_the_id_whatever_the_row_factory(
    conn: psycopg.Connection[Any], database_url: str
) -> None:
    # In autocommit, a failure after the INSERT would have invited a retry: two events.
    with psycopg.connect(database_url, autocommit=True, row_factory=dict_row) as dconn:
        first = enqueue(dconn, stream_id="s-1", event_type="t", payload={"n": 1})
        with dconn.cursor() as cur:  # a cursor of that connection, dict_row too
            second = enqueue(cur, stream_id="s-2", event_type="t", payload={"n": 2})
    assert rows(conn) == [(first, "s-1", {"n": 1}), (second, "s-2", {"n": 2})]


async def test_async_enqueue_returns_the_id_whatever_the_row_factory(
    conn: psycopg.Connection[Any], database_url: str
) -> None:
    pool = AsyncConnectionPool(
        database_url,
        min_size=1,
        max_size=1,
        kwargs={"autocommit": True, "row_factory": dict_row},
        open=False,
    )
    await pool.open()
    try:
        async with pool.connection() as pconn:
            first = await enqueue(pconn, stream_id="s-1", event_type="t", payload=[1])
            async with pconn.cursor() as cur:
                second = await enqueue(cur, stream_id="s-2", event_type="t", payload=[2])
    finally:
        await pool.close()
    assert rows(conn) == [(first, "s-1", [1]), (second, "s-2", [2])]


async def test_the_inbox_install_reads_its_rows_whatever_the_row_factory(
    inbox_database_url: str,
) -> None:
    with psycopg.connect(inbox_database_url, autocommit=True, row_factory=dict_row) as dconn:
        assert inbox.install(dconn) is False  # installed already
    async with await psycopg.AsyncConnection.connect(
        inbox_database_url, autocommit=True, row_factory=dict_row
    ) as aconn:
        assert await inbox.install_report(aconn) == inbox.Installed(created=False)


async def test_the_inbox_prune_reads_its_rows_whatever_the_row_factory(
    inbox_database_url: str,
) -> None:
    async with await psycopg.AsyncConnection.connect(
        inbox_database_url, autocommit=True, row_factory=dict_row
    ) as aconn:
        await aconn.execute(
            "INSERT INTO webhook_inbox (delivery_id, received_at)"
            " VALUES ('old', now() - interval '2 days'), ('new', now())"
        )
        counted = await inbox.prune(aconn, older_than_ms=86_400_000, dry_run=True)
        assert counted.deleted == 1
        done = await inbox.prune(aconn, older_than_ms=86_400_000)
        assert (done.deleted, done.batches) == (1, 1)
        cur = await aconn.execute("SELECT delivery_id FROM webhook_inbox")
        assert await cur.fetchall() == [{"delivery_id": "new"}]


# -- checks before the database ---------------------------------------------------------------

EVENT: dict[str, Any] = {"tenant": "", "stream_id": "s-1", "event_type": "t", "payload": {}}
BIG = "x" * (MAX_PAYLOAD_BYTES - len('{"blob": ""}') + 1)  # one byte over, as JSON

REFUSED = [
    ({"event_type": "x" * 201}, r"event_type must be 1 to 200 .* \(is 201 characters\)"),
    ({"event_type": "x" * 20_000}, r"event_type must be 1 to 200"),
    ({"event_type": "caf\u00e9"}, r"event_type must be 1 to 200 printable ASCII"),
    ({"stream_id": "s" * 501}, r"stream_id must be a string of 1 to 500 characters \(is 501\)"),
    ({"stream_id": "s" * 1_000_000}, r"stream_id must be a string of 1 to 500"),
    ({"stream_id": ""}, r"stream_id must be a string of 1 to 500"),
    ({"stream_id": "s\x00"}, r"stream_id must be text .* NUL"),
    ({"stream_id": "s\ud800"}, r"stream_id must be text .* unpaired surrogate"),
    ({"payload": {"blob": BIG}}, rf"payload must be at most {MAX_PAYLOAD_BYTES} bytes"),
    ({"payload": {"blob": "x" * 30_000_000}}, r"payload must be at most 1048576 bytes"),
    ({"payload": {"n": float("nan")}}, r"payload cannot .* NaN, Infinity and numbers past"),
    ({"payload": [float("inf")]}, r"payload cannot .* NaN, Infinity and numbers past"),
    ({"payload": {"k": -float("inf")}}, r"payload cannot .* NaN, Infinity and numbers past"),
    ({"payload": {"k": "a\x00b"}}, r"payload contains a NUL"),
    ({"payload": {"\x00": 1}}, r"payload contains a NUL"),
    ({"payload": {"k": "\\\\\x00"}}, r"payload contains a NUL"),
    ({"payload": {"k": "\udc80"}}, r"payload holds an unpaired surrogate"),
    ({"tenant": "acme corp"}, r"tenant must be empty"),
]


@pytest.mark.parametrize(("change", "message"), REFUSED)
def test_enqueue_refuses_what_the_api_refuses_before_the_database(
    database_url: str, change: dict[str, Any], message: str
) -> None:
    with psycopg.connect(database_url) as tconn:  # not autocommit: a statement would BEGIN
        with pytest.raises(ValueError, match=message):
            enqueue(tconn, **{**EVENT, **change})
        assert tconn.info.transaction_status == TransactionStatus.IDLE  # nothing was sent


@pytest.mark.parametrize(("change", "message"), REFUSED[::3])
async def test_async_enqueue_refuses_what_the_api_refuses_before_the_database(
    database_url: str, change: dict[str, Any], message: str
) -> None:
    async with await psycopg.AsyncConnection.connect(database_url) as tconn:
        with pytest.raises(ValueError, match=message):
            await enqueue(tconn, **{**EVENT, **change})
        assert tconn.info.transaction_status == TransactionStatus.IDLE


def test_enqueue_refuses_a_payload_json_cannot_hold(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(TypeError, match="payload must be JSON-serializable"):
        enqueue(conn, **{**EVENT, "payload": {"at": object()}})
    assert rows(conn) == []


def test_enqueue_takes_what_is_within_the_limits(conn: psycopg.Connection[Any]) -> None:
    stream_id = "\U0001f600" * 500  # 2,000 bytes: within what the outbox's indexes hold
    at_limit = {"blob": BIG[:-1]}
    backslash = {"k": "\\u0000", "j": "\\\\u0000"}  # text, not a NUL
    ids = [
        enqueue(conn, stream_id=stream_id, event_type="x" * 200, payload=at_limit),
        enqueue(conn, stream_id="s-2", event_type="! ~", payload=backslash),
        enqueue(conn, stream_id="s-3", event_type="t", payload=json.dumps({"a": 1})),
    ]
    found = rows(conn)
    assert [(d, s) for d, s, _ in found] == list(zip(ids, [stream_id, "s-2", "s-3"], strict=True))
    assert found[0][2] == at_limit and found[1][2] == backslash
    assert found[2][2] == '{"a": 1}'  # a JSON string, as the README says: not an object


# -- a schema older than the code ----------------------------------------------------------

ORIGINAL = """CREATE TABLE webhook_outbox (
    id bigserial PRIMARY KEY, stream_id text NOT NULL, event_type text NOT NULL,
    payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now(),
    processed boolean NOT NULL DEFAULT false)"""


@pytest.mark.parametrize("table", [None, ORIGINAL])
async def test_enqueue_on_an_unmigrated_database_says_to_migrate(
    empty_database_url: str, table: str | None
) -> None:
    with psycopg.connect(empty_database_url, autocommit=True) as sconn:
        if table is not None:
            sconn.execute(table)
        with pytest.raises(SchemaError, match="run `fluxora-webhooks migrate`") as raised:
            enqueue(sconn, **EVENT)
        assert isinstance(raised.value.__cause__, psycopg.errors.ProgrammingError)
    async with await psycopg.AsyncConnection.connect(empty_database_url) as aconn:
        with pytest.raises(SchemaError, match="older than this version") as raised:
            await enqueue(aconn, **EVENT)
    what = "tenant" if table else "webhook_outbox"
    assert what in str(raised.value)


# -- the connections of other libraries ----------------------------------------------------


def test_enqueue_names_what_it_was_given_instead_of_a_psycopg_connection(
    database_url: str,
) -> None:
    import django.db as django_db  # not configured: its connection untouched

    with pytest.raises(TypeError, match=r"not django\.utils\.connection\.ConnectionProxy") as e:
        enqueue(django_db.connection, **EVENT)
    assert "django.db.connection.connection inside transaction.atomic()" in str(e.value)
    with pytest.raises(TypeError, match=r"psycopg 3 connection or cursor .* not builtins\.str"):
        enqueue(database_url, **EVENT)  # type: ignore[call-overload]


async def test_enqueue_on_an_asyncpg_connection_is_a_type_error_and_no_coroutine(
    database_url: str,
) -> None:
    import asyncpg

    apg = await asyncpg.connect(database_url)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with pytest.raises(TypeError, match=r"not asyncpg\.connection\.Connection; enqueue"):
                enqueue(apg, **EVENT)
            gc.collect()  # an abandoned coroutine would warn here
        assert [str(w.message) for w in seen] == []
    finally:
        await apg.close()


# -- the recipes of examples/README.md -------------------------------------------------------


def test_the_django_recipe_enqueues_in_the_atomic_block(
    conn: psycopg.Connection[Any], database_url: str
) -> None:
    conn.execute(STREAMS)
    conn.execute("INSERT INTO streams (id) VALUES ('s-1'), ('s-2')")
    info = conninfo_to_dict(database_url)
    database = {
        "ENGINE": "django.db.backends.postgresql",
        **{k.upper(): str(info[k]) for k in ("host", "port", "user") if k in info},
        "NAME": str(info["dbname"]),
    }
    script = "\n".join(
        [
            "import django",
            "from django.conf import settings",
            f"settings.configure(DATABASES={{'default': {database!r}}}, USE_TZ=True)",
            "django.setup()",
            snippet("Django"),
            "print(pause_stream('s-1'))",
            "try:",
            "    with transaction.atomic():",
            "        pause_stream('s-2')",  # a savepoint, rolled back with the outer block
            "        raise LookupError",
            "except LookupError:",
            "    pass",
            "try:",
            "    with transaction.atomic():",
            "        enqueue(connection, stream_id='s-3', event_type='t', payload={})",
            "except TypeError as exc:",
            "    print(exc)",
        ]
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    delivery_id, refusal = done.stdout.splitlines()
    assert rows(conn) == [(delivery_id, "s-1", {"id": "s-1", "status": "paused"})]
    assert "pass django.db.connection.connection inside transaction.atomic()" in refusal
    statuses = conn.execute("SELECT id, status FROM streams ORDER BY id").fetchall()
    assert statuses == [("s-1", "paused"), ("s-2", "active")]


def _async_recipe(
    conn: psycopg.Connection[Any], database_url: str, driver: str, streams: list[str]
) -> tuple[Any, dict[str, Any]]:
    """An async engine of SQLAlchemy's ``driver`` dialect and the names examples/README.md's
    "SQLAlchemy async with <driver>" recipe defines, the streams table holding ``streams``."""
    if not database_url.startswith("postgresql://"):
        pytest.skip(f"a URL SQLAlchemy's {driver} dialect takes is needed")
    from sqlalchemy.ext.asyncio import create_async_engine

    conn.execute(STREAMS)
    conn.execute("INSERT INTO streams (id) SELECT unnest(%s::text[])", (streams,))
    recipe: dict[str, Any] = {}
    exec(snippet(f"SQLAlchemy async with {driver}"), recipe)
    url = database_url.replace("postgresql://", f"postgresql+{driver}://")
    return create_async_engine(url), recipe


async def test_the_sqlalchemy_asyncpg_recipe_enqueues_in_the_session(
    conn: psycopg.Connection[Any], database_url: str
) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession

    engine, recipe = _async_recipe(conn, database_url, "asyncpg", ["s-1"])
    try:
        async with AsyncSession(engine) as session:
            await recipe["pause_stream"](session, "s-1")
            async with session.begin():  # and enqueue itself, on asyncpg's connection
                raw = await (await session.connection()).get_raw_connection()
                assert raw.driver_connection is not None
                with pytest.raises(TypeError, match="cannot run on asyncpg"):
                    enqueue(raw.driver_connection, **EVENT)
    finally:
        await engine.dispose()
    [(_, stream_id, payload)] = rows(conn)
    assert (stream_id, payload) == ("s-1", {"id": "s-1", "status": "paused"})
    assert conn.execute("SELECT status FROM streams").fetchall() == [("paused",)]


async def test_the_sqlalchemy_async_psycopg_recipe_enqueues_in_the_session(
    conn: psycopg.Connection[Any], database_url: str
) -> None:
    """The recipe the TypeError's hint points an AsyncSession user to: committed with the
    session's write, nothing when the session's transaction rolls back."""
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import AsyncSession

    engine, recipe = _async_recipe(conn, database_url, "psycopg", ["s-1", "s-2"])
    try:
        async with AsyncSession(engine) as session:
            delivery_id = await recipe["pause_stream"](session, "s-1")
            with pytest.raises(TypeError, match=r"get_raw_connection\(\)\)\.driver_connection"):
                enqueue(session, **EVENT)  # type: ignore[call-overload]
        async with AsyncSession(engine) as session:
            with pytest.raises(LookupError):
                async with session.begin():
                    await session.execute(text("UPDATE streams SET status = 'x'"))
                    raw = await (await session.connection()).get_raw_connection()
                    driver = raw.driver_connection
                    assert isinstance(driver, psycopg.AsyncConnection)
                    await enqueue(driver, **EVENT)
                    raise LookupError
    finally:
        await engine.dispose()
    assert rows(conn) == [(delivery_id, "s-1", {"id": "s-1", "status": "paused"})]


@pytest.fixture
def producer_roles(
    pg_admin_url: str, database_url: str
) -> Iterator[tuple[psycopg.Connection[Any], list[str]]]:
    """Roles created for the test (named fix_prod_*), their grants and themselves dropped
    afterwards; yields the test database's admin connection and the list to add them to."""
    made: list[str] = []
    with psycopg.connect(database_url, autocommit=True) as admin:
        try:
            yield admin, made
        finally:
            for role in made:
                admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
    with psycopg.connect(pg_admin_url, autocommit=True) as cluster:
        for role in made:
            cluster.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def _role(admin: psycopg.Connection[Any], made: list[str], grants: str) -> str:
    role = f"fix_prod_{uuid.uuid4().hex[:10]}"
    made.append(role)
    admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    admin.execute(grants.replace("app_producer", role).encode())
    return role


def test_the_producer_grants_are_enough_and_no_more(
    producer_roles: tuple[psycopg.Connection[Any], list[str]], database_url: str
) -> None:
    admin, made = producer_roles
    plain = "INSERT INTO webhook_outbox (stream_id, event_type, payload) VALUES (%s, %s, %s)"
    full = _role(admin, made, snippet("The grants of a producer role", "sql", 0))
    with psycopg.connect(make_conninfo(database_url, user=full), autocommit=True) as pconn:
        delivery_id = enqueue(pconn, **EVENT)
        pconn.execute(plain, ("s-2", "t", json.dumps({})))
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            pconn.execute("SELECT payload FROM webhook_outbox")  # other events stay unread
    bare = _role(admin, made, snippet("The grants of a producer role", "sql", 1))
    with psycopg.connect(make_conninfo(database_url, user=bare), autocommit=True) as pconn:
        pconn.execute(plain, ("s-3", "t", json.dumps({})))
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            enqueue(pconn, **EVENT)
    found = admin.execute("SELECT delivery_id::text, stream_id FROM webhook_outbox ORDER BY id")
    assert found.fetchall()[0] == (delivery_id, "s-1")
    assert [r[1] for r in rows(admin)] == ["s-1", "s-2", "s-3"]


# What only the dispatcher writes: a producer that could write it would make a delivery to
# any endpoint (whatever its subscriptions), an operator event signed with the operator's
# secret, or an event marked processed and never sent.
DISPATCHERS_COLUMNS = [
    ("endpoint_id", "operator"),
    ("processed", True),
    ("outcome", "delivered"),
    ("attempt", 8),
    ("delivery_id", str(uuid.uuid4())),
    ("event_id", 1),
    ("hold", "parked"),
]


@pytest.mark.parametrize("index", [0, 1])
def test_the_producer_grants_write_the_producers_columns_and_no_others(
    producer_roles: tuple[psycopg.Connection[Any], list[str]], database_url: str, index: int
) -> None:
    admin, made = producer_roles
    role = _role(admin, made, snippet("The grants of a producer role", "sql", index))
    url = make_conninfo(database_url, user=role)
    with psycopg.connect(url, autocommit=True) as pconn:
        for column, value in DISPATCHERS_COLUMNS:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                pconn.execute(
                    sql.SQL(
                        "INSERT INTO webhook_outbox (stream_id, event_type, payload, {})"
                        " VALUES ('s-forged', 't', '{{}}', %s)"
                    ).format(sql.Identifier(column)),
                    (value,),
                )
        # Every column a producer writes (examples/README.md, "Plain SQL from another
        # language"), by INSERT and by COPY.
        pconn.execute(
            "INSERT INTO webhook_outbox (tenant, stream_id, event_type, payload, created_at,"
            " traceparent, tracestate) VALUES ('acme', 's-1', 't', '{}', now(), NULL, NULL)"
        )
        with (
            pconn.cursor() as cur,
            cur.copy(
                "COPY webhook_outbox (tenant, stream_id, event_type, payload) FROM STDIN"
            ) as copy,
        ):
            copy.write_row(("acme", "s-2", "t", "{}"))
    assert [r[1] for r in rows(admin)] == ["s-1", "s-2"]


def test_the_plain_sql_recipes_enqueue_as_a_producer_role(
    producer_roles: tuple[psycopg.Connection[Any], list[str]], database_url: str
) -> None:
    admin, made = producer_roles
    admin.execute(STREAMS)
    admin.execute("INSERT INTO streams (id) VALUES ('s-1'), ('s-2')")
    heading = "Plain SQL from another language"
    role = _role(admin, made, snippet("The grants of a producer role", "sql", 1))
    admin.execute(sql.SQL("GRANT SELECT, UPDATE ON streams TO {}").format(sql.Identifier(role)))
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    one = [s.strip() for s in snippet(heading, "sql", 0).split(";") if s.strip()]
    assert one[0] == "BEGIN" and one[-1] == "COMMIT"
    with psycopg.connect(make_conninfo(database_url, user=role), autocommit=True) as pconn:
        cur = psycopg.RawCursor(pconn)  # $1 ... as the recipe writes them
        for params in (("s-1", "acme", json.dumps({"n": 1}), traceparent), None):
            with pconn.transaction(force_rollback=params is None):  # a rollback sends nothing
                cur.execute(one[1], ("s-1",))
                cur.execute(one[2], params or ("s-1", "acme", json.dumps({"n": 0}), None))
        admin.execute(snippet(heading, "sql", 2).encode())  # the trigger, made by the owner
        cur.execute("UPDATE streams SET status = 'paused' WHERE id = 's-2'")
        cur.execute(snippet(heading, "sql", 1))  # many in one statement
    found = admin.execute(
        "SELECT tenant, stream_id, event_type, payload, traceparent,"
        " created_at - enqueued_at > interval '9 minutes' FROM webhook_outbox ORDER BY id"
    ).fetchall()

    def paused(stream_id: str) -> tuple[Any, ...]:
        body = {"id": stream_id, "status": "paused"}
        return ("", stream_id, "stream.paused", body, None, False)

    assert found[:2] == [  # the delayed event with its trace context; the trigger's
        ("acme", "s-1", "stream.paused", {"n": 1}, traceparent, True),
        paused("s-2"),
    ]
    assert sorted(found[2:], key=str) == [paused("s-1"), paused("s-2")]  # the statement's


def test_many_events_copied_or_enqueued_in_one_transaction_are_each_one_delivery(
    conn: psycopg.Connection[Any],
) -> None:
    events = [
        {"stream_id": f"s-{i % 100}", "type": "stream.paused", "data": {"i": i}}
        for i in range(20_000)
    ]
    exec(snippet("Many events at once"), {"conn": conn, "events": events})
    with conn.transaction():  # and enqueue in a loop
        looped = [enqueue(conn, stream_id="s-x", event_type="t", payload=i) for i in range(100)]
    found = rows(conn)
    assert len(found) == 20_100
    assert len({d for d, _, _ in found}) == 20_100  # a delivery id each
    assert [p for _, _, p in found[:20_000]] == [e["data"] for e in events]
    assert [d for d, _, _ in found[20_000:]] == looped


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def test_enqueue_refuses_a_payload_deeper_or_larger_as_stored_than_the_api_takes(
    conn: psycopg.Connection[Any],
) -> None:
    """Deeper than 250 levels: the API refuses such a body and could not show such an
    event (its lists answered 500); a RecursionError past 1,000. Over 1 MiB as stored:
    jsonb writes 1e308 as 309 digits, so [1e308] * 5000 (40 KB as Python writes it) reached
    each consumer as 1.5 MB, over its inbox's limit. Refused before anything is written."""
    for depth, shown in ((251, "at most 250 levels"), (5000, "at most 250 levels")):
        with pytest.raises(ValueError, match=f"payload is nested too deeply: {shown}"):
            enqueue(conn, **{**EVENT, "payload": _nested(depth)})
    with pytest.raises(ValueError, match=r"as it is stored and sent .* is 1555000\)"):
        enqueue(conn, **{**EVENT, "payload": [1e308] * 5000})
    assert rows(conn) == []
    enqueue(conn, **{**EVENT, "payload": _nested(250)})
    enqueue(conn, **{**EVENT, "payload": [1e308] * 3000})  # 933,000 bytes as stored
    stored = conn.execute("SELECT max(octet_length(payload::text)) FROM webhook_outbox").fetchone()
    assert stored == (933000,)  # as counted


async def test_enqueue_on_a_raw_cursor_or_sql_ascii_connection_returns_a_usable_id(
    database_url: str,
) -> None:
    """A connection whose cursors are raw (psycopg.RawCursor: $1 placeholders) failed with
    psycopg's own TypeError; one in SQL_ASCII returned "b'...'" for the id."""
    import uuid

    ids = []
    with psycopg.connect(database_url, cursor_factory=psycopg.RawCursor) as raw:
        ids.append(enqueue(raw, **EVENT))
    with psycopg.connect(database_url, client_encoding="SQL_ASCII") as ascii_conn:
        ids.append(enqueue(ascii_conn, **EVENT))
    async with await psycopg.AsyncConnection.connect(
        database_url, cursor_factory=psycopg.AsyncRawCursor
    ) as araw:
        ids.append(await enqueue(araw, **EVENT))
    async with await psycopg.AsyncConnection.connect(
        database_url, client_encoding="SQL_ASCII"
    ) as aascii:
        ids.append(await enqueue(aascii, **EVENT))
    assert [str(uuid.UUID(i)) for i in ids] == ids
    with psycopg.connect(database_url) as check:
        found = check.execute(
            "SELECT delivery_id::text FROM webhook_outbox WHERE delivery_id::text = ANY(%s)",
            (ids,),
        ).fetchall()
    assert sorted(r[0] for r in found) == sorted(ids)


def test_a_float_subclass_with_its_own_repr_is_counted_as_json_writes_it(
    conn: psycopg.Connection[Any],
) -> None:
    """numpy's float64 (repr 'np.float64(1e+300)') made the size check raise
    decimal.InvalidOperation; json.dumps writes any float subclass with float's repr."""

    class Tagged(float):
        def __repr__(self) -> str:
            return f"Tagged({float(self)!r})"

    enqueue(conn, **{**EVENT, "payload": [Tagged(1e300), Tagged(1e-5), Tagged(2.5)]})
    [(_, _, stored)] = rows(conn)
    assert stored == [10**300, 1e-5, 2.5]  # jsonb wrote the first with no exponent
