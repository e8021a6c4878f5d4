"""Redis clients for a ``REDIS_URL`` that may name one node of a Redis Cluster.

A plain URL is all the configuration there is (SPEC section 16). The first command a
client sends (the gate's ping at start-up, normally) asks the node ``CLUSTER INFO``:

- a single node refuses it (cluster support disabled, or the command unknown): the client
  goes on as a plain :class:`redis.asyncio.Redis`, exactly as before;
- a cluster node answers it: every command from then on goes through redis-py's own
  :class:`redis.asyncio.cluster.RedisCluster`, which keeps the slot map and follows MOVED,
  ASK and TRYAGAIN by itself, and loads scripts on every master (``SCRIPT LOAD``), so a
  NOSCRIPT on any node is answered by loading the script and calling again.

The keys of one gate script share a hash tag (``webhook_rl:{<digest>}``,
``webhook_cb:{<digest>}``, ``webhook_cb_probe:{<digest>}``), so each EVALSHA goes to the one
node that owns that consumer's slot.

When Redis cannot be reached, nothing is decided: the next command asks again, so a
dispatcher started while the cluster was down protects consumers as soon as it is up.
``unix://`` URLs (the embedded Redis) are never a cluster and get a plain client.

Only commands are delegated (no pipelines, no pub/sub): that is all the gate, the
service's breaker reading and ``status`` use.

A ``REDIS_URL`` that can never work is a configuration error where it is first used (exit
2, naming ``REDIS_URL``, never its password), not an outage to fail open through for the
whole run: an option redis-py cannot take (:func:`check_url_options`, with the other checks
of the variable), and at start-up a password or user Redis refuses, a user whose ACL lacks
a command, a read-only replica, a TLS certificate not verified or a TLS file that cannot be
read (:func:`refuse_misconfigured`). A Redis that cannot be reached, or does not answer in
time, is an outage, at start-up as later.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    NoPermissionError,
    RedisClusterException,
    RedisError,
    ResponseError,
)

from .errors import ConfigError

log = logging.getLogger(__name__)

# Connection options that mean the same to both clients (the others, such as a retry
# policy, belong to the single-node connection pool only).
_SHARED_OPTIONS = ("socket_connect_timeout", "socket_timeout", "health_check_interval")


class ClusterAwareRedis(Redis):
    """A :class:`Redis` that turns into a cluster client if its node is a cluster node.

    Build it with :func:`client_for`. Every command method of :class:`Redis` ends in
    :meth:`execute_command`, which is the one place that chooses the client.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._url = ""
        self._cluster_options: dict[str, Any] = {}
        self._cluster: RedisCluster | None = None
        self._single_node = False
        self._detecting = asyncio.Lock()

    @property
    def cluster_client(self) -> RedisCluster | None:
        """The cluster client, once the node is known to be a cluster node."""
        return self._cluster

    @property
    def is_cluster(self) -> bool | None:
        """True for a cluster, False for a single node, None while not known."""
        if self._cluster is not None:
            return True
        return False if self._single_node else None

    async def detect(self) -> bool:
        """Find out (once) whether the node is a cluster node. Raises what Redis raised
        when it cannot be reached (nothing is decided then), and :class:`ConfigError`
        when a cluster URL names a database other than 0."""
        async with self._detecting:
            if self.is_cluster is None:
                try:
                    await self._on_this_node("CLUSTER INFO")
                except ResponseError as exc:
                    if "cluster mode" in str(exc):  # the URL's SELECT, refused by a cluster
                        raise ConfigError(
                            "REDIS_URL",
                            "names a Redis Cluster node, and a cluster has only database 0 "
                            "(end the URL with /0 or no database)",
                        ) from None
                    refuse_missing_database(exc)
                    self._single_node = True
                else:
                    self._cluster = self._make_cluster()
        return self._cluster is not None

    def _make_cluster(self) -> RedisCluster:
        try:
            return RedisCluster.from_url(self._url, **self._cluster_options)
        except RedisClusterException as exc:
            # The only option a URL can carry that a cluster refuses is a database number.
            raise ConfigError(
                "REDIS_URL", f"names a Redis Cluster node, which cannot be used as given: {exc}"
            ) from None

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        if self.is_cluster is None:
            await self.detect()
        if self._cluster is not None:
            return await self._cluster.execute_command(*args, **options)
        return await self._on_this_node(*args, **options)

    async def _on_this_node(self, *args: Any, **options: Any) -> Any:
        # redis-py leaves execute_command untyped; name the type it has.
        command: Callable[..., Awaitable[Any]] = super().execute_command
        return await command(*args, **options)

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        if self._cluster is not None:
            await self._cluster.aclose()
        await super().aclose(close_connection_pool)


