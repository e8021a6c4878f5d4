"""``fluxora-webhooks endpoints``: register, list, show, update, disable, enable, rotate the
secret of, and remove endpoints (SPEC 10). Each action takes ``--json``; ids and secrets are
printed once, at creation and rotation; a client certificate's private key never."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping
from typing import Any

from ..terminal import console, visible
from .common import EXIT_CONFIG, as_options, confirm, connect, engines, positive_int, run_async

NAME = "endpoints"
HELP = "register and manage the endpoints of your tenants"
DESCRIPTION = (
    "Endpoints are consumer URLs registered for a tenant, each with its event-type filter, "
    "its own signing secret and its own state. Changes reach running dispatchers at once."
)


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    # Never the text itself: a header's value is often a credential, and one written as
    # HTTP writes it ("Authorization: Basic dXNlcjpw...==") has an "=" in its value.
    if ":" in name:
        field = name.partition(":")[0].strip()[:40]
        raise argparse.ArgumentTypeError(f"{field!r}: write NAME=VALUE, not NAME: VALUE")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError("a header is NAME=VALUE")
    return name.strip(), value


def _events(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _options(p: argparse.ArgumentParser, *, creating: bool) -> None:
    p.add_argument("--url", required=creating, help="the consumer's https URL")
    if creating:
        p.add_argument("--tenant", default="", help="the tenant (default: the default tenant)")
        p.add_argument("--secret", help="the signing secret (default: a new whsec_ secret)")
        p.add_argument(
            "--idempotency-key",
            type=_idempotency_key,
            metavar="KEY",
            help="run again with the same key and options within 24 hours: the endpoint the"
            " first run added, not a second one (its secret while not rotated since)",
        )
    p.add_argument(
        "--events",
        type=_events,
        metavar="TYPES",
        help="event types to receive, comma-separated: *, exact names, prefixes like stream.*",
    )
    p.add_argument("--description", help="free text shown in lists")
    p.add_argument(
        "--header",
        action="append",
        type=_header,
        default=None,
        metavar="NAME=VALUE",
        help="a custom header sent with every request (repeat for more)",
    )
    p.add_argument("--rate-limit", type=positive_int, metavar="N", help="retries per second")
    p.add_argument(
        "--client-cert",
        metavar="FILE",
        help="a PEM file: the endpoint's own TLS client certificate (then any intermediates),"
        " presented to its consumer in place of WEBHOOK_TLS_CLIENT_CERT"
        + ("" if creating else "; replaces the one it has"),
    )
    p.add_argument(
        "--client-key",
        metavar="FILE",
        help="a PEM file: the certificate's unencrypted private key (default: the key in the"
        " --client-cert file); stored encrypted with WEBHOOK_ENCRYPTION_KEY when set",
    )
    if not creating:
        p.add_argument(
            "--no-client-cert",
            action="store_true",
            help="remove its client certificate (WEBHOOK_TLS_CLIENT_CERT's is presented again)",
        )
    p.add_argument(
        "--ordered",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="deliver each stream's events one at a time, in order",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="endpoints_action", required=True, metavar="ACTION")
    _options(actions.add_parser("add", help="register an endpoint"), creating=True)
    p = actions.add_parser("list", help="endpoints, of one tenant or of all")
    p.add_argument("--tenant", default=None, help="only this tenant's ('' for the default)")
    p.add_argument("--json", action="store_true")
    for action, text in (
        ("show", "one endpoint"),
        ("disable", "disable; its deliveries are parked, not lost"),
        ("enable", "enable; its parked deliveries are sent"),
    ):
        p = actions.add_parser(action, help=text)
        p.add_argument("id")
        p.add_argument("--json", action="store_true")
    p = actions.add_parser("update", help="change an endpoint")
    p.add_argument("id")
    _options(p, creating=False)
    p = actions.add_parser("rotate-secret", help="a new secret; the old one signs for a while")
    p.add_argument("id")
    p.add_argument("--secret", help="the new secret (default: a new whsec_ secret)")
    p.add_argument(
        "--keep-previous",
        default="24h",
        metavar="PERIOD",
        help="how long the old secret keeps signing too (default 24h; 0 to stop at once)",
    )
    p.add_argument("--json", action="store_true")
    p = actions.add_parser("remove", help="remove; its pending deliveries become dead letters")
    p.add_argument("id")
    p.add_argument("--yes", action="store_true", help="do not ask")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from .. import endpoints
    from ..secretbox import keyring_from_env
    from ..settings import Settings

    action = args.endpoints_action
    if action == "list":
        endpoints.check_tenant_filter(args.tenant)
    allowed = Settings.from_env(env).allowed_networks if action in ("add", "update") else ()
    # The secret (and a client certificate's key) is stored sealed with
    # WEBHOOK_ENCRYPTION_KEY when it is set.
    keys = keyring_from_env(env) if action in ("add", "update", "rotate-secret") else None
    client_cert = _client_cert(args) if action in ("add", "update") else None
    keep_ms = 0
    if action == "rotate-secret":
        keep_ms = endpoints.keep_previous_ms(args.keep_previous, "--keep-previous")
    if action == "update" and all(
        value is None
        for value in (
            args.url,
            args.events,
            args.description,
            args.header,
            args.rate_limit,
            args.ordered,
            client_cert,
            args.no_client_cert or None,
        )
    ):
        print(
            "fluxora-webhooks: error: endpoints update: nothing to change (give --url, --events,"
            " --description, --header, --rate-limit, --ordered/--no-ordered, --client-cert or"
            " --no-client-cert)",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    if action == "remove" and not args.yes and not _confirm(args.id):
        print("not removed", file=sys.stderr)
        return 1
    database_url, _ = engines(env, redis=False)

    async def main() -> int:
        async with connect(database_url) as conn:
            if action == "add":
                assert keys is not None
                fields = _add_fields(args)

                async def create() -> tuple[endpoints.Endpoint, str]:
                    return await endpoints.create(
                        conn, tenant=args.tenant, allowed_networks=allowed, keys=keys,
                        client_cert=client_cert, **fields,
                    )  # fmt: skip

                if args.idempotency_key is None:
                    endpoint, secret = await create()
                    _print_created(endpoint.as_json(), secret, args.json)
                else:
                    from ..deliveries import EndpointRequest, create_endpoint_once

                    tenant = endpoints.check_tenant(args.tenant, "--tenant")
                    endpoint, shown, before = await create_endpoint_once(
                        conn,
                        tenant,
                        args.idempotency_key,
                        EndpointRequest(tenant, fields, client_cert),
                        create,
                        scope=None,
                        keys=keys,
                    )
                    # Not shown: rotated since, or sealed with a key this process lacks.
                    locked = shown is None and (
                        endpoints.unopenable(endpoint.secret, endpoint.id, keys) is not None
                    )
                    _print_created(
                        endpoint.as_json(), shown, args.json, before=before, locked=locked
                    )
            elif action == "list":
                _print_list(await _all(conn, args.tenant), args.json)
            elif action in ("show", "disable", "enable"):
                do = {
                    "show": endpoints.get,
                    "disable": endpoints.disable,
                    "enable": endpoints.enable,
                }[action]
                _print_one((await do(conn, args.id)).as_json(), args.json)
            elif action == "update":
                changes = endpoints.Changes(
                    url=args.url,
                    event_types=args.events,
                    description=args.description,
                    headers=None if args.header is None else dict(args.header),
                    rate_limit=args.rate_limit,
                    ordered=args.ordered,
                )
                if client_cert is not None or args.no_client_cert:
                    # Checked (and refused, naming the option) before anything else changes.
                    if client_cert is not None:
                        client_cert.check()
                    await endpoints.get(conn, args.id)
                updated = await endpoints.update(
                    conn, args.id, changes, allowed_networks=allowed, keys=keys
                )
                if client_cert is not None or args.no_client_cert:
                    updated = await endpoints.set_client_certificate(
                        conn, args.id, client_cert, keys=keys
                    )
                _print_one(updated.as_json(), args.json)
            elif action == "rotate-secret":
                endpoint, secret = await endpoints.rotate_secret(
                    conn, args.id, secret=args.secret, keep_previous_ms=keep_ms, keys=keys
                )
                if args.json:
                    print(json.dumps({"id": endpoint.id, "secret": secret}))
                else:
                    print(f"new secret for {endpoint.id} (shown once): {secret}")
            else:
                dead = await endpoints.remove(conn, args.id)
                if args.json:
                    print(json.dumps({"id": args.id, "removed": True, "dead_lettered": dead}))
                else:
                    print(f"removed {args.id}; {dead} pending delivery(ies) dead-lettered")
        return 0

    return as_options(lambda: run_async(main()))


def _client_cert(args: argparse.Namespace) -> Any:
    """``--client-cert`` and ``--client-key`` read (an endpoints.ClientCert; None: not
    given). The key may be in the certificate's file, after it."""
    from ..clientcerts import split_pem
    from ..endpoints import ClientCert
    from ..errors import ConfigError

    if args.client_cert is None:
        if args.client_key is not None:
            raise ConfigError("--client-key", "is given without --client-cert")
        return None
    if getattr(args, "no_client_cert", False):
        raise ConfigError("--client-cert", "and --no-client-cert cannot go together")

    def read(path: str, option: str) -> str:
        try:
            with open(path, encoding="utf-8") as given:
                return given.read(1 << 20)
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not PEM text"
            raise ConfigError(option, f"cannot read {path} ({why})") from None

    chain = read(args.client_cert, "--client-cert")
    if args.client_key is not None:
        return ClientCert(
            chain, read(args.client_key, "--client-key"), ("client_cert", "client_key")
        )
    certs, key = split_pem(chain)
    if "-----BEGIN CERTIFICATE-----" not in certs:
        raise ConfigError(
            "--client-cert",
            f"{args.client_cert} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
        )
    if key is None:
        raise ConfigError(
            "--client-key",
            f"is required: {args.client_cert} holds no private key (give its file with"
            " --client-key, or append the key to the certificate's file)",
        )
    return ClientCert(certs, key, ("client_cert", "client_cert"))


