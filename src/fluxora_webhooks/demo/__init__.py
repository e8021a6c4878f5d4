"""``fluxora-webhooks demo``: the original system end to end, on real engines.

- :mod:`.streams`: the payment-streams write path; each stream write and its ``stream.*``
  event commit (or roll back) together.
- :mod:`.consumer`: a consumer on loopback that verifies every signature, de-duplicates by
  delivery id and refuses some first attempts so that retries show.
- :mod:`.display`: the live progress and the summary table.
- :mod:`.runner`: the wiring (migrate, write, dispatch, wait) and the check of the
  guarantees.
"""

from __future__ import annotations

from .runner import DemoOptions, DemoReport, run_demo

__all__ = ["DemoOptions", "DemoReport", "run_demo"]
