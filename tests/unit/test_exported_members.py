"""The public API is exactly what __all__ says; a change here is a change for users."""

from __future__ import annotations

import fluxora_webhooks


def test_public_api_is_locked() -> None:
    assert sorted(fluxora_webhooks.__all__) == [
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
    for name in fluxora_webhooks.__all__:
        assert hasattr(fluxora_webhooks, name), name


def test_every_error_derives_from_the_base() -> None:
    for name in fluxora_webhooks.__all__:
        obj = getattr(fluxora_webhooks, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, fluxora_webhooks.FluxoraError), name
