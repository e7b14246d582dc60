"""Segment metadata backends: where engines publish descriptors and peers look them up.

``open_metadata(conn)`` picks one from a connection string:

* ``P2PHANDSHAKE``        -> None: no service; peers ask the engine itself (DESCRIBE frame)
* ``memory://NAME``       -> an in-process table (tests; shared by engines of one process)
* ``http://h:p/metadata`` -> the HTTP metadata server (``kvplane metadata`` or Mooncake's)
* ``etcd://h:p``          -> etcd v3 through its JSON gateway (etcd3gw)
* ``redis://h:p[/db]``    -> Redis

Every call takes a timeout; backend errors become ``Unavailable``. The HTTP backend retries
a server it cannot reach (refused, reset, timed out, 503) until that timeout.
"""

from __future__ import annotations

import abc
import threading
import time
from typing import Any

from kvplane.common import metrics
from kvplane.common.deadline import Deadline
from kvplane.common.errors import InvalidArgument, Unauthorized, Unavailable
from kvplane.common.extras import require
from kvplane.common.registry import Registry

KEY_PREFIX = "kvplane/segments/"
BACKOFF = (0.02, 0.25)  # HTTP metadata: first and longest pause between attempts, seconds
CONNECT_ATTEMPT = 1.0  # HTTP metadata: the longest single connect, seconds


class MetadataBackend(abc.ABC):
    """A small key -> UTF-8 text store (descriptors are JSON).

    Methods block for at most ``timeout`` seconds, from any thread.
    """

    name = "abstract"

    @abc.abstractmethod
    def get(self, key: str, timeout: float = 5.0) -> bytes | None:
        """The value, or None if absent. Raises Unavailable when the backend cannot be reached."""

    @abc.abstractmethod
    def put(self, key: str, value: bytes, timeout: float = 5.0) -> None:
        """Store ``value`` under ``key``. Raises Unavailable."""

    @abc.abstractmethod
    def delete(self, key: str, timeout: float = 5.0) -> None:
        """Remove ``key`` (absent is fine). Raises Unavailable."""

    def close(self) -> None:  # noqa: B027  (optional hook: most backends hold nothing)
        """Release connections (idempotent)."""

    def _count(self, op: str) -> None:
        metrics.METADATA_OPS.labels(self.name, op).inc()


_MEMORY: dict[str, dict[str, bytes]] = {}
_MEMORY_LOCK = threading.Lock()


class MemoryMetadata(MetadataBackend):
    """In-process table; every backend with the same ``space`` sees the same keys."""

    name = "memory"

    def __init__(self, space: str = "default") -> None:
        with _MEMORY_LOCK:
            self._table = _MEMORY.setdefault(space, {})

    def get(self, key: str, timeout: float = 5.0) -> bytes | None:
        self._count("get")
        return self._table.get(key)

    def put(self, key: str, value: bytes, timeout: float = 5.0) -> None:
        self._count("put")
        self._table[key] = bytes(value)

    def delete(self, key: str, timeout: float = 5.0) -> None:
        self._count("delete")
        self._table.pop(key, None)


class HttpMetadata(MetadataBackend):
    """Mooncake's HTTP metadata protocol: ``GET|PUT|DELETE <url>?key=K``."""

    name = "http"

    def __init__(self, url: str, token: str = "") -> None:
        import httpx

        self.url = url
        headers = {"X-KVPlane-Token": token} if token else {}
        self._client = httpx.Client(headers=headers, trust_env=False)
        self._errors = (httpx.HTTPError,)

    def _call(self, method: str, key: str, timeout: float, content: bytes | None = None) -> Any:
        """One request, retried within ``timeout`` while the server cannot be reached.

        A refused, reset or timed-out connection (a server still starting, or restarting) and a
        503 are retried with backoff until the deadline: GET, PUT (of the same value) and
        DELETE are idempotent. A connect gets at most ``CONNECT_ATTEMPT`` seconds, so a full
        backlog costs one attempt, not the deadline.
        """
        import httpx

        self._count(method.lower())
        deadline, pause = Deadline.after(timeout), BACKOFF[0]
        while True:
            left = deadline.remaining()
            try:
                r = self._client.request(method, self.url, params={"key": key}, content=content,
                                         timeout=httpx.Timeout(max(left, 0.001),
                                                               connect=min(CONNECT_ATTEMPT, left)))
                if r.status_code != 503:
                    break
                why = f"HTTP 503 {r.text[:200]}"
            except httpx.TransportError as exc:  # refused, reset, timed out: try again
                why = str(exc) or type(exc).__name__
            except self._errors as exc:
                raise Unavailable(f"metadata server {self.url}: {exc}") from exc
            if deadline.remaining() <= pause:
                raise Unavailable(f"metadata server {self.url}: {why} (gave up after "
                                  f"{timeout:g}s)")
            time.sleep(pause)
            pause = min(pause * 2, BACKOFF[1])
        if r.status_code == 404:
            return None
        if r.status_code in (401, 403):  # a wrong or missing token: not worth a retry
            raise Unauthorized(f"metadata server {self.url}: HTTP {r.status_code} {r.text[:200]}")
        if r.status_code >= 400:
            raise Unavailable(f"metadata server {self.url}: HTTP {r.status_code} {r.text[:200]}")
        return r

    def get(self, key: str, timeout: float = 5.0) -> bytes | None:
        r = self._call("GET", key, timeout)
        return None if r is None else r.content

    def put(self, key: str, value: bytes, timeout: float = 5.0) -> None:
        self._call("PUT", key, timeout, value)

    def delete(self, key: str, timeout: float = 5.0) -> None:
        self._call("DELETE", key, timeout)

    def close(self) -> None:
        self._client.close()


