"""The delivery gate on Redis: the retry rate limit and the circuit breaker, shared by all
dispatcher instances, at one round trip per batch.

``admit`` runs one Lua script (breaker check, then rate limit, for the whole batch) and
``report`` runs another (breaker bookkeeping); both read the Redis server's clock, so the
instances agree on time. A report of nothing but successes admitted while the breaker
was closed with no failure on record (``Admission.clean``) would change nothing and is
not sent: a healthy consumer costs one round trip per batch, not two. The scripts live
in ``lua/*.lua`` and are composed and loaded once.

Keys, per consumer URL (``<digest>`` is the full SHA-256 hex digest of the URL, the only
form of a URL in Redis; the braces make one URL's keys share a Redis Cluster hash slot, so
each script touches one slot):

- ``{prefix}webhook_rl:{<digest>}``: the retry limit, a sliding-window log. A sorted set
  with one member per outbound attempt, scored by the Redis server's clock in ms. First
  attempts are recorded but never refused; a retry is refused while the window already
  holds ``limit`` attempts. It expires one window after its last member was added.
- ``{prefix}webhook_cb:{<digest>}``: the circuit breaker, a hash with ``state``
  (``closed``, ``open``, ``half-open``), ``failures`` (consecutive retryable failures
  while closed), ``reset_at`` (server ms when an open circuit may be probed) and
  ``probe`` (the token of the current half-open probe's owner, ``""`` when none). A
  missing hash means closed with no failures: closing deletes it, so healthy consumers
  cost nothing; a stored hash expires ``reset_ms`` + one day after its last change.
- ``{prefix}webhook_cb_probe:{<digest>}``: the half-open probe lease, taken with ``SET NX
  PX probe_ttl`` and holding the owner's token: exactly one attempt across all instances
  probes a half-open circuit, and a probe whose dispatcher crashed expires so a later one
  can probe again. Only the latest owner's report closes or re-opens a half-open circuit;
  while open, reports change nothing, so stragglers cannot extend ``reset_at``.

Redis is a protection, not a dependency: when it is down, slow or answers an error, the
gate fails open (``admit`` allows everything, ``report`` does nothing) and counts
``fluxora_webhook_redis_fail_open_total{component}``. An outage (no connection, a broken
one, no answer within the call's bound, a cluster without a master for the slot) is logged
once, and the gate leaves Redis alone for a short back-off, so an outage costs one timeout
per back-off period rather than one per batch; the first call after the back-off tries
again, and the gate protects again as soon as Redis answers. On a Redis Cluster all of this
is kept per node where the node cannot be reached, and per slot where the node answers but
refuses the call (a slot being migrated): either leaves every other consumer protected. An
answer that refuses one call (out of memory under ``noeviction``, an ACL refusal, a script
error, a key of another type) is no outage: that call goes ahead without the gate, the next
ones still ask Redis, and it is logged at most once a minute.

Connections: at most :data:`GATE_CONNECTIONS` of the gate's calls run at once on one Redis
node, each on a connection of its own, kept for the next call; more wait for one within
their own call's bound (a call that waits its whole bound goes ahead without the gate, and
is no outage either). Reports take at most ``GATE_CONNECTIONS - ADMIT_RESERVE`` of them, so
a batch's admit never queues behind a burst of reports. redis-py's pool raises at its own
cap rather than waiting, and a worker reporting on a hundred failing consumers at once
would otherwise hold a hundred connections.

At start-up (:func:`connect_gate`) a ``REDIS_URL`` that can never serve the gate stops the
command (:class:`~fluxora_webhooks.errors.ConfigError`): credentials refused, an ACL without
a command the scripts run, TLS not verified (see
:mod:`.redis_connect`); and a Redis that may evict the gate's keys is warned about.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ClusterError,
    MaxConnectionsError,
    MovedError,
    NoScriptError,
    OutOfMemoryError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from . import metrics
from .errors import ConfigError
from .gate import ALLOW, ALLOW_CLEAN, ANSWERED, Admission, AdmitCode, AdmitRequest, Signal
from .logs import Notice
from .redis_connect import (
    REDIS_DOCS,
    ClusterAwareRedis,
    acl_denied,
    client_for,
    detect_cluster,
    misconfiguration,
    refuse_misconfigured,
)
from .settings import Settings
from .urlpolicy import redacted

log = logging.getLogger(__name__)

T = TypeVar("T")

# Client defaults of connect_gate: a gate check must never hold a batch for long.
CONNECT_TIMEOUT_S = 0.25
SOCKET_TIMEOUT_S = 0.5
HEALTH_CHECK_INTERVAL_S = 10
# Each gate call's bound (waiting for a connection included), and how long the gate leaves
# a node alone after an outage.
CALL_TIMEOUT_MS = 750
FAILURE_BACKOFF_MS = 1000
# At most this many gate calls at once per Redis node, each on a connection of its own;
# reports leave ADMIT_RESERVE of them to admits.
GATE_CONNECTIONS = 8
ADMIT_RESERVE = 2
# A refused call (not an outage) is logged at most once per this many seconds.
NOTICE_INTERVAL_S = 60.0
# A half-open probe's lease outlives its attempt's timeout by this much.
PROBE_MARGIN_MS = 5_000

RATE_LIMIT_KEY = "webhook_rl:"
BREAKER_KEY = "webhook_cb:"
PROBE_KEY = "webhook_cb_probe:"

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half-open"

# The retry limit's window: WEBHOOK_RETRY_RPS attempts per this many milliseconds.
RATE_WINDOW_MS = 1000
# How long a breaker hash outlives its last change, beyond reset_ms.
STATE_IDLE_TTL_MS = 86_400_000


def url_digest(url: str) -> str:
    """The full SHA-256 hex digest of the full URL: the only form of a URL in Redis keys."""
    return hashlib.sha256(url.encode("utf-8", "surrogatepass")).hexdigest()


@functools.lru_cache(maxsize=16_384)
def hash_tagged(prefix: str, name: str, url: str) -> str:
    """``{prefix}{name}{<digest>}``: the braces make a URL's keys share a Cluster slot.
    Kept for the URLs in use (three keys each): a batch that fans out to a hundred
    endpoints asks for three hundred keys, a digest each."""
    return f"{prefix}{name}{{{url_digest(url)}}}"


def rate_limit_key(url: str, prefix: str = "") -> str:
    """The sorted set of the attempts sent to ``url`` within the last window."""
    return hash_tagged(prefix, RATE_LIMIT_KEY, url)


# A result's outcome as breaker.lua's cb_record takes it.
_OUTCOME_ARG: dict[Signal, str] = {True: "1", False: "0", ANSWERED: "a", None: "-"}


def breaker_key(url: str, prefix: str = "") -> str:
    """The hash holding the breaker state of ``url``."""
    return hash_tagged(prefix, BREAKER_KEY, url)


def probe_key(url: str, prefix: str = "") -> str:
    """The half-open probe lease of ``url``."""
    return hash_tagged(prefix, PROBE_KEY, url)


@dataclass(frozen=True, slots=True)
class BreakerState:
    """A snapshot of one consumer's breaker, for operators and tests."""

    state: str = CLOSED
    failures: int = 0
    reset_at_ms: int = 0
    probe_token: str = ""


