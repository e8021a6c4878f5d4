"""The consumer's inbox on a real PostgreSQL: install, receive (sync and async), what a
refusal leaves behind (nothing), concurrency on one delivery id, and prune."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from fluxora_webhooks.errors import SchemaError, VerificationError
from fluxora_webhooks.inbox import (
    InboxEvent,
    TransactionAborted,
    check_committable,
    install,
    install_report,
    prune,
    receive,
)
from tests.support.dispatch import SECRET
from tests.support.inbox import Delivery, delivery

pytestmark = pytest.mark.integration

OTHER = b"another-secret-of-the-consumer-0123456789"


@pytest.fixture
def conn(inbox_database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection as an application uses it: not in autocommit mode."""
    with psycopg.connect(inbox_database_url) as connection:
        yield connection


def recorded(url: str) -> list[tuple[str, str | None, int | None]]:
    with psycopg.connect(url) as c:
        rows = c.execute(
            "SELECT delivery_id, event_type, attempt FROM webhook_inbox ORDER BY received_at"
        ).fetchall()
    return [(r[0], r[1], r[2]) for r in rows]


def take(conn: psycopg.Connection[Any], d: Delivery, **kw: Any) -> InboxEvent | None:
    return receive(conn, body=d.body, headers=d.headers, secret=SECRET, **kw)


# -- install ------------------------------------------------------------------------------


def test_install_is_idempotent_and_reports_whether_it_created(empty_database_url: str) -> None:
    with psycopg.connect(empty_database_url, autocommit=True) as c:
        assert install(c) is True
        assert install(c) is False
        columns = c.execute(
            "SELECT column_name, data_type FROM information_schema.columns"
            " WHERE table_name = 'webhook_inbox' ORDER BY ordinal_position"
        ).fetchall()
        key = c.execute(
            "SELECT a.attname FROM pg_index i JOIN pg_attribute a"
            " ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)"
            " WHERE i.indrelid = 'webhook_inbox'::regclass AND i.indisprimary"
        ).fetchall()
    assert columns == [
        ("delivery_id", "text"),
        ("event_type", "text"),
        ("attempt", "integer"),
        ("received_at", "timestamp with time zone"),
    ]
    assert key == [("delivery_id",)]


def test_concurrent_installs_all_succeed(empty_database_url: str) -> None:
    results: list[bool] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            with psycopg.connect(empty_database_url) as c:
                results.append(install(c))
                c.commit()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert sorted(results) == [False, False, False, True]