class EtcdMetadata(MetadataBackend):
    """etcd v3 through its JSON gateway (``etcd3gw``; works with etcd 3.4+)."""

    name = "etcd"

    def __init__(self, host: str, port: int) -> None:
        client = require("etcd3gw.client", "etcd", "etcd metadata")
        self._host, self._port = host, port
        self._client = client.Etcd3Client(host=host, port=port, timeout=5)

    def _wrap(self, op: str, fn: Any, *args: Any) -> Any:
        self._count(op)
        try:
            return fn(*args)
        except Exception as exc:  # etcd3gw raises requests/etcd3gw errors of many kinds
            raise Unavailable(f"etcd {self._host}:{self._port} {op}: {exc}") from exc

    def get(self, key: str, timeout: float = 5.0) -> bytes | None:
        vals = self._wrap("get", self._client.get, key)
        if not vals:
            return None
        v = vals[0]
        return v if isinstance(v, bytes) else str(v).encode("utf-8")

    def put(self, key: str, value: bytes, timeout: float = 5.0) -> None:
        self._wrap("put", self._client.put, key, bytes(value))

    def delete(self, key: str, timeout: float = 5.0) -> None:
        self._wrap("delete", self._client.delete, key)

    def close(self) -> None:
        session = getattr(self._client, "session", None)
        if session is not None:
            session.close()


class RedisMetadata(MetadataBackend):
    """Redis (redis-py); ``redis://host:port/db``, password from the URL."""

    name = "redis"

    def __init__(self, url: str) -> None:
        redis = require("redis", "redis", "Redis metadata")
        self._redis = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        self._errors = (redis.RedisError, OSError)

    def _wrap(self, op: str, fn: Any, *args: Any) -> Any:
        self._count(op)
        try:
            return fn(*args)
        except self._errors as exc:
            raise Unavailable(f"redis {op}: {exc}") from exc

    def get(self, key: str, timeout: float = 5.0) -> bytes | None:
        return self._wrap("get", self._redis.get, key)  # type: ignore[no-any-return]  # redis-py types get() as Any

    def put(self, key: str, value: bytes, timeout: float = 5.0) -> None:
        self._wrap("put", self._redis.set, key, value)

    def delete(self, key: str, timeout: float = 5.0) -> None:
        self._wrap("delete", self._redis.delete, key)

    def close(self) -> None:
        self._redis.close()


BACKENDS: Registry[MetadataBackend] = Registry("metadata backend")
BACKENDS.register("memory", "kvplane.transfer.metadata:MemoryMetadata")
BACKENDS.register("http", "kvplane.transfer.metadata:HttpMetadata")
BACKENDS.register("etcd", "kvplane.transfer.metadata:EtcdMetadata")
BACKENDS.register("redis", "kvplane.transfer.metadata:RedisMetadata")


def open_metadata(conn: str, token: str = "") -> MetadataBackend | None:
    """Open the backend named by a connection string (see the module docstring).

    Returns None for ``P2PHANDSHAKE``.

    Raises:
        InvalidArgument: for an unknown scheme.
    """
    if conn.upper() in ("P2PHANDSHAKE", "P2P", ""):
        return None
    scheme, sep, rest = conn.partition("://")
    if not sep:
        raise InvalidArgument(f"bad metadata server {conn!r}: use P2PHANDSHAKE, memory://name, "
                              "http://host:port/metadata, etcd://host:port or redis://host:port")
    cls = BACKENDS.load(scheme.lower().replace("https", "http"))
    if cls is MemoryMetadata:
        return MemoryMetadata(rest or "default")
    if cls is HttpMetadata:
        return HttpMetadata(conn, token)
    if cls is EtcdMetadata:
        from kvplane.common.config import parse_hostport

        host, port = parse_hostport(rest.split("/")[0].split(",")[0], 2379)
        return EtcdMetadata(host, port)
    return cls(conn)  # type: ignore[call-arg]  # the registered backends take the address; the ABC does not say so
