"""The deliveries pages: search (stream id, event type, delivery id, tenant, status) with
paging, one delivery with every attempt and a replay button, and one event."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from ... import deliveries
from ...errors import NotFoundError
from ..deps import api_state
from ..errors import ApiError
from ..pagination import decode_int, encode
from .render import Forbidden, Viewer, posted, render, viewer

router = APIRouter(include_in_schema=False)


async def existing_endpoints(conn: Any, ids: Iterable[str], tenant: str | None) -> frozenset[str]:
    """Which of these endpoints exist (of ``tenant``'s, for a tenant's portal): a delivery
    outlives its removed endpoint, and its page neither links to that endpoint nor offers
    a replay that would be refused."""
    wanted = sorted(set(ids))
    if not wanted:
        return frozenset()
    cur = await conn.execute(
        "SELECT id FROM webhook_endpoints WHERE id = ANY(%s) AND (%s::text IS NULL OR tenant = %s)",
        (wanted, tenant, tenant),
    )
    return frozenset(str(row[0]) for row in await cur.fetchall())


PAGE = 50
FILTERS = ("stream_id", "event_type", "tenant", "status", "endpoint_id")
# What the deliveries' list takes in its query: its form's fields and its links'.
_SEARCH_TAKES = frozenset((*FILTERS, "delivery_id", "default_tenant", "held", "cursor"))

PARKED = "its endpoint is disabled; it is sent when the endpoint is enabled"
# The reasons a dead letter can have without a request made (delivery_rows: no status, no
# duration); the others had one, whose row retention may have pruned since.
UNSENT_REASONS = frozenset({"endpoint_removed", "invalid_request", "internal_error"})


def _attempts(count: int) -> str:
    return f"{count} attempt" if count == 1 else f"{count} attempts"


def why_it_ended(delivery: Mapping[str, Any]) -> str:
    """Why a dead-lettered delivery ended, in plain words: its dead letter's reason (as
    the API and `dlq list` name it, metrics.DEAD_LETTER_REASONS), with what its last
    attempt, if any, says of it."""
    reason = delivery["dead_letter_reason"]
    tried = delivery["attempts"]
    last = tried[-1] if tried else None
    answer = last["status_code"] if last is not None else None
    if reason == "attempts_exhausted":
        # A replay numbers its attempts afresh: the count is the last run's.
        if last is None:
            return "every attempt failed"
        return f"every attempt failed ({_attempts(int(last['attempt']))})"
    if reason == "http_4xx":
        return (
            f"the receiver answered {answer or '4xx'}: a 4xx answer (but 408, 425 or 429)"
            " is not retried"
        )
    if reason == "http_3xx":
        return (
            f"the receiver answered {answer or '3xx'}: a redirect is neither followed nor retried"
        )
    if reason == "endpoint_refused":
        return "its endpoint's URL was refused by the address policy (the error says why)"
    if reason == "endpoint_removed":
        if last is None:
            return "its endpoint was removed before it was sent"
        return "its endpoint was removed before it was sent again"
    if reason == "invalid_request":
        if last is None:
            return "its endpoint or its event could not be used, so no request was made"
        return "its request could not be made (the error says why), which is not retried"
    if reason == "internal_error":
        return "an internal error of the dispatcher (its log says more), not retried"
    if reason is None:
        return "not known: its dead letter is no longer kept"
    return str(reason)


def why_it_waits_or_ended(delivery: Mapping[str, Any]) -> str | None:
    """The delivery page's account of a dead letter or a parked delivery (else None)."""
    if delivery["status"] == "dead_letter":
        return why_it_ended(delivery)
    if delivery["status"] == "parked":
        return PARKED
    if delivery.get("wait_reason"):
        return str(delivery["wait_reason"])
    return None


def no_attempts(delivery: Mapping[str, Any]) -> str:
    """What a delivery without an attempt says in their place: as its status has it (a
    dead letter that was never sent is not waiting for its first attempt)."""
    if delivery["status"] == "dead_letter":
        if delivery["dead_letter_reason"] in UNSENT_REASONS:
            return f"Never attempted: {why_it_ended(delivery)}."
        return "Its attempts are no longer kept (pruned)."
    if delivery["status"] == "parked":
        return f"Not attempted yet: {PARKED}."
    return "Not attempted yet."


