"""``fluxora-webhooks run`` without the Redis gate (no rate limit, no breaker).

The same service, settings and dispatcher as the real command; only the gate is the
in-process :class:`~fluxora_webhooks.gate.OpenGate`. Run side by side with the real command,
it shows what the Redis round trip per batch costs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import run

from fluxora_webhooks import logs
from fluxora_webhooks.service import Service
from fluxora_webhooks.settings import Settings


async def serve() -> None:
    settings = Settings.from_env(os.environ)
    logs.configure(settings.log_format)
    service = Service(settings, database_url=os.environ["DATABASE_URL"], redis_url=None)
    await service.run()


if __name__ == "__main__":
    run(serve())
