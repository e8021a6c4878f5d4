"""The forms of the endpoints a tenant manages itself in its portal (an admin for any
tenant): add one (its secret shown once), change it, remove it (asked first), and send an
event to see a delivery arrive. The same functions as the API's, with its rules: a tenant
token's tenant only, its cap on endpoints, the URL policy."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from ... import deliveries, endpoints
from ...errors import ConfigError, EndpointLimitReached
from ..deps import api_state
from ..routes.endpoints import audit
from .endpoint_pages import FROM_DASHBOARD
from .render import (
    FORM_KEY,
    Forbidden,
    Viewer,
    new_form_key,
    posted,
    render,
    require_write,
    viewer,
)

router = APIRouter(include_in_schema=False)

TEST_EVENT_TYPE = "webhook.test"
# A payload typed into the form: the form's encoding of it (a quote, a brace: 3 bytes)
# must stay within the API's 1 MiB body limit.
MAX_PAYLOAD_CHARS = 300 * 1024
# The form's fields by their names in errors (ConfigError's variable, enqueue's first word).
LABELS = {
    "url": "URL",
    "tenant": "Tenant",
    "event_types": "Event types",
    "description": "Description",
    "headers": "Custom headers",
    "rate_limit": "Retries a second",
    "event_type": "Event type",
    "stream_id": "Stream id",
    "payload": "Payload",
}


@dataclass(frozen=True)
class Problem:
    """What is wrong with a form: the field (its input is marked; '' for none) and the
    message, in the form's words."""

    field: str
    message: str

    @classmethod
    def of(cls, exc: ConfigError) -> Problem:
        field, message = exc.variable, exc.problem
        if field not in LABELS:  # "event": enqueue's own check, "stream_id must be ..."
            first, _, rest = message.partition(" ")
            field, message = (first, rest) if first in LABELS else ("", message)
        return cls(field, f"{LABELS[field]}: {message}" if field else message)

    @property
    def title(self) -> str:
        return f"Error in {LABELS[self.field]}" if self.field else "Not saved"


class _AddedBefore(Exception):
    def __init__(self, endpoint_id: str) -> None:
        super().__init__(endpoint_id)
        self.endpoint_id = endpoint_id


