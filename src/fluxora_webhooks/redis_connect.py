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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisClusterException, ResponseError

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
        raise ConfigError(
            "REDIS_URL",
            "names a database this Redis does not have (its `databases` setting; 16 by"
            " default: 0 to 15)",
        ) from None


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
        except Exception:  # unreachable: the gate fails open, as for a TCP URL
            pass
        return False
    try:
        async with asyncio.timeout(timeout_s):
            found = await client.detect()
    except ConfigError:
        raise
    except Exception:  # unreachable: the gate fails open and the next command asks again
        return None
    if found:
        log.info("REDIS_URL names a node of a Redis Cluster: the gate follows its slot map")
    return found