async def test_install_on_an_async_connection(empty_database_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(empty_database_url) as c:
        assert await install(c) is True
        await c.commit()
        assert await install(c) is False


def test_receive_without_the_table_says_what_to_run(empty_database_url: str) -> None:
    with (
        psycopg.connect(empty_database_url) as c,
        pytest.raises(SchemaError, match="inbox install"),
    ):
        take(c, delivery())


def test_a_table_made_by_hand_is_named_by_receive_and_completed_by_install(
    empty_database_url: str,
) -> None:
    """A webhook_inbox made from SPEC's column list (no attempt), or without its primary key,
    is not a raw database error on the first webhook: receive names what is missing, and
    install adds the missing column (a key is for its owner to add)."""
    with psycopg.connect(empty_database_url, autocommit=True) as c:
        c.execute(
            "CREATE TABLE webhook_inbox (delivery_id text PRIMARY KEY, event_type text,"
            " received_at timestamptz NOT NULL DEFAULT now())"
        )
        c.execute("INSERT INTO webhook_inbox (delivery_id) VALUES ('kept')")
        c.execute("CREATE TABLE keyless (LIKE webhook_inbox)")
    with psycopg.connect(empty_database_url) as c:
        with pytest.raises(SchemaError, match=r'column "attempt".*inbox install'):
            take(c, delivery())
        c.rollback()
        assert install(c) is False  # it was there; now it is whole
        c.commit()
        d = delivery({"amount": 1}, attempt=2, event_type="a.b")
        assert take(c, d) is not None
        c.commit()
    assert recorded(empty_database_url)[-1] == (d.delivery_id, "a.b", 2)
    assert recorded(empty_database_url)[0] == ("kept", None, None)  # kept, not rewritten
    with psycopg.connect(empty_database_url, autocommit=True) as c:
        c.execute("DROP TABLE webhook_inbox")
        c.execute("ALTER TABLE keyless RENAME TO webhook_inbox")
        c.execute("ALTER TABLE webhook_inbox ADD COLUMN attempt integer")
    with (
        psycopg.connect(empty_database_url) as c,
        pytest.raises(SchemaError, match="no primary key or unique index on delivery_id"),
    ):
        take(c, delivery())


@pytest.mark.parametrize(
    ("table", "named"),
    [
        ("delivery_id text, event_type text, attempt integer", "no primary key or unique index"),
        ("delivery_id text UNIQUE DEFERRABLE, attempt integer", "no primary key or unique index"),
        ("id bigint PRIMARY KEY, event_type text", "no delivery_id column"),
        # A delivery_id that cannot hold every id receive stores (up to 255 characters of
        # text): the type named, and the ALTER that makes it text.
        (
            "delivery_id integer PRIMARY KEY, event_type text, attempt integer",
            r"delivery_id is integer, not text.*ALTER COLUMN delivery_id TYPE text",
        ),
        ("delivery_id uuid PRIMARY KEY", "delivery_id is uuid, not text"),
        ("delivery_id varchar(36) PRIMARY KEY", r"is character varying\(36\), not text"),
        ("delivery_id varchar(254) PRIMARY KEY", r"is character varying\(254\), not text"),
        ("delivery_id char(255) PRIMARY KEY", r"is character\(255\), not text"),
    ],
)
def test_install_names_a_table_made_by_hand_that_receive_cannot_use(
    empty_database_url: str, table: str, named: str
) -> None:
    """Not "already installed" for a table every receive would refuse: install raises what
    receive would (sync and async), and changes nothing."""
    with psycopg.connect(empty_database_url, autocommit=True) as c:
        c.execute(f"CREATE TABLE webhook_inbox ({table})")
    with psycopg.connect(empty_database_url) as c, pytest.raises(SchemaError, match=named):
        install(c)

    async def on_async() -> None:
        async with await psycopg.AsyncConnection.connect(empty_database_url) as c:
            await install(c)

    with pytest.raises(SchemaError, match=named):
        asyncio.run(on_async())
    with psycopg.connect(empty_database_url, autocommit=True) as c:
        columns = c.execute(
            "SELECT count(*) FROM pg_attribute WHERE attrelid = 'webhook_inbox'::regclass"
            " AND attnum > 0 AND NOT attisdropped"
        ).fetchone()
    assert columns == (len(table.split(",")),)  # nothing added


@pytest.mark.parametrize("id_type", ["text", "varchar", "varchar(255)", "varchar(1000)"])
def test_a_hand_made_delivery_id_of_text_or_long_enough_varchar_is_completed(
    empty_database_url: str, id_type: str
) -> None:
    with psycopg.connect(empty_database_url, autocommit=True) as c:
        c.execute(f"CREATE TABLE webhook_inbox (delivery_id {id_type} PRIMARY KEY)")
        assert install(c) is False
        with c.transaction():
            assert take(c, delivery(delivery_id="x" * 255)) is not None
            assert take(c, delivery(delivery_id="x" * 255)) is None


@pytest.mark.parametrize(
    ("id_type", "delivery_id"),
    [
        ("integer", None),  # a UUID, as the dispatcher sends
        ("uuid", "msg_2LxyAbCdEf"),  # another sender's id (receive takes any up to 255)
        ("varchar(36)", "x" * 37),
    ],
)
def test_receive_on_a_delivery_id_that_is_not_text_says_so_not_a_raw_database_error(
    empty_database_url: str, id_type: str, delivery_id: str | None
) -> None:
    """A table made by hand and never given to install: the first id it cannot store is a
    SchemaError (the glue's inbox_not_installed, retried) rather than a psycopg DataError
    (the glue's handler_failed), and nothing is recorded."""
    with psycopg.connect(empty_database_url, autocommit=True) as c:
        c.execute(
            f"CREATE TABLE webhook_inbox (delivery_id {id_type} PRIMARY KEY, event_type text,"
            " attempt integer, received_at timestamptz NOT NULL DEFAULT now())"
        )
    with psycopg.connect(empty_database_url) as c:
        with pytest.raises(SchemaError, match="webhook_inbox cannot store this delivery"):
            take(c, delivery(delivery_id=delivery_id))
        c.rollback()
        assert c.execute("SELECT count(*) FROM webhook_inbox").fetchone() == (0,)


# -- receive ------------------------------------------------------------------------------


def test_first_delivery_returns_the_event_and_repeats_return_none(
    conn: psycopg.Connection[Any], inbox_database_url: str
) -> None:
    d = delivery({"amount": 42, "note": "é"}, attempt=3, event_type="account.credited")
    event = take(conn, d)
    assert event == InboxEvent(d.delivery_id, "account.credited", 3, {"amount": 42, "note": "é"})
    assert take(conn, d) is None  # the same transaction already has it
    conn.commit()
    retry = delivery({"amount": 42, "note": "é"}, delivery_id=d.delivery_id, attempt=4)
    assert take(conn, retry) is None  # a later attempt, newly signed: still a repeat
    conn.commit()
    assert recorded(inbox_database_url) == [(d.delivery_id, "account.credited", 3)]


def test_a_rolled_back_transaction_forgets_the_delivery(
    conn: psycopg.Connection[Any], inbox_database_url: str
) -> None:
    d = delivery()
    with pytest.raises(RuntimeError), conn.transaction():
        assert take(conn, d) is not None
        raise RuntimeError("the handler failed")
    assert recorded(inbox_database_url) == []
    with conn.transaction():
        assert take(conn, d) is not None  # the retry applies it
    assert [r[0] for r in recorded(inbox_database_url)] == [d.delivery_id]


def test_a_caught_database_error_is_told_before_the_commit_would_quietly_roll_back(
    inbox_database_url: str,
) -> None:
    """The documented plain-psycopg handler catches an error without a savepoint: its
    COMMIT would roll back without an error, losing the id and the writes while the code
    answered 2xx. check_committable says so first; inside a savepoint it is fine."""
    with psycopg.connect(inbox_database_url, autocommit=True) as c:
        c.execute("CREATE TABLE seen (id int PRIMARY KEY)")
        c.execute("INSERT INTO seen VALUES (1)")
        lost, kept, ended = delivery(), delivery(), delivery()
        with (
            pytest.raises(TransactionAborted, match="caught without a savepoint"),
            c.transaction(),
        ):
            assert take(c, lost) is not None
            with contextlib.suppress(psycopg.errors.UniqueViolation):
                c.execute("INSERT INTO seen VALUES (1)")
            check_committable(c)
        with c.transaction():
            assert take(c, kept) is not None
            with contextlib.suppress(psycopg.errors.UniqueViolation), c.transaction():
                c.execute("INSERT INTO seen VALUES (1)")
            check_committable(c)  # the savepoint took the error: nothing to say
        with (
            pytest.raises(TransactionAborted, match="COMMIT or ROLLBACK of its own"),
            c.transaction(),
        ):
            assert take(c, ended) is not None
            c.execute("ROLLBACK")
            check_committable(c)
    # Not in autocommit mode, a statement after the handler's own ROLLBACK begins a new
    # transaction: it is refused all the same, and its write is rolled back with it.
    with psycopg.connect(inbox_database_url) as c:
        again = delivery()
        with pytest.raises(TransactionAborted, match="COMMIT or ROLLBACK of its own"):
            assert take(c, again) is not None
            c.execute("ROLLBACK")
            c.execute("INSERT INTO seen VALUES (2)")
            check_committable(c)
        c.rollback()
        assert take(c, delivery()) is not None
        check_committable(c)  # a transaction that recorded its id: nothing to say
        c.rollback()
    # A savepoint rolled back with the id in it: the outer transaction would commit the
    # writes without it.
    with psycopg.connect(inbox_database_url, autocommit=True) as c:
        lost_in_savepoint = delivery()
        with pytest.raises(TransactionAborted, match="savepoint"), c.transaction():
            with c.transaction() as savepoint:
                assert take(c, lost_in_savepoint) is not None
                raise psycopg.Rollback(savepoint)
            c.execute("INSERT INTO seen VALUES (3)")
            check_committable(c)
        # In a pipeline, the statements not synced yet are synced by the check (the
        # connection is ACTIVE meanwhile, not ended): it passes, and all of it commits.
        piped = delivery()
        with c.transaction(), c.pipeline():
            assert take(c, piped) is not None
            c.execute("INSERT INTO seen VALUES (4)")
            check_committable(c)
    assert [r[0] for r in recorded(inbox_database_url)] == [kept.delivery_id, piped.delivery_id]
    with psycopg.connect(inbox_database_url) as c:
        assert c.execute("SELECT count(*) FROM seen WHERE id = 2").fetchone() == (0,)
        assert c.execute("SELECT array_agg(id ORDER BY id) FROM seen").fetchone() == ([1, 4],)


def test_several_deliveries_received_in_one_transaction_are_all_checked(
    inbox_database_url: str,
) -> None:
    """A handler that receives several deliveries in one transaction: a copy received again
    among them leaves the ids recorded before it checked, and every id recorded is looked
    up, not only the last."""
    with psycopg.connect(inbox_database_url, autocommit=True) as c:
        c.execute("CREATE TABLE seen (id int PRIMARY KEY)")
        earlier = delivery()
        with c.transaction():
            assert take(c, earlier) is not None
    with psycopg.connect(inbox_database_url) as c:
        first = delivery()
        with pytest.raises(TransactionAborted, match="COMMIT or ROLLBACK of its own"):
            assert take(c, first) is not None
            assert take(c, earlier) is None  # a copy: nothing to apply
            c.execute("ROLLBACK")
            c.execute("INSERT INTO seen VALUES (1)")
            check_committable(c)
        c.rollback()
        # A copy in a later transaction forgets the ids of the one that ended: no
        # transaction of its own to compare, nothing refused.
        assert take(c, earlier) is None
        check_committable(c)
        c.rollback()
    with psycopg.connect(inbox_database_url, autocommit=True) as c:
        lost, kept = delivery(), delivery()
        with pytest.raises(TransactionAborted, match="savepoint"), c.transaction():
            with c.transaction() as savepoint:
                assert take(c, lost) is not None
                raise psycopg.Rollback(savepoint)
            assert take(c, kept) is not None
            c.execute("INSERT INTO seen VALUES (2)")
            check_committable(c)
        # Received again after the savepoint it was first recorded in rolled back (as the
        # refusal advises): recorded once more, and the check passes.
        again = delivery()
        with c.transaction():
            with c.transaction() as savepoint:
                assert take(c, again) is not None
                raise psycopg.Rollback(savepoint)
            assert take(c, again) is not None
            check_committable(c)
        both = delivery(), delivery()
        with c.transaction():
            assert all(take(c, d) is not None for d in both)
            assert take(c, earlier) is None
            c.execute("INSERT INTO seen VALUES (3)")
            check_committable(c)
    ids = {r[0] for r in recorded(inbox_database_url)}
    assert ids == {earlier.delivery_id, again.delivery_id} | {d.delivery_id for d in both}
    with psycopg.connect(inbox_database_url) as c:
        assert c.execute("SELECT array_agg(id ORDER BY id) FROM seen").fetchone() == ([3],)


def test_autocommit_outside_a_transaction_is_refused_before_anything_happens(
    inbox_database_url: str,
) -> None:
    with psycopg.connect(inbox_database_url, autocommit=True) as c:
        with pytest.raises(ValueError, match=r"conn\.transaction\(\)"):
            take(c, delivery())
        with pytest.raises(ValueError):  # checked before the signature, too
            receive(c, body=b"{}", headers={}, secret=SECRET)
        with c.transaction():
            assert take(c, delivery()) is not None
    assert len(recorded(inbox_database_url)) == 1


async def test_async_receive_in_a_transaction(inbox_database_url: str) -> None:
    d = delivery({"amount": 7})
    async with await psycopg.AsyncConnection.connect(inbox_database_url, autocommit=True) as c:
        with pytest.raises(ValueError):
            await receive(c, body=d.body, headers=d.headers, secret=SECRET)
        async with c.transaction():
            event = await receive(c, body=d.body, headers=d.headers, secret=SECRET)
        async with c.transaction():
            again = await receive(c, body=d.body, headers=d.headers, secret=SECRET)
    assert event is not None and event.payload == {"amount": 7}
    assert again is None


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda d: (d.body + b" ", d.headers), "no_matching_signature"),
        (lambda d: (d.body, {**d.headers, "webhook-signature": "v1,AAAA"}), "bad_signature"),
        (lambda d: (d.body, d.standard_only() | {"webhook-id": "other"}), "no_matching_signature"),
        (lambda d: (d.body, {}), "missing_header"),
    ],
    ids=["tampered body", "malformed signature", "relabelled id", "no headers"],
)
def test_a_refused_request_records_nothing(
    conn: psycopg.Connection[Any], inbox_database_url: str, make: Any, reason: str
) -> None:
    body, headers = make(delivery())
    with pytest.raises(VerificationError) as caught:
        receive(conn, body=body, headers=headers, secret=SECRET)
    assert caught.value.reason == reason
    conn.commit()
    assert recorded(inbox_database_url) == []


