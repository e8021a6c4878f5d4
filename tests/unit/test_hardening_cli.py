"""Issue 18 (defects 4, 7, 8, 12) at the command line, in-process: number options refused
naming the option, stored text shown as data, ``--all`` confirmed.
"""

from __future__ import annotations

import io
import sys
from typing import Any

import pytest

from fluxora_webhooks import cli
from fluxora_webhooks.commands import dlq, status
from fluxora_webhooks.ops import RECORDED_OUTCOMES
from fluxora_webhooks.terminal import cell, visible

HUGE = "9" * 5000  # int() refuses more than 4,300 digits


# --- CLI options: exit 2 naming the option, before anything connects ---------------------------


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (("dlq", "list", "--limit", HUGE), "--limit"),
        (("dlq", "list", "--limit", "99999999999999999999"), "--limit"),
        (("dlq", "list", "--limit", "1000001"), "--limit"),
        (("dlq", "list", "--limit", "\u00b2"), "--limit"),
        (("status", "--minutes", HUGE), "--minutes"),
        (("status", "--minutes", "99999999999"), "--minutes"),
        (("status", "--minutes", "0"), "--minutes"),
        (("prune", "--older-than", HUGE + "d"), "--older-than"),
        (("prune", "--older-than", "99999999999999d"), "--older-than"),
        (("prune", "--older-than", "0d"), "--older-than"),  # never "the whole history"
        (("prune", "--older-than", "7d", "--batch-size", HUGE), "--batch-size"),
        (("prune", "--older-than", "7d", "--batch-size", "\u0661\u0660"), "--batch-size"),
        (("inbox", "prune", "--older-than", HUGE + "d"), "--older-than"),
        (("inbox", "prune", "--older-than", "30d", "--batch-size", HUGE), "--batch-size"),
        (("demo", "--timeout", HUGE), "--timeout"),
        (("demo", "--events", "99999999999999999999"), "--events"),
        (("demo", "--rate", "inf"), "--rate"),
        (("demo", "--rate", "1e999"), "--rate"),
        (("demo", "--seed", HUGE), "--seed"),
    ],
)
def test_every_number_option_refuses_any_input_naming_itself(
    args: tuple[str, ...], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = cli.main(list(args))
    except SystemExit as exc:  # argparse's own refusals
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"error: {option}:" in err and "configuration error" not in err
    assert "Traceback" not in err and len(err) < 500


@pytest.mark.parametrize("command", [("tail",), ("dlq", "list")])
def test_a_negative_limit_is_told_its_bound(
    command: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = cli.main([*command, "--limit", "-1"])
    except SystemExit as exc:
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2
    assert "error: --limit: must be at least 1, got -1" in err, err


def test_status_reads_the_breaker_threshold_without_raising() -> None:
    for raw in ("\u00b2", HUGE, "x"):
        assert status._breaker_threshold({"WEBHOOK_CIRCUIT_BREAKER_THRESHOLD": raw}) is None
    assert status._breaker_threshold({"WEBHOOK_CIRCUIT_BREAKER_THRESHOLD": "5"}) == 5


# --- 4. Stored text on the terminal ----------------------------------------------------------

HOSTILE: dict[str, Any] = {
    "delivery_id": "0b8a3c1e-6f6e-4f43-9d3c-4f1b1d1e8a11",
    "event_type": "[bold red]stream.updated[/]",
    "stream_id": "[link=https://e.example]x[/link]",
    "attempts": 8,
    "reason": "[/]",
    "last_status": 503,
    "dead_at": "\x1b[31m\x07\x7f\x9b\u202e",
    "state": "dead",
}
OSC_LINK = "\x1b]8;;http://e/\x1b\\"  # a terminal hyperlink escape sequence


def test_visible_escapes_what_a_terminal_would_act_on() -> None:
    assert visible("plain [b]text[/b] ü") == "plain [b]text[/b] ü"
    assert visible("a\x1b[31mb") == "a\\x1b[31mb"
    assert visible("\x00\x07\t\n\x7f\x85\x9b") == "\\x00\\x07\\x09\\x0a\\x7f\\x85\\x9b"
    assert visible("\u202eevil\u2066") == "\\u202eevil\\u2066"
    assert cell("x" * 100, 10).plain == "x" * 9 + "…"
    assert cell("[bold]x[/]").plain == "[bold]x[/]"


def test_dlq_list_shows_stored_text_as_data(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [HOSTILE, {**HOSTILE, "stream_id": OSC_LINK}, {**HOSTILE, "stream_id": "s" * 500}]
    dlq.print_rows(rows, dlq.LIST_COLUMNS, False)
    out = capsys.readouterr().out
    assert "[bold red]stream.updated[/]" in out
    assert "[link=https://e.example]x[/link]" in out
    assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out and "\u202e" not in out
    assert "\\x1b]8;;http://e/\\x1b\\" in out
    assert "\\x1b[31m\\x07\\x7f\\x9b\\u202e" in out
    assert HOSTILE["delivery_id"] in out  # ids are never cut
    assert "s" * 500 not in out and "s" * 39 + "…" in out  # other fields are bounded
    dlq.print_rows([{**HOSTILE, "stream_id": "s" * 500}], dlq.LIST_COLUMNS, True)
    assert "s" * 500 in capsys.readouterr().out  # --json: all of it


def test_status_shows_a_redis_error_as_data(capsys: pytest.CaptureFixture[str]) -> None:
    snapshot: dict[str, Any] = {
        "at": "now",
        "backlog": {
            "pending": 0,
            "due_now": 0,
            "oldest_due_age_seconds": 0,
            "next_due_in_seconds": None,
            "estimated": False,
            "egress_held": 0,
        },
        "dead_letters": {"waiting": 0},
        "recent": {"minutes": 15, "attempts": dict.fromkeys(RECORDED_OUTCOMES, 0),
                   "duration_ms": {}, "last_at": None},
        "consumer": {
            "endpoint": "https://hooks.example.com",
            "redis": {"url": "redis://r", "reachable": False, "error": "[/] \x1b[2J gone"},
        },
    }  # fmt: skip
    status.render(snapshot)
    out = capsys.readouterr().out
    assert "[/] \\x1b[2J gone" in out and "\x1b" not in out


# --- 12. Confirmation of --all ------------------------------------------------------------------


@pytest.mark.parametrize("action", ["purge", "replay"])
def test_all_without_a_terminal_needs_yes(
    action: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))  # not a terminal: never read
    code = cli.main(["dlq", action, "--all"])
    err = capsys.readouterr().err
    assert code == 2 and "error: --yes: is needed to go ahead without a terminal" in err, err


def test_a_database_out_of_resources_is_not_called_unreachable() -> None:
    """Out of shared memory (the lock table), or of disk: the database was reached and
    may have committed what came before; "cannot reach the database" would mislead."""
    import psycopg

    from fluxora_webhooks.cli import _describe_failure

    env = {"DATABASE_URL": "postgresql:///x"}
    said = _describe_failure(psycopg.errors.OutOfMemory("out of shared memory"), env)
    assert said == "the database (DATABASE_URL) ran out of resources: out of shared memory"
    crowded = _describe_failure(psycopg.errors.TooManyConnections("too many clients"), env)
    assert crowded is not None and crowded.startswith("cannot reach the database")


@pytest.mark.parametrize(
    ("not_before", "not_after", "said"),
    [
        ("2020-01-01T00:00:00+00:00", "3000-01-01T00:00:00+00:00",
         "valid until 3000-01-01T00:00:00+00:00"),
        ("2019-01-01T00:00:00+00:00", "2020-01-01T00:00:00+00:00",
         "EXPIRED on 2020-01-01T00:00:00+00:00"),
        ("2999-01-01T00:00:00+00:00", "3000-01-01T00:00:00+00:00",
         "NOT VALID before 2999-01-01T00:00:00+00:00 (until 3000-01-01T00:00:00+00:00)"),
        (None, "3000-01-01T00:00:00+00:00", "valid until 3000-01-01T00:00:00+00:00"),
    ],
    ids=["valid", "expired", "not-yet-valid", "no-start-read"],
)  # fmt: skip
def test_endpoints_show_says_whether_its_client_certificate_is_valid_now(
    capsys: pytest.CaptureFixture[str], not_before: str | None, not_after: str, said: str
) -> None:
    from fluxora_webhooks.commands.endpoints import _print_one

    described = {"subject": "CN=a", "issuer": "CN=ca", "not_before": not_before,
                 "not_after": not_after, "fingerprint_sha256": "ab" * 32}  # fmt: skip
    _print_one({"id": "ep_1", "client_certificate": described}, as_json=False)
    assert capsys.readouterr().out.splitlines() == [
        "id                 ep_1",
        f"client_certificate CN=a, issued by CN=ca, {said}, sha256 {'ab' * 32}",
    ]


@pytest.mark.parametrize(
    ("held", "said"),
    [
        (1, "1 delivery held: this service's way out failed (the egress proxy,"
            " WEBHOOK_PROXY_URL, or its DNS lookups), so no consumer was asked and no attempt"
            " is used; it is sent when it works again"),
        (1_000_000, "at least 1,000,000 deliveries held: this service's way out failed (the"
            " egress proxy, WEBHOOK_PROXY_URL, or its DNS lookups), so no consumer was asked"
            " and no attempt is used; they are sent when it works again"),
    ],
    ids=["one", "at-the-cap"],
)  # fmt: skip
def test_status_says_how_many_deliveries_the_egress_proxy_holds(
    capsys: pytest.CaptureFixture[str], held: int, said: str
) -> None:
    snapshot: dict[str, Any] = {
        "at": "now",
        "backlog": {"pending": held, "due_now": 0, "oldest_due_age_seconds": 0,
                    "next_due_in_seconds": 5, "estimated": False, "egress_held": held},
        "dead_letters": {"waiting": 0},
        "recent": {"minutes": 15, "attempts": dict.fromkeys(RECORDED_OUTCOMES, 0),
                   "duration_ms": {}, "last_at": None},
        "endpoints": None,
        "consumer": None,
    }  # fmt: skip
    status.render(snapshot)
    assert said in capsys.readouterr().out.splitlines()


def test_endpoints_add_says_when_its_client_certificate_is_not_valid_yet(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from fluxora_webhooks.commands.endpoints import _print_created

    described = {
        "subject": "CN=a",
        "issuer": "CN=ca",
        "not_before": "2999-01-01T00:00:00+00:00",
        "not_after": "3000-01-01T00:00:00+00:00",
        "fingerprint_sha256": "ab" * 32,
    }
    made = {
        "id": "ep_1",
        "tenant": "acme",
        "url": "https://a.example/",
        "client_certificate": described,
    }
    _print_created(made, "whsec_x", as_json=False)
    assert capsys.readouterr().out.splitlines()[-1] == (
        "client certificate: CN=a, issued by CN=ca, NOT VALID before 2999-01-01T00:00:00+00:00"
        f" (until 3000-01-01T00:00:00+00:00), sha256 {'ab' * 32}"
    )


def test_ids_are_never_cut_in_the_tables_of_a_narrow_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a 120-column terminal `dlq list` showed '66cb75c6-8a79-9dcb-6a09-cb12f5569...':
    an id an operator copies into `dlq replay` was cut (docs: never)."""
    from fluxora_webhooks.commands.dlq import LIST_COLUMNS, print_rows
    from fluxora_webhooks.commands.endpoints import _print_list

    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    delivery_id = "66cb75c6-8a79-4dcb-8a09-cb12f5569e11"
    endpoint_id = "ep_" + "z" * 24
    row = {c: "x" * 60 for c in LIST_COLUMNS}
    row.update(delivery_id=delivery_id, endpoint_id=endpoint_id)
    print_rows([row], LIST_COLUMNS, as_json=False)
    out = capsys.readouterr().out
    assert delivery_id in out and endpoint_id in out, out
    _print_list([{
        "id": endpoint_id, "tenant": "acme", "url": "https://hooks.example.com/" + "p" * 90,
        "event_types": ["*"], "state": "enabled", "disabled_reason": None, "ordered": False,
    }], as_json=False)  # fmt: skip
    assert endpoint_id in capsys.readouterr().out


def test_an_option_is_taken_only_as_spelled_out(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse's prefixes made `dlq purge --a --y` purge every dead letter."""
    with pytest.raises(SystemExit) as stopped:
        cli.main(["dlq", "purge", "--a", "--y"])
    assert stopped.value.code == 2
    assert "unrecognized arguments: --a --y" in capsys.readouterr().err
