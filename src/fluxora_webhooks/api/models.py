"""The API's request and response bodies (SPEC 15), from which FastAPI validates requests
and writes the OpenAPI document. Responses list their fields exactly: whatever else the
admin layer returns is dropped, so nothing unlisted (a secret above all) can leak."""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    WithJsonSchema,
    model_validator,
)

from ..endpoints import MAX_URL_LENGTH

T = TypeVar("T")
Status = Literal["pending", "retrying", "parked", "delivered", "dead_letter"]


def _blank_is_absent(value: Any) -> Any:
    return None if value == "" else value


# A list's filter in the query string: empty (``?stream_id=``, as a search form sends an
# unfilled field) is no filter. Not ``tenant``, whose empty value is the default tenant.
Filter = Annotated[str | None, BeforeValidator(_blank_is_absent)]
StatusFilter = Annotated[Status | None, BeforeValidator(_blank_is_absent)]
# A time in an answer: ISO 8601 with its offset, as the admin layer writes it (the text is
# sent as it is); typed `date-time` in the document, so that a client generated from it
# reads a datetime rather than a string.
Timestamp = Annotated[str, WithJsonSchema({"type": "string", "format": "date-time"})]


class _In(BaseModel):
    """A request body: no field it does not know, and each of the type the document gives
    (strict: "10" is no integer, 1 and "yes" are no booleans)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class ErrorDetail(BaseModel):
    code: str = Field(
        examples=["not_found"],
        description="what went wrong, for a program: bad_request, invalid_cursor (400);"
        " unauthorized (401); read_only, tenant_forbidden (403); not_found (404);"
        " method_not_allowed (405); conflict, endpoint_limit (409); too_large (413);"
        " unsupported_media_type (415); validation_error, idempotency_key_reused,"
        " query_timeout (422); internal_error, database_privilege (500); unavailable (503)."
        " A string, not an enumeration: a later version may add codes",
    )
    message: str = Field(description="what went wrong, for a person")


class ErrorBody(BaseModel):
    error: ErrorDetail


class Page(BaseModel, Generic[T]):
    data: list[T]
    next_cursor: str | None = Field(description="pass as `cursor` for the next page; null: no more")


# -- endpoints ----------------------------------------------------------------------------


class ClientCertificateIn(_In):
    certificate: str = Field(
        description="PEM: the certificate, then any intermediate certificates of its chain"
    )
    private_key: str = Field(
        description="PEM, unencrypted: the certificate's private key. Stored encrypted with"
        " WEBHOOK_ENCRYPTION_KEY when that is set; never shown again"
    )


class ClientCertificate(BaseModel):
    subject: str = Field(description="RFC 4514, as in CN=acme-integration,O=Example")
    issuer: str
    not_before: Timestamp | None = Field(
        description="its start of validity: a consumer that checks it refuses it before"
    )
    not_after: Timestamp
    fingerprint_sha256: str = Field(description="of the certificate (DER), hex")


class EndpointIn(_In):
    url: str = Field(
        description="the consumer's https URL",
        json_schema_extra={"maxLength": MAX_URL_LENGTH},  # checked (and said) by endpoints
    )
    tenant: str | None = Field(None, description="default: the token's tenant, or '' (admin)")
    event_types: list[str] = Field(default_factory=lambda: ["*"], max_length=100)
    description: str = Field("", max_length=1000)
    headers: dict[str, str] = Field(default_factory=dict)
    rate_limit: int | None = Field(None, ge=1, le=1_000_000, description="retries per second")
    ordered: bool = False
    secret: str | None = Field(None, description="default: a new whsec_ secret")
    client_certificate: ClientCertificateIn | None = Field(
        None,
        description="the endpoint's own TLS client certificate, presented to its consumer in"
        " place of the deployment's (WEBHOOK_TLS_CLIENT_CERT); default: none",
    )


class EndpointPatch(_In):
    url: str | None = Field(None, json_schema_extra={"maxLength": MAX_URL_LENGTH})
    event_types: list[str] | None = Field(None, max_length=100)
    description: str | None = Field(None, max_length=1000)
    headers: dict[str, str] | None = Field(
        None,
        description="the whole map; a credential's value given as shown (********) keeps the"
        " stored one",
    )
    rate_limit: int | None = Field(None, ge=1, le=1_000_000, description="null: WEBHOOK_RETRY_RPS")
    ordered: bool | None = None

    @model_validator(mode="after")
    def _null_only_for_rate_limit(self) -> EndpointPatch:
        """A field left out is kept; null clears only ``rate_limit`` (the others have no
        empty state to go back to), so a null elsewhere is refused, not ignored."""
        for name in ("url", "event_types", "description", "headers", "ordered"):
            if name in self.model_fields_set and getattr(self, name) is None:
                raise ValueError(f"{name} cannot be null (leave it out to keep it)")
        return self


class Endpoint(BaseModel):
    id: str
    tenant: str | None
    url: str
    event_types: list[str]
    description: str
    headers: dict[str, str] = Field(
        description="a header carrying a credential (Authorization, X-Api-Key...) as ********"
    )
    rate_limit: int | None
    ordered: bool
    state: Literal["enabled", "disabled"]
    disabled_reason: Literal["manual", "gone", "failing"] | None
    disabled_at: Timestamp | None
    failing_since: Timestamp | None
    created_at: Timestamp | None
    updated_at: Timestamp | None
    builtin: bool
    client_certificate: ClientCertificate | None = Field(
        description="its own TLS client certificate (never its key); null: the deployment's"
        " (WEBHOOK_TLS_CLIENT_CERT), or none"
    )
    previous_secret_until: Timestamp | None = Field(
        default=None,
        description="until when the secret before its last rotation still signs (a second"
        " webhook-signature): its consumers' deadline to move to the new one; null: none",
    )


class EndpointCreated(Endpoint):
    secret: str | None = Field(
        description="shown this once; null only in a replayed answer (Idempotency-Key) after"
        " the secret was rotated"
    )


class RotateIn(_In):
    secret: str | None = Field(None, description="default: a new whsec_ secret")
    keep_previous: str = Field("24h", description="how long the old secret signs too; 0: not")


class Secret(BaseModel):
    id: str
    secret: str = Field(description="shown this once")


class RecoverIn(_In):
    since: str = Field(
        description="ISO 8601 (UTC unless it has an offset), or a duration ago such as 2h"
    )
    until: str | None = Field(None, description="default: now")


class Requeued(BaseModel):
    requeued: int


# -- events and deliveries ---------------------------------------------------------------


class EventIn(_In):
    tenant: str | None = Field(None, description="default: the token's tenant, or '' (admin)")
    stream_id: str = Field(min_length=1, max_length=500)
    event_type: str = Field(min_length=1, max_length=200)
    payload: JsonValue


_OMITTED = Field(
    default=None,
    description="why `payload` is null though the event has one: stored by SQL nested deeper"
    " than the 250 levels the API serializes (the outbox row holds it, and it is sent as"
    " stored); null otherwise",
)


class Event(BaseModel):
    id: int
    tenant: str | None
    stream_id: str
    event_type: str
    payload: Any
    created_at: Timestamp | None
    payload_omitted: str | None = _OMITTED


class EventAccepted(Event):
    delivery_id: str | None = Field(
        description="the built-in default endpoint's delivery id (as enqueue returns) when"
        " the event goes to it (the default tenant, with WEBHOOK_URL configured); null"
        " otherwise. Each endpoint's delivery has its own id, listed by GET /events/{id}"
    )


class Delivery(BaseModel):
    delivery_id: str
    event_id: int
    endpoint_id: str
    tenant: str | None
    stream_id: str
    event_type: str
    status: Status
    attempt_count: int
    created_at: Timestamp | None
    last_attempt_at: Timestamp | None
    next_attempt_at: Timestamp | None


class Attempt(BaseModel):
    attempt: int
    at: Timestamp | None
    status_code: int | None
    duration_ms: float | None
    error: str | None
    response_body: str | None
    outcome: Literal["delivered", "retry", "parked", "dead_letter"] = Field(
        description="what followed: delivered, a retry, parked (its endpoint disabled, as a"
        " 410 Gone does) or a dead letter"
    )
    replay: bool


class DeliveryDetail(Delivery):
    dead_letter_reason: str | None = Field(
        description="why a dead-lettered delivery ended (as `dlq list` says:"
        " attempts_exhausted, http_4xx, endpoint_removed, ...); null otherwise"
    )
    wait_reason: str | None = Field(
        default=None,
        description="why a pending delivery is held with no attempt used (this service's"
        " egress proxy or its DNS lookups failed, so no consumer was asked): it is sent"
        " when that ends; null otherwise",
    )
    payload: Any
    payload_omitted: str | None = _OMITTED
    attempts: list[Attempt] = Field(
        description="the requests sent (a dead letter made when its endpoint was removed is"
        " none: `dead_letter_reason` says so)"
    )
    trace_id: str = Field(
        description="the W3C trace id (32 hex digits) its attempts' spans are in when the"
        " dispatcher traces (OpenTelemetry): the producer's, from the event's stored"
        " `traceparent` when valid, else the delivery's own, the same for every attempt"
    )


class EventDetail(Event):
    traceparent: str | None = Field(
        description="the producer's W3C trace context stored with the event (SPEC 18), as"
        " the requests carry it; null when none was stored or it is not valid"
    )
    routing: Literal["pending", "routed", "unrouted", "dead_letter"] = Field(
        description="pending: not routed yet (a dispatcher routes it as it claims it);"
        " routed: its deliveries are listed; unrouted: no endpoint of its tenant subscribed"
        " to its type when it was routed (nothing is sent); dead_letter: its fan-out was"
        " refused, a dead letter with no endpoint holds it (replay routes it again)"
    )
    deliveries: list[Delivery]


# -- statistics ---------------------------------------------------------------------------


class Backlog(BaseModel):
    pending: int
    due: int
    parked: int
    egress_held: int = Field(
        description="deliveries held because this service's egress proxy or its DNS"
        " lookups failed (no consumer was asked, no attempt used): sent when they work"
        " again; each one's `wait_reason` says which"
    )
    oldest_due_age_seconds: float
    capped_at: int


class DeadLetters(BaseModel):
    waiting: int = Field(
        description="dead letters waiting to be replayed or recovered (their endpoint exists)"
    )
    of_removed_endpoints: int = Field(
        description="dead letters of endpoints removed since: a replay answers 409 and a"
        " recovery 404; kept for the record until purged (`dlq purge`). With `waiting`,"
        " counted up to `backlog.capped_at`"
    )


class Outcome(BaseModel):
    attempts: int
    p50_ms: float | None
    p95_ms: float | None


class Breaker(BaseModel):
    state: Literal["closed", "open", "half-open"]
    failures: int


class EndpointHealth(BaseModel):
    id: str
    tenant: str | None
    state: Literal["enabled", "disabled"]
    disabled_reason: str | None
    attempts: int
    success_rate: float | None
    p50_ms: float | None
    p95_ms: float | None
    pending: int
    breaker: Breaker | None


class Bucket(BaseModel):
    at: Timestamp | None
    delivered: int
    retry: int
    dead_letter: int
    latency_p50_ms: float | None
    latency_p95_ms: float | None
    backlog: int
    dead_letters: int


class RedisReading(BaseModel):
    configured: bool
    reachable: bool
    error: str | None


class Stats(BaseModel):
    window_seconds: int
    backlog: Backlog
    dead_letters: DeadLetters
    recent: dict[str, Outcome]
    endpoints: list[EndpointHealth] = Field(
        description="a page of the endpoints' health, by id (`endpoints_limit`, up to 1000)"
    )
    endpoints_next_cursor: str | None = Field(
        description="null: `endpoints` holds every endpoint of the scope; else the list was"
        " cut at `endpoints_limit`: pass this as `endpoints_cursor` for the next page"
    )
    redis: RedisReading
    series: list[Bucket] | None = None