def test_stale_and_future_timestamps_are_refused_within_the_tolerance(
    conn: psycopg.Connection[Any],
) -> None:
    now = 1_800_000_000
    for offset, reason in ((-301, "timestamp_too_old"), (301, "timestamp_too_new")):
        d = delivery(timestamp=now + offset)
        with pytest.raises(VerificationError) as caught:
            take(conn, d, now=now)
        assert caught.value.reason == reason
    assert take(conn, delivery(timestamp=now - 300), now=now) is not None
    assert take(conn, delivery(timestamp=now - 20), now=now, tolerance_s=30) is not None
    with pytest.raises(VerificationError):
        take(conn, delivery(timestamp=now - 31), now=now, tolerance_s=30)


def test_previous_secret_and_both_schemes(conn: psycopg.Connection[Any]) -> None:
    old = delivery(secret=OTHER)  # a sender still on the previous secret
    with pytest.raises(VerificationError):
        take(conn, old)
    assert take(conn, old, previous_secret=OTHER) is not None
    for strip in (Delivery.standard_only, Delivery.fluxora_only):
        d = delivery()
        event = receive(conn, body=d.body, headers=strip(d), secret=SECRET)
        assert event is not None and event.delivery_id == d.delivery_id


def test_scheme_standard_refuses_a_request_stripped_to_the_unsigned_id_scheme(
    conn: psycopg.Connection[Any],
) -> None:
    d = delivery()
    with pytest.raises(VerificationError) as caught:
        receive(conn, body=d.body, headers=d.fluxora_only(), secret=SECRET, scheme="standard")
    assert caught.value.reason == "missing_header"
    assert take(conn, d, scheme="standard") is not None


