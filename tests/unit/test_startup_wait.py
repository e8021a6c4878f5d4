"""Which failures to reach the database at start-up `run` waits out (a server not reached,
starting, shutting down or out of slots) and which stop it at once (refusals that waiting
does not change). A failed connection carries no SQLSTATE: the server's FATAL line tells,
in the server's language; only the lasting refusals are recognised (in English), any other
is waited for."""

from __future__ import annotations

import psycopg
import pytest

from fluxora_webhooks.service import _curable_by_waiting

REACH = 'connection failed: connection to server at "10.0.0.5", port 5432 failed: '


@pytest.mark.parametrize(
    "message",
    [
        REACH + "Connection refused\n\tIs the server running on that host?",
        REACH + "timeout expired",
        'connection failed: could not translate host name "db" to address',
        REACH + "FATAL:  the database system is starting up",
        REACH + "FATAL:  the database system is shutting down",
        REACH + "FATAL:  the database system is in recovery mode",
        REACH + "FATAL:  sorry, too many clients already",
        REACH + "FATAL:  remaining connection slots are reserved for roles with SUPERUSER",
        # A server whose lc_messages is not English says so in its language.
        REACH + "FATAL:  tut mir leid, schon zu viele Verbindungen",
        REACH + "FATAL:  das Datenbanksystem startet",
        REACH + "FATAL:  le système de bases de données est en cours de restauration",
        REACH + "致命的エラー:  データベースシステムは起動処理中です",
    ],
)
def test_a_failure_that_passes_is_waited_out(message: str) -> None:
    assert _curable_by_waiting(psycopg.OperationalError(message))


@pytest.mark.parametrize(
    "message",
    [
        REACH + 'FATAL:  password authentication failed for user "app"',
        REACH + 'FATAL:  database "shop" does not exist',
        REACH + 'FATAL:  role "app" does not exist',
        REACH + 'FATAL:  no pg_hba.conf entry for host "10.0.0.9", user "app"',
        REACH + 'FATAL:  Ident authentication failed for user "app"',
        REACH + 'FATAL:  role "app" is not permitted to log in',
        REACH + 'FATAL:  permission denied for database "shop"',
        REACH + 'FATAL:  unrecognized configuration parameter "serch_path"',
        REACH + 'FATAL:  database "shop" is not currently accepting connections',
        # libpq's own, as psycopg raises them (no SQLSTATE):
        REACH + "server does not support SSL, but SSL was required",
        'connection is bad: invalid sslmode value: "bogus"',
        'connection is bad: invalid integer value "5432x" for connection option "port"',
        REACH + "channel binding required, but server authenticated client without channel binding",
        REACH + 'could not open certificate file "/etc/app/client.crt": No such file',
        REACH + "fe_sendauth: no password supplied",
    ],
)
def test_a_refusal_stops_start_up_at_once(message: str) -> None:
    assert not _curable_by_waiting(psycopg.OperationalError(message))


def test_a_host_named_after_a_word_of_a_refusal_is_still_waited_for() -> None:
    assert _curable_by_waiting(
        psycopg.OperationalError(
            'connection failed: connection to server at "pg-certificate-store.internal"'
            " (10.0.0.5), port 5432 failed: Connection refused"
        )
    )
