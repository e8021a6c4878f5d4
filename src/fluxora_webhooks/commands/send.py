"""``fluxora-webhooks send``: enqueue a test event and print its delivery ids (SPEC 18).

The event goes through :func:`~fluxora_webhooks.outbox.enqueue`, as a producer's would.
Its deliveries to the table's endpoints get their delivery ids when a dispatcher routes it
(see :mod:`fluxora_webhooks.tooling`), so ``send`` waits for that, ``--wait`` seconds at
most (a running dispatcher routes it within milliseconds). One line per delivery:
``DELIVERY_ID ENDPOINT_ID``; ``--json`` prints one object.

Exit codes: 0 routed (also to no endpoint: said on stderr), or not waited for
(``--wait 0``); 1 not routed within ``--wait`` (no dispatcher running?: the event stays
enqueued and is routed when one runs); 2 a bad option (the payload's JSON named).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping
from typing import Any

from ..endpoints import check_event_type
from ..errors import ConfigError
from ..outbox import MAX_STREAM_ID, payload_json
from .common import EXIT_FAILED, EXIT_OK, connect, engines, run_async

NAME = "send"
HELP = "enqueue a test event and print its delivery ids"
DESCRIPTION = (
    "Enqueue a test event for a tenant (through enqueue(), as a producer would) and print "
    "the delivery id of each endpoint it reaches, once a dispatcher has routed it."
)
DEFAULT_STREAM = "fluxora-webhooks-send"
DEFAULT_WAIT_S = 10.0
MAX_WAIT_S = 3600.0


def _wait(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not 0 <= value <= MAX_WAIT_S:
        raise ConfigError("--wait", f"must be a number of seconds from 0 to {MAX_WAIT_S:.0f}")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tenant", default="", help="the tenant (default: the default tenant)")
    parser.add_argument("--event", required=True, metavar="TYPE", help="the event type")
    parser.add_argument("--payload", required=True, metavar="JSON", help="the payload, as JSON")
    parser.add_argument(
        "--stream",
        default=DEFAULT_STREAM,
        metavar="ID",
        help=f"stream id (default {DEFAULT_STREAM})",
    )
    parser.add_argument(
        "--wait",
        type=_wait,
        default=DEFAULT_WAIT_S,
        metavar="SECONDS",
        help=f"how long to wait for a dispatcher to route it (default {DEFAULT_WAIT_S:.0f}; "
        "0: do not wait)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def parse_payload(text: str) -> Any:
    """The payload as JSON, or a :class:`ConfigError` naming ``--payload`` and the fault."""

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        payload = json.loads(text, parse_constant=constant)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            "--payload", f"is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
        ) from None
    except (ValueError, RecursionError) as exc:
        raise ConfigError("--payload", f"is not valid JSON: {exc}") from None

    try:  # what enqueue refuses, refused as an option is: exit 2, no traceback
        payload_json(payload)
    except (ValueError, TypeError) as exc:
        raise ConfigError("--payload", str(exc).removeprefix("payload ")) from None
    return payload


def run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from ..endpoints import check_tenant
    from ..tooling import Routing, send_event, wait_routed

    tenant = check_tenant(args.tenant, "--tenant")
    if not args.stream:
        raise ConfigError("--stream", "must not be empty")
    if len(args.stream) > MAX_STREAM_ID:
        raise ConfigError(
            "--stream", f"must be at most {MAX_STREAM_ID} characters (is {len(args.stream)})"
        )
    check_event_type(args.event, "--event")
    payload = parse_payload(args.payload)
    database_url, _ = engines(env, redis=False)

    async def main() -> int:
        async with connect(database_url) as conn:
            sent = await send_event(
                conn, tenant=tenant, event_type=args.event, payload=payload, stream_id=args.stream
            )
            routing = await wait_routed(conn, sent, args.wait) if args.wait > 0 else Routing()
        out = {
            "event_id": sent.event_id,
            "tenant": tenant,
            "event_type": args.event,
            "stream_id": args.stream,
            "routed": routing.routed,  # a dispatcher routed it (to no endpoint, maybe)
            "routing": routing.routing,
            "deliveries": [{"endpoint_id": e, "delivery_id": d} for e, d in routing.deliveries],
        }
        if args.json:
            print(json.dumps(out))
        else:
            for endpoint_id, delivery_id in routing.deliveries:
                print(f"{delivery_id} {endpoint_id}")
        if routing.routing == "unrouted":
            print(
                f"event {sent.event_id}: no endpoint of tenant {tenant!r} subscribes to"
                f" {args.event!r} (recorded as unrouted)",
                file=sys.stderr,
            )
        elif routing.routing == "dead_letter":
            print(
                f"event {sent.event_id}: its fan-out was refused (a dead letter:"
                " `fluxora-webhooks dlq list`)",
                file=sys.stderr,
            )
        if not routing.routed and args.wait > 0:
            print(
                f"event {sent.event_id} enqueued but not routed within {args.wait:g}s: is a"
                " dispatcher running (fluxora-webhooks run)? It is routed when one runs.",
                file=sys.stderr,
            )
            return EXIT_FAILED
        if not routing.routed:
            print(f"event {sent.event_id} enqueued (not waited for its routing)", file=sys.stderr)
        return EXIT_OK

    return run_async(main())