def test_header_forms_dict_multidict_and_raw_pairs(conn: psycopg.Connection[Any]) -> None:
    forms: dict[str, Callable[[Any], Any]] = {
        "dict": lambda d: d.headers,
        "title-case dict": lambda d: {k.title(): v for k, v in d.headers.items()},
        "aiohttp multidict": lambda d: CIMultiDictProxy(CIMultiDict(d.headers)),
        "ASGI raw pairs": lambda d: d.raw_pairs(),
        "tuple of str pairs": lambda d: tuple(d.headers.items()),
    }
    for name, form in forms.items():
        d = delivery(attempt=2)
        event = receive(conn, body=d.body, headers=form(d), secret=SECRET)
        assert event is not None, name
        assert (event.delivery_id, event.event_type, event.attempt) == (
            d.delivery_id,
            "account.credited",
            2,
        ), name


def test_the_first_copy_of_a_repeated_raw_header_is_the_one_checked(
    conn: psycopg.Connection[Any],
) -> None:
    d, other = delivery({"amount": 1}), delivery({"amount": 2})
    pairs = d.raw_pairs() + other.raw_pairs()  # a second, valid set after the first
    event = receive(conn, body=d.body, headers=pairs, secret=SECRET)
    assert event is not None and event.delivery_id == d.delivery_id
    with pytest.raises(VerificationError):
        receive(conn, body=other.body, headers=pairs, secret=SECRET)