@router.get("/deliveries", response_class=HTMLResponse)
async def search(
    request: Request, who: Annotated[Viewer, Depends(viewer)], cursor: str = ""
) -> Response:
    query = request.query_params
    unknown = sorted(set(query.keys()) - _SEARCH_TAKES)
    if unknown:
        # As the API's: a misspelt filter (?endpoint= for ?endpoint_id=) would list every
        # delivery as if they matched it.
        shown = ", ".join(repr(name[:40]) for name in unknown[:5])
        takes = ", ".join(sorted(_SEARCH_TAKES))
        raise ApiError(
            400, "validation_error", f"unknown filter {shown} (this list takes: {takes})"
        )
    wanted = {k: query.get(k, "").strip() for k in (*FILTERS, "delivery_id")}
    if wanted["delivery_id"]:
        # Only a delivery id is a path to go to (never "../login"): in the form stored.
        try:
            found_id = uuid.UUID(wanted["delivery_id"])
        except ValueError:
            raise NotFoundError(f"no delivery {wanted['delivery_id'][:64]!r}") from None
        return RedirectResponse(f"/deliveries/{found_id}", status_code=303)
    status = wanted["status"] or None
    if status not in (None, *deliveries.STATUSES):
        raise ApiError(
            400,
            "validation_error",
            f"status {status[:40]!r} is not one of {', '.join(deliveries.STATUSES)}",
        )
    if query.get("default_tenant") == "1" and wanted["tenant"]:
        raise ApiError(
            400,
            "validation_error",
            "give a tenant or tick 'default tenant only', not both",
        )
    held = query.get("held") == "1"  # the overview's held notice links here
    tenant_filter = None  # a tenant's portal is scoped to it anyway
    if who.tenant is not None and (
        wanted["tenant"] not in ("", who.tenant)
        or (query.get("default_tenant") == "1" and who.tenant != "")
    ):
        # As the API's tenant_forbidden: another tenant's list is not shown as this one's.
        raise Forbidden(
            "this sign-in acts for its own tenant only: another tenant's deliveries cannot"
            " be searched from it"
        )
    if who.tenant is None and query.get("default_tenant") == "1":
        tenant_filter = ""
    elif who.tenant is None and wanted["tenant"]:
        tenant_filter = wanted["tenant"]
    async with api_state(request).connection() as conn:
        found, after = await deliveries.list_deliveries(
            conn,
            tenant=who.tenant,
            tenant_filter=tenant_filter,
            endpoint_id=wanted["endpoint_id"] or None,
            status=status,
            stream_id=wanted["stream_id"] or None,
            event_type=wanted["event_type"] or None,
            limit=PAGE,
            before=decode_int("deliveries", cursor or None),
            held=held,
        )
        existing = await existing_endpoints(conn, (d["endpoint_id"] for d in found), who.tenant)
    kept = {k: v for k, v in query.items() if k != "cursor" and v}
    older = None
    if after is not None:
        older = "/deliveries?" + urlencode({**kept, "cursor": encode("deliveries", after)})
    return render(
        request,
        "deliveries.html",
        who,
        deliveries=found,
        existing=existing,
        wanted=wanted,
        default_tenant=tenant_filter == "",
        statuses=deliveries.STATUSES,
        held=held,
        older=older,
        newest="/deliveries?" + urlencode(kept) if cursor else None,
    )


@router.get("/deliveries/{delivery_id}", response_class=HTMLResponse)
async def delivery_page(
    request: Request,
    delivery_id: str,
    who: Annotated[Viewer, Depends(viewer)],
    done: str = "",
) -> HTMLResponse:
    async with api_state(request).connection() as conn:
        found = await deliveries.get_delivery(conn, delivery_id, tenant=who.tenant)
        existing = await existing_endpoints(conn, [found["endpoint_id"]], who.tenant)
    replayed = done == "replayed"
    return render(
        request,
        "delivery.html",
        who,
        delivery=found,
        existing=existing,
        why=why_it_waits_or_ended(found),
        no_attempts=no_attempts(found),
        result="Replay queued" if replayed else None,
        flash=_replay_flash(found) if replayed else None,
    )


def _replay_flash(delivery: Mapping[str, Any]) -> str:
    if delivery["status"] == "parked":
        return (
            "Replay queued under the same delivery id; it stays parked until its endpoint"
            " is enabled."
        )
    return "Replay queued under the same delivery id."


@router.post("/deliveries/{delivery_id}/replay")
async def replay(request: Request, delivery_id: str) -> Response:
    who, _ = await posted(request)
    async with api_state(request).connection() as conn:
        found = await deliveries.replay(conn, delivery_id, tenant=who.tenant)
    return RedirectResponse(f"/deliveries/{found['delivery_id']}?done=replayed", status_code=303)


@router.get("/events/{event_id}", response_class=HTMLResponse)
async def event_page(
    request: Request, event_id: str, who: Annotated[Viewer, Depends(viewer)], done: str = ""
) -> HTMLResponse:
    if not event_id.isascii() or not event_id.isdigit() or len(event_id) > 18:
        raise NotFoundError(f"no event {event_id[:40]!r}")
    async with api_state(request).connection() as conn:
        found = await deliveries.get_event(conn, int(event_id), tenant=who.tenant)
        existing = await existing_endpoints(
            conn, (d["endpoint_id"] for d in found["deliveries"]), who.tenant
        )
    sent = done == "sent"  # from the dashboard's own form
    return render(
        request,
        "event.html",
        who,
        event=found,
        existing=existing,
        result="Event sent" if sent else None,
        flash="Event sent. Its deliveries are listed here once a dispatcher has routed it:"
        " reload to follow them."
        if sent
        else None,
    )
