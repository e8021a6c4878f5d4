"""The errors fluxora-webhooks raises.

Every error derives from one base, so ``except FluxoraError`` catches them all::

    FluxoraError
    +-- ConfigError            a setting is missing or invalid (names the variable)
    +-- EndpointError          a consumer URL or its resolved address is refused
    +-- NotFoundError          no such endpoint, delivery or token (for the caller's tenant)
    +-- ConflictError          the request contradicts the object's state (a built-in endpoint)
    |   +-- IdempotencyKeyReused   an idempotency key sent again with another request
    +-- SchemaError            the database schema is missing, older or newer than the code
    +-- EmbeddedEngineError    an embedded PostgreSQL or Redis could not start or stop
    +-- VerificationError      a received webhook failed verification (``reason`` says which check)

Messages never contain a secret or a full consumer URL.
"""

from __future__ import annotations

# The exit statuses of the commands (and of a worker process, which its supervisor reads).
EXIT_CONFIG = 2
EXIT_SCHEMA = 3


class FluxoraError(Exception):
    """Base of every fluxora-webhooks error."""


class ConfigError(FluxoraError):
    """A configuration value is missing or invalid.

    ``variable`` is the environment variable (or option) at fault.
    """

    def __init__(self, variable: str, problem: str) -> None:
        self.variable = variable
        self.problem = problem
        super().__init__(f"{variable}: {problem}")


class EndpointError(FluxoraError):
    """A consumer endpoint is refused by the URL or address policy."""


class NotFoundError(FluxoraError):
    """The named object does not exist, or belongs to another tenant (the same answer)."""


class ConflictError(FluxoraError):
    """The change is refused by what the object is: a built-in endpoint cannot be updated,
    rotated or removed, the operator endpoint cannot be disabled."""


class EndpointLimitReached(ConflictError):
    """A tenant token asked for one endpoint more than its tenant may have."""


class IdempotencyKeyReused(ConflictError):
    """An idempotency key names an earlier request that differs from this one."""


class SchemaError(FluxoraError):
    """The database schema does not match what this version of the code expects."""


class EmbeddedEngineError(FluxoraError):
    """An embedded engine could not be started or stopped; the message names the log."""


class VerificationError(FluxoraError):
    """A webhook failed verification; ``reason`` names the check that failed.

    Reasons: ``missing_header``, ``bad_timestamp``, ``timestamp_too_old``,
    ``timestamp_too_new``, ``bad_signature``, ``no_matching_signature``; and from the
    consumer's inbox, for a request whose signature is good: ``bad_payload`` (the body is
    not JSON), ``bad_delivery_id`` (an id it cannot store).
    """

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)