async def read_breaker_state(redis: Any, url: str, prefix: str = "") -> BreakerState:
    """Read the stored state of ``url``'s breaker (closed when nothing is stored)."""
    raw: dict[Any, Any] = await redis.hgetall(breaker_key(url, prefix))
    fields = {_text(k): _text(v) for k, v in raw.items()}
    state = fields.get("state", CLOSED)
    return BreakerState(
        state=state if state in (OPEN, HALF_OPEN) else CLOSED,
        failures=int(fields.get("failures") or 0),
        reset_at_ms=int(fields.get("reset_at") or 0),
        probe_token=fields.get("probe", ""),
    )


# Keys the start-up check reads in random slots: a node that owns a third of the slots
# (three masters) serves all of them once in 43 million checks; half, once in 65,536.
_SLOT_PROBES = 16


def _cluster_info_refused() -> ConfigError:
    return ConfigError(
        "REDIS_URL",
        "names a node of a Redis Cluster (it answered MOVED) whose user may not "
        "run CLUSTER INFO: give it +cluster|info +cluster|slots +command as well "
        f"({REDIS_DOCS})",
    )


@cache
def lua_script(name: str) -> str:
    """The source of ``lua/<name>.lua`` with what it uses: the admit codes as constants,
    the server clock, and the breaker and rate-limit functions. Read once."""
    folder = resources.files("fluxora_webhooks").joinpath("lua")
    codes = "".join(f"local {code.name} = {int(code)}\n" for code in AdmitCode)
    parts = [codes] + [
        folder.joinpath(f"{part}.lua").read_text("utf-8")
        for part in ("clock", "breaker", "ratelimit", name)
    ]
    return "\n".join(parts)


