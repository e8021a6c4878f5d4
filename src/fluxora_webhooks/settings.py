"""Settings: every environment variable parsed and validated in one place.

An invalid value raises :class:`ConfigError` naming the variable; nothing falls back
silently to a default. Secrets are kept out of ``repr`` and messages.
"""

from __future__ import annotations

import base64
import binascii
import errno
import functools
import ipaddress
import logging
import os
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, unquote_to_bytes, urlsplit

from . import logs
from .errors import ConfigError, EndpointError
from .host import default_workers
from .secretbox import NO_KEYS, Keyring, keyring_from_env
from .urlpolicy import IPNetwork, has_space_or_control

log = logging.getLogger(__name__)

DEFAULT_RETRY_SCHEDULE = "5s,5m,30m,2h,5h,10h,10h"
MIN_SECRET_BYTES = 24
MAX_WORKERS = 64

_DURATION = re.compile(r"^\s*([0-9]+)\s*(ms|s|m|h|d)\s*$")
_DIGITS = re.compile(r"[0-9]+")
_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")
# The names LOG_LEVEL takes (logs.configure reads it; a service refuses anything else).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL")
_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
MAX_DELAY_MS = 7 * 86_400_000
# The longest period any duration may name (retention, prune): a hundred years is beyond
# any real use and far inside what PostgreSQL intervals and timestamps can hold, so a
# typo such as 99999999999999d is refused here instead of failing every run later.
MAX_DURATION_MS = 36_500 * 86_400_000
# Far above any real consumer, and small enough for every use (Redis counts, Lua numbers).
MAX_RETRY_RPS = 100_000
MAX_BREAKER_THRESHOLD = 100_000
# The largest whole number any setting may hold: PostgreSQL's bigint.
MAX_BIGINT = 2**63 - 1
# More significant digits than this is above every bound (int() itself refuses more than
# 4,300 digits with a ValueError), so such a number is refused before it is converted.
_MAX_DIGITS = len(str(MAX_BIGINT))
_SHOWN_CHARS = 40  # of a refused value, in a message
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def shown_value(text: str) -> str:
    """A refused value as a message may quote it: bounded, control characters escaped."""
    text = text.strip()
    short = text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."
    return repr(short)


def format_ms(ms: int) -> str:
    """A bound in milliseconds as the largest unit that writes it whole (``36500d``)."""
    for unit in ("d", "h", "m", "s"):
        if ms % _UNIT_MS[unit] == 0:
            return f"{ms // _UNIT_MS[unit]}{unit}"
    return f"{ms}ms"


def _whole(digits: str) -> int | None:
    """ASCII digits as an int, or None when there are too many digits for any bound."""
    significant = digits.lstrip("0") or "0"
    return int(significant) if len(significant) <= _MAX_DIGITS else None


def parse_int(text: str, variable: str, *, low: int, high: int) -> int:
    """A whole number in ASCII digits between ``low`` and ``high``, of any length of input:
    anything else raises :class:`ConfigError` naming ``variable``."""
    stripped = text.strip()
    if not stripped:
        raise ConfigError(variable, "is empty (a whole number is needed)")
    if stripped.startswith("-") and _DIGITS.fullmatch(stripped[1:]) and stripped.strip("-0"):
        # A negative whole number is below every bound here: say the bound.
        shown = stripped if len(stripped) <= _SHOWN_CHARS else stripped[:_SHOWN_CHARS] + "..."
        raise ConfigError(variable, f"must be at least {low}, got {shown}")
    if not _DIGITS.fullmatch(stripped):
        raise ConfigError(variable, f"{shown_value(stripped)} is not a whole number")
    value = _whole(stripped)
    if value is None or value > high:
        raise ConfigError(variable, f"must be at most {high}, got {shown_value(stripped)}")
    if value < low:
        raise ConfigError(variable, f"must be at least {low}, got {value}")
    return value


def looks_like_duration(text: str) -> bool:
    """Whether ``text`` is written as a duration (``2h``), whatever its size."""
    return _DURATION.match(text) is not None


def _read_duration_ms(text: str, variable: str) -> int | None:
    """A duration in ms; None when its number has more digits than any bound allows."""
    match = _DURATION.match(text)
    if not match:
        raise ConfigError(
            variable,
            f"{shown_value(text)} is not a duration (a whole number with ms, s, m, h or d)",
        )
    count = _whole(match.group(1))
    return None if count is None else count * _UNIT_MS[match.group(2)]


