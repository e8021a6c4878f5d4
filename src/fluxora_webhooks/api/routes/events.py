"""``/api/v1/events``: enqueue over HTTP, list, and one event with its deliveries."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Response

from ... import deliveries
from ...endpoints import check_tenant
from ...errors import NotFoundError
from ..deps import Conn, Reader, Writer, scoped
from ..models import ErrorBody, Event, EventAccepted, EventDetail, EventIn, Filter, Page
from ..pagination import DEFAULT_LIMIT, Cursor, Limit, decode_int, page

router = APIRouter(
    prefix="/events",
    tags=["events"],
    responses={
        403: {
            "model": ErrorBody,
            "description": "`read_only`: a read-only token; `tenant_forbidden`: a tenant token"
            " naming another tenant",
        },
        404: {"model": ErrorBody, "description": "`not_found`: no such event (for this token)"},
    },
)


# What a keyed request's answers document (an enqueue's, an endpoint creation's).
REPLAYED: dict[str, Any] = {
    "headers": {
        "Idempotent-Replayed": {
            "description": "`true` when the answer is the first one again (an"
            " Idempotency-Key seen before); absent otherwise",
            "required": False,
            "schema": {"type": "string", "enum": ["true"]},
        }
    }
}
KEY_REUSED: dict[str, Any] = {
    "model": ErrorBody,
    "description": "invalid body or header (`validation_error`), or the"
    " Idempotency-Key was used with another request (`idempotency_key_reused`)",
}
TRACESTATE_HELP = (
    "W3C tracestate, passed on with a valid traceparent (repeated headers are one list,"
    " combined in their order, as W3C says)"
)
# How the document gives `tracestate`: one header value, a string (the route reads every
# header of the name, which a list parameter would document as an array: a header no
# client generator can send, openapi-python-client leaving the whole operation out).
TRACESTATE_PARAMETER = {
    "name": "tracestate",
    "in": "header",
    "required": False,
    "description": TRACESTATE_HELP,
    "schema": {"type": "string"},
}


@router.post(
    "",
    status_code=202,
    response_model=EventAccepted,
    summary="Enqueue an event",
    responses={202: REPLAYED, 422: KEY_REUSED},
    openapi_extra={"parameters": [TRACESTATE_PARAMETER]},
)
async def enqueue_event(
    who: Writer,
    conn: Conn,
    body: EventIn,
    response: Response,
    idempotency_key: Annotated[
        str | None,
        Header(
            pattern=deliveries.IDEMPOTENCY_KEY,
            description="1-255 visible ASCII characters. The same key and request within 24"
            " hours enqueue nothing and return the first answer again (with"
            " `Idempotent-Replayed: true`), also when both arrive at once; the same key with"
            " another request is 422 `idempotency_key_reused`. Keys are per tenant",
        ),
    ] = None,
    traceparent: Annotated[
        str | None,
        Header(
            description="W3C trace context of the producer: each attempt's span is its child"
            " and the consumer's request carries it on (an invalid one is ignored)"
        ),
    ] = None,
    tracestate: Annotated[
        list[str] | None, Header(description=TRACESTATE_HELP, include_in_schema=False)
    ] = None,
) -> dict[str, Any]:
    """For producers outside the database: the event is committed to the outbox and
    delivered to its tenant's endpoints like any other."""
    tenant = scoped(who, None if body.tenant is None else check_tenant(body.tenant))
    answer, replayed = await deliveries.enqueue_event(
        conn,
        tenant=tenant if tenant is not None else "",
        stream_id=body.stream_id,
        event_type=body.event_type,
        payload=body.payload,
        traceparent=traceparent,
        tracestate=",".join(tracestate) if tracestate else None,
        idempotency_key=idempotency_key,
    )
    if replayed:
        response.headers["Idempotent-Replayed"] = "true"
    return answer


@router.get("", response_model=Page[Event], summary="List events, newest first")
async def list_events(
    who: Reader,
    conn: Conn,
    tenant: Annotated[str | None, Query(description="'' is the default tenant")] = None,
    stream_id: Filter = None,
    event_type: Filter = None,
    limit: Limit = DEFAULT_LIMIT,
    cursor: Cursor = None,
) -> dict[str, Any]:
    found, after = await deliveries.list_events(
        conn,
        tenant=who.tenant,
        tenant_filter=scoped(who, tenant),
        stream_id=stream_id,
        event_type=event_type,
        limit=limit,
        before=decode_int("events", cursor),
    )
    return page("events", found, after)


@router.get("/{event_id}", response_model=EventDetail, summary="One event and its deliveries")
async def get_event(event_id: str, who: Reader, conn: Conn) -> dict[str, Any]:
    """``event_id``: the event's id, or the id ``enqueue`` returned for it (its row's
    delivery id: a producer logs that one)."""
    if event_id.isascii() and event_id.isdigit() and len(event_id) <= 18:
        return await deliveries.get_event(conn, int(event_id), tenant=who.tenant)
    found = await deliveries.event_of_row(conn, event_id, tenant=who.tenant)
    if found is None:
        raise NotFoundError(f"no event {event_id[:40]!r}")
    return await deliveries.get_event(conn, found, tenant=who.tenant)
