"""``fluxora-webhooks demo``: many endpoints end to end, on real engines.

- :mod:`.streams`: the payment-streams write path; each stream write and its ``stream.*``
  event for the stream's tenant commit (or roll back) together.
- :mod:`.cast`: the tenants and their endpoints, what each subscribes to and its part.
- :mod:`.consumer`: one consumer per endpoint on loopback that verifies every signature
  with its endpoint's secret, de-duplicates by delivery id, and goes down, rejects or
  holds a stream's head back when a step says so; it checks per-stream order too.
- :mod:`.runner`: the wiring (migrate, register, dispatch, the five steps).
- :mod:`.checks`: what each step claims, checked.
- :mod:`.display`: the cast, the steps' progress and checks, the summary tables.
"""

from __future__ import annotations

from .runner import DemoOptions, DemoReport, run_demo

__all__ = ["DemoOptions", "DemoReport", "run_demo"]
