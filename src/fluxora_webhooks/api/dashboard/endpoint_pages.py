"""The endpoints pages: the list with each one's health, one endpoint, and its actions
(disable, enable, rotate the secret -- asked first, then shown once -- and recover dead
letters)."""

from __future__ import annotations

import os
from typing import Annotated, Any
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from ... import deliveries, endpoints
from ...errors import ConfigError
from ...settings import environ_keyring, retry_rps
from ..deps import api_state
from ..pagination import decode, encode
from ..routes.endpoints import audit
from ..routes.stats import with_breakers
from .render import (
    FORM_KEY,
    Viewer,
    back_to,
    env,
    new_form_key,
    posted,
    render,
    require_write,
    viewer,
)

FROM_DASHBOARD = " from the dashboard"

router = APIRouter(include_in_schema=False)
WINDOW_MS = 3_600_000
PAGE = 50  # endpoints a page, as the deliveries' list
# An action's result: (first in the title, shown above the page).
RESULTS = {
    "disabled": (
        "Endpoint disabled",
        "Endpoint disabled: its deliveries are parked until it is enabled.",
    ),
    "enabled": ("Endpoint enabled", "Endpoint enabled: its parked deliveries are due again."),
    "updated": ("Endpoint changed", "Endpoint changed: its next requests use the new settings."),
    "removed": (
        "Endpoint removed",
        "Endpoint removed. Its pending deliveries, if it had any, are dead letters now.",
    ),
}
# Why an endpoint is disabled, in its owner's words (the page's state line).
DISABLED_WHY = {
    "manual": "disabled by hand; its deliveries wait until it is enabled",
    "gone": "the receiver answered 410 Gone, which asks for no more requests; its deliveries"
    " wait until it is enabled",
    "failing": "every request failed for longer than the service allows; its deliveries wait"
    " until it is enabled (fix the receiver first)",
}
NO_RESULT = (None, None)
# How long a rotated-out secret keeps signing, as the rotation's form offers it.
KEEP_CHOICES = (("24h", "24 hours"), ("1h", "1 hour"), ("0", "no time (it leaked)"))
env.globals.update(keep_choices=KEEP_CHOICES)  # the endpoint's page and the rotation's


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
    keys = environ_keyring()
    following = None
    if len(listed) > PAGE and shown:
        following = "/endpoints?" + urlencode({"cursor": encode("endpoints", shown[-1].id)})
    # The actions bring the viewer back to this page, not to the first.
    here = "/endpoints?" + urlencode({"cursor": cursor}) if cursor else "/endpoints"
    result, flash = RESULTS.get(done, NO_RESULT)
    return render(
        request,
        "endpoints.html",
        who,
        endpoints=[e.as_json() for e in shown],
        locked={e.id for e in shown if endpoints.locked_values(e, keys)},
        health={h["id"]: h for h in health},
        redis=redis,
        result=result,
        flash=flash,
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
    result, flash = RESULTS.get(done, NO_RESULT)
    if done == "recovered" and requeued is not None:
        result = f"Requeued {requeued} dead letter(s)"
        flash = f"{result} under their delivery ids."
    return await _endpoint_view(request, endpoint_id, who, result=result, flash=flash)


async def _endpoint_view(
    request: Request,
    endpoint_id: str,
    who: Viewer,
    *,
    status: int = 200,
    **context: Any,
) -> HTMLResponse:
    state = api_state(request)
    keys = environ_keyring()
    async with state.connection() as conn:
        endpoint = await endpoints.get(conn, endpoint_id, tenant=who.tenant)
        # Its own health, wherever it is among the endpoints.
        found = await deliveries.endpoint_health(
            conn, [endpoint.id], tenant=who.tenant, window_ms=WINDOW_MS
        )
    redis = await with_breakers(state, found, detail=who.tenant is None)
    return render(
        request,
        "endpoint.html",
        who,
        status=status,
        endpoint=endpoint.as_json(),
        health=found[0] if found else None,
        redis=redis,
        # What no key of this server opens: the dispatchers, which need the same keys,
        # hold its deliveries (docs/security.md, "A value no configured key opens").
        locked=[(what, str(why)) for what, why in endpoints.locked_values(endpoint, keys)],
        default_rps=retry_rps(os.environ),
        disabled_why=DISABLED_WHY,
        **context,
    )


async def _state_change(request: Request, endpoint_id: str, action: str) -> Response:
    who, form = await posted(request)
    async with api_state(request).connection() as conn:
        change = endpoints.disable_once if action == "disable" else endpoints.enable_once
        _, changed = await change(conn, endpoint_id, tenant=who.tenant)
    done = "disabled" if action == "disable" else "enabled"
    if changed:
        audit(f"endpoint %s {done}", endpoint_id, who=who.principal.name, where=FROM_DASHBOARD)
    target = back_to(form.get("next", "").split("#")[0], f"/endpoints/{endpoint_id}")
    joiner = "&" if "?" in target else "?"
    # Back on the list: at the endpoint's own row (app.js gives its button the focus).
    row = f"#ep-{quote(endpoint_id, safe='')}" if target.split("?")[0] == "/endpoints" else ""
    return RedirectResponse(f"{target}{joiner}done={done}{row}", status_code=303)


@router.post("/endpoints/{endpoint_id}/disable")
async def disable(request: Request, endpoint_id: str) -> Response:
    return await _state_change(request, endpoint_id, "disable")


@router.post("/endpoints/{endpoint_id}/enable")
async def enable(request: Request, endpoint_id: str) -> Response:
    return await _state_change(request, endpoint_id, "enable")


@router.get("/endpoints/{endpoint_id}/rotate", response_class=HTMLResponse)
async def rotate_form(
    request: Request,
    endpoint_id: str,
    who: Annotated[Viewer, Depends(viewer)],
    keep_previous: str = "24h",
) -> HTMLResponse:
    """Asks before a rotation (the new secret must then reach every consumer; after a
    leak, the old one stops at once): the form that rotates, with the choice made."""
    require_write(who)
    async with api_state(request).connection() as conn:
        endpoint = await endpoints.get(conn, endpoint_id, tenant=who.tenant)
    return _rotate_form(request, who, endpoint.as_json(), keep_previous)


def _rotate_form(
    request: Request, who: Viewer, endpoint: dict[str, Any], keep_previous: str
) -> HTMLResponse:
    chosen = keep_previous.strip() if keep_previous.strip() in dict(KEEP_CHOICES) else "24h"
    return render(
        request, "rotate.html", who, endpoint=endpoint, chosen=chosen, form_key=new_form_key()
    )


class _RotatedBefore(Exception):
    """This confirmation form rotated the secret already (a reload of its answer)."""


@router.post("/endpoints/{endpoint_id}/rotate", response_class=HTMLResponse)
async def rotate(request: Request, endpoint_id: str) -> HTMLResponse:
    """The new secret is in this response only (not cached: no-store), never again. The
    old one keeps signing as long as the form says (``keep_previous``: 24h, as the API and
    the CLI, unless chosen; ``0`` ends it at once, after a leak). Only the confirmation
    form (``confirm=yes``) rotates: any other post is asked again."""
    who, form = await posted(request)
    keep_text = form.get("keep_previous", "").strip() or "24h"
    if form.get("confirm") != "yes":
        async with api_state(request).connection() as conn:
            endpoint = await endpoints.get(conn, endpoint_id, tenant=who.tenant)
        return _rotate_form(request, who, endpoint.as_json(), keep_text)
    keep_ms = endpoints.keep_previous_ms(keep_text)
    # The form's one-time key: the same confirmation posted again (a reload of the page
    # that showed the new secret) rotates nothing more, or the secret shown then, which
    # consumers may have now, would be dropped and the first one with it.
    form_key = form.get("form_key", "")
    key = "dashboard:rotate:" + form_key if FORM_KEY.fullmatch(form_key) else None
    try:
        async with api_state(request).connection() as conn, conn.transaction():
            tenant = (await endpoints.get(conn, endpoint_id, tenant=who.tenant)).tenant
            if key and await deliveries.answered_before(conn, tenant, key):
                raise _RotatedBefore
            rotated, secret = await endpoints.rotate_secret(
                conn, endpoint_id, keep_previous_ms=keep_ms, tenant=who.tenant
            )
            if key and not await deliveries.keep_answer(
                conn, tenant, key, {"endpoint_id": endpoint_id}
            ):
                raise _RotatedBefore  # the same form, posted at the same moment, rotated it
    except _RotatedBefore:
        return render(request, "rotated_before.html", who, status=409, endpoint_id=endpoint_id)
    name = who.principal.name  # never the secret
    audit("secret of endpoint %s rotated", rotated.id, who=name, where=FROM_DASHBOARD)
    return render(
        request, "secret.html", who, endpoint=rotated.as_json(), secret=secret,
        kept=keep_text if keep_ms else None, result="Secret rotated",
    )  # fmt: skip


@router.post("/endpoints/{endpoint_id}/recover")
async def recover(request: Request, endpoint_id: str) -> Response:
    who, form = await posted(request)
    since_text = form.get("since", "").strip()
    until_text = form.get("until", "").strip()
    try:
        if not since_text:
            raise ConfigError("since", "is required: an ISO 8601 time or a duration ago such as 2h")
        async with api_state(request).connection() as conn:
            await endpoints.get(conn, endpoint_id, tenant=who.tenant)
            since = await endpoints.moment(conn, since_text, "since")
            until = await endpoints.moment(conn, until_text, "until") if until_text else None
            count = await endpoints.recover(
                conn, endpoint_id, since=since, until=until, tenant=who.tenant
            )
    except ConfigError as exc:
        if exc.variable not in ("since", "until"):
            raise
        # The form again, as filled in, its field marked and described by the problem.
        return await _endpoint_view(
            request,
            endpoint_id,
            who,
            status=422,
            result=f"Error in {exc.variable}",
            recover_error={"field": exc.variable, "message": str(exc)},
            recover_values={"since": since_text, "until": until_text},
        )
    audit(
        "%d dead letter(s) of endpoint %s recovered", count, endpoint_id,
        who=who.principal.name, where=FROM_DASHBOARD,
    )  # fmt: skip
    return RedirectResponse(
        f"/endpoints/{endpoint_id}?done=recovered&requeued={count}", status_code=303
    )
