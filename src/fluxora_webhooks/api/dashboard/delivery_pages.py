"""The deliveries pages: search (stream id, event type, delivery id, tenant, status) with
paging, one delivery with every attempt and a replay button, and one event."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from ... import deliveries
from ...errors import NotFoundError
from ..deps import api_state
from ..pagination import decode_int, encode
from .render import Viewer, posted, render, viewer

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


@router.get("/deliveries", response_class=HTMLResponse)
async def search(
    request: Request, who: Annotated[Viewer, Depends(viewer)], cursor: str = ""
) -> Response:
    query = request.query_params
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
        status = None
    tenant_filter = None  # a tenant's portal is scoped to it anyway
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
        result="Replay queued" if replayed else None,
        flash="Replay queued under the same delivery id." if replayed else None,
    )


@router.post("/deliveries/{delivery_id}/replay")
async def replay(request: Request, delivery_id: str) -> Response:
    who, _ = await posted(request)
    async with api_state(request).connection() as conn:
        found = await deliveries.replay(conn, delivery_id, tenant=who.tenant)
    return RedirectResponse(f"/deliveries/{found['delivery_id']}?done=replayed", status_code=303)


@router.get("/events/{event_id}", response_class=HTMLResponse)
async def event_page(
    request: Request, event_id: str, who: Annotated[Viewer, Depends(viewer)]
) -> HTMLResponse:
    if not event_id.isascii() or not event_id.isdigit() or len(event_id) > 18:
        raise NotFoundError(f"no event {event_id[:40]!r}")
    async with api_state(request).connection() as conn:
        found = await deliveries.get_event(conn, int(event_id), tenant=who.tenant)
        existing = await existing_endpoints(
            conn, (d["endpoint_id"] for d in found["deliveries"]), who.tenant
        )
    return render(request, "event.html", who, event=found, existing=existing)