def refuse_missing_database(exc: ResponseError) -> None:
    """The URL's SELECT refused: never cured by waiting, so a configuration error rather
    than an outage to fail open through for the whole run."""
    if "DB index is out of range" in str(exc):
        raise ConfigError("REDIS_URL", MISSING_DATABASE) from None


MISSING_DATABASE = (
    "names a database this Redis does not have (its `databases` setting; 16 by default: 0 to 15)"
)


def client_for(url: str, **options: Any) -> Redis:
    """A client for ``url``: a :class:`ClusterAwareRedis` for ``redis://`` and
    ``rediss://`` URLs, a plain :class:`Redis` for ``unix://`` ones. ``options`` are
    :meth:`Redis.from_url`'s; the timeouts and health checks apply to a cluster too."""
    if url.startswith("unix://"):
        return Redis.from_url(url, **options)
    client = ClusterAwareRedis.from_url(url, **options)
    assert isinstance(client, ClusterAwareRedis)
    client._url = url
    client._cluster_options = {k: options[k] for k in _SHARED_OPTIONS if k in options}
    return client


async def detect_cluster(client: Redis, timeout_s: float) -> bool | None:
    """Whether ``client`` talks to a Redis Cluster: True, False, or None when Redis did not
    answer within ``timeout_s`` (the next command asks again). Raises :class:`ConfigError`
    for a cluster URL that a cluster cannot serve."""
    if not isinstance(client, ClusterAwareRedis):  # unix://: never a cluster
        try:
            async with asyncio.timeout(timeout_s):
                await client.ping()
        except ResponseError as exc:
            refuse_missing_database(exc)
            refuse_misconfigured(exc, client.connection_pool.connection_kwargs)
        except Exception as exc:  # unreachable: the gate fails open, as for a TCP URL
            refuse_misconfigured(exc, client.connection_pool.connection_kwargs)
        return False
    try:
        async with asyncio.timeout(timeout_s):
            found = await client.detect()
    except ConfigError:
        raise
    except Exception as exc:  # unreachable: the gate fails open and the next command asks again
        refuse_misconfigured(exc, client.connection_pool.connection_kwargs)
        return None
    if found:
        log.info("REDIS_URL names a node of a Redis Cluster: the gate follows its slot map")
    return found


# The TLS files a rediss:// URL may name (redis-py's options), read at each connection.
TLS_FILE_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_ca_path")
# An ACL refusal inside a script: NOPERM (Redis 7.2+), or before it an ERR in these words.
_DENIED_IN_SCRIPT = re.compile(r"NOPERM|no permissions|can't run this command|can't access")
_UNKNOWN_OPTION = re.compile(r"unexpected keyword argument '([^']+)'")
# Where the operator finds the ACL, TLS and memory settings the gate needs.
REDIS_DOCS = "docs/operations.md, section Redis"


def check_url_options(url: str) -> None:
    """Refuse a ``REDIS_URL`` whose query options redis-py cannot use (an unknown option, a
    value of the wrong type, an ``ssl_cert_reqs`` it does not know) with a
    :class:`ConfigError`, before anything connects: redis-py would raise a ``TypeError`` or
    a ``ValueError`` from deep inside the first connection."""
    from redis.asyncio.connection import ConnectionPool

    try:
        pool = ConnectionPool.from_url(url)
        pool.connection_class(**pool.connection_kwargs)  # checks the options, connects nothing
    except (TypeError, ValueError, RedisError) as exc:
        text = _first_line(exc)
        unknown = _UNKNOWN_OPTION.search(text)
        if unknown:
            name = unknown.group(1)
            tls = name.startswith("ssl_") and not url.startswith("rediss://")
            why = f"has an option redis-py does not know here: {name}" + (
                " (the TLS options need a rediss:// URL)" if tls else ""
            )
        elif "Invalid SSL Certificate Requirements" in text:
            why = "ssl_cert_reqs must be none, optional or required"
        else:
            why = f"has an option redis-py cannot use: {text.rstrip('.')}"
        raise ConfigError("REDIS_URL", _scrubbed(why, url)) from None


