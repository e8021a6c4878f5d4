"""fluxora-webhooks: reliable webhooks from a PostgreSQL transactional outbox.

Producer side: :func:`enqueue` inside your own transaction. Consumer side: :func:`verify`,
and :mod:`fluxora_webhooks.inbox` to apply each event exactly once in your own transaction.
Service side: :class:`Dispatcher` configured by :class:`Settings` (or ``fluxora-webhooks run``).

``Dispatcher`` and ``Settings`` are imported on first use, so a producer or a consumer that
only needs :func:`enqueue` or :func:`verify` does not load the dispatcher's HTTP client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (
    ConfigError,
    EmbeddedEngineError,
    EndpointError,
    FluxoraError,
    SchemaError,
    VerificationError,
)
from .outbox import enqueue
from .signing import Signer, verify

if TYPE_CHECKING:
    from .dispatcher import Dispatcher
    from .settings import Settings

__all__ = [
    "ConfigError",
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

_LAZY = {"Dispatcher": "dispatcher", "Settings": "settings"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
