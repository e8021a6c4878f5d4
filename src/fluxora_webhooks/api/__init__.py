"""The management API and dashboard (SPEC 15), behind the ``api`` extra: FastAPI routes over
the admin layer (:mod:`..endpoints`, :mod:`..deliveries`, :mod:`..tokens`), the dashboard's
server-rendered pages, and :class:`ApiServer`, which serves them with uvicorn in the
caller's event loop.

Nothing in the core install imports this package: ``fluxora-webhooks api`` and ``run``
(with ``WEBHOOK_API_PORT``) import it when they serve it.
"""

from __future__ import annotations

from .app import ApiConfig, create_app
from .server import ApiServer

__all__ = ["ApiConfig", "ApiServer", "create_app"]
