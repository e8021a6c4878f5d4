"""``/api/v1/endpoints``: list, create, show, update, remove, disable, enable, rotate the
secret, set or remove the client certificate and recover dead letters."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Body, Header, Query, Request, Response
from pydantic import WithJsonSchema

from ... import deliveries, endpoints
from ...settings import environ_keyring
from ..deps import Conn, Reader, Writer, api_state, scoped
from ..models import (
    ClientCertificateIn,
    Endpoint,
    EndpointCreated,
    EndpointIn,
    EndpointPatch,
    ErrorBody,
    Page,
    RecoverIn,
    Requeued,
    RotateIn,
    Secret,
)
from ..pagination import DEFAULT_LIMIT, MAX_LIMIT, Cursor, Limit, decode, page
from .events import KEY_REUSED, REPLAYED

log = logging.getLogger("fluxora_webhooks.api")
# A built-in endpoint (default, operator) is the service's configuration, not the API's.
BUILT_IN: dict[int | str, dict[str, Any]] = {
    409: {"model": ErrorBody, "description": "`conflict`: a built-in endpoint"}
}

router = APIRouter(
    prefix="/endpoints",
    tags=["endpoints"],
    responses={
        403: {
            "model": ErrorBody,
            "description": "`read_only`: a read-only token; `tenant_forbidden`: a tenant token"
            " naming another tenant",
        },
        404: {"model": ErrorBody, "description": "`not_found`: no such endpoint (for this token)"},
    },
)
# The rotation's body is optional (no body, or JSON null, is every default): documented as
# the object alone, not "RotateIn or null", which generated clients cannot leave out
# (openapi-python-client sends its "unset" marker as the body, and fails).
OPTIONAL_ROTATE_IN = WithJsonSchema({"$ref": "#/components/schemas/RotateIn"})


@router.get("", response_model=Page[Endpoint], summary="List endpoints")
async def list_endpoints(
    who: Reader,
    conn: Conn,
    tenant: Annotated[str | None, Query(description="'' is the default tenant")] = None,
    limit: Limit = DEFAULT_LIMIT,
    cursor: Cursor = None,
) -> dict[str, Any]:
    scope = scoped(who, tenant)
    wanted = limit + 1 if limit < MAX_LIMIT else limit
    found = await endpoints.list_endpoints(
        conn, tenant=scope, limit=wanted, after=decode("endpoints", cursor)
    )
    shown = found[:limit]
    more = len(found) > limit
    if wanted == limit and len(found) == limit:
        # A full page of the most a page holds: is there one more after it? (A cursor
        # then names a page that has something: null ends the list, as in the others.)
        more = bool(await endpoints.list_endpoints(conn, tenant=scope, limit=1, after=shown[-1].id))
    return page("endpoints", [e.as_json() for e in shown], shown[-1].id if more and shown else None)


@router.post(
    "",
    status_code=201,
    response_model=EndpointCreated,
    summary="Create an endpoint",
    responses={
        201: REPLAYED,
        409: {
            "model": ErrorBody,
            "description": "`endpoint_limit`: the tenant token's tenant has as many endpoints"
            " as it may",
        },
        422: KEY_REUSED,
    },
)
async def create_endpoint(
    request: Request,
    who: Writer,
    conn: Conn,
    body: EndpointIn,
    response: Response,
    idempotency_key: Annotated[
        str | None,
        Header(
            pattern=deliveries.IDEMPOTENCY_KEY,
            description="1-255 visible ASCII characters. The same key and request within 24"
            " hours create nothing and answer with the endpoint the first one created (with"
            " `Idempotent-Replayed: true`; its `secret` while it has not been rotated, else"
            " null), also when both arrive at once; the same key with another request is 422"
            " `idempotency_key_reused`. Keys are per tenant",
        ),
    ] = None,
) -> dict[str, Any]:
    tenant = scoped(who, body.tenant)
    tenant = tenant if tenant is not None else ""
    given = body.client_certificate
    client_cert = (
        None
        if given is None
        else endpoints.ClientCert(
            given.certificate,
            given.private_key,
            ("client_certificate.certificate", "client_certificate.private_key"),
        )
    )
    if idempotency_key is None:
        endpoint, secret = await _create(request, who, conn, body, tenant, client_cert)
        return {**endpoint.as_json(), "secret": secret}
    # The tenant as resolved, not as written: a tenant's token (no tenant in the body) and an
    # admin naming that tenant send the same request.
    fields = body.model_dump(mode="json", exclude={"tenant", "client_certificate"})
    endpoint, shown, replayed = await deliveries.create_endpoint_once(
        conn,
        tenant,
        idempotency_key,
        deliveries.EndpointRequest(tenant, fields, client_cert),
        lambda: _create(request, who, conn, body, tenant, client_cert),
        scope=tenant if who.tenant is not None else None,
        keys=environ_keyring(),
    )
    if replayed:
        response.headers["Idempotent-Replayed"] = "true"
    return {**endpoint.as_json(), "secret": shown}


async def _create(
    request: Request,
    who: Any,
    conn: Any,
    body: EndpointIn,
    tenant: str,
    client_cert: endpoints.ClientCert | None,
) -> tuple[endpoints.Endpoint, str]:
    endpoint, secret = await endpoints.create(
        conn,
        url=body.url,
        tenant=tenant,
        event_types=body.event_types,
        secret=body.secret,
        description=body.description,
        headers=body.headers,
        rate_limit=body.rate_limit,
        ordered=body.ordered,
        allowed_networks=api_state(request).config.allowed_networks,
        max_for_tenant=api_state(request).config.max_endpoints_per_tenant
        if who.tenant is not None
        else 0,
        client_cert=client_cert,
    )
    certificate = endpoint.client_certificate()  # never the key: its fingerprint
    audit(
        "endpoint %s created for tenant %r%s",
        endpoint.id,
        endpoint.tenant,
        ""
        if certificate is None
        else f" (client certificate sha256 {certificate.get('fingerprint_sha256')})",
        who=who.name,
    )
    return endpoint, secret


@router.get("/{endpoint_id}", response_model=Endpoint, summary="Show an endpoint")
async def get_endpoint(endpoint_id: str, who: Reader, conn: Conn) -> dict[str, Any]:
    return (await endpoints.get(conn, endpoint_id, tenant=who.tenant)).as_json()


@router.patch(
    "/{endpoint_id}", response_model=Endpoint, summary="Update an endpoint", responses=BUILT_IN
)
async def update_endpoint(
    request: Request, endpoint_id: str, who: Writer, conn: Conn, body: EndpointPatch
) -> dict[str, Any]:
    given = body.model_fields_set
    changes = endpoints.Changes(
        url=body.url,
        event_types=body.event_types,
        description=body.description,
        headers=body.headers,
        rate_limit=body.rate_limit,
        clear_rate_limit="rate_limit" in given and body.rate_limit is None,
        ordered=body.ordered,
    )
    updated = await endpoints.update(
        conn,
        endpoint_id,
        changes,
        tenant=who.tenant,
        allowed_networks=api_state(request).config.allowed_networks,
    )
    audit("endpoint %s updated", updated.id, who=who.name)
    return updated.as_json()


@router.delete("/{endpoint_id}", status_code=204, summary="Remove an endpoint", responses=BUILT_IN)
async def remove_endpoint(endpoint_id: str, who: Writer, conn: Conn) -> Response:
    """Its pending deliveries become dead letters (reason `endpoint_removed`)."""
    await endpoints.remove(conn, endpoint_id, tenant=who.tenant)
    audit("endpoint %s removed", endpoint_id, who=who.name)
    return Response(status_code=204)


@router.post(
    "/{endpoint_id}/disable",
    response_model=Endpoint,
    summary="Disable an endpoint",
    responses=BUILT_IN,
)
async def disable_endpoint(endpoint_id: str, who: Writer, conn: Conn) -> dict[str, Any]:
    """Its deliveries are parked: kept, not attempted, until it is enabled."""
    disabled, changed = await endpoints.disable_once(conn, endpoint_id, tenant=who.tenant)
    if changed:  # the log says what changed, not what was asked twice
        audit("endpoint %s disabled", disabled.id, who=who.name)
    return disabled.as_json()


@router.post("/{endpoint_id}/enable", response_model=Endpoint, summary="Enable an endpoint")
async def enable_endpoint(endpoint_id: str, who: Writer, conn: Conn) -> dict[str, Any]:
    """Every parked delivery is due again."""
    enabled, changed = await endpoints.enable_once(conn, endpoint_id, tenant=who.tenant)
    if changed:
        audit("endpoint %s enabled", enabled.id, who=who.name)
    return enabled.as_json()


@router.post(
    "/{endpoint_id}/rotate-secret",
    response_model=Secret,
    summary="Rotate the secret",
    responses=BUILT_IN,
)
async def rotate_secret(
    endpoint_id: str,
    who: Writer,
    conn: Conn,
    body: Annotated[RotateIn | None, Body(), OPTIONAL_ROTATE_IN] = None,
) -> dict[str, Any]:
    """A new secret, shown this once; the old one keeps signing for `keep_previous` as a
    second signature in `webhook-signature` (`x-fluxora-signature` is the new secret's at
    once)."""
    wanted = body or RotateIn.model_validate({})
    keep_ms = endpoints.keep_previous_ms(wanted.keep_previous)
    endpoint, secret = await endpoints.rotate_secret(
        conn, endpoint_id, secret=wanted.secret, keep_previous_ms=keep_ms, tenant=who.tenant
    )
    audit("secret of endpoint %s rotated", endpoint.id, who=who.name)  # never the secret
    return {"id": endpoint.id, "secret": secret}


@router.put(
    "/{endpoint_id}/client-certificate",
    response_model=Endpoint,
    summary="Set the client certificate",
    responses=BUILT_IN,
)
async def set_client_certificate(
    endpoint_id: str, who: Writer, conn: Conn, body: ClientCertificateIn
) -> dict[str, Any]:
    """The endpoint's own TLS client certificate, presented when its consumer asks for one
    (in place of the deployment's WEBHOOK_TLS_CLIENT_CERT); a new one replaces the last
    (a rotation). Refused (422, naming the field): a certificate or key that is not PEM, a
    key that is not the certificate's or is encrypted, a certificate that has expired."""
    updated = await endpoints.set_client_certificate(
        conn,
        endpoint_id,
        endpoints.ClientCert(body.certificate, body.private_key),
        tenant=who.tenant,
    )
    # Never the key; the fingerprint says which certificate.
    shown = updated.client_certificate() or {}
    audit(
        "client certificate of endpoint %s set (sha256 %s)",
        updated.id,
        shown.get("fingerprint_sha256"),
        who=who.name,
    )
    return updated.as_json()


@router.delete(
    "/{endpoint_id}/client-certificate",
    status_code=204,
    summary="Remove the client certificate",
    responses=BUILT_IN,
)
async def remove_client_certificate(endpoint_id: str, who: Writer, conn: Conn) -> Response:
    """The endpoint presents the deployment's client certificate again (or none). An
    endpoint without one of its own answers 204 too, and nothing is logged as removed."""
    had = (await endpoints.get(conn, endpoint_id, tenant=who.tenant)).client_cert is not None
    await endpoints.set_client_certificate(conn, endpoint_id, None, tenant=who.tenant)
    if had:
        audit("client certificate of endpoint %s removed", endpoint_id, who=who.name)
    return Response(status_code=204)


@router.post("/{endpoint_id}/recover", response_model=Requeued, summary="Recover dead letters")
async def recover(endpoint_id: str, who: Writer, conn: Conn, body: RecoverIn) -> dict[str, Any]:
    """Re-queue every delivery of the endpoint dead-lettered in the window (same delivery
    id, attempts counted afresh)."""
    await endpoints.get(conn, endpoint_id, tenant=who.tenant)
    since = await endpoints.moment(conn, body.since, "since")
    until = await endpoints.moment(conn, body.until, "until") if body.until else None
    count = await endpoints.recover(conn, endpoint_id, since=since, until=until, tenant=who.tenant)
    audit("%d dead letter(s) of endpoint %s recovered", count, endpoint_id, who=who.name)
    return {"requeued": count}


def audit(message: str, *args: object, who: str, where: str = "") -> None:
    """An audit line: what changed in the registry, and which token changed it (its name;
    never a token, a secret or a URL). ``where``: " from the dashboard", say."""
    log.info(f"{message}{where} by token %r", *args, who)
