"""The dispatcher's view of the endpoints: a cache of the registry, reloaded endpoint by
endpoint when PostgreSQL notifies a change (and wholly every few seconds as a fallback),
plus the built-in endpoints configured from the environment. The table stays the truth:
the routing and every state change are decided in SQL; the cache only tells the dispatcher
where to send, how to sign, and what it may skip (a disabled endpoint's rows are parked).

Each :class:`Target` also carries this process's own bookkeeping for its endpoint: how many
requests are in flight (at most ``WEBHOOK_ENDPOINT_CONCURRENCY``) and whether the endpoint
is slow right now (a request outlived a batch), so that one endpoint never holds up the
others.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import random
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from .clientcerts import CertificateUnusable, ClientTls
from .clientcerts import load as load_client_tls
from .delivery import header_texts, secret_texts
from .endpoints import (
    DEFAULT_ID,
    OPERATOR_ID,
    OPERATOR_TENANT,
    Endpoint,
    check_headers,
    open_headers,
)
from .errors import ConfigError, EndpointError
from .secretbox import NO_KEYS, Keyring, SecretLocked
from .signing import Signer
from .urlpolicy import validate_url

log = logging.getLogger(__name__)

# An endpoint stays "slow" this long after a request to it outlived its batch (or timed
# out): its requests are detached from their batch at once meanwhile.
SLOW_FOR_S = 30.0
# How much each ended request moves an endpoint's typical request time (Load.typical_s).
TYPICAL_WEIGHT = 0.25
# A request running this many times its endpoint's typical time may hang: the endpoint's
# requests are expected to last until their timeout again (Load.expected_s).
OVERDUE_FACTOR = 4.0
# Rows of an endpoint deferred before any request to it has ended (Load.early), made due
# again at its first answer: at most this many are remembered per endpoint.
EARLY_ROWS = 1000
# Registry rows read and applied between two turns of the event loop (Targets.load_all).
LOAD_SLICE = 1000


@dataclass
class Turns:
    """When rows deferred one after the other may come back, paced (a slow endpoint's,
    Load.turns; those withheld by the detached requests' share, one for the process)."""

    next: float = 0.0  # monotonic: when the next deferred row may go

    def next_in_s(self, first_s: float, *, step: float, horizon: float) -> float:
        """When a row deferred now may come back: the first at ``first_s``, each later one
        ``step`` after the one before (the rate at which slots free), each jittered within
        its step; past ``horizon`` anywhere between ``first_s`` and it."""
        now = time.monotonic()
        turn = max(self.next, now + first_s)
        if turn + step > now + horizon:
            return random.uniform(first_s, max(first_s, horizon))
        self.next = turn + step
        return turn - now + random.uniform(0.0, step)


@dataclass
class Load:
    """This process's requests to one endpoint: kept across reloads of the endpoint.

    ``in_flight`` counts the slots taken (at most ``WEBHOOK_ENDPOINT_CONCURRENCY``). A row
    claimed while a fast endpoint's slots are all taken waits here, in this process, for
    the next slot (:meth:`acquire`), first come first served, instead of being written
    back to the outbox and claimed again: its row is locked by this process's batch
    anyway, and a fast endpoint frees a slot within milliseconds.
    """

    in_flight: int = 0
    # How long its requests take lately (a moving average of those that ended, a timeout
    # counted as the whole timeout); 0 until one has ended. See expected_s.
    typical_s: float = 0.0
    slow_until: float = 0.0
    suspect_until: float = 0.0  # see detached_at_once
    turns: Turns = field(default_factory=Turns)  # its deferred rows' (while it is slow)
    starts: list[float] = field(default_factory=list)  # its requests in flight, monotonic
    waiters: collections.deque[asyncio.Future[None]] = field(default_factory=collections.deque)
    # Its rows deferred while no request to it had ended (id: partition_at): each waits
    # as if its requests ran to their timeout, as a hanging endpoint's do; made due again
    # when its first request is answered (Dispatcher.send), as an endpoint that answers
    # in half a second would otherwise have them wait a timeout.
    early: dict[int, datetime | None] = field(default_factory=dict)

    async def acquire(self, limit: int) -> None:
        """Take a slot: at once if one of ``limit`` is free and nobody waits, else when
        :meth:`release` hands one over (the caller holds it then)."""
        if self.in_flight < limit and not self.waiters:
            self.in_flight += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed over as the wait was cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):
                    self.waiters.remove(waiter)
            raise

    def release(self) -> None:
        """Give up a slot: to the longest waiting row if there is one, else free it."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.in_flight -= 1

    @property
    def queued(self) -> int:
        return len(self.waiters)

    @property
    def slow(self) -> bool:
        return time.monotonic() < self.slow_until

    def mark_slow(self) -> None:
        self.slow_until = time.monotonic() + SLOW_FOR_S

    @property
    def detached_at_once(self) -> bool:
        """Whether its requests leave their batch at once: it is slow, or a request to it
        was still running when the rest of its batch had answered (it may hang)."""
        now = time.monotonic()
        return now < self.slow_until or now < self.suspect_until

    def mark_suspect(self) -> None:
        self.suspect_until = time.monotonic() + SLOW_FOR_S

    def answered_fast(self) -> None:
        self.slow_until = self.suspect_until = 0.0

    def ended(self, duration_s: float) -> None:
        """A request to it was answered after ``duration_s``, or timed out (its timeout):
        what its requests take. Not a request that failed before an answer (a refused
        connection), which says nothing of how long the consumer takes."""
        duration_s = max(duration_s, 0.001)  # 0 means "none ended yet"
        if self.typical_s <= 0.0:
            self.typical_s = duration_s
        else:
            self.typical_s += TYPICAL_WEIGHT * (duration_s - self.typical_s)

    def deferred(self, row_id: int, partition_at: datetime | None) -> None:
        """One of its rows was deferred as a slow endpoint's: remembered while none of its
        requests has ended (see ``early``)."""
        if self.typical_s <= 0.0 and len(self.early) < EARLY_ROWS:
            self.early[row_id] = partition_at

    def expected_end(self, started_at: float, timeout_s: float) -> float:
        """When a request to it that started at ``started_at`` is expected to end, at its
        timeout at the latest: after its typical time; once past that, after twice as long
        as it has run so far; once it has run OVERDUE_FACTOR times its typical time (it
        may hang), at its timeout. Before any has ended, at its timeout: nothing tells an
        endpoint that answers slowly from one that hangs yet (its rows deferred meanwhile
        are made due again at its first answer: ``early``)."""
        typical = self.typical_s
        elapsed = time.monotonic() - started_at
        if typical <= 0.0:
            guess = timeout_s
        elif elapsed <= typical:
            guess = typical
        elif elapsed <= OVERDUE_FACTOR * typical:
            guess = 2 * elapsed
        else:
            guess = timeout_s
        return started_at + min(timeout_s, guess)

    def expected_s(self, timeout_s: float) -> float:
        """How long a request to it is expected to take (expected_end, for the longest
        running one in flight; with none, its typical time, else its timeout). A "slow"
        endpoint is one whose request outlived a batch, which one that answers in half a
        second does at once: its rows are paced by the time its requests take, not by a
        timeout they never reach; one that hangs by its timeout."""
        if not self.starts:
            return self.typical_s or timeout_s
        started_at = min(self.starts)
        return self.expected_end(started_at, timeout_s) - started_at

    def next_free_in_s(self, timeout_s: float) -> float:
        """How long until one of its in-flight requests is expected to end (expected_end:
        its timeout at the latest)."""
        if not self.starts:
            return 0.0
        first = min(self.expected_end(started, timeout_s) for started in self.starts)
        return max(0.0, first - time.monotonic())


@dataclass
class Target:
    """One endpoint as this dispatcher sends to it."""

    id: str
    tenant: str
    url: str
    signer: Signer
    builtin: bool = False
    headers: Mapping[str, str] = field(default_factory=dict)
    rate_limit: int | None = None
    ordered: bool = False
    enabled: bool = True
    failing_since: float | None = None  # unix seconds (database clock), None: no streak
    load: Load = field(default_factory=Load)
    # Masked in the response bodies and errors stored with each attempt: the signing
    # secrets and the custom headers' values.
    secret_texts: tuple[str, ...] = ()
    # Its own TLS client certificate, loaded (None: the deployment's, or none). The
    # dispatcher sends to it over connections of that certificate only.
    tls: ClientTls | None = None


def _problem(endpoint: Endpoint, stored_headers: Any) -> str | None:
    """What makes a registered endpoint's row unusable (None: nothing). The built-in ones
    are configured from the environment, checked at start-up."""
    if endpoint.builtin:
        return None
    if not endpoint.secret:
        return "it has no secret"
    try:
        validate_url(endpoint.url)
        check_headers(stored_headers or {})
    except EndpointError as exc:
        return f"url: {exc}"
    except ConfigError as exc:
        return str(exc)
    return None


def _plain_secrets(endpoint: Endpoint, keys: Keyring) -> tuple[str, str | None, str | None]:
    """The endpoint's secret, its previous one while that still signs, and its previous one
    whether or not it does (masked in what is stored of each attempt all the same), opened:
    each is stored plain or sealed with WEBHOOK_ENCRYPTION_KEY. Opened once per reading of
    its row, never per request. One that signs and that no key here opens raises
    SecretLocked; an expired previous one that does not open is only left unmasked."""
    assert endpoint.secret is not None
    secret = keys.open(endpoint.secret, endpoint.id)
    if not endpoint.secret_previous:
        return secret, None, None
    until = endpoint.previous_until
    if until is not None and until.timestamp() > time.time():
        previous = keys.open(endpoint.secret_previous, endpoint.id)
        return secret, previous, previous
    try:
        return secret, None, keys.open(endpoint.secret_previous, endpoint.id)
    except SecretLocked:
        return secret, None, None


def _plain_client_cert(row: Mapping[str, Any], keys: Keyring) -> tuple[str, str] | None:
    """A row's client certificate chain and its private key, opened (None: it has none).
    A key no key here opens raises SecretLocked, as a secret does."""
    chain, key = row.get("client_cert"), row.get("client_key")
    if not chain and not key:
        return None
    if not isinstance(chain, str) or not isinstance(key, str) or not chain or not key:
        raise CertificateUnusable("its client certificate lacks its certificate or its key")
    return chain, keys.open(key, str(row["id"]), "its client certificate's private key")


def _tls_key(chain: str, key: str) -> str:
    # In memory only: the loaded contexts by what they were loaded from.
    return hashlib.sha256(f"{chain}\0{key}".encode()).hexdigest()


class Targets:
    """The endpoints a dispatcher sends to, by id. ``env`` holds the built-in endpoints'
    (url, signer) from the environment; their state comes from the registry when a row
    exists (it does once a service has started)."""

    def __init__(
        self,
        env: Mapping[str, tuple[str, Signer]],
        env_secrets: Mapping[str, tuple[str, ...]],
        keys: Keyring = NO_KEYS,
    ) -> None:
        self._env = dict(env)
        self._keys = keys
        self._by_id: dict[str, Target] = {}
        # Of the endpoints in _by_id (None: stale): their tenants, and each tenant's ordered
        # endpoints.
        self._tenants: frozenset[str] | None = None
        self._ordered: dict[str, tuple[Target, ...]] = {}
        # Each row as last applied, and when (load_all applies a row again only if it
        # changed).
        self._applied: dict[str, tuple[dict[str, Any], float]] = {}
        # Endpoints whose row cannot be used as it is (written by SQL past the checks of
        # the CLI and the API): why, by id.
        self._unusable: dict[str, str] = {}
        # Endpoints whose sealed secret no key of this process opens: the key id it names,
        # by id. Their deliveries wait (deferred, no attempt consumed) for a dispatcher
        # that has the key; they are never dead-lettered for it.
        self._locked: dict[str, str] = {}
        # The endpoints' own client certificates, loaded: one context per certificate and
        # key, whatever number of endpoints present it (load_all forgets those unused).
        self._tls: dict[str, ClientTls] = {}
        # Those that failed to load, why: from _load_certificates to _apply_row (not loaded
        # again, on the event loop, to say so).
        self._tls_failed: dict[str, str] = {}
        self.loaded = False
        for endpoint_id, (url, signer) in self._env.items():
            self._by_id[endpoint_id] = Target(
                endpoint_id,
                OPERATOR_TENANT if endpoint_id == OPERATOR_ID else "",
                url,
                signer,
                builtin=True,
                secret_texts=env_secrets.get(endpoint_id, ()),
            )

    @property
    def has_default(self) -> bool:
        return DEFAULT_ID in self._env

    def get(self, endpoint_id: str) -> Target | None:
        return self._by_id.get(endpoint_id)

    def all(self) -> Iterable[Target]:
        return self._by_id.values()

    def routes_tenant(self, tenant: str) -> bool:
        """Whether an endpoint of ``tenant`` (not a built-in one) is known here. A hint
        only: the routing itself reads the registry, so an endpoint not known here yet is
        routed to all the same, just not sent to by the batch that routes it."""
        return tenant in self._known()[0]

    @property
    def has_ordered(self) -> bool:
        """Whether an ordered endpoint is known here (a hint as well: a routing batch looks
        for ordered streams' heads to send only then; the claim finds them all the same)."""
        return bool(self._known()[1])

    def ordered_of(self, tenant: str) -> tuple[Target, ...]:
        """``tenant``'s ordered endpoints known here (a hint: see
        :func:`fluxora_webhooks.outbox.route_events`)."""
        return self._known()[1].get(tenant, ())

    def _known(self) -> tuple[frozenset[str], dict[str, tuple[Target, ...]]]:
        if self._tenants is None:
            mine = [t for t in self._by_id.values() if not t.builtin]
            self._tenants = frozenset(t.tenant for t in mine)
            ordered: dict[str, list[Target]] = {}
            for t in mine:
                if t.ordered:
                    ordered.setdefault(t.tenant, []).append(t)
            self._ordered = {k: tuple(v) for k, v in ordered.items()}
        return self._tenants, self._ordered

    async def load_all(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Read the whole registry (at start, and as the periodic fallback). A row as it
        was when last applied is not checked and applied again: with tens of thousands of
        endpoints that work (each URL's check above all) held the event loop for seconds
        every period, stalling every request and the gate's calls. The rows are read a
        slice at a time, the loop free between slices."""
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute("SELECT * FROM webhook_endpoints")
        seen: set[str] = set()
        while rows := await cur.fetchmany(LOAD_SLICE):
            changed = []
            for row in rows:
                endpoint_id = str(row["id"])
                seen.add(endpoint_id)
                if not self._unchanged(endpoint_id, row):
                    changed.append(row)
            await self._load_certificates(changed)
            for row in changed:
                self._apply_row(row)
            await asyncio.sleep(0)
        for endpoint_id in list(self._by_id):
            if endpoint_id not in seen and endpoint_id not in self._env:
                del self._by_id[endpoint_id]
        for endpoint_id in list(self._unusable):
            if endpoint_id not in seen:  # removed: its deliveries say so (endpoint_removed)
                del self._unusable[endpoint_id]
        for endpoint_id in list(self._locked):
            if endpoint_id not in seen:
                del self._locked[endpoint_id]
        for endpoint_id in list(self._applied):
            if endpoint_id not in seen:
                del self._applied[endpoint_id]
        used = {id(t.tls) for t in self._by_id.values() if t.tls is not None}
        for loaded_key, tls in list(self._tls.items()):
            if id(tls) not in used:
                del self._tls[loaded_key]
        self._tls_failed.clear()
        self.loaded = True
        self._tenants = None

    def _unchanged(self, endpoint_id: str, row: Mapping[str, Any]) -> bool:
        """Whether ``row`` is what was applied last, and applying it again would make
        the same target: not while a rotated-out secret it signs with may have expired
        since (its expiry is read when the row is applied)."""
        applied = self._applied.get(endpoint_id)
        if applied is None or applied[0] != row:
            return False
        until = row.get("previous_until")
        return until is None or not row.get("secret_previous") or until.timestamp() <= applied[1]

    async def reload(self, conn: psycopg.AsyncConnection[Any], endpoint_id: str) -> Target | None:
        """Read one endpoint again (after its NOTIFY); None when it no longer exists."""
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute("SELECT * FROM webhook_endpoints WHERE id = %s", (endpoint_id,))
        row = await cur.fetchone()
        if row is None:
            self._applied.pop(endpoint_id, None)
            if endpoint_id in self._env:
                builtin = self._by_id[endpoint_id]
                builtin.enabled, builtin.failing_since = True, None
                return builtin
            self._by_id.pop(endpoint_id, None)
            self._unusable.pop(endpoint_id, None)
            self._locked.pop(endpoint_id, None)
            self._tenants = None
            return None
        await self._load_certificates([row])
        return self._apply_row(row)

    async def _load_certificates(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """The client certificates of ``rows`` not loaded yet, loaded in a thread: each
        context loads the trust store, tens of milliseconds the event loop (every request
        in flight) must not wait. A row whose certificate cannot be loaded is left to
        :meth:`_apply_row`, which says why."""
        wanted: dict[str, tuple[str, str]] = {}
        for row in rows:
            try:
                pair = _plain_client_cert(row, self._keys)
            except (SecretLocked, CertificateUnusable):
                continue
            if pair is not None and _tls_key(*pair) not in self._tls:
                wanted[_tls_key(*pair)] = pair
        if not wanted:
            return

        def load_them() -> dict[str, ClientTls | str]:
            loaded: dict[str, ClientTls | str] = {}
            for loaded_key, pair in wanted.items():
                try:
                    loaded[loaded_key] = load_client_tls(*pair)
                except CertificateUnusable as exc:
                    loaded[loaded_key] = str(exc)
            return loaded

        for loaded_key, tls in (await asyncio.to_thread(load_them)).items():
            if isinstance(tls, str):
                self._tls_failed[loaded_key] = tls
            else:
                self._tls[loaded_key] = tls

    def _client_tls(self, row: Mapping[str, Any]) -> ClientTls | None:
        """The row's client certificate, loaded (:meth:`_load_certificates` did, unless it
        cannot be: then it raises CertificateUnusable, saying why)."""
        pair = _plain_client_cert(row, self._keys)
        if pair is None:
            return None
        loaded_key = _tls_key(*pair)
        failed = self._tls_failed.get(loaded_key)
        if failed is not None:
            raise CertificateUnusable(failed)
        tls = self._tls.get(loaded_key)
        if tls is None:
            tls = self._tls[loaded_key] = load_client_tls(*pair)
        return tls

    def unusable(self, endpoint_id: str) -> str | None:
        """Why the registry's row of ``endpoint_id`` cannot be sent to (None: it can, or
        it is not known here)."""
        return self._unusable.get(endpoint_id)

    def locked(self, endpoint_id: str) -> str | None:
        """The key id of the endpoint's sealed secret when no key of this process opens it
        (None: it opens, or it is not known here). Such an endpoint is not :meth:`unusable`:
        its row is sound, this process lacks its key, so its deliveries wait as those of an
        endpoint another dispatcher is configured for do."""
        return self._locked.get(endpoint_id)

    def _apply_row(self, row: Mapping[str, Any]) -> Target | None:
        """One registry row, checked as the CLI and the API check what they write: a row
        that fails (a header value that is no text, no secret, a URL the policy refuses)
        is not sent to; its deliveries become dead letters naming why (the batch asks
        :meth:`unusable`), and one bad row never stops the loading of the others."""
        endpoint_id = str(row.get("id"))
        self._applied[endpoint_id] = (dict(row), time.time())
        try:
            # Its credential headers' values opened (once per reading of its row: a value
            # no key here opens locks it, as its secret would), then made readable and
            # checked as they are sent.
            headers = open_headers(row["headers"], endpoint_id, self._keys)
            endpoint = Endpoint.from_row({**row, "headers": headers})
            problem = _problem(endpoint, headers)
            if problem is None:
                tls = None if endpoint.builtin else self._client_tls(row)
                # Its Signer refuses a secret empty once decoded.
                target = self._apply(endpoint, tls)
                self._unusable.pop(endpoint_id, None)
                self._locked.pop(endpoint_id, None)
                return target
        except SecretLocked as exc:
            self._lock(endpoint_id, exc)
            return None
        except CertificateUnusable as exc:
            problem = str(exc)
        except (TypeError, ValueError, AttributeError) as exc:
            # A value of the wrong type, or a secret no key can be made of. Not a missing
            # column (KeyError): the schema is not what this code expects, which no dead
            # letter mends; the batch fails.
            problem = (
                str(exc)
                if isinstance(exc, ValueError) and "signing secret" in str(exc)
                else f"its row cannot be read ({type(exc).__name__})"
            )
        if self._unusable.get(endpoint_id) != problem:
            log.error(
                "endpoint %s cannot be used: %s; its deliveries become dead letters until its"
                " row is fixed (then: fluxora-webhooks recover)",
                endpoint_id,
                problem,
            )
        self._unusable[endpoint_id] = problem
        self._locked.pop(endpoint_id, None)
        if endpoint_id not in self._env:
            self._by_id.pop(endpoint_id, None)
            self._tenants = None
        return None

    def _lock(self, endpoint_id: str, exc: SecretLocked) -> None:
        """An endpoint whose secret (its client key, a credential header) no key here opens:
        not sent to, its deliveries deferred (the batch finds it neither known nor
        unusable, its row present), said once."""
        if self._locked.get(endpoint_id) != exc.key_id:
            log.error(
                "endpoint %s cannot be sent to: %s; its deliveries wait (kept, no attempt"
                " consumed) until a dispatcher runs with the key %s as WEBHOOK_ENCRYPTION_KEY"
                " or WEBHOOK_ENCRYPTION_KEY_PREVIOUS",
                endpoint_id,
                exc,
                exc.key_id,
            )
        self._locked[endpoint_id] = exc.key_id
        self._unusable.pop(endpoint_id, None)
        if endpoint_id not in self._env:
            self._by_id.pop(endpoint_id, None)
            self._tenants = None

    def _apply(self, endpoint: Endpoint, tls: ClientTls | None = None) -> Target | None:
        failing = None if endpoint.failing_since is None else endpoint.failing_since.timestamp()
        if endpoint.id in self._env:
            target = self._by_id[endpoint.id]
            target.enabled = endpoint.enabled
            target.failing_since = failing
            return target
        if endpoint.builtin or endpoint.secret is None:
            return None  # a built-in endpoint this dispatcher is not configured for
        secret, previous, masked_previous = _plain_secrets(endpoint, self._keys)
        old = self._by_id.get(endpoint.id)
        target = Target(
            endpoint.id,
            endpoint.tenant,
            endpoint.url,
            Signer(secret.encode(), None if previous is None else previous.encode()),
            headers=dict(endpoint.headers),
            rate_limit=endpoint.rate_limit,
            ordered=endpoint.ordered,
            enabled=endpoint.enabled,
            failing_since=failing,
            secret_texts=secret_texts(secret.encode(), (masked_previous or "").encode() or None)
            + header_texts(endpoint.headers),
            tls=tls,
        )
        if old is not None:  # this process's bookkeeping outlives a reload
            target.load = old.load
        self._by_id[endpoint.id] = target
        self._tenants = None
        return target