async def _all(conn: Any, tenant: str | None) -> list[dict[str, Any]]:
    from .. import endpoints

    out: list[dict[str, Any]] = []
    after = None
    while True:
        page = await endpoints.list_endpoints(conn, tenant=tenant, limit=500, after=after)
        out.extend(e.as_json() for e in page)
        if len(page) < 500:
            return out
        after = page[-1].id


def _confirm(endpoint_id: str) -> bool:
    # Asked on stderr, as dlq asks: standard output is the answer (--json), not the prompt.
    question = f"remove {visible(endpoint_id)} and dead-letter its pending deliveries; go ahead?"
    return confirm(question, yes=False)


def _print_created(
    endpoint: dict[str, Any],
    secret: str | None,
    as_json: bool,
    *,
    before: bool = False,
    locked: bool = False,
) -> None:
    if as_json:
        print(json.dumps({**endpoint, "secret": secret, **({"replayed": True} if before else {})}))
        return
    said = "added before with this key:" if before else "created"
    print(f"{said} {endpoint['id']} for tenant {endpoint['tenant']!r}: {endpoint['url']}")
    if locked:
        print(
            "signing secret: not shown: it is stored encrypted with a key this process does"
            " not have (run again with the service's WEBHOOK_ENCRYPTION_KEY)"
        )
    elif secret is None:
        print("signing secret: rotated since; not shown again")
    elif before:
        print(f"signing secret (as first shown; shown while not rotated): {secret}")
    else:
        print(f"signing secret (shown once): {secret}")
    if endpoint.get("client_certificate"):
        print(f"client certificate: {_certificate_line(endpoint['client_certificate'])}")


