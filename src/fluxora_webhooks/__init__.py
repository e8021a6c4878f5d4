"""fluxora-webhooks: reliable webhooks from a PostgreSQL transactional outbox."""

from __future__ import annotations

__version__ = "0.1.0"