def test_signed_but_unusable_requests_are_refused_with_their_own_reasons(
    conn: psycopg.Connection[Any], inbox_database_url: str
) -> None:
    cases = [
        (delivery(body=b"not json"), "bad_payload"),
        (delivery(body=b'{"a": 1'), "bad_payload"),
        (delivery(delivery_id="x" * 256), "bad_delivery_id"),
        (delivery(delivery_id="nul\x00byte"), "bad_delivery_id"),
    ]
    for d, reason in cases:
        with pytest.raises(VerificationError) as caught:
            take(conn, d)
        assert caught.value.reason == reason
    conn.commit()
    assert recorded(inbox_database_url) == []
    assert take(conn, delivery(delivery_id="x" * 255)) is not None


@pytest.mark.parametrize(
    ("event_header", "attempt_header", "expected"),
    [
        ("", "", (None, None)),
        ("bad\x01type", "0", (None, None)),
        (" spaced.out ", "-1", ("spaced.out", None)),
        ("t", "1.5", ("t", None)),
        ("t", "2", ("t", 2)),
        # The dispatcher writes a non-ASCII type in UTF-8; ASGI/WSGI servers decode header
        # bytes as ISO-8859-1, aiohttp as UTF-8: the inbox stores the type either way.
        ("\u6ce8\u6587.created".encode().decode("latin-1"), "1", ("\u6ce8\u6587.created", 1)),
        ("\u6ce8\u6587.created", "1", ("\u6ce8\u6587.created", 1)),
        ("caf\u00e9", "1", ("caf\u00e9", 1)),  # not UTF-8 bytes: kept as it came
    ],
)
def test_unreadable_event_type_and_attempt_are_none(
    conn: psycopg.Connection[Any],
    event_header: str,
    attempt_header: str,
    expected: tuple[str | None, int | None],
) -> None:
    d = delivery()
    headers = {**d.headers, "x-fluxora-event": event_header, "x-fluxora-attempt": attempt_header}
    event = receive(conn, body=d.body, headers=headers, secret=SECRET)
    assert event is not None
    assert (event.event_type, event.attempt) == expected