def parse_duration_ms(text: str, variable: str, *, high_ms: int = MAX_DURATION_MS) -> int:
    """Parse ``500ms``, ``5s``, ``30m``, ``2h`` or ``7d`` into milliseconds, at most
    ``high_ms`` (default 100 years). Raises :class:`ConfigError` naming ``variable``."""
    value = _read_duration_ms(text, variable)
    if value is None or value > high_ms:
        raise ConfigError(
            variable, f"{shown_value(text)} is too long: at most {format_ms(high_ms)}"
        )
    return value


def parse_schedule(text: str, variable: str = "WEBHOOK_RETRY_SCHEDULE") -> tuple[int, ...]:
    """Parse a comma-separated list of durations (each from 1 ms to 7 days)."""
    parts = text.split(",")
    if not text.strip() or any(not p.strip() for p in parts):
        raise ConfigError(variable, "must be a comma-separated list of durations such as 5s,5m,2h")
    delays = []
    for part in parts:
        delay = _read_duration_ms(part, variable)
        if delay is None or not 1 <= delay <= MAX_DELAY_MS:
            raise ConfigError(variable, f"{shown_value(part)} must be between 1ms and 7d")
        delays.append(delay)
    return tuple(delays)


def parse_retention(raw: str | None, variable: str = "WEBHOOK_RETENTION") -> int | None:
    """A retention period in ms, or None for off: unset, empty, ``off``, ``0`` and every
    zero duration (``0d``, ``0s``) mean off, never "delete everything at once"."""
    text = (raw or "").strip()
    if not text or text.lower() in ("off", "0"):
        return None
    period = parse_duration_ms(text, variable)
    return period or None


# WEBHOOK_API_RATE_LIMIT's default, (requests, per ms): a burst of 1000 requests, 100 a
# second sustained per API token or dashboard session (docs/api.md, "Request rate limit").
API_RATE_LIMIT = (1000, 10_000)


def parse_rate(
    raw: str | None, variable: str, default: tuple[int, int] | None
) -> tuple[int, int] | None:
    """A rate ``N/PERIOD`` (``20/s``, ``1000/10s``) as (N, PERIOD in ms): N requests at
    once, and N more each PERIOD (a duration, or a bare unit for one of it, at most 1d);
    ``0`` or ``off``: None (no limit); unset: ``default``."""
    if raw is None:
        return default
    text = raw.strip()
    if not text:
        raise ConfigError(variable, "is set but empty (unset it to use the default)")
    if text.lower() in ("0", "off"):
        return None
    count, slash, period = text.partition("/")
    if not slash:
        raise ConfigError(
            variable,
            f"{shown_value(text)} is not a rate: requests per period such as 20/s or"
            " 1000/10s (0: off)",
        )
    requests = parse_int(count, variable, low=1, high=1_000_000)
    period = period.strip()
    per_ms = parse_duration_ms(
        f"1{period}" if period in _UNIT_MS else period, variable, high_ms=86_400_000
    )
    if per_ms < 1:
        raise ConfigError(variable, f"{shown_value(text)}: the period must be at least 1ms")
    return requests, per_ms


def check_builtin_pairs(env: Mapping[str, str]) -> None:
    """For ``run``: a built-in endpoint's secret set without its URL is refused. It is
    almost always a URL variable misspelled or missing, and the run would remove that
    endpoint (README) and sign nothing, with no word said. Commands that only manage
    endpoints or serve the API do not care."""
    pairs = (
        ("WEBHOOK_URL", ("WEBHOOK_SECRET", "WEBHOOK_SECRET_PREVIOUS")),
        ("WEBHOOK_OPERATOR_URL", ("WEBHOOK_OPERATOR_SECRET",)),
    )
    for url_name, secrets in pairs:
        if env.get(url_name, "").strip():
            continue
        for name in secrets:
            if env.get(name) is not None:
                raise ConfigError(
                    name,
                    f"is set but {url_name} is not (a missing or misspelled {url_name}?);"
                    f" unset {name} when there is no built-in endpoint to sign for",
                )


