"""Who takes part in the demo: three tenants (customers of the payment-streams
application), their endpoints with what each subscribes to, and the part each plays."""

from __future__ import annotations

from dataclasses import dataclass

from .streams import TENANT_PREFIX

ACME, GLOBEX, INITECH = (TENANT_PREFIX + name for name in ("acme", "globex", "initech"))
TENANTS = (ACME, GLOBEX, INITECH)


@dataclass(frozen=True)
class Part:
    """One endpoint of the demo: registered for ``tenant``, subscribed to ``events``."""

    name: str
    tenant: str
    events: tuple[str, ...]
    role: str
    ordered: bool = False
    refuse_every: int = 0  # its consumer answers 503 to every n-th first attempt

    @property
    def label(self) -> str:
        return f"{self.tenant.removeprefix(TENANT_PREFIX)}/{self.name}"


LEDGER = Part("ledger", ACME, ("*",), "goes down: auto-disabled, parked, re-enabled")
ALERTS = Part("alerts", ACME, ("stream.paused", "stream.cancelled"), "healthy")
SYNC = Part("sync", GLOBEX, ("stream.*",), "one stream's head retries", ordered=True)
CRM = Part("crm", GLOBEX, ("stream.created", "stream.cancelled"), "healthy")
BILLING = Part("billing", INITECH, ("*",), "503s, then 422s: recovered", refuse_every=7)
PARTS = (LEDGER, ALERTS, SYNC, CRM, BILLING)


def subscribes(patterns: tuple[str, ...], event_type: str) -> bool:
    """The subscription rule of SPEC section 10, written out on its own for the checks:
    ``*`` is every type, ``prefix*`` every type that starts with the prefix, anything else
    one exact type."""
    return any(
        p == "*" or p == event_type or (p.endswith("*") and event_type.startswith(p[:-1]))
        for p in patterns
    )