def test_a_plain_standard_webhooks_request_has_no_event_type_or_attempt(
    conn: psycopg.Connection[Any],
) -> None:
    d = delivery()
    event = receive(conn, body=d.body, headers=d.standard_only(), secret=SECRET)
    assert event is not None and (event.event_type, event.attempt) == (None, None)


# -- concurrency --------------------------------------------------------------------------


def _blocked_on_a_lock(url: str, pid: int) -> bool:
    with psycopg.connect(url, autocommit=True) as watcher:
        row = watcher.execute(
            "SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted", (pid,)
        ).fetchone()
    return bool(row and row[0])


def _wait_blocked(url: str, pid: int) -> None:
    deadline = time.monotonic() + 15
    while not _blocked_on_a_lock(url, pid):
        assert time.monotonic() < deadline, "the second transaction never waited"
        time.sleep(0.02)


@pytest.mark.parametrize("first_ends", ["commit", "rollback"])
def test_the_same_delivery_in_two_transactions_at_once_applies_once(
    inbox_database_url: str, first_ends: str
) -> None:
    d = delivery({"amount": 5})
    results: dict[str, InboxEvent | None] = {}
    with (
        psycopg.connect(inbox_database_url) as first,
        psycopg.connect(inbox_database_url) as second,
    ):
        assert take(first, d) is not None  # uncommitted: the row is held

        def race() -> None:
            results["second"] = take(second, d)
            second.commit()

        thread = threading.Thread(target=race)
        thread.start()
        _wait_blocked(inbox_database_url, second.info.backend_pid)
        assert thread.is_alive() and results == {}  # waiting, not answered
        getattr(first, first_ends)()
        thread.join(15)
    if first_ends == "commit":
        assert results == {"second": None}
    else:
        second_event = results["second"]
        assert second_event is not None and second_event.delivery_id == d.delivery_id
    assert [r[0] for r in recorded(inbox_database_url)] == [d.delivery_id]


async def test_async_race_second_transaction_gets_none_after_the_first_commits(
    inbox_database_url: str,
) -> None:
    d = delivery()
    async with (
        await psycopg.AsyncConnection.connect(inbox_database_url) as first,
        await psycopg.AsyncConnection.connect(inbox_database_url) as second,
    ):
        assert await receive(first, body=d.body, headers=d.headers, secret=SECRET) is not None
        racer: asyncio.Task[Any] = asyncio.create_task(
            receive(second, body=d.body, headers=d.headers, secret=SECRET)  # type: ignore[arg-type]
        )
        pid = second.info.backend_pid
        deadline = time.monotonic() + 15
        while not await asyncio.to_thread(_blocked_on_a_lock, inbox_database_url, pid):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert not racer.done()
        await first.commit()
        assert await racer is None
        await second.commit()