# Every WEBHOOK_* and FLUXORA_* variable a command reads (tests/unit/test_settings.py keeps
# it in step with the source): one set that names none of them is a typo, warned about.
KNOWN_VARIABLES = frozenset(
    {
        "WEBHOOK_ALLOWED_NETWORKS", "WEBHOOK_API_HOST", "WEBHOOK_API_PORT",
        "WEBHOOK_API_RATE_LIMIT", "WEBHOOK_BATCH_SIZE", "WEBHOOK_CIRCUIT_BREAKER_RESET_MS",
        "WEBHOOK_CIRCUIT_BREAKER_THRESHOLD", "WEBHOOK_CLAIM_LOOPS", "WEBHOOK_DISABLE_AFTER",
        "WEBHOOK_ENCRYPTION_KEY", "WEBHOOK_ENCRYPTION_KEY_PREVIOUS",
        "WEBHOOK_ENDPOINT_CONCURRENCY", "WEBHOOK_MAX_ATTEMPTS", "WEBHOOK_MAX_CONNECTIONS",
        "WEBHOOK_MAX_ENDPOINTS_PER_TENANT", "WEBHOOK_MAX_RESPONSE_BYTES",
        "WEBHOOK_METRICS_HOST", "WEBHOOK_METRICS_PORT", "WEBHOOK_NO_PROXY",
        "WEBHOOK_OPERATOR_SECRET", "WEBHOOK_OPERATOR_URL", "WEBHOOK_POLL_INTERVAL_MS",
        "WEBHOOK_PROXY_URL", "WEBHOOK_RETENTION", "WEBHOOK_RETRY_RPS",
        "WEBHOOK_RETRY_SCHEDULE", "WEBHOOK_SECRET", "WEBHOOK_SECRET_PREVIOUS",
        "WEBHOOK_STARTUP_WAIT_MS", "WEBHOOK_TIMEOUT_MS", "WEBHOOK_TLS_CLIENT_CERT",
        "WEBHOOK_TLS_CLIENT_KEY", "WEBHOOK_URL", "WEBHOOK_WORKERS",
        "FLUXORA_HOME", "FLUXORA_REDIS_PREFIX", "FLUXORA_WORKER", "FLUXORA_WORKER_SILENT_S",
        "FLUXORA_WORKER_UNRESPONSIVE_S", "FLUXORA_BENCH_DIR",
    }
)  # fmt: skip


def unknown_variables(env: Mapping[str, str]) -> list[str]:
    """What to warn about at start-up: each ``WEBHOOK_*`` variable that names nothing a
    command reads (a misspelt retention variable left retention off without a word), and each
    ``FLUXORA_*`` one close to a name of ours (that prefix is shared with test and bench
    tooling), with the closest name when one is close. Values are never shown."""
    import difflib

    known = KNOWN_VARIABLES | {f"{name}_FILE" for name in SECRET_FILE_VARIABLES}
    found = []
    for name in sorted(env):
        if name in known or not name.startswith(("WEBHOOK_", "FLUXORA_")):
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        if name.startswith("FLUXORA_") and not close:
            continue
        hint = f" (did you mean {close[0]}?)" if close else ""
        shown = ascii(name)[1:-1]
        found.append(f"{shown} is set but is no variable fluxora-webhooks reads{hint}")
    return found


def warn_unknown_variables(env: Mapping[str, str]) -> None:
    """:func:`unknown_variables` as warnings (``run`` and ``api``, once configured)."""
    for line in unknown_variables(env):
        log.warning("%s", line)


#: Variables that hold a secret. Each may name a file instead (``DATABASE_URL_FILE``, ...),
#: as container platforms mount secrets (Docker, Kubernetes): the value is then in no
#: environment a deployment's manifest or ``docker inspect`` shows.
SECRET_FILE_VARIABLES = (
    "DATABASE_URL",
    "REDIS_URL",
    "WEBHOOK_SECRET",
    "WEBHOOK_SECRET_PREVIOUS",
    "WEBHOOK_OPERATOR_SECRET",
    "WEBHOOK_PROXY_URL",
    "WEBHOOK_ENCRYPTION_KEY",
    "WEBHOOK_ENCRYPTION_KEY_PREVIOUS",
)
# Far above any URL or key; a path to the wrong file (a log, a disk) is refused unread.
MAX_SECRET_FILE_BYTES = 65_536


