"""``/api/v1/deliveries``: search, one delivery with every attempt, and replay."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from ... import deliveries
from ..deps import Conn, Reader, Writer, scoped
from ..models import Delivery, DeliveryDetail, ErrorBody, Filter, Page, StatusFilter
from ..pagination import DEFAULT_LIMIT, Cursor, Limit, decode_int, page

router = APIRouter(
    prefix="/deliveries",
    tags=["deliveries"],
    responses={
        403: {
            "model": ErrorBody,
            "description": "`read_only`: a read-only token; `tenant_forbidden`: a tenant token"
            " naming another tenant",
        },
        404: {"model": ErrorBody, "description": "`not_found`: no such delivery (for this token)"},
    },
)


@router.get("", response_model=Page[Delivery], summary="Search deliveries, newest first")
async def list_deliveries(
    who: Reader,
    conn: Conn,
    endpoint_id: Filter = None,
    status: StatusFilter = None,
    stream_id: Filter = None,
    tenant: Annotated[str | None, Query(description="'' is the default tenant")] = None,
    event_type: Filter = None,
    held: Annotated[
        bool,
        Query(
            description="only the deliveries held by an outage of this service's egress"
            " proxy or DNS lookups (no attempt used; their `wait_reason` says so, and"
            " `backlog.egress_held` of the stats counts them)"
        ),
    ] = False,
    limit: Limit = DEFAULT_LIMIT,
    cursor: Cursor = None,
) -> dict[str, Any]:
    found, after = await deliveries.list_deliveries(
        conn,
        tenant=who.tenant,
        tenant_filter=scoped(who, tenant),
        endpoint_id=endpoint_id,
        status=status,
        stream_id=stream_id,
        event_type=event_type,
        limit=limit,
        before=decode_int("deliveries", cursor),
        held=held,
    )
    return page("deliveries", found, after)


@router.get("/{delivery_id}", response_model=DeliveryDetail, summary="One delivery")
async def get_delivery(delivery_id: str, who: Reader, conn: Conn) -> dict[str, Any]:
    """With its payload and every attempt: time, status code, duration, error and the
    response body as kept (up to WEBHOOK_MAX_RESPONSE_BYTES)."""
    return await deliveries.get_delivery(conn, delivery_id, tenant=who.tenant)


@router.post(
    "/{delivery_id}/replay",
    status_code=202,
    response_model=DeliveryDetail,
    summary="Send a delivery again",
    responses={
        409: {
            "model": ErrorBody,
            "description": "`conflict`: its endpoint was removed, or a batch was still sending"
            " it after 5 s",
        }
    },
)
async def replay(delivery_id: str, who: Writer, conn: Conn) -> dict[str, Any]:
    """Whatever its status, under the same delivery id: a pending one is due now (a
    parked one when its endpoint is enabled), a finished one gets a new attempt."""
    return await deliveries.replay(conn, delivery_id, tenant=who.tenant)