def test_repeatable_read_reports_the_race_as_a_serialization_failure(
    inbox_database_url: str,
) -> None:
    d = delivery()
    with (
        psycopg.connect(inbox_database_url) as first,
        psycopg.connect(inbox_database_url) as second,
    ):
        second.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        second.execute("SELECT 1")  # the snapshot is taken before the first commits
        assert take(first, d) is not None
        first.commit()
        with pytest.raises(psycopg.errors.SerializationFailure):
            take(second, d)
        second.rollback()
        assert take(second, d) is None  # the next attempt: a plain repeat
        second.commit()
    assert len(recorded(inbox_database_url)) == 1


# -- prune --------------------------------------------------------------------------------


async def test_prune_deletes_old_ids_in_batches_and_keeps_recent_ones(
    inbox_database_url: str,
) -> None:
    async with await psycopg.AsyncConnection.connect(inbox_database_url, autocommit=True) as c:
        await c.execute(
            "INSERT INTO webhook_inbox (delivery_id, received_at)"
            " SELECT 'old-' || g, now() - interval '40 days' - g * interval '1 second'"
            " FROM generate_series(1, 25) g"
        )
        await c.execute(
            "INSERT INTO webhook_inbox (delivery_id, received_at)"
            " SELECT 'new-' || g, now() - interval '29 days' FROM generate_series(1, 5) g"
        )
        dry = await prune(c, older_than_ms=30 * 86_400_000, dry_run=True)
        assert (dry.deleted, dry.dry_run) == (25, True)
        result = await prune(c, older_than_ms=30 * 86_400_000, batch_size=10)
        assert (result.deleted, result.batches) == (25, 3)
        left = await (await c.execute("SELECT delivery_id FROM webhook_inbox")).fetchall()
        assert sorted(r[0] for r in left) == [f"new-{g}" for g in range(1, 6)]
        await c.set_autocommit(False)
        with pytest.raises(ValueError, match="autocommit"):
            await prune(c, older_than_ms=1)


async def test_prune_finds_old_ids_through_the_received_at_index(
    inbox_database_url: str,
) -> None:
    async with await psycopg.AsyncConnection.connect(inbox_database_url, autocommit=True) as c:
        await c.execute(
            "INSERT INTO webhook_inbox (delivery_id, received_at)"
            " SELECT md5(g::text), now() - g * interval '1 second'"
            " FROM generate_series(1, 20000) g"
        )
        await c.execute("ANALYZE webhook_inbox")
        cur = await c.execute(
            "EXPLAIN (FORMAT JSON) SELECT delivery_id FROM webhook_inbox"
            " WHERE received_at < now() - interval '5 hours' ORDER BY received_at LIMIT 100"
        )
        row = await cur.fetchone()
    assert row is not None
    assert "webhook_inbox_received_at_idx" in str(row[0])


def test_prune_and_install_report_on_a_sync_connection_are_refused_at_the_call(
    empty_database_url: str,
) -> None:
    """install and receive take either connection; prune and install_report are async
    only, and say so rather than returning a coroutine that would silently do nothing."""
    with psycopg.connect(empty_database_url, autocommit=True) as c, warnings.catch_warnings():
        warnings.simplefilter("error")  # no "coroutine ... was never awaited" either
        with pytest.raises(TypeError, match=r"inbox\.install_report needs a psycopg Async"):
            install_report(c)  # type: ignore[arg-type, unused-coroutine]
        assert c.execute("SELECT to_regclass('webhook_inbox')").fetchone() == (None,)
        install(c)
        c.execute("INSERT INTO webhook_inbox (delivery_id, received_at) VALUES ('x', 'epoch')")
        with pytest.raises(TypeError, match=r"inbox\.prune needs a psycopg AsyncConnection"):
            prune(c, older_than_ms=1)  # type: ignore[arg-type, unused-coroutine]
        assert c.execute("SELECT count(*) FROM webhook_inbox").fetchone() == (1,)
