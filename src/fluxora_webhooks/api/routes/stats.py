"""``/api/v1/stats``: backlog, dead letters, recent outcomes and per-endpoint health."""

from __future__ import annotations

from typing import Annotated, Any

import psycopg
from fastapi import APIRouter, Query, Request

from ... import deliveries
from ...settings import parse_duration_ms
from ..deps import ApiState, Conn, Reader, api_state, scoped
from ..models import ErrorBody, Stats
from ..pagination import MAX_LIMIT, decode, encode

# What a tenant is told when the breakers' states cannot be read.
REDIS_UNREADABLE = "the circuit breakers' states cannot be read now"
# The cursors of the endpoints' health in the statistics: a list of its own.
HEALTH_LIST = "endpoint_health"

router = APIRouter(
    prefix="/stats",
    tags=["stats"],
    responses={
        403: {
            "model": ErrorBody,
            "description": "`tenant_forbidden`: a tenant token asking for another tenant's",
        }
    },
)


async def read_stats(
    state: ApiState,
    conn: psycopg.AsyncConnection[Any],
    tenant: str | None,
    window_ms: int,
    *,
    with_series: bool,
    detail: bool,
    endpoints_limit: int = MAX_LIMIT,
    endpoints_after: str | None = None,
) -> dict[str, Any]:
    """The statistics of a scope, with each endpoint's breaker read from Redis (the API
    and the dashboard show the same). ``detail``: why Redis could not be read, as it
    failed (an admin's view); a tenant is told only that it could not (no internal host,
    port or error of the deployment). The endpoints are a page (``endpoints_after`` in
    the answer: the last id, when there are more)."""
    out = await deliveries.stats(
        conn,
        tenant=tenant,
        window_ms=window_ms,
        endpoints_limit=endpoints_limit,
        endpoints_after=endpoints_after,
    )
    out["redis"] = await with_breakers(state, out["endpoints"], detail=detail)
    if with_series:
        out["series"] = await deliveries.series(conn, tenant=tenant, window_ms=window_ms)
    return out


async def with_breakers(
    state: ApiState, health: list[dict[str, Any]], *, detail: bool
) -> dict[str, Any]:
    """Each health item's breaker (by its URL, then dropped) and the Redis reading."""
    config = state.config
    urls = [e["url"] for e in health]
    states, problem = await deliveries.breaker_states(config.redis_url, config.redis_prefix, urls)
    for item in health:
        item["breaker"] = states.get(item.pop("url"))
    return {
        "configured": config.redis_url is not None,
        "reachable": config.redis_url is not None and problem is None,
        "error": problem if detail or problem is None else REDIS_UNREADABLE,
    }


@router.get("", response_model=Stats, summary="Backlog, outcomes and endpoint health")
async def get_stats(
    request: Request,
    who: Reader,
    conn: Conn,
    window: Annotated[str, Query(description="the recent window: 1m to 7d")] = "1h",
    series: Annotated[bool, Query(description="add the window in 30 buckets")] = False,
    tenant: Annotated[
        str | None, Query(description="an admin's filter ('' is the default tenant)")
    ] = None,
    endpoints_limit: Annotated[
        int, Query(ge=1, le=MAX_LIMIT, description="endpoints' health per page (by id)")
    ] = MAX_LIMIT,
    endpoints_cursor: Annotated[
        str | None, Query(description="`endpoints_next_cursor` of the previous answer")
    ] = None,
) -> dict[str, Any]:
    window_ms = deliveries.check_window(parse_duration_ms(window, "window"))
    scope = scoped(who, tenant)
    out = await read_stats(
        api_state(request),
        conn,
        scope,
        window_ms,
        with_series=series,
        detail=who.tenant is None,
        endpoints_limit=endpoints_limit,
        endpoints_after=decode(HEALTH_LIST, endpoints_cursor),
    )
    after = out.pop("endpoints_after")
    out["endpoints_next_cursor"] = None if after is None else encode(HEALTH_LIST, after)
    return out
