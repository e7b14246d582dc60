"""A small etcd v3 client for the store's high availability: keys, leases and transactions
through etcd's JSON gateway (``etcd3gw``; etcd 3.4+), over one or more endpoints.

Also parses the HA master address ``etcd://h1:2379;h2:2379[/CLUSTER]`` (Mooncake's syntax, with
an optional cluster id; the default is ``KVPLANE_CLUSTER_ID`` or ``kvplane``) and names the
cluster's keys. Every call is bounded by the client's timeout; an endpoint that fails is
skipped for the next. Errors become ``Unavailable``. Imports etcd3gw lazily (extra ``[etcd]``).
"""

from __future__ import annotations

import base64
import json
import threading
from dataclasses import dataclass
from typing import Any

from kvplane.common import envs
from kvplane.common.config import parse_hostport
from kvplane.common.errors import InvalidArgument, Unavailable
from kvplane.common.extras import require

SCHEME = "etcd://"
DEFAULT_CLUSTER = "kvplane"


def is_ha(address: str) -> bool:
    """True for an ``etcd://`` master address."""
    return address.startswith(SCHEME)


@dataclass(frozen=True)
class HaAddress:
    """A parsed ``etcd://h1:2379;h2:2379[/CLUSTER]`` address."""

    endpoints: tuple[tuple[str, int], ...]
    cluster: str

    @classmethod
    def parse(cls, address: str, cluster: str | None = None) -> HaAddress:
        """Parse ``address``; ``cluster`` (if given) overrides the one in the address.

        Raises:
            InvalidArgument: not an etcd address, or a bad endpoint or cluster id.
        """
        if not is_ha(address):
            raise InvalidArgument(f"{address!r} is not an etcd:// address")
        rest = address[len(SCHEME):]
        hosts, _, named = rest.partition("/")
        eps = tuple(parse_hostport(h.strip()) for h in hosts.replace(",", ";").split(";")
                    if h.strip())
        if not eps:
            raise InvalidArgument(f"{address!r} names no etcd endpoint")
        name = cluster or named or envs.get("KVPLANE_CLUSTER_ID") or DEFAULT_CLUSTER
        if not name.replace("-", "").replace("_", "").replace(".", "").isalnum() or len(name) > 64:
            raise InvalidArgument(f"bad cluster id {name!r}: 1-64 of [A-Za-z0-9_.-]")
        return cls(eps, name)

    def key(self, leaf: str) -> str:
        """The etcd key ``kvplane/<cluster>/<leaf>``."""
        return f"kvplane/{self.cluster}/{leaf}"


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


class Etcd:
    """etcd v3 over its JSON gateway. Thread-safe (calls are serialised).

    Args:
        endpoints: (host, port) of etcd members; tried in turn.
        timeout: seconds for one HTTP request.
    """

    def __init__(self, endpoints: tuple[tuple[str, int], ...], timeout: float = 1.0) -> None:
        client = require("etcd3gw.client", "etcd", "HA masters (etcd:// addresses)")
        self._clients = [client.Etcd3Client(host=h, port=p, timeout=timeout, api_path="/v3/")
                         for h, p in endpoints]
        self._i = 0
        self._lock = threading.Lock()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        last: Exception | None = None
        with self._lock:
            for k in range(len(self._clients)):
                c = self._clients[(self._i + k) % len(self._clients)]
                try:
                    out = c.post(c.get_url(path), data=json.dumps(body))
                except Exception as exc:  # etcd3gw/requests raise many kinds: all mean "not now"
                    last = exc
                    continue
                self._i = (self._i + k) % len(self._clients)
                return out  # type: ignore[no-any-return]  # etcd3gw's client is untyped
            self._i = (self._i + 1) % len(self._clients)
        raise Unavailable(f"etcd unreachable: {last}") from last

    # -- keys ---------------------------------------------------------------------------
    def get(self, key: str) -> tuple[bytes, int] | None:
        """(value, mod_revision) of ``key``, or None."""
        kvs = self._post("/kv/range", {"key": _b64(key)}).get("kvs") or []
        if not kvs:
            return None
        kv = kvs[0]
        return base64.b64decode(kv.get("value", "")), int(kv.get("mod_revision", 0))

    def put(self, key: str, value: str | bytes) -> None:
        self._post("/kv/put", {"key": _b64(key), "value": _b64(value)})

    def delete(self, key: str) -> None:
        self._post("/kv/deleterange", {"key": _b64(key)})

    def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]]) -> bool:
        """Run ``success`` if every ``compare`` holds; returns whether it did."""
        out = self._post("/kv/txn", {"compare": compare, "success": success, "failure": []})
        return bool(out.get("succeeded", False))

    # -- leases -------------------------------------------------------------------------
    def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; returns its id."""
        return int(self._post("/lease/grant", {"TTL": ttl, "ID": 0})["ID"])

    def keepalive(self, lease: int) -> int:
        """Refresh ``lease``; returns its TTL in seconds, <= 0 once it has expired."""
        out = self._post("/lease/keepalive", {"ID": lease})
        return int(out.get("result", {}).get("TTL", -1))

    def revoke(self, lease: int) -> None:
        self._post("/kv/lease/revoke", {"ID": lease})

    def close(self) -> None:
        for c in self._clients:
            session = getattr(c, "session", None)
            if session is not None:
                session.close()


# -- transaction pieces -------------------------------------------------------------------------
def absent(key: str) -> dict[str, Any]:
    """Compare: ``key`` does not exist."""
    return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}


def unchanged(key: str, mod_revision: int) -> dict[str, Any]:
    """Compare: ``key`` was last written at ``mod_revision`` (0: it does not exist)."""
    if not mod_revision:
        return absent(key)
    return {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}


def holds(key: str, value: str | bytes) -> dict[str, Any]:
    """Compare: ``key`` holds ``value``."""
    return {"key": _b64(key), "target": "VALUE", "result": "EQUAL", "value": _b64(value)}


def put_op(key: str, value: str | bytes, lease: int = 0) -> dict[str, Any]:
    """Operation: put ``value`` under ``key`` (attached to ``lease`` if given)."""
    req: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        req["lease"] = str(lease)
    return {"request_put": req}
