"""fluxora-webhooks: reliable webhooks from a PostgreSQL transactional outbox.

Producer side: :func:`enqueue` inside your own transaction. Consumer side: :func:`verify`,
and :mod:`fluxora_webhooks.inbox` to apply each event exactly once in your own transaction.
Service side: :class:`Dispatcher` configured by :class:`Settings` (or ``fluxora-webhooks run``).
"""

from __future__ import annotations

__version__ = "0.1.0"

from .dispatcher import Dispatcher
from .errors import (
    ConfigError,
    DatabaseError,
    EmbeddedEngineError,
    EndpointError,
    FluxoraError,
    SchemaError,
    VerificationError,
)
from .outbox import enqueue
from .settings import Settings
from .signing import Signer, verify

__all__ = [
    "ConfigError",
    "DatabaseError",
    "Dispatcher",
    "EmbeddedEngineError",
    "EndpointError",
    "FluxoraError",
    "SchemaError",
    "Settings",
    "Signer",
    "VerificationError",
    "__version__",
    "enqueue",
    "verify",
]