def misconfiguration(exc: BaseException, options: Mapping[str, Any]) -> str | None:
    """What is wrong with ``REDIS_URL`` when ``exc`` (a failed first call) says it can
    never work, waiting or not; None for an outage (refused, reset, timed out), which may
    pass. ``options`` are the client's connection options (its TLS files; its password,
    which the text never holds)."""
    secret = str(options.get("password") or "")
    if isinstance(exc, ResponseError) and "DB index is out of range" in str(exc):
        return MISSING_DATABASE
    if isinstance(exc, (AuthenticationError, AuthenticationWrongNumberOfArgsError)):
        if not secret:
            return (
                "Redis asks for a password and REDIS_URL gives none: write it in the URL"
                " (redis://:PASSWORD@host:6379/0, or redis://USER:PASSWORD@... for an ACL"
                f" user; {REDIS_DOCS})"
            )
        why = _first_line(exc, secret) or "its credentials were refused"
        return (
            f"Redis refused the user name or password ({type(exc).__name__}: {why}); check"
            " the credentials in REDIS_URL"
        )
    denied = next((c for c in _causes(exc) if acl_denied(c)), None)
    if denied is not None:  # redis-py's cluster client wraps it (CLUSTER SLOTS refused)
        return (
            f"the Redis user may not run a command it needs ({_first_line(denied, secret)}); "
            f"give it the ACL in {REDIS_DOCS}"
        )
    # A read-only replica (READONLY) is not one: during a failover the URL's name may
    # reach a replica for seconds; the gate fails open meanwhile and says so.
    for cause in _causes(exc):
        if isinstance(cause, ssl.SSLCertVerificationError):
            reason = cause.verify_message or cause.reason or str(cause)
            return (
                f"the Redis server's TLS certificate was not accepted ({reason}); name the CA"
                " that signed it with ?ssl_cert_reqs=required&ssl_ca_certs=/path/ca.pem "
                f"({REDIS_DOCS})"
            )
        if isinstance(cause, (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)):
            return None  # the connection went away during the handshake: an outage
        if isinstance(cause, ssl.SSLError):
            return (
                f"TLS to Redis cannot be set up ({cause.reason or _first_line(cause)}); check "
                "ssl_certfile, ssl_keyfile and ssl_ca_certs"
            )
        if isinstance(cause, OSError) and not isinstance(cause, ConnectionError):
            unreadable = _unreadable_tls_files(options)
            if unreadable:
                return "names TLS files that cannot be read: " + ", ".join(unreadable)
    if isinstance(exc, RedisError) and "Invalid SSL Certificate Requirements" in str(exc):
        return "ssl_cert_reqs must be none, optional or required"
    return None


def acl_denied(exc: BaseException) -> bool:
    """Whether ``exc`` is the user's ACL refusing a command (or a key), as a command's
    answer (NOPERM) or inside a script (an ERR before Redis 7.2)."""
    return isinstance(exc, NoPermissionError) or (
        isinstance(exc, ResponseError) and _DENIED_IN_SCRIPT.search(str(exc)) is not None
    )


def refuse_misconfigured(exc: BaseException, options: Mapping[str, Any]) -> None:
    """Raise a :class:`ConfigError` naming ``REDIS_URL`` when ``exc`` says it can never
    work (see :func:`misconfiguration`); return for an outage."""
    problem = misconfiguration(exc, options)
    if problem is not None:
        raise ConfigError("REDIS_URL", problem) from None


async def check_usable(
    url: str, reads: Sequence[Sequence[str | int]] = (), timeout_s: float = 2.0
) -> None:
    """For a command that reads Redis (``api``, ``status``): connect to ``url``, send
    ``PING`` and ``reads`` (whole commands), and raise a :class:`ConfigError` for what
    says ``REDIS_URL`` can never work (:func:`misconfiguration`). An outage passes: the
    command reports it as before."""
    client = client_for(url, socket_connect_timeout=timeout_s / 2, socket_timeout=timeout_s / 2)
    send: Callable[..., Awaitable[Any]] = client.execute_command  # untyped in redis-py
    try:
        async with asyncio.timeout(timeout_s):
            await client.ping()
            for command in reads:
                await send(*command)
    except ConfigError:
        raise
    except Exception as exc:
        refuse_misconfigured(exc, client.connection_pool.connection_kwargs)
    finally:
        await client.aclose()


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it was raised from (redis-py wraps the socket's and ssl's errors)."""
    found: list[BaseException] = []
    at: BaseException | None = exc
    while at is not None and at not in found and len(found) < 8:
        found.append(at)
        at = at.__cause__ or at.__context__
    return found


def _unreadable_tls_files(options: Mapping[str, Any]) -> list[str]:
    out = []
    for name in TLS_FILE_OPTIONS:
        path = options.get(name)
        if not isinstance(path, str) or not path:
            continue
        wanted = os.R_OK | (os.X_OK if name == "ssl_ca_path" else 0)
        if not os.access(path, wanted):
            why = "no such file" if not os.path.exists(path) else "not readable"
            out.append(f"{name}={path} ({why})")
    return out


def _first_line(exc: BaseException, secret: str = "") -> str:
    text = (str(exc).strip().splitlines() or [""])[0]
    return text.replace(secret, "***") if secret else text


def _scrubbed(text: str, url: str) -> str:
    from urllib.parse import urlsplit

    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    return text.replace(password, "***") if password else text