def with_secret_files(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with each ``X_FILE`` of :data:`SECRET_FILE_VARIABLES` read into ``X`` (and
    gone: what a command starts, a supervised ``run``'s workers, gets the value read once,
    and signs as the others do whatever the file holds later). One line break at the end
    (``echo``, editors) is no part of the value. Both set, an unreadable, empty or
    oversized file: ConfigError naming the ``_FILE`` variable and the path, never the
    content."""
    resolved = dict(env)
    for name in SECRET_FILE_VARIABLES:
        variable = f"{name}_FILE"
        path = env.get(variable)
        if path is None:
            continue
        if name in env:
            raise ConfigError(variable, f"and {name} are both set: keep one")
        if not path.strip():
            raise ConfigError(variable, "is set but empty (a path to the file that holds it)")
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_SECRET_FILE_BYTES + 1)
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise ConfigError(variable, f"{path}: cannot be read ({reason})") from None
        if len(data) > MAX_SECRET_FILE_BYTES:
            raise ConfigError(
                variable, f"{path}: longer than {MAX_SECRET_FILE_BYTES} bytes (the wrong file?)"
            )
        text = data.decode("utf-8", "surrogateescape")
        text = text.removesuffix("\n").removesuffix("\r")
        if not text.strip():
            raise ConfigError(variable, f"{path}: the file is empty")
        if "\0" in text:
            raise ConfigError(variable, f"{path}: holds a NUL byte (not a text file?)")
        resolved[name] = text
        del resolved[variable]
    return resolved


def secret_file_hint(variable: str, env: Mapping[str, str]) -> str:
    """What to add to a refusal of ``variable`` read from its file: where it came from."""
    if variable in SECRET_FILE_VARIABLES and env.get(f"{variable}_FILE") is not None:
        return f" (read from {variable}_FILE)"
    return ""


EMPTY_ENGINE_URL = "is set but empty (unset it to use the embedded engine)"


def _blank(env: Mapping[str, str], name: str) -> bool:
    """Set but empty: not unset (the embedded engine). A deployment whose variable came out
    empty (a missing secret in a template) would otherwise run on a private engine of its
    own, never reading the real outbox, and with REDIS_URL each host would keep a rate
    limit and breaker of its own."""
    raw = env.get(name)
    return raw is not None and not raw.strip()


def _int(env: Mapping[str, str], name: str, default: int, *, low: int, high: int) -> int:
    raw = env.get(name)
    if raw is None:
        return default
    if not raw.strip():
        raise ConfigError(name, "is set but empty (unset it to use the default)")
    return parse_int(raw, name, low=low, high=high)


def _secret(env: Mapping[str, str], name: str, *, required: bool) -> bytes | None:
    raw = env.get(name)
    if raw is None:
        if required:
            raise ConfigError(name, "is required (the HMAC signing secret)")
        return None
    if raw == "" or raw.strip() == "":
        raise ConfigError(name, "must not be empty")
    try:
        # surrogateescape: the bytes of the environment as they were, even if not UTF-8.
        value = raw.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise ConfigError(name, "is not valid text (a lone surrogate)") from None
    key = value
    if raw.startswith("whsec_"):
        try:
            key = base64.b64decode(raw[len("whsec_") :], validate=True)
        except (binascii.Error, ValueError):
            raise ConfigError(
                name, "starts with whsec_ but the rest is not valid base64 (Standard Webhooks)"
            ) from None
        if not key:
            # The Standard Webhooks signature would be an HMAC with an empty key.
            raise ConfigError(name, "is whsec_ with nothing after it: an empty key")
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
    from .urlpolicy import check_url_address, validate_kept_url

    raw = env.get(name)
    if raw is None and not required:
        return ""
    url = (raw or "").strip()
    if not url:
        what = "the consumer's https URL" if name == "WEBHOOK_URL" else "an https URL"
        raise ConfigError(name, f"is required to be {what} when set (unset it to serve without it)")
    try:
        validate_kept_url(url)
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
            raise ConfigError(name, f"{shown_value(part)} is not a CIDR network") from None
    return tuple(nets)


def _check_redis_url(url: str) -> None:
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError("REDIS_URL", "must start with redis://, rediss:// or unix://")
    if has_space_or_control(url):
        raise ConfigError("REDIS_URL", "contains whitespace or a control character")
    try:
        parts = urlsplit(url)
        _ = parts.port
    except ValueError:
        raise ConfigError("REDIS_URL", "cannot be parsed (host or port)") from None
    if parts.scheme == "unix":
        if not parts.path:
            raise ConfigError("REDIS_URL", "unix:// needs a socket path")
    else:
        if not parts.hostname:
            raise ConfigError("REDIS_URL", "has no host")
        db = parts.path.lstrip("/")
        number = _whole(db) if _DIGITS.fullmatch(db) else None
        if db and (number is None or number >= 2**31):
            raise ConfigError("REDIS_URL", "the database (after the last /) must be a number")
    if parts.query:  # an option redis-py cannot use: ?socket_timeout=abc, ?ssl_cert_reqs=x
        from .redis_connect import check_url_options

        check_url_options(url)


# A libpq message quotes the piece it could not read, which may be a password.
_QUOTED = re.compile(r'"[^"]*"')


def check_database_url(url: str, variable: str = "DATABASE_URL") -> dict[str, str]:
    """Parse a ``postgresql://`` URL or a libpq ``key=value`` string the way libpq will,
    and check its ports; the parsed options. Every command validates ``DATABASE_URL`` here
    (through :class:`EngineSettings`), so a bad one is a :class:`ConfigError` (exit 2)
    before anything connects, never a driver error later."""
    from psycopg import ProgrammingError
    from psycopg.conninfo import conninfo_to_dict

    # libpq key=value strings are allowed too.
    if not url.startswith(("postgresql://", "postgres://")) and "=" not in url:
        raise ConfigError(variable, "must be a postgresql:// URL or a libpq connection string")
    try:
        options = {k: str(v) for k, v in conninfo_to_dict(url).items() if v is not None}
    except ProgrammingError as exc:
        reason = _QUOTED.sub('"..."', (str(exc).strip().splitlines() or [""])[0])[:120]
        raise ConfigError(
            variable, f"is not a valid PostgreSQL URL or libpq connection string ({reason})"
        ) from None
    for port in options.get("port", "").split(","):
        number = _whole(port) if _DIGITS.fullmatch(port) else None
        if port and (number is None or not 1 <= number <= 65535):
            raise ConfigError(variable, "has a port that is not a number from 1 to 65535")
    # libpq pairs a list of hosts with one port for all or one port each, and refuses any
    # other count at every connection (which start-up would wait on as if it could pass).
    # (What the URL leaves out, libpq takes from PGHOST, PGHOSTADDR and PGPORT.)
    given = {k: options.get(k) or os.environ.get(f"PG{k.upper()}") for k in ("host", "hostaddr")}
    counts = {len(v.split(",")) for v in given.values() if v}
    if len(counts) > 1:
        raise ConfigError(variable, "has a different number of host and hostaddr entries")
    hosts = counts.pop() if counts else 1
    port_list = options.get("port") or os.environ.get("PGPORT")
    ports = len(port_list.split(",")) if port_list else 1
    if ports not in (1, hosts):
        raise ConfigError(
            variable,
            f"has {ports} ports for {hosts} host(s): give one port for all hosts, or one per host",
        )
    # Options libpq reads only when it connects: a bad one would make every connection of
    # the pools fail later while start-up (which sets its own timeout) had succeeded.
    timeout = options.get("connect_timeout", "").strip()
    if "connect_timeout" in options and not _SIGNED_DIGITS.fullmatch(timeout):
        raise ConfigError(variable, "connect_timeout must be whole seconds, e.g. connect_timeout=5")
    for option, allowed in _LIBPQ_CHOICES.items():
        if option in options and options[option] not in allowed:
            raise ConfigError(variable, f"{option} must be one of {', '.join(allowed)}")
    return options


_SIGNED_DIGITS = re.compile(r"-?[0-9]{1,9}")
_LIBPQ_CHOICES = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "target_session_attrs": (
        "any", "read-write", "read-only", "primary", "standby", "prefer-standby",
    ),
}  # fmt: skip


def database_url_secrets(url: str | None) -> tuple[str, ...]:
    """The secrets of a database URL or libpq string (its passwords), for the log scrubber:
    only those, not every option (``sslmode=require`` names no secret)."""
    if not url:
        return ()
    try:
        options = check_database_url(url)
    except ConfigError:
        return ()
    return tuple(options[k] for k in ("password", "sslpassword") if options.get(k))


def register_engine_secrets(database_url: str | None, redis_url: str | None) -> None:
    """Tell the log scrubber the engines' passwords, and only those: their other parameters
    (``sslmode=disable``, ``application_name=...``) are no secret, and masking them would
    garble unrelated words in every message."""
    logs.add_sensitive(*database_url_secrets(database_url))
    logs.add_sensitive(*logs.credential_secrets(redis_url))


def _is_host(text: str) -> bool:
    """An IP address, or a host name: dot-separated labels of 1-63 letters, digits and
    hyphens, not all digits (``999.1.1.1`` is no address and no name)."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        labels = text.split(".")
        return (
            bool(_HOSTNAME.fullmatch(text))
            and all(_LABEL.fullmatch(label) for label in labels)
            and not all(label.isdigit() for label in labels)
        )


def cannot_listen(kind: str, host: str, port: int, exc: BaseException) -> ConfigError:
    """A listening socket that could not be opened (``kind``: METRICS or API), as the
    configuration error it is, naming the variable: the port when it is taken or not
    allowed, else the host (not an address of this machine, or a name that does not
    resolve)."""
    if isinstance(exc, OSError) and exc.errno in (errno.EADDRINUSE, errno.EACCES):
        return ConfigError(f"WEBHOOK_{kind}_PORT", f"cannot listen on port {port}: {exc.strerror}")
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
    return ConfigError(f"WEBHOOK_{kind}_HOST", f"cannot listen on {shown_value(host)}: {reason}")


NO_PROXY_DEFAULT: tuple[IPNetwork, ...] = (
    ipaddress.ip_network("127.0.0.0/8"),
    ipaddress.ip_network("::1/128"),
)


@dataclass(frozen=True, slots=True)
class Proxy:
    """An HTTP proxy that https consumers are reached through (``CONNECT``)."""

    host: str
    port: int
    # The Proxy-Authorization value (Basic), from the URL's user and password.
    authorization: str | None = field(default=None, repr=False)

    @property
    def shown(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _no_proxy(env: Mapping[str, str]) -> tuple[IPNetwork, ...]:
    """``WEBHOOK_NO_PROXY``: the networks connected to directly (unset: loopback)."""
    raw = env.get("WEBHOOK_NO_PROXY")
    if raw is None:
        return NO_PROXY_DEFAULT
    if raw.strip().lower() == "none":
        return ()
    if not raw.strip():
        raise ConfigError("WEBHOOK_NO_PROXY", "is set but empty (CIDRs, or none: every address)")
    return _networks(env, "WEBHOOK_NO_PROXY")


def parse_proxy_url(raw: str | None, variable: str = "WEBHOOK_PROXY_URL") -> Proxy | None:
    """``http://[user:password@]host[:port]``: an http proxy (the tunnel to the consumer
    is TLS itself). Unset: no proxy. Its password is given to the log scrubber."""
    if raw is None:
        return None
    text = raw.strip()
    if not text:
        raise ConfigError(variable, "is set but empty (unset it to connect directly)")
    if has_space_or_control(text):
        raise ConfigError(variable, "holds a space or a control character")
    try:
        parts = urlsplit(text)
        host, port = parts.hostname, parts.port
    except ValueError:
        raise ConfigError(variable, "cannot be parsed as http://host:port") from None
    if parts.scheme.lower() != "http":
        raise ConfigError(
            variable,
            "must be an http:// proxy URL (the tunnel to an https consumer is TLS already)",
        )
    if not host or not (_is_host(host) or _is_host(host.rstrip("."))):
        raise ConfigError(variable, "names no host (http://host:port)")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(variable, "must be http://host:port, without a path or query")
    if port == 0:
        raise ConfigError(variable, "port 0 is no port to connect to")
    authorization = None
    if parts.username is not None or parts.password is not None:
        # As bytes: a percent-encoded byte (%FF) is that byte, and so is a byte of the
        # environment that is not UTF-8 (surrogateescape), as curl sends them.
        try:
            user, password = (
                unquote_to_bytes((part or "").encode("utf-8", "surrogateescape"))
                for part in (parts.username, parts.password)
            )
        except UnicodeEncodeError:
            raise ConfigError(variable, "is not valid text (a lone surrogate)") from None
        logs.add_sensitive(password, unquote(parts.password or ""), parts.password or "")
        token = base64.b64encode(user + b":" + password).decode("ascii")
        logs.add_sensitive(token)
        authorization = f"Basic {token}"
    return Proxy(host, port or 80, authorization)


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
    # The endpoints a tenant token may give its tenant through the API (0: no cap); admin
    # tokens and the command line are not capped.
    max_endpoints_per_tenant: int = 100
    # How long `run` waits at start-up for a database that does not answer yet (0: not at
    # all); a refusal that waiting does not cure (authentication) stops it at once.
    startup_wait_ms: int = 30_000
    disable_after_ms: int | None = 5 * 86_400_000  # None: never
    operator_url: str = ""
    operator_secret: bytes = field(default=b"", repr=False)
    # The management API and dashboard (SPEC 15): `run` serves them when WEBHOOK_API_PORT
    # is set; `fluxora-webhooks api` always, on 8080 by default.
    api_host: str = "127.0.0.1"
    api_port: int | None = None
    api_rate_limit: tuple[int, int] | None = API_RATE_LIMIT  # WEBHOOK_API_RATE_LIMIT
    # The client certificate presented to consumers that ask for one (mutual TLS): a PEM
    # file of the certificate (and its chain), and of its key when that is not in it.
    tls_client_cert: str | None = None
    tls_client_key: str | None = None
    # An egress proxy for https consumers (CONNECT tunnels), and the networks connected to
    # directly (by default loopback, which a proxy elsewhere cannot reach).
    proxy: Proxy | None = field(default=None, repr=False)
    no_proxy: tuple[IPNetwork, ...] = NO_PROXY_DEFAULT
    # The keys endpoint secrets are stored encrypted with (WEBHOOK_ENCRYPTION_KEY and
    # WEBHOOK_ENCRYPTION_KEY_PREVIOUS; none: stored and read in plain text).
    encryption_keys: Keyring = field(default=NO_KEYS, repr=False)

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
        retention = parse_retention(env.get("WEBHOOK_RETENTION"))
        log_format = env.get("LOG_FORMAT", "text").strip().lower() or "text"
        if log_format not in ("text", "json"):
            raise ConfigError("LOG_FORMAT", f"must be text or json, got {shown_value(log_format)}")
        log_level = env.get("LOG_LEVEL", "").strip().upper()
        if log_level and log_level not in LOG_LEVELS:
            raise ConfigError(
                "LOG_LEVEL", f"must be DEBUG, INFO, WARNING or ERROR, got {shown_value(log_level)}"
            )
        metrics_host = env.get("WEBHOOK_METRICS_HOST", "127.0.0.1").strip() or "127.0.0.1"
        if not _is_host(metrics_host):
            raise ConfigError(
                "WEBHOOK_METRICS_HOST", f"{shown_value(metrics_host)} is not an address"
            )
        numbers = {
            attr: _int(env, variable, _default(attr), low=low, high=high)
            for attr, (variable, low, high) in _INTEGERS.items()
        }
        tls_client_cert, tls_client_key = _client_certificate(env)
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
            api_rate_limit=parse_rate(
                env.get("WEBHOOK_API_RATE_LIMIT"), "WEBHOOK_API_RATE_LIMIT", API_RATE_LIMIT
            ),
            tls_client_cert=tls_client_cert,
            tls_client_key=tls_client_key,
            proxy=parse_proxy_url(env.get("WEBHOOK_PROXY_URL")),
            no_proxy=_no_proxy(env),
            encryption_keys=keyring_from_env(env),
            **numbers,
        )


def _client_certificate(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """``WEBHOOK_TLS_CLIENT_CERT`` and ``WEBHOOK_TLS_CLIENT_KEY`` as given; their files are
    read by `run` only (:func:`check_client_certificate`): another command sharing the
    environment (``api``, ``endpoints``) need not see a key readable by the dispatcher
    alone."""
    cert = env.get("WEBHOOK_TLS_CLIENT_CERT", "").strip() or None
    key = env.get("WEBHOOK_TLS_CLIENT_KEY", "").strip() or None
    if cert is None and key is not None:
        raise ConfigError("WEBHOOK_TLS_CLIENT_KEY", "is set without WEBHOOK_TLS_CLIENT_CERT")
    return cert, key


def check_client_certificate(settings: Settings) -> None:
    """Load the client certificate once, at `run`'s start, so that a file that cannot be
    read, a key that is not the certificate's, or an encrypted key (which OpenSSL would ask
    a terminal for) stops start-up naming its variable."""
    cert, key = settings.tls_client_cert, settings.tls_client_key
    if cert is None:
        return
    for variable, path in (("WEBHOOK_TLS_CLIENT_CERT", cert), ("WEBHOOK_TLS_CLIENT_KEY", key)):
        if path is None:
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise ConfigError(variable, f"cannot read {path} ({exc.strerror})") from None
    key_variable = "WEBHOOK_TLS_CLIENT_KEY" if key else "WEBHOOK_TLS_CLIENT_CERT"

    def encrypted() -> bytes:
        raise ConfigError(
            key_variable,
            "the private key is encrypted: give it unencrypted, in a file only the dispatcher"
            " can read",
        )

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key, password=encrypted)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            why = "the private key is not the certificate's"
        elif key is None:
            why = (
                f"{cert} does not hold a PEM certificate followed by its private key (or give"
                " the key's file in WEBHOOK_TLS_CLIENT_KEY)"
            )
        else:
            why = f"{cert} and {key} are not a PEM certificate and its private key"
        raise ConfigError("WEBHOOK_TLS_CLIENT_CERT", why) from None


# Every whole-number setting: field -> (variable, lowest, highest). Defaults are the
# dataclass fields' defaults above, written once.
_INTEGERS: dict[str, tuple[str, int, int]] = {
    "poll_interval_ms": ("WEBHOOK_POLL_INTERVAL_MS", 1, 3_600_000),
    "batch_size": ("WEBHOOK_BATCH_SIZE", 1, 1000),
    "retry_rps": ("WEBHOOK_RETRY_RPS", 1, MAX_RETRY_RPS),
    "circuit_breaker_threshold": ("WEBHOOK_CIRCUIT_BREAKER_THRESHOLD", 0, MAX_BREAKER_THRESHOLD),
    "circuit_breaker_reset_ms": ("WEBHOOK_CIRCUIT_BREAKER_RESET_MS", 1, MAX_DELAY_MS),
    "max_attempts": ("WEBHOOK_MAX_ATTEMPTS", 1, 1000),
    "timeout_ms": ("WEBHOOK_TIMEOUT_MS", 1, 3_600_000),
    "max_response_bytes": ("WEBHOOK_MAX_RESPONSE_BYTES", 1, 16 << 20),
    "metrics_port": ("WEBHOOK_METRICS_PORT", 0, 65535),
    "claim_loops": ("WEBHOOK_CLAIM_LOOPS", 1, 64),
    "max_connections": ("WEBHOOK_MAX_CONNECTIONS", 1, 100_000),
    "endpoint_concurrency": ("WEBHOOK_ENDPOINT_CONCURRENCY", 1, 10_000),
    "max_endpoints_per_tenant": ("WEBHOOK_MAX_ENDPOINTS_PER_TENANT", 0, 1_000_000),
    "startup_wait_ms": ("WEBHOOK_STARTUP_WAIT_MS", 0, 3_600_000),
}


def environ_keyring() -> Keyring:
    """The encryption keys of this process's environment, its ``_FILE`` variables read:
    what the endpoint functions seal secrets with when their caller gives no keys (the API,
    the dashboard, a library user). Read once per distinct environment."""
    names = ("WEBHOOK_ENCRYPTION_KEY", "WEBHOOK_ENCRYPTION_KEY_PREVIOUS")
    given = tuple((n, os.environ.get(n)) for v in names for n in (v, f"{v}_FILE"))
    return _environ_keyring(given)


@functools.lru_cache(maxsize=8)
def _environ_keyring(given: tuple[tuple[str, str | None], ...]) -> Keyring:
    return keyring_from_env(with_secret_files({k: v for k, v in given if v is not None}))


def retry_rps(env: Mapping[str, str]) -> int:
    """``WEBHOOK_RETRY_RPS`` as ``run`` reads it: the rate at which the commands and the API
    make a replayed or recovered endpoint's deliveries due (the gate admits no more)."""
    return _int(env, "WEBHOOK_RETRY_RPS", _default("retry_rps"), low=1, high=MAX_RETRY_RPS)


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
    # REDIS_URL set but empty: refused by what uses Redis (check_redis), not by a command
    # that never does (migrate, endpoints) run from an environment shared with the service.
    redis_blank: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> EngineSettings:
        redis_prefix = env.get("FLUXORA_REDIS_PREFIX", "")
        if "{" in redis_prefix or "}" in redis_prefix:
            # Braces would change the Redis Cluster hash tag of the per-consumer keys.
            raise ConfigError("FLUXORA_REDIS_PREFIX", "must not contain { or }")
        if _blank(env, "DATABASE_URL"):
            raise ConfigError("DATABASE_URL", EMPTY_ENGINE_URL)
        database_url = env.get("DATABASE_URL", "").strip() or None
        redis_url = env.get("REDIS_URL", "").strip() or None
        if redis_url:
            _check_redis_url(redis_url)
        if database_url:
            check_database_url(database_url)
        home = Path(env.get("FLUXORA_HOME", "").strip() or ".fluxora")
        return cls(database_url, redis_url, home, redis_prefix, _blank(env, "REDIS_URL"))

    def check_redis(self) -> None:
        """For a command that uses Redis: an empty REDIS_URL is no embedded Redis (each
        host would keep a rate limit and breaker of its own, silently)."""
        if self.redis_blank:
            raise ConfigError("REDIS_URL", EMPTY_ENGINE_URL)