def _idempotency_key(text: str) -> str:
    """1 to 255 visible ASCII characters, as the API's Idempotency-Key."""
    from ..deliveries import IDEMPOTENCY_KEY

    if not re.fullmatch(IDEMPOTENCY_KEY, text):
        raise argparse.ArgumentTypeError("must be 1 to 255 visible ASCII characters")
    return text


def _print_one(endpoint: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(endpoint))
        return
    width = max(map(len, endpoint), default=0)
    for key, value in endpoint.items():
        if key == "client_certificate" and value is not None:
            shown: Any = _certificate_line(value)
        else:
            shown = json.dumps(value) if isinstance(value, dict | list) else value
        # A tenant's text (a description, a header) may hold a terminal's control
        # sequences: shown as escapes, never run by the operator's terminal.
        print(f"{key:{width}} {'' if shown is None else visible(str(shown))}")


def _certificate_line(described: dict[str, Any]) -> str:
    """An endpoint's client certificate in one line: whose, by whom, how long, which."""
    from datetime import datetime

    from .. import clientcerts

    not_before, not_after = described.get("not_before"), described["not_after"]
    found = clientcerts.validity(
        None if not_before is None else datetime.fromisoformat(not_before),
        datetime.fromisoformat(not_after),
    )
    if found == clientcerts.EXPIRED:
        validity = f"EXPIRED on {not_after}"
    elif found == clientcerts.NOT_YET_VALID:
        validity = f"NOT VALID before {not_before} (until {not_after})"
    else:
        validity = f"valid until {not_after}"
    return (
        f"{described['subject']}, issued by {described['issuer']}, {validity},"
        f" sha256 {described['fingerprint_sha256']}"
    )


def _print_list(items: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print(json.dumps(items, indent=2))
        return
    if not items:
        print("no endpoints")
        return
    from rich.table import Table
    from rich.text import Text

    table = Table()
    for column in ("id", "tenant", "url", "event_types", "state", "ordered"):
        # The id is what an operator copies into the other commands: kept on one line.
        whole = {"no_wrap": True, "min_width": 27} if column == "id" else {}
        table.add_column(column, overflow="fold", **whole)  # type: ignore[arg-type]
    for item in items:
        state = item["state"] + (f" ({item['disabled_reason']})" if item["disabled_reason"] else "")
        table.add_row(
            *(
                Text(visible(str(v)))  # stored text as text: no markup, no control codes
                for v in (
                    item["id"],
                    item["tenant"] if item["tenant"] is not None else "(operator)",
                    item["url"],
                    ",".join(item["event_types"]),
                    state,
                    "yes" if item["ordered"] else "",
                )
            )
        )
    console(width=200 if not sys.stdout.isatty() else None).print(table)


def _add_fields(args: argparse.Namespace) -> dict[str, Any]:
    """What `add` makes the endpoint of, as endpoints.create takes it; with the client
    certificate, what `add --idempotency-key` binds its key to (a secret and a key only
    through the key's digest)."""
    return {
        "url": args.url,
        "event_types": ["*"] if args.events is None else args.events,
        "secret": args.secret,
        "description": args.description or "",
        "headers": dict(args.header or []),
        "rate_limit": args.rate_limit,
        "ordered": bool(args.ordered),
    }