def _form_values(endpoint: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The form's fields as text: an endpoint's, or a new one's defaults (and its one-time
    key: the same form posted again, a reload of its answer, adds nothing more)."""
    if endpoint is None:
        return {
            "url": "",
            "event_types": "*",
            "description": "",
            "headers": "",
            "rate_limit": "",
            "form_key": new_form_key(),
        }
    return {
        "url": endpoint["url"],
        "event_types": ", ".join(endpoint["event_types"]),
        "description": endpoint["description"],
        "headers": "\n".join(f"{k}: {v}" for k, v in endpoint["headers"].items()),
        "rate_limit": "" if endpoint["rate_limit"] is None else str(endpoint["rate_limit"]),
        "ordered": "on" if endpoint["ordered"] else "",
    }


def _event_types(text: str) -> list[str]:
    return text.replace(",", " ").split()


def _headers(text: str) -> dict[str, str]:
    """``Name: value`` lines (blank lines skipped); checked by endpoints.check_headers."""
    found: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        name, colon, value = line.partition(":")
        if not colon or not name.strip():
            raise ConfigError("headers", f"line {number} is not a header written Name: value")
        if name.strip() in found:
            raise ConfigError("headers", f"{name.strip()} is given twice")
        found[name.strip()] = value.strip()
    return found


def _rate_limit(text: str) -> int | None:
    value = text.strip()
    if not value:
        return None
    if not (value.isascii() and value.isdigit()):  # int() would take "1_000" and "٣"
        raise ConfigError("rate_limit", "must be a whole number of retries a second")
    return int(value)


def _form(
    request: Request,
    who: Viewer,
    *,
    values: Mapping[str, str],
    endpoint: Mapping[str, Any] | None = None,
    problem: Problem | None = None,
    status: int = 200,
) -> HTMLResponse:
    return render(
        request,
        "endpoint_form.html",
        who,
        status=status,
        endpoint=endpoint,
        values=values,
        problem=problem,
        result=problem.title if problem else None,
    )


@router.get("/endpoints/new", response_class=HTMLResponse)
async def new_form(request: Request, who: Annotated[Viewer, Depends(viewer)]) -> HTMLResponse:
    require_write(who)
    return _form(request, who, values=_form_values())


@router.post("/endpoints/new", response_class=HTMLResponse)
async def create(request: Request) -> HTMLResponse:
    who, form = await posted(request)
    state = api_state(request)
    tenant = who.tenant if who.tenant is not None else form.get("tenant", "").strip()
    form_key = form.get("form_key", "")
    if not FORM_KEY.fullmatch(form_key):
        form_key = new_form_key()
        form = {**form, "form_key": form_key}
    key = "dashboard:" + form_key
    try:
        async with state.connection() as conn, conn.transaction():
            tenant = endpoints.check_tenant(tenant)
            before = await deliveries.answered_before(conn, tenant, key)
            if before is not None:
                raise _AddedBefore(str(before["endpoint_id"]))
            endpoint, secret = await endpoints.create(
                conn,
                url=form.get("url", "").strip(),
                tenant=tenant,
                event_types=_event_types(form.get("event_types", "")) or ["*"],
                description=form.get("description", "").strip(),
                headers=_headers(form.get("headers", "")),
                rate_limit=_rate_limit(form.get("rate_limit", "")),
                ordered=form.get("ordered") == "on",
                allowed_networks=state.config.allowed_networks,
                max_for_tenant=state.config.max_endpoints_per_tenant
                if who.tenant is not None
                else 0,
            )
            if not await deliveries.keep_answer(conn, tenant, key, {"endpoint_id": endpoint.id}):
                # The same form, posted at the same moment, added it: this one is undone.
                first = await deliveries.answered_before(conn, tenant, key)
                raise _AddedBefore(str(first["endpoint_id"]) if first else "")
    except ConfigError as exc:
        return _form(request, who, values=form, problem=Problem.of(exc), status=422)
    except EndpointLimitReached as exc:
        limit = Problem("", str(exc))
        return _form(request, who, values=form, problem=limit, status=409)
    except _AddedBefore as first:
        # This form was posted before (a reload of its answer): its endpoint exists, and
        # its secret was shown then, once.
        return render(
            request, "endpoint_added_before.html", who, status=409, endpoint_id=first.endpoint_id
        )
    name = who.principal.name
    audit(
        "endpoint %s created for tenant %r", endpoint.id, endpoint.tenant, who=name,
        where=FROM_DASHBOARD,
    )  # fmt: skip
    return render(
        request,
        "secret.html",
        who,
        endpoint=endpoint.as_json(),
        secret=secret,
        created=True,
    )


@router.get("/endpoints/{endpoint_id}/edit", response_class=HTMLResponse)
async def edit_form(
    request: Request, endpoint_id: str, who: Annotated[Viewer, Depends(viewer)]
) -> HTMLResponse:
    require_write(who)
    async with api_state(request).connection() as conn:
        endpoint = (await endpoints.get(conn, endpoint_id, tenant=who.tenant)).as_json()
    if endpoint["builtin"]:
        raise Forbidden(f"{endpoint_id} is configured from the environment; it cannot be changed")
    return _form(request, who, values=_form_values(endpoint), endpoint=endpoint)


@router.post("/endpoints/{endpoint_id}/edit", response_class=HTMLResponse)
async def edit(request: Request, endpoint_id: str) -> Response:
    who, form = await posted(request)
    state = api_state(request)
    async with state.connection() as conn:
        current = (await endpoints.get(conn, endpoint_id, tenant=who.tenant)).as_json()
        try:
            rate_limit = _rate_limit(form.get("rate_limit", ""))
            url = form.get("url", "").strip()
            headers = _headers(form.get("headers", ""))
            description = form.get("description", "").strip()
            changes = endpoints.Changes(
                # Unchanged, the URL and the headers are not checked again as new ones (a
                # stored header or address that the rules now refuse keeps working).
                url=None if url == current["url"] else url,
                # Emptied, refused (as a PATCH with none is), not widened to every type.
                event_types=_event_types(form.get("event_types", "")),
                # Unchanged, kept as stored (one stored before bidirectional controls
                # were refused is not refused for another field's change).
                description=None if description == current["description"] else description,
                headers=None if headers == current["headers"] else headers,
                rate_limit=rate_limit,
                clear_rate_limit=rate_limit is None,
                ordered=form.get("ordered") == "on",
            )
            await endpoints.update(
                conn,
                endpoint_id,
                changes,
                tenant=who.tenant,
                allowed_networks=state.config.allowed_networks,
            )
        except ConfigError as exc:
            return _form(
                request, who, values=form, endpoint=current, problem=Problem.of(exc), status=422
            )
    audit("endpoint %s updated", endpoint_id, who=who.principal.name, where=FROM_DASHBOARD)
    return RedirectResponse(f"/endpoints/{endpoint_id}?done=updated", status_code=303)


@router.get("/endpoints/{endpoint_id}/remove", response_class=HTMLResponse)
async def remove_form(
    request: Request, endpoint_id: str, who: Annotated[Viewer, Depends(viewer)]
) -> HTMLResponse:
    require_write(who)
    return await _remove_form(request, who, endpoint_id)


async def _remove_form(request: Request, who: Viewer, endpoint_id: str) -> HTMLResponse:
    state = api_state(request)
    async with state.connection() as conn:
        endpoint = (await endpoints.get(conn, endpoint_id, tenant=who.tenant)).as_json()
        health = await deliveries.endpoint_health(conn, [endpoint_id], tenant=who.tenant)
    if endpoint["builtin"]:
        raise Forbidden(f"{endpoint_id} is configured from the environment; it cannot be removed")
    pending = health[0]["pending"] if health else 0
    return render(request, "endpoint_remove.html", who, endpoint=endpoint, pending=pending)


@router.post("/endpoints/{endpoint_id}/remove")
async def remove(request: Request, endpoint_id: str) -> Response:
    """Only the confirmation form (``confirm=yes``) removes: any other post is asked again."""
    who, form = await posted(request)
    if form.get("confirm") != "yes":
        return await _remove_form(request, who, endpoint_id)
    async with api_state(request).connection() as conn:
        await endpoints.remove(conn, endpoint_id, tenant=who.tenant)
    audit("endpoint %s removed", endpoint_id, who=who.principal.name, where=FROM_DASHBOARD)
    return RedirectResponse("/endpoints?done=removed", status_code=303)


@router.get("/events/new", response_class=HTMLResponse)
async def event_form(
    request: Request,
    who: Annotated[Viewer, Depends(viewer)],
    endpoint_id: str = "",
) -> HTMLResponse:
    """An event to send to the viewer's endpoints (to one endpoint's subscriptions when
    opened from its page): every endpoint of the tenant subscribed to its type gets it."""
    require_write(who)
    values = {"stream_id": "test", "event_type": TEST_EVENT_TYPE, "payload": '{"test": true}'}
    endpoint = await _endpoint_of(request, who, endpoint_id)
    if endpoint is not None:
        exact = [t for t in endpoint["event_types"] if not t.endswith("*")]
        prefixes = [t[:-1] for t in endpoint["event_types"] if t.endswith("*") and t != "*"]
        if exact:
            values["event_type"] = exact[0]
        elif prefixes:
            values["event_type"] = prefixes[0] + "test"
        values["tenant"] = endpoint["tenant"] or ""
    return _event_form(request, who, values=values, endpoint=endpoint)


async def _endpoint_of(request: Request, who: Viewer, endpoint_id: str) -> dict[str, Any] | None:
    if not endpoint_id:
        return None
    async with api_state(request).connection() as conn:
        return (await endpoints.get(conn, endpoint_id, tenant=who.tenant)).as_json()


def _event_form(
    request: Request,
    who: Viewer,
    *,
    values: Mapping[str, str],
    endpoint: Mapping[str, Any] | None,
    problem: Problem | None = None,
) -> HTMLResponse:
    return render(
        request,
        "event_form.html",
        who,
        status=422 if problem else 200,
        values=values,
        endpoint=endpoint,
        problem=problem,
        result=problem.title if problem else None,
        max_payload=MAX_PAYLOAD_CHARS,
    )


@router.post("/events/new", response_class=HTMLResponse)
async def send_event(request: Request, endpoint_id: str = "") -> Response:
    """``endpoint_id``: the endpoint whose page the form was opened from (its form again
    on a problem, and its page the way back)."""
    who, form = await posted(request)
    tenant = who.tenant if who.tenant is not None else form.get("tenant", "").strip()
    try:
        event_type = form.get("event_type", "").strip()
        stream_id = form.get("stream_id", "").strip()
        payload = _payload(form.get("payload", ""))
        async with api_state(request).connection() as conn:
            answer, _ = await deliveries.enqueue_event(
                conn,
                tenant=endpoints.check_tenant(tenant),
                stream_id=stream_id,
                event_type=event_type,
                payload=payload,
            )
    except ConfigError as exc:  # enqueue's own checks too: "event", "stream_id must be ..."
        problem = Problem.of(exc)
    else:
        return RedirectResponse(f"/events/{answer['id']}?done=sent", status_code=303)
    endpoint = await _endpoint_of(request, who, endpoint_id)
    return _event_form(request, who, values=form, endpoint=endpoint, problem=problem)


def _payload(text: str) -> Any:
    if len(text) > MAX_PAYLOAD_CHARS:
        raise ConfigError("payload", f"must be at most {MAX_PAYLOAD_CHARS} characters")
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite)
    except (ValueError, RecursionError) as exc:
        raise ConfigError("payload", f"is not JSON ({str(exc)[:120]})") from None
    return value


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # 1e999: no JSON number PostgreSQL stores
        raise ValueError(f"{text[:40]} is too large a number")
    return value
