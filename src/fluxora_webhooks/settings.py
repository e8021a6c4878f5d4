"""Settings: every environment variable parsed and validated in one place.

An invalid value raises :class:`ConfigError` naming the variable; nothing falls back
silently to a default. Secrets are kept out of ``repr`` and messages.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from .errors import ConfigError, EndpointError
from .host import default_workers

log = logging.getLogger(__name__)

DEFAULT_RETRY_SCHEDULE = "5s,5m,30m,2h,5h,10h,10h"
MIN_SECRET_BYTES = 24
MAX_WORKERS = 64

_DURATION = re.compile(r"^\s*([0-9]+)\s*(ms|s|m|h|d)\s*$")
_DIGITS = re.compile(r"[0-9]+")
_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")
MAX_DELAY_MS = 7 * 86_400_000
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def parse_duration_ms(text: str, variable: str) -> int:
    """Parse ``500ms``, ``5s``, ``30m``, ``2h`` or ``7d`` into milliseconds."""
    match = _DURATION.match(text)
    if not match:
        raise ConfigError(
            variable, f"{text.strip()!r} is not a duration (a whole number with ms, s, m, h or d)"
        )
    return int(match.group(1)) * _UNIT_MS[match.group(2)]


def parse_schedule(text: str, variable: str = "WEBHOOK_RETRY_SCHEDULE") -> tuple[int, ...]:
    """Parse a comma-separated list of durations (each from 1 ms to 7 days)."""
    parts = text.split(",")
    if not text.strip() or any(not p.strip() for p in parts):
        raise ConfigError(variable, "must be a comma-separated list of durations such as 5s,5m,2h")
    delays = tuple(parse_duration_ms(p, variable) for p in parts)
    for part, delay in zip(parts, delays, strict=True):
        if not 1 <= delay <= MAX_DELAY_MS:
            raise ConfigError(variable, f"{part.strip()!r} must be between 1ms and 7d")
    return delays


def _int(env: Mapping[str, str], name: str, default: int, *, low: int, high: int | None) -> int:
    raw = env.get(name)
    if raw is None:
        return default
    text = raw.strip()
    if not text:
        raise ConfigError(name, "is set but empty (unset it to use the default)")
    if not _DIGITS.fullmatch(text):
        raise ConfigError(name, f"{text!r} is not a whole number")
    value = int(text)
    if value < low:
        raise ConfigError(name, f"must be at least {low}, got {value}")
    if high is not None and value > high:
        raise ConfigError(name, f"must be at most {high}, got {value}")
    return value


def _secret(env: Mapping[str, str], name: str, *, required: bool) -> bytes | None:
    raw = env.get(name)
    if raw is None:
        if required:
            raise ConfigError(name, "is required (the HMAC signing secret)")
        return None
    if raw == "" or raw.strip() == "":
        raise ConfigError(name, "must not be empty")
    value = raw.encode("utf-8")
    key = value
    if raw.startswith("whsec_"):
        try:
            key = base64.b64decode(raw[len("whsec_") :], validate=True)
        except (binascii.Error, ValueError):
            raise ConfigError(
                name, "starts with whsec_ but the rest is not valid base64 (Standard Webhooks)"
            ) from None
    if len(key) < MIN_SECRET_BYTES:
        log.warning("%s is shorter than %d bytes; use a long random secret", name, MIN_SECRET_BYTES)
    return value


def _consumer_url(
    env: Mapping[str, str],
    name: str,
    allowed: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...],
    *,
    required: bool,
) -> str:
    """A built-in endpoint's URL: the operator's own, so a loopback URL is allowed."""
    from .urlpolicy import check_url_address, validate_url

    raw = env.get(name)
    if raw is None and not required:
        return ""
    url = (raw or "").strip()
    if not url:
        what = "the consumer's https URL" if name == "WEBHOOK_URL" else "an https URL"
        raise ConfigError(name, f"is required to be {what} when set (unset it to serve without it)")
    try:
        validate_url(url)
        check_url_address(url, allowed_networks=allowed)
    except EndpointError as exc:
        raise ConfigError(name, str(exc)) from None
    return url


def _networks(
    env: Mapping[str, str], name: str
) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    raw = env.get(name, "").strip()
    if not raw:
        return ()
    nets = []
    for part in raw.split(","):
        try:
            nets.append(ipaddress.ip_network(part.strip(), strict=False))
        except ValueError:
            raise ConfigError(name, f"{part.strip()!r} is not a CIDR network") from None
    return tuple(nets)


def _check_redis_url(url: str) -> None:
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError("REDIS_URL", "must start with redis://, rediss:// or unix://")
    parts = urlsplit(url)
    try:
        _ = parts.port
    except ValueError:
        raise ConfigError("REDIS_URL", "has a port that is not a number") from None
    if parts.scheme == "unix":
        if not parts.path:
            raise ConfigError("REDIS_URL", "unix:// needs a socket path")
        return
    if not parts.hostname:
        raise ConfigError("REDIS_URL", "has no host")
    db = parts.path.lstrip("/")
    if db and not _DIGITS.fullmatch(db):
        raise ConfigError("REDIS_URL", "the database (after the last /) must be a number")


def _is_host(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return bool(_HOSTNAME.fullmatch(text))


@dataclass(frozen=True)
class Settings:
    """Validated configuration of a dispatcher. Build it with :meth:`from_env`."""

    # The built-in endpoint `default` (SPEC 10): WEBHOOK_URL and WEBHOOK_SECRET, optional.
    webhook_url: str = ""
    secret: bytes = field(default=b"", repr=False)
    secret_previous: bytes | None = field(default=None, repr=False)
    database_url: str | None = field(default=None, repr=False)
    redis_url: str | None = field(default=None, repr=False)
    poll_interval_ms: int = 10_000
    batch_size: int = 10
    retry_rps: int = 10
    circuit_breaker_threshold: int = 0
    circuit_breaker_reset_ms: int = 300_000
    max_attempts: int = 8
    retry_schedule_ms: tuple[int, ...] = (
        5_000,
        300_000,
        1_800_000,
        7_200_000,
        18_000_000,
        36_000_000,
        36_000_000,
    )
    timeout_ms: int = 15_000
    max_response_bytes: int = 65_536
    metrics_port: int = 9464
    metrics_host: str = "127.0.0.1"
    # Beyond the original: throughput and operations.
    claim_loops: int = 4
    max_connections: int = 100
    redis_prefix: str = ""
    allowed_networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    retention_ms: int | None = None
    log_format: str = "text"
    home: Path = Path(".fluxora")
    # Dispatcher processes of `run` (SPEC section 16). Settings built in code describe one
    # process; from_env defaults to the usable CPUs.
    workers: int = 1
    # Many endpoints (SPEC 11, 12).
    endpoint_concurrency: int = 20
    disable_after_ms: int | None = 5 * 86_400_000  # None: never
    operator_url: str = ""
    operator_secret: bytes = field(default=b"", repr=False)
    # The management API and dashboard (SPEC 15): `run` serves them when WEBHOOK_API_PORT
    # is set; `fluxora-webhooks api` always, on 8080 by default.
    api_host: str = "127.0.0.1"
    api_port: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, require_endpoint: bool = False) -> Settings:
        """Parse and validate the environment. Raises :class:`ConfigError`.

        ``WEBHOOK_URL`` is optional (the service also serves the endpoints of the table);
        ``require_endpoint`` makes it required."""
        engines = EngineSettings.from_env(env)
        allowed = _networks(env, "WEBHOOK_ALLOWED_NETWORKS")
        url = _consumer_url(env, "WEBHOOK_URL", allowed, required=require_endpoint)
        secret = _secret(env, "WEBHOOK_SECRET", required=bool(url)) or b""
        previous = _secret(env, "WEBHOOK_SECRET_PREVIOUS", required=False)
        operator_url = _consumer_url(env, "WEBHOOK_OPERATOR_URL", allowed, required=False)
        operator_secret = (
            _secret(env, "WEBHOOK_OPERATOR_SECRET", required=bool(operator_url)) or b""
        )
        disable_raw = env.get("WEBHOOK_DISABLE_AFTER", "5d").strip()
        disable_after = (
            None if disable_raw == "0" else parse_duration_ms(disable_raw, "WEBHOOK_DISABLE_AFTER")
        )
        if disable_after is not None and disable_after < 1000:
            raise ConfigError("WEBHOOK_DISABLE_AFTER", "must be at least 1s (or 0 for never)")
        api_port_raw = env.get("WEBHOOK_API_PORT")
        api_port = (
            None if api_port_raw is None else _int(env, "WEBHOOK_API_PORT", 8080, low=0, high=65535)
        )
        api_host = env.get("WEBHOOK_API_HOST", "127.0.0.1").strip() or "127.0.0.1"
        if not _is_host(api_host):
            raise ConfigError("WEBHOOK_API_HOST", f"{api_host!r} is not an address")
        schedule_raw = env.get("WEBHOOK_RETRY_SCHEDULE")
        schedule = parse_schedule(DEFAULT_RETRY_SCHEDULE if schedule_raw is None else schedule_raw)
        retention_raw = env.get("WEBHOOK_RETENTION", "").strip()
        retention = (
            parse_duration_ms(retention_raw, "WEBHOOK_RETENTION")
            if retention_raw and retention_raw.lower() not in ("off", "0")
            else None
        )
        log_format = env.get("LOG_FORMAT", "text").strip().lower() or "text"
        if log_format not in ("text", "json"):
            raise ConfigError("LOG_FORMAT", f"must be text or json, got {log_format!r}")
        metrics_host = env.get("WEBHOOK_METRICS_HOST", "127.0.0.1").strip() or "127.0.0.1"
        if not _is_host(metrics_host):
            raise ConfigError("WEBHOOK_METRICS_HOST", f"{metrics_host!r} is not an address")
        numbers = {
            attr: _int(env, variable, _default(attr), low=low, high=high)
            for attr, (variable, low, high) in _INTEGERS.items()
        }
        return cls(
            webhook_url=url,
            secret=secret,
            secret_previous=previous,
            database_url=engines.database_url,
            redis_url=engines.redis_url,
            retry_schedule_ms=schedule,
            metrics_host=metrics_host,
            redis_prefix=engines.redis_prefix,
            allowed_networks=allowed,
            retention_ms=retention,
            log_format=log_format,
            home=engines.home,
            workers=_int(env, "WEBHOOK_WORKERS", default_workers(), low=1, high=MAX_WORKERS),
            disable_after_ms=disable_after,
            operator_url=operator_url,
            operator_secret=operator_secret,
            api_host=api_host,
            api_port=api_port,
            **numbers,
        )


# Every whole-number setting: field -> (variable, lowest, highest). Defaults are the
# dataclass fields' defaults above, written once.
_INTEGERS: dict[str, tuple[str, int, int | None]] = {
    "poll_interval_ms": ("WEBHOOK_POLL_INTERVAL_MS", 1, 3_600_000),
    "batch_size": ("WEBHOOK_BATCH_SIZE", 1, 1000),
    "retry_rps": ("WEBHOOK_RETRY_RPS", 1, None),
    "circuit_breaker_threshold": ("WEBHOOK_CIRCUIT_BREAKER_THRESHOLD", 0, None),
    "circuit_breaker_reset_ms": ("WEBHOOK_CIRCUIT_BREAKER_RESET_MS", 1, MAX_DELAY_MS),
    "max_attempts": ("WEBHOOK_MAX_ATTEMPTS", 1, 1000),
    "timeout_ms": ("WEBHOOK_TIMEOUT_MS", 1, 3_600_000),
    "max_response_bytes": ("WEBHOOK_MAX_RESPONSE_BYTES", 1, 16 << 20),
    "metrics_port": ("WEBHOOK_METRICS_PORT", 0, 65535),
    "claim_loops": ("WEBHOOK_CLAIM_LOOPS", 1, 64),
    "max_connections": ("WEBHOOK_MAX_CONNECTIONS", 1, 100_000),
    "endpoint_concurrency": ("WEBHOOK_ENDPOINT_CONCURRENCY", 1, 10_000),
}


def _default(attr: str) -> int:
    value = Settings.__dataclass_fields__[attr].default
    assert isinstance(value, int)
    return value


@dataclass(frozen=True)
class EngineSettings:
    """Where the database and Redis are, as every command reads it: ``DATABASE_URL`` and
    ``REDIS_URL`` (``None``: the embedded engines in ``home``), ``FLUXORA_HOME`` and
    ``FLUXORA_REDIS_PREFIX``. Validated; the one parser of these variables."""

    database_url: str | None = field(default=None, repr=False)
    redis_url: str | None = field(default=None, repr=False)
    home: Path = Path(".fluxora")
    redis_prefix: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> EngineSettings:
        redis_prefix = env.get("FLUXORA_REDIS_PREFIX", "")
        if "{" in redis_prefix or "}" in redis_prefix:
            # Braces would change the Redis Cluster hash tag of the per-consumer keys.
            raise ConfigError("FLUXORA_REDIS_PREFIX", "must not contain { or }")
        database_url = env.get("DATABASE_URL", "").strip() or None
        redis_url = env.get("REDIS_URL", "").strip() or None
        if redis_url:
            _check_redis_url(redis_url)
        # libpq key=value strings are allowed too.
        if (
            database_url
            and not database_url.startswith(("postgresql://", "postgres://"))
            and "=" not in database_url
        ):
            raise ConfigError(
                "DATABASE_URL", "must be a postgresql:// URL or a libpq connection string"
            )
        home = Path(env.get("FLUXORA_HOME", "").strip() or ".fluxora")
        return cls(database_url, redis_url, home, redis_prefix)