class RedisGate:
    """A :class:`~fluxora_webhooks.gate.DeliveryGate` shared through Redis.

    ``retry_rps`` retries are allowed per ``window_ms`` per consumer URL (first attempts
    are counted, never refused). ``breaker_threshold`` consecutive retryable failures open
    the circuit for ``breaker_reset_ms``; 0 disables the breaker. ``probe_ttl_ms`` bounds
    how long a half-open probe may hold its lease (longer than one HTTP attempt).
    ``prefix`` goes before every key. ``timeout_ms`` bounds each Redis call (its wait for a
    connection included), ``failure_backoff_ms`` is how long the gate fails open without
    trying Redis after an outage. ``connections``: at most this many calls at once per Redis
    node (fewer when the client's pool is small: half its cap). Each call that fails open
    counts once in ``REDIS_FAIL_OPEN``, labelled
    ``gate`` (admit, breaker on), ``ratelimit`` (admit, breaker off) or ``breaker``
    (report).

    The gate does not close a client it was given; :func:`connect_gate` makes a gate that
    owns (and closes) its client.
    """

    def __init__(
        self,
        redis: Redis,
        *,
        retry_rps: int,
        breaker_threshold: int,
        breaker_reset_ms: int,
        probe_ttl_ms: int,
        prefix: str = "",
        window_ms: int = RATE_WINDOW_MS,
        timeout_ms: int = CALL_TIMEOUT_MS,
        failure_backoff_ms: int = FAILURE_BACKOFF_MS,
        connections: int = GATE_CONNECTIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value, low in (
            ("retry_rps", retry_rps, 1),
            ("breaker_threshold", breaker_threshold, 0),
            ("breaker_reset_ms", breaker_reset_ms, 1),
            ("probe_ttl_ms", probe_ttl_ms, 1),
            ("window_ms", window_ms, 1),
            ("timeout_ms", timeout_ms, 1),
            ("failure_backoff_ms", failure_backoff_ms, 0),
            ("connections", connections, 1),
        ):
            if value < low:
                raise ValueError(f"{name} must be at least {low}, got {value}")
        if "{" in prefix or "}" in prefix:
            # A brace in the prefix would change the hash tag and split a URL's keys
            # across Cluster slots, breaking the scripts.
            raise ValueError("the Redis key prefix must not contain '{' or '}'")
        self._redis = redis
        self._owns_client = False
        self.retry_rps = retry_rps
        self.breaker_threshold = breaker_threshold
        self.breaker_reset_ms = breaker_reset_ms
        self.probe_ttl_ms = probe_ttl_ms
        self.prefix = prefix
        self.window_ms = window_ms
        self._timeout_s = timeout_ms / 1000
        self._state_ttl_ms = breaker_reset_ms + STATE_IDLE_TTL_MS
        self._admit_script = redis.register_script(lua_script("admit"))
        self._report_script = redis.register_script(lua_script("report"))
        self._direct = _DirectScripts(redis)
        password = redis.connection_pool.connection_kwargs.get("password")
        self._outages = _Outages(failure_backoff_ms / 1000, clock, str(password or ""))
        self._config_error_logged = False
        # redis-py's pool raises at its cap (100 unless the URL says): stay well below it.
        pool_cap = getattr(redis.connection_pool, "max_connections", None)
        if isinstance(pool_cap, int) and pool_cap > 0:
            connections = min(connections, max(1, pool_cap // 2))
        self.connections = connections
        self._lanes: dict[str, _Lanes] = {}
        self._refused = Notice(NOTICE_INTERVAL_S, clock)
        self._busy = Notice(NOTICE_INTERVAL_S, clock)
        # The probes of failing nodes, off the deliveries' path (_call): one per node at once.
        self._retrying: dict[str, asyncio.Task[None]] = {}
        # The ids of the endpoints a URL serves, for the breaker's transition lines (set by
        # the service to read its dispatcher's endpoints; None: the scheme and host only).
        self.endpoints_of: EndpointsOf | None = None

    @property
    def available(self) -> bool:
        """False from a failed Redis call until the next successful one (on a cluster:
        while any node's or slot's calls fail)."""
        return not self._outages.down

    def _places(self, key: str | None) -> tuple[str, int | None]:
        """Where a call on ``key`` goes: its cluster node's ``host:port`` and slot, or ""
        and None (a single node, or a cluster whose slot map is not known yet)."""
        cluster = self._cluster_client()
        if cluster is None or key is None:
            return "", None
        try:
            slot = cluster.keyslot(key)
            node = cluster.get_node_from_key(key)
        except Exception:  # no slot map yet, or the slot not covered: the whole cluster
            return "", None
        return ("", None) if node is None else (node.name, slot)

    def _cluster_client(self) -> RedisCluster | None:
        client = self._redis
        if isinstance(client, ClusterAwareRedis):
            return client.cluster_client
        return client if isinstance(client, RedisCluster) else None

    async def admit(
        self, url: str, attempts: Sequence[int], *, limit: int | None = None
    ) -> list[Admission]:
        """``limit``: this URL's retries per window (an endpoint's ``rate_limit``), else
        ``retry_rps``."""
        if not attempts:
            return []
        return (await self._admit([AdmitRequest(url, attempts, limit)]))[0]

    async def admit_many(self, requests: Sequence[AdmitRequest]) -> list[list[Admission]]:
        """Several URLs' decisions in one script call on a single Redis node (a batch with
        rows for many endpoints costs one round trip, not one per URL); on a Redis Cluster
        (or before it is known which), one call per URL, concurrently."""
        if len(requests) <= 1 or self._single_node():
            return await self._admit(requests) if requests else []
        return [
            decided[0] for decided in await asyncio.gather(*(self._admit([r]) for r in requests))
        ]

    async def _admit(self, requests: Sequence[AdmitRequest]) -> list[list[Admission]]:
        """One admit script call for ``requests``, whose keys must all live on one node."""
        token = secrets.token_hex(8)
        keys: list[str] = []
        args: list[str | int] = [
            self.window_ms,
            self.breaker_threshold,
            self.breaker_reset_ms,
            self.probe_ttl_ms,
            self._state_ttl_ms,
            token,
        ]
        for r in requests:
            keys += [
                rate_limit_key(r.url, self.prefix),
                breaker_key(r.url, self.prefix),
                probe_key(r.url, self.prefix),
            ]
            args += [r.limit or self.retry_rps, len(r.attempts)]
            args.extend("1" if attempt > 1 else "0" for attempt in r.attempts)
        component = "gate" if self.breaker_threshold > 0 else "ratelimit"
        counts = [len(r.attempts) for r in requests]
        decided = await self._call(
            component,
            self._admit_script,
            keys,
            args,
            lambda reply: _decode_admit(reply, token, counts),
        )
        if decided is None:
            return [[ALLOW] * n for n in counts]
        for r, (admissions, transition) in zip(requests, decided, strict=True):
            _counted(r.url, admissions, transition, self.endpoints_of)
        return [admissions for admissions, _ in decided]

    def _single_node(self) -> bool:
        """Whether every key lives on one Redis server (not a Cluster, and known not to be)."""
        client = self._redis
        if isinstance(client, ClusterAwareRedis):
            return client.is_cluster is False
        return not isinstance(client, RedisCluster)

    async def report(self, url: str, results: Sequence[tuple[Admission, Signal]]) -> None:
        if self.breaker_threshold <= 0:
            return
        args: list[str | int] = [self.breaker_threshold, self.breaker_reset_ms, self._state_ttl_ms]
        changes = False  # whether recording these can change the breaker
        for admission, outcome in results:
            if not admission.allowed or (
                (outcome is None or outcome == ANSWERED) and not admission.probe
            ):
                # Nothing to record: a 4xx neither counts as a failure nor ends a streak;
                # a probe's still releases its lease (and an answer closes the breaker).
                continue
            args.append(_OUTCOME_ARG[outcome])
            args.append(admission.probe_token if admission.probe else "")
            changes = changes or not (outcome is True and admission.clean)
        if not changes:
            # Nothing, or only successes admitted while the breaker was closed with no
            # failure: they would leave it as it is (no hash at all), so no round trip.
            # A failure another instance records between that admission and now is not
            # reset by these successes; the next success admitted after it resets it.
            return
        keys = [breaker_key(url, self.prefix), probe_key(url, self.prefix)]
        transitions = await self._call(
            "breaker", self._report_script, keys, args, _decode_transitions
        )
        for from_state, to_state in transitions or ():
            _count_transition(url, from_state, to_state, self.endpoints_of)

    async def _probe_node(self, node: str, key: str) -> None:
        """Whether a failing node serves the gate's keys again (bounded; :meth:`_call`): it
        is then used. An ``EXISTS`` of the key the call was for, which changes nothing and
        is routed as the scripts are: a cluster node that answers ``PING`` but whose cluster
        is down answers it ``CLUSTERDOWN``, as it would the scripts."""
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._redis.exists(key)
        except Exception as exc:
            self._failed(node, None, exc)
            return
        self._outages.answered(node, None)

    async def ping(self) -> bool:
        """Whether Redis answers now (bounded, never raises); updates the outage state."""
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._redis.ping()
        except Exception as exc:
            self._failed("", None, exc)
            return False
        self._outages.answered("", None)
        return True

    async def check_at_start(self) -> None:
        """Whether this Redis can serve the gate as configured, asked once at start-up
        (bounded; a Redis that does not answer passes: the gate fails open until it does).
        Raises :class:`ConfigError` (``REDIS_URL``) for credentials refused, an ACL without
        a command the scripts run (each one named), TLS not verified; a Redis that refuses
        writes for now (out of memory; a read-only replica, a failover's seconds) is
        logged, not refused."""
        options = self._redis.connection_pool.connection_kwargs
        tag = f"{{fluxora-check-{secrets.token_hex(8)}}}"
        keys = [f"{self.prefix}{name}{tag}" for name in (RATE_LIMIT_KEY, BREAKER_KEY, PROBE_KEY)]
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._redis.ping()
                # Loaded whether or not Redis has it: the gate loads its scripts again after
                # a restart of Redis or a SCRIPT FLUSH, so SCRIPT LOAD must be allowed.
                sha = await self._redis.script_load(lua_script("check"))
                breaker = 1 if self.breaker_threshold > 0 else 0
                reply = await self._redis.evalsha(sha, len(keys), *keys, breaker)
        except ConfigError:
            raise
        except Exception as exc:
            refuse_misconfigured(exc, options)
            if isinstance(exc, MovedError) and self._single_node():
                raise _cluster_info_refused() from None
            if not _outage(exc):  # an answer that refused (an outage is said by ping below)
                log.warning(
                    "Redis refused the delivery gate's start-up check (%s)%s",
                    self._outages.describe(exc),
                    _OOM_HINT if isinstance(exc, OutOfMemoryError) else "",
                )
            return
        if self._single_node():
            await self._refuse_a_cluster_taken_for_one_redis()
        refused = _decode_transitions(reply)  # (command, error) pairs
        denied = [name for name, error in refused if acl_denied(ResponseError(error))]
        if denied:
            raise ConfigError(
                "REDIS_URL",
                f"the Redis user may not run {', '.join(sorted(set(denied)))} (its ACL), which "
                f"the delivery gate needs; give it the ACL in {REDIS_DOCS}",
            )
        for _, error in refused:
            problem = misconfiguration(ResponseError(error), options)
            if problem is not None:
                raise ConfigError("REDIS_URL", problem)
        if refused:
            log.warning(
                "Redis refuses the delivery gate's writes (%s: %s); until it accepts them, "
                "each refused call goes ahead without the gate%s",
                refused[0][0],
                self._outages.describe(ResponseError(refused[0][1])),
                _OOM_HINT if any(e.startswith("OOM") for _, e in refused) else "",
            )

    async def _refuse_a_cluster_taken_for_one_redis(self) -> None:
        """A cluster node whose user may not run ``CLUSTER INFO`` is taken for a single
        Redis, and answers ``MOVED`` for the keys of other nodes' slots: the check's own
        keys may all be on this node, so read keys in slots spread over the whole range
        (``ZCARD``, a command the gate needs, on keys of its own); any ``MOVED`` stops
        start-up. A node serving every one of them serves every slot there is, in practice."""
        for _ in range(_SLOT_PROBES):
            key = f"{self.prefix}{RATE_LIMIT_KEY}{{fluxora-check-{secrets.token_hex(8)}}}"
            try:
                async with asyncio.timeout(self._timeout_s):
                    await self._redis.zcard(key)
            except MovedError:
                raise _cluster_info_refused() from None
            except Exception:  # not ours to judge here: the script's check said it
                return

    async def warn_if_evicting(self) -> None:
        """Log one warning when this Redis may evict the gate's keys (``maxmemory`` set and
        a ``maxmemory-policy`` other than ``noeviction``): an evicted rate-limit window or
        breaker silently lets attempts through, with no fail-open counted. ``CONFIG`` may
        be refused (a managed Redis, an ACL without it): then nothing is said."""
        try:
            async with asyncio.timeout(self._timeout_s):
                found = await self._redis.config_get("maxmemory*")
        except Exception as exc:
            log.debug("Redis's eviction policy not read: %s", self._outages.describe(exc))
            return
        values = {_text(k): _text(v) for k, v in dict(found).items()}
        policy = values.get("maxmemory-policy", "")
        limit = values.get("maxmemory", "0")
        if policy and policy != "noeviction" and limit.isdigit() and int(limit) > 0:
            log.warning(
                "Redis may evict the delivery gate's keys (maxmemory %s bytes, "
                "maxmemory-policy %s): an evicted rate-limit window or circuit breaker "
                "silently lets attempts through (no fail-open is counted); give the gate "
                "maxmemory-policy noeviction, or a Redis of its own with enough memory (%s)",
                limit,
                policy,
                REDIS_DOCS,
            )

    async def close(self) -> None:
        retrying = list(self._retrying.values())
        for task in retrying:
            task.cancel()
        await asyncio.gather(*retrying, return_exceptions=True)
        await self._direct.close()
        if self._owns_client:
            await self._redis.aclose()

    def _lanes_of(self, node: str) -> _Lanes:
        lanes = self._lanes[node] = _Lanes(self.connections)
        return lanes

    async def _call(
        self,
        component: str,
        script: AsyncScript,
        keys: list[str],
        args: list[str | int],
        decode: Callable[[Any], T],
    ) -> T | None:
        """Run one script (one EVALSHA); ``None`` (fail open, counted) on any failure. A
        report (``component`` "breaker") leaves some of the node's connections to admits.

        A node that failed is tried again off the deliveries' path: once its back-off has
        passed, this call goes ahead without the gate at once, and a probe of the node (an
        ``EXISTS`` of this call's key), in the background, finds out whether it serves the
        gate again (the next calls use it then).
        Tried inline, every try would hold a batch for the whole bound while the node is
        still down (a dead cluster node would slow the consumers of every other node: their
        admits are gathered with its own). The probe changes nothing: a call given up is
        never applied later. (A slot its node refuses, for a migration's moments, is tried
        inline: its node answers at once.)"""
        node, slot = self._places(keys[0])
        node_failing = self._outages.node_failing(node)
        if not self._outages.should_try(node, slot):
            metrics.REDIS_FAIL_OPEN.labels(component=component).inc()
            return None
        if node_failing:
            metrics.REDIS_FAIL_OPEN.labels(component=component).inc()
            if node not in self._retrying:
                task = asyncio.create_task(self._probe_node(node, keys[0]))
                self._retrying[node] = task
                task.add_done_callback(lambda _: self._retrying.pop(node, None))
            return None
        lanes = self._lanes.get(node) or self._lanes_of(node)
        first = lanes.reports if component == "breaker" else None
        held = 0  # 1: a report's lane; 2: a connection of the node's (the call runs)
        try:
            async with asyncio.timeout(self._timeout_s):
                if first is not None:
                    await first.acquire()
                    held = 1
                await lanes.calls.acquire()
                held = 2
                if self._single_node():
                    reply = await self._direct.run(script, keys, args)
                else:
                    reply = await script(keys=keys, args=args)
                result = decode(reply)
        except Exception as exc:  # any failure: deliveries must go on without the gate
            if held < 2:
                self._waited_out(component)
            else:
                self._failed(node, slot, exc)
            metrics.REDIS_FAIL_OPEN.labels(component=component).inc()
            return None
        finally:
            if held == 2:
                lanes.calls.release()
            if held and first is not None:
                first.release()
        self._outages.answered(node, slot)
        return result

    def _waited_out(self, component: str) -> None:
        """A call that waited its whole bound for one of the node's connections: the calls
        holding them say what Redis does (a timeout among them is an outage)."""
        said = self._busy.due()
        if said is not None:
            log.warning(
                "the delivery gate's %d connections to Redis were all busy for %d ms: a %s "
                "call went ahead without the gate%s",
                self.connections,
                round(self._timeout_s * 1000),
                component,
                _unsaid(said),
            )

    def _failed(self, node: str, slot: int | None, exc: BaseException) -> None:
        if isinstance(exc, ConfigError):
            # REDIS_URL cannot be used as given, found out only now (its node did not answer
            # at start-up, which a wrong URL does not stop): said once, as what it is.
            if not self._config_error_logged:
                self._config_error_logged = True
                log.error(
                    "%s; the delivery gate fails open (no rate limit, no circuit breaker) "
                    "until the dispatcher is restarted with a usable REDIS_URL",
                    self._outages.describe(exc),
                )
            self._outages.failed(node, None, exc, quiet=True)
            return
        if _slot_only(exc):
            self._outages.failed(node, slot, exc)
        elif _outage(exc):
            self._outages.failed(node, None, exc)
        else:
            self._refused_call(node, slot, exc)

    def _refused_call(self, node: str, slot: int | None, exc: BaseException) -> None:
        """Redis answered and refused this one call (out of memory, an ACL refusal, a script
        error), or the client's pool was at its cap: no outage, so the gate does not stop
        asking Redis for its back-off (the rate limit would be off for every consumer)."""
        if not isinstance(exc, MaxConnectionsError):
            self._outages.answered(node, slot)  # Redis is there: it answered
        said = self._refused.due()
        if said is not None:
            log.warning(
                "Redis%s refused a delivery gate call (%s); that call went ahead without the "
                "gate, the next ones still ask Redis%s%s",
                f" at {node}" if node else "",
                self._outages.describe(exc),
                _OOM_HINT if isinstance(exc, OutOfMemoryError) else "",
                _unsaid(said),
            )


async def connect_gate(
    redis_url: str,
    *,
    retry_rps: int,
    breaker_threshold: int,
    breaker_reset_ms: int,
    probe_ttl_ms: int,
    prefix: str = "",
    window_ms: int = RATE_WINDOW_MS,
    timeout_ms: int = CALL_TIMEOUT_MS,
    failure_backoff_ms: int = FAILURE_BACKOFF_MS,
    warn_eviction: bool = True,
) -> RedisGate:
    """A :class:`RedisGate` with its own client (closed by :meth:`RedisGate.close`).

    The client has short connect and read timeouts, health checks idle connections, and
    retries a command once, at once, only when the connection broke (a stale pooled
    connection after a Redis restart). A Redis that is down at start is not an error:
    the gate starts failing open and picks Redis up when it comes. A Redis that answers
    but can never serve the gate (:meth:`RedisGate.check_at_start`) is a
    :class:`ConfigError`; one that may evict the gate's keys is warned about
    (``warn_eviction``). A URL that names a node of a Redis Cluster gets redis-py's
    cluster client (:mod:`.redis_connect`).
    """
    client = client_for(
        redis_url,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=SOCKET_TIMEOUT_S,
        health_check_interval=HEALTH_CHECK_INTERVAL_S,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )
    try:
        # A Redis Cluster node (see redis_connect); None: Redis did not answer.
        found = await detect_cluster(client, timeout_ms / 1000)
        gate = RedisGate(
            client,
            retry_rps=retry_rps,
            breaker_threshold=breaker_threshold,
            breaker_reset_ms=breaker_reset_ms,
            probe_ttl_ms=probe_ttl_ms,
            prefix=prefix,
            window_ms=window_ms,
            timeout_ms=timeout_ms,
            failure_backoff_ms=failure_backoff_ms,
        )
    except BaseException:
        await client.aclose()
        raise
    gate._owns_client = True
    try:
        if found is not None:
            await gate.check_at_start()
            if warn_eviction:
                await gate.warn_if_evicting()
        await gate.ping()
    except BaseException:
        await gate.close()
        raise
    return gate


class _DirectScripts:
    """The gate's script calls on a single Redis node, on connections of their own.

    redis-py's command path (packing each argument through its encoder, taking and giving
    back a pooled connection, its observability and event hooks, timing each write in a
    task of its own) cost the dispatcher 275-310 us of CPU per admit call of a batch of
    ten; this sends the same ``EVALSHA``, packed here, on a redis-py connection of the
    client's pool (its address, credentials, database, TLS and health checks) and reads
    the reply with that connection's parser: 155-170 us for the whole admit call. Each
    call has a connection to itself, as many as run at once (the claim loops' admits, the
    reports; at most the gate's ``connections`` on one node, see :class:`_Lanes`), taken from
    the client's pool once and kept until :meth:`close` (the pool also closes them with the
    client), with no socket timeout of their own: the gate's
    timeout bounds each whole call. A connection that broke is reconnected and the call
    sent once more at once, as the client's own retry does (a script call is safe to
    repeat: its members are unique per call); a server that does not know the script
    (restarted, ``SCRIPT FLUSH``) gets it through the client's script object, which loads
    it."""

    def __init__(self, client: Redis) -> None:
        self._client = client
        self._idle: list[Any] = []
        self._taken: list[tuple[Any, float | None]] = []  # each with the pool's timeout
        self._closed = False

    async def run(self, script: AsyncScript, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        packed = _pack_command(("EVALSHA", script.sha, len(keys), *keys, *args))
        conn = await self._take()
        try:
            return await self._send(conn, packed)
        except NoScriptError:
            pass
        finally:
            if not self._closed:
                self._idle.append(conn)
        return await script(keys=list(keys), args=list(args))

    async def _take(self) -> Any:
        if self._closed:
            raise RedisConnectionError("the delivery gate is closed")
        if self._idle:
            return self._idle.pop()
        pool: Any = self._client.connection_pool
        conn = await pool.get_connection()
        self._taken.append((conn, conn.socket_timeout))
        conn.socket_timeout = None
        return conn

    async def _send(self, conn: Any, packed: bytes) -> Any:
        for last in (False, True):
            try:
                await conn.send_packed_command(packed)
                return await conn.read_response()
            except (RedisConnectionError, OSError):
                await conn.disconnect(nowait=True)
                if last or self._closed:
                    raise
            except ResponseError:
                raise  # an answer (NOSCRIPT among them): the connection is in order
            except BaseException:
                # A timeout or a cancellation may leave the reply unread on the wire.
                await conn.disconnect(nowait=True)
                raise
        raise AssertionError("unreachable")

    async def close(self) -> None:
        """Give every connection back to the client's pool, closed (a call still running
        on one fails and fails open)."""
        self._closed = True
        taken, self._taken, self._idle = self._taken, [], []
        for conn, timeout in taken:
            await conn.disconnect()
            conn.socket_timeout = timeout  # the pool's again
            await self._client.connection_pool.release(conn)


def _pack_command(parts: Sequence[str | int]) -> bytes:
    """One RESP command (an array of bulk strings) of text and whole numbers."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        if isinstance(part, str):
            data = part.encode()
        elif type(part) is int:
            data = b"%d" % part
        else:
            raise TypeError(f"a script argument must be str or int, not {type(part).__name__}")
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class _Lanes:
    """The gate's calls at once on one Redis node: ``calls`` bounds them (each on a
    connection of its own), ``reports`` bounds the reports among them, so that admits always
    find a connection free of a burst of reports (a batch's reports go all at once)."""

    __slots__ = ("calls", "reports")

    def __init__(self, connections: int) -> None:
        self.calls = asyncio.Semaphore(connections)
        self.reports = asyncio.Semaphore(max(1, connections - ADMIT_RESERVE))


def _unsaid(count: int) -> str:
    if not count:
        return f" (said at most once a minute, counted in {_FAIL_OPEN_SERIES})"
    return f" ({count} more since this was last said; counted in {_FAIL_OPEN_SERIES})"


_FAIL_OPEN_SERIES = "fluxora_webhook_redis_fail_open_total"
_OOM_HINT = (
    ". Redis is out of memory (maxmemory, maxmemory-policy noeviction): until it has room it "
    "refuses the breaker's reports (failures go uncounted, no circuit opens); the rate limit "
    "still works"
)


def _outage(exc: BaseException) -> bool:
    """Whether a failed call says the node cannot serve anyone now: no connection, a broken
    one, no answer within the bound, Redis loading its data, a cluster that is down. An
    answer that refuses the call, and the client's own pool at its cap, are not."""
    if isinstance(exc, MaxConnectionsError):
        return False
    return isinstance(
        exc,
        (
            RedisConnectionError,
            RedisTimeoutError,
            TimeoutError,
            OSError,
            ClusterDownError,
            RedisClusterException,
        ),
    ) or (isinstance(exc, ClusterError) and not isinstance(exc, ResponseError))


def _slot_only(exc: BaseException) -> bool:
    """Whether a failed call says something of its slot only, not of its node: a slot
    being migrated (TRYAGAIN, ASK, or redis-py's redirections running out on them).
    Anything else is the node's: a connection error, a timeout (redis-py retries a node
    that went away past the gate's bound), CLUSTERDOWN, an error answer."""
    if isinstance(exc, (TryAgainError, AskError)):
        return True
    return isinstance(exc, ClusterError) and "TTL exhausted" in str(exc)


class _Outages:
    """Fail-open bookkeeping: the places whose calls fail, each with the time it may be
    tried again (a back-off between tries), one warning per outage. A place is a Redis
    node (``host:port``; "" for the one Redis, or a cluster whose slot map is not known
    yet) or a cluster slot that its node refuses; only failing places are kept, so this
    never grows with the keys in use. A node's refused slots are said once: when the
    first is refused, and when the last is served again."""

    def __init__(self, backoff_s: float, clock: Callable[[], float], secret: str) -> None:
        self._backoff_s = backoff_s
        self._clock = clock
        self._secret = secret
        self._nodes: dict[str, float] = {}
        self._slots: dict[tuple[str, int], float] = {}

    @property
    def down(self) -> bool:
        return bool(self._nodes or self._slots)

    def node_failing(self, node: str) -> bool:
        """Whether calls to this node failed last time (whatever its back-off)."""
        return bool(self._nodes) and node in self._nodes

    def should_try(self, node: str, slot: int | None) -> bool:
        if not (self._nodes or self._slots):
            return True  # the common case: nothing failing
        now = self._clock()
        # The slot's back-off first: a slot still waiting does not use up its node's try.
        key = (node, slot) if slot is not None else None
        slot_at = self._slots.get(key) if key is not None else None
        node_at = self._nodes.get(node)
        if (slot_at is not None and now < slot_at) or (node_at is not None and now < node_at):
            return False
        # This caller tries; concurrent callers keep failing open until it knows.
        if key is not None and slot_at is not None:
            self._slots[key] = now + self._backoff_s
        if node_at is not None:
            self._nodes[node] = now + self._backoff_s
        return True

    def failed(
        self, node: str, slot: int | None, exc: BaseException, *, quiet: bool = False
    ) -> None:
        retry_at = self._clock() + self._backoff_s
        if slot is not None:
            first = not self._refuses_slots(node)
            self._slots[(node, slot)] = retry_at
            if first and not quiet:
                log.warning(
                    "Redis at %s refuses the gate's calls for a slot (%s; a slot being "
                    "migrated?); the delivery gate fails open for that slot's consumers "
                    "until it answers",
                    node,
                    self.describe(exc),
                )
            return
        first = node not in self._nodes
        self._nodes[node] = retry_at
        if first and not quiet:
            log.warning(
                "Redis unavailable%s (%s); the delivery gate fails open (no rate limit, no "
                "circuit breaker) for the consumers it serves until it answers again",
                f" at {node}" if node else "",
                self.describe(exc),
            )

    def answered(self, node: str, slot: int | None) -> None:
        if not (self._nodes or self._slots):
            return  # the common case: nothing failing
        if self._nodes.pop(node, None) is not None:
            log.info(
                "Redis answers again%s; the delivery gate protects its consumers again",
                f" at {node}" if node else "",
            )
        if slot is not None:
            self._nodes.pop("", None)  # a cluster node answered: the cluster is there
            if self._slots.pop((node, slot), None) is not None and not self._refuses_slots(node):
                log.info("Redis at %s serves every slot again", node)

    def _refuses_slots(self, node: str) -> bool:
        return any(n == node for n, _ in self._slots)

    def describe(self, exc: BaseException) -> str:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return text.replace(self._secret, "***") if self._secret else text


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


EndpointsOf = Callable[[str], Sequence[str]]


def _counted(
    url: str,
    admissions: Sequence[Admission],
    transition: tuple[str, str] | None,
    endpoints_of: EndpointsOf | None = None,
) -> None:
    if transition is not None:
        _count_transition(url, *transition, endpoints_of)
    rate_limited = sum(1 for a in admissions if a.reason == "rate_limited")
    circuit_open = sum(1 for a in admissions if a.reason == "circuit_open")
    if rate_limited:
        metrics.RATE_LIMIT_DEFERRALS.inc(rate_limited)
    if circuit_open:
        metrics.CIRCUIT_DEFERRALS.inc(circuit_open)


Decided = tuple[list[Admission], tuple[str, str] | None]


def _decode_admit(reply: Any, token: str, counts: Sequence[int]) -> list[Decided]:
    values = list(reply)
    if len(values) != 1 + sum(2 + 2 * n for n in counts):
        raise ValueError(
            f"admit script answered {len(values)} values for {sum(counts)} attempts"
            f" of {len(counts)} URLs"
        )
    out, at = [], 1
    for n in counts:
        out.append(_decode_url(values, at, token, n))
        at += 2 + 2 * n
    return out


def _decode_url(values: Sequence[Any], at: int, token: str, count: int) -> Decided:
    """One URL's part of an admit reply: from, to, then (code, delay) per attempt."""
    from_state, to_state = _text(values[at]), _text(values[at + 1])
    admissions: list[Admission] = []
    for i in range(at + 2, at + 2 + 2 * count, 2):
        code, delay = AdmitCode(int(values[i])), int(values[i + 1])
        if code is AdmitCode.ALLOWED_CLEAN:
            admissions.append(ALLOW_CLEAN)
        elif code is AdmitCode.ALLOWED:
            admissions.append(ALLOW)
        elif code is AdmitCode.PROBE:
            admissions.append(Admission(True, probe=True, probe_token=token))
        elif code is AdmitCode.RATE_LIMITED:
            admissions.append(Admission(False, delay_ms=delay, reason="rate_limited"))
        else:
            admissions.append(Admission(False, delay_ms=delay, reason="circuit_open"))
    return admissions, ((from_state, to_state) if from_state else None)


def _decode_transitions(reply: Any) -> list[tuple[str, str]]:
    values = [_text(v) for v in reply]
    return list(zip(values[::2], values[1::2], strict=True))


# At most this many endpoint ids in a transition's line; the others are counted.
NAMED_ENDPOINTS_MAX = 5


def breaker_name(url: str, endpoint_ids: Sequence[str] = ()) -> str:
    """A breaker as its transition lines name it: the URL's scheme and host (its path and
    query may carry a token, and are never logged) and the ids of the endpoints that
    send to that URL (they share its breaker), which tell apart endpoints on one host."""
    where = redacted(url)
    ids = sorted(set(endpoint_ids))
    if not ids:
        return where
    shown = ", ".join(ids[:NAMED_ENDPOINTS_MAX])
    if len(ids) > NAMED_ENDPOINTS_MAX:
        shown += f" and {len(ids) - NAMED_ENDPOINTS_MAX} more"
    return f"{where} (endpoint{'s' if len(ids) > 1 else ''} {shown})"


def _count_transition(
    url: str, from_state: str, to_state: str, endpoints_of: EndpointsOf | None = None
) -> None:
    """Count and log a transition. Only the script call that made it returns it, so each
    transition is logged once, by the process that made it, whatever the instances.
    ``endpoints_of``: the ids of the endpoints that send to ``url`` (asked only here: a
    transition is rare), named in the line."""
    metrics.BREAKER_TRANSITIONS.labels(from_state=from_state, to_state=to_state).inc()
    ids: Sequence[str] = ()
    if endpoints_of is not None:
        try:
            ids = endpoints_of(url)
        except Exception:  # a name is not worth a lost transition line
            log.debug("endpoints of a breaker not named", exc_info=True)
    endpoint = breaker_name(url, ids)
    if to_state == OPEN:
        log.warning(
            "circuit breaker for %s opened (from %s): attempts are deferred until a probe",
            endpoint,
            from_state,
        )
    elif to_state == HALF_OPEN:
        log.info("circuit breaker for %s is half-open: one probe attempt may go", endpoint)
    else:
        log.info("circuit breaker for %s closed (from %s): deliveries resume", endpoint, from_state)


async def gate_for(settings: Settings, redis_url: str, *, warn: bool = True) -> RedisGate:
    """The gate a dispatcher configured by ``settings`` uses (see :func:`connect_gate`); a
    half-open probe may hold its lease for one attempt plus a margin. ``warn``: say whether
    Redis may evict the gate's keys (one worker of a supervisor says it for all)."""
    return await connect_gate(
        redis_url,
        retry_rps=settings.retry_rps,
        breaker_threshold=settings.circuit_breaker_threshold,
        breaker_reset_ms=settings.circuit_breaker_reset_ms,
        probe_ttl_ms=settings.timeout_ms + PROBE_MARGIN_MS,
        prefix=settings.redis_prefix,
        warn_eviction=warn,
    )
