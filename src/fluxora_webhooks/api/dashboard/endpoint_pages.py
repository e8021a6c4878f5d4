"""The endpoints pages: the list with each one's health, one endpoint, and its actions
(disable, enable, rotate the secret -- shown once -- and recover dead letters)."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from ... import deliveries, endpoints
from ...errors import ConfigError
from ..deps import api_state
from ..pagination import decode, encode
from ..routes.endpoints import audit
from ..routes.stats import with_breakers
from .render import Viewer, back_to, posted, render, viewer

FROM_DASHBOARD = " from the dashboard"

router = APIRouter(include_in_schema=False)
WINDOW_MS = 3_600_000
PAGE = 50  # endpoints a page, as the deliveries' list
MESSAGES = {
    "disabled": "Endpoint disabled: its deliveries are parked until it is enabled.",
    "enabled": "Endpoint enabled: its parked deliveries are due again.",
}


@router.get("/endpoints", response_class=HTMLResponse)
async def endpoint_list(
    request: Request, who: Annotated[Viewer, Depends(viewer)], done: str = "", cursor: str = ""
) -> HTMLResponse:
    """A page of endpoints by id, each with its health (the page's only: its cost does
    not grow with the number of endpoints), and *Next* / *First* links."""
    state = api_state(request)
    async with state.connection() as conn:
        listed = await endpoints.list_endpoints(
            conn, tenant=who.tenant, limit=PAGE + 1, after=decode("endpoints", cursor or None)
        )
        shown = listed[:PAGE]
        health = await deliveries.endpoint_health(
            conn, [e.id for e in shown], tenant=who.tenant, window_ms=WINDOW_MS
        )
    redis = await with_breakers(state, health, detail=who.tenant is None)
    following = None
    if len(listed) > PAGE and shown:
        following = "/endpoints?" + urlencode({"cursor": encode("endpoints", shown[-1].id)})
    # The actions bring the viewer back to this page, not to the first.
    here = "/endpoints?" + urlencode({"cursor": cursor}) if cursor else "/endpoints"
    return render(
        request,
        "endpoints.html",
        who,
        endpoints=[e.as_json() for e in shown],
        health={h["id"]: h for h in health},
        redis=redis,
        message=MESSAGES.get(done),
        here=here,
        following=following,
        first="/endpoints" if cursor else None,
    )


@router.get("/endpoints/{endpoint_id}", response_class=HTMLResponse)
async def endpoint_page(
    request: Request,
    endpoint_id: str,
    who: Annotated[Viewer, Depends(viewer)],
    done: str = "",
    requeued: int | None = None,
) -> HTMLResponse:
    state = api_state(request)
    async with state.connection() as conn:
        endpoint = await endpoints.get(conn, endpoint_id, tenant=who.tenant)
        # Its own health, wherever it is among the endpoints.
        found = await deliveries.endpoint_health(
            conn, [endpoint.id], tenant=who.tenant, window_ms=WINDOW_MS
        )
    redis = await with_breakers(state, found, detail=who.tenant is None)
    message = MESSAGES.get(done)
    if done == "recovered" and requeued is not None:
        message = f"Requeued {requeued} dead letter(s) under their delivery ids."
    return render(
        request,
        "endpoint.html",
        who,
        endpoint=endpoint.as_json(),
        health=found[0] if found else None,
        redis=redis,
        message=message,
    )


async def _state_change(request: Request, endpoint_id: str, action: str) -> Response:
    who, form = await posted(request)
    async with api_state(request).connection() as conn:
        change = endpoints.disable_once if action == "disable" else endpoints.enable_once
        _, changed = await change(conn, endpoint_id, tenant=who.tenant)
    done = "disabled" if action == "disable" else "enabled"
    if changed:
        audit(f"endpoint %s {done}", endpoint_id, who=who.principal.name, where=FROM_DASHBOARD)
    target = back_to(form.get("next", ""), f"/endpoints/{endpoint_id}")
    joiner = "&" if "?" in target else "?"
    return RedirectResponse(f"{target}{joiner}done={done}", status_code=303)


@router.post("/endpoints/{endpoint_id}/disable")
async def disable(request: Request, endpoint_id: str) -> Response:
    return await _state_change(request, endpoint_id, "disable")


@router.post("/endpoints/{endpoint_id}/enable")
async def enable(request: Request, endpoint_id: str) -> Response:
    return await _state_change(request, endpoint_id, "enable")


@router.post("/endpoints/{endpoint_id}/rotate", response_class=HTMLResponse)
async def rotate(request: Request, endpoint_id: str) -> HTMLResponse:
    """The new secret is in this response only (not cached: no-store), never again. The
    old one keeps signing as long as the form says (``keep_previous``: 24h, as the API and
    the CLI, unless chosen; ``0`` ends it at once, after a leak)."""
    who, form = await posted(request)
    keep_text = form.get("keep_previous", "").strip() or "24h"
    keep_ms = endpoints.keep_previous_ms(keep_text)
    async with api_state(request).connection() as conn:
        endpoint, secret = await endpoints.rotate_secret(
            conn, endpoint_id, keep_previous_ms=keep_ms, tenant=who.tenant
        )
    name = who.principal.name  # never the secret
    audit("secret of endpoint %s rotated", endpoint.id, who=name, where=FROM_DASHBOARD)
    return render(
        request, "secret.html", who, endpoint=endpoint.as_json(), secret=secret,
        kept=keep_text if keep_ms else None,
    )  # fmt: skip


@router.post("/endpoints/{endpoint_id}/recover")
async def recover(request: Request, endpoint_id: str) -> Response:
    who, form = await posted(request)
    since_text = form.get("since", "").strip()
    if not since_text:
        raise ConfigError("since", "is required: an ISO 8601 time or a duration ago such as 2h")
    async with api_state(request).connection() as conn:
        await endpoints.get(conn, endpoint_id, tenant=who.tenant)
        since = await endpoints.moment(conn, since_text, "since")
        until_text = form.get("until", "").strip()
        until = await endpoints.moment(conn, until_text, "until") if until_text else None
        count = await endpoints.recover(
            conn, endpoint_id, since=since, until=until, tenant=who.tenant
        )
    audit(
        "%d dead letter(s) of endpoint %s recovered", count, endpoint_id,
        who=who.principal.name, where=FROM_DASHBOARD,
    )  # fmt: skip
    return RedirectResponse(
        f"/endpoints/{endpoint_id}?done=recovered&requeued={count}", status_code=303
    )
