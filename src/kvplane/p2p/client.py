"""TrackerClient: the P2P tracker's HTTP API as blocking calls that raise kvplane errors.

Every call has a timeout; HTTP statuses map to the error tree (401 Unauthorized, 404 NotFound,
409 Conflict, 400/413/422 InvalidArgument), and transport failures to Unavailable / Timeout.
Imports ``kvplane.common`` and ``kvplane.p2p`` only.
"""

from __future__ import annotations

from typing import Any, TypeVar

import httpx
import msgspec

from kvplane.common.errors import (
    Conflict,
    InvalidArgument,
    KVPlaneError,
    NotFound,
    Timeout,
    Unauthorized,
    Unavailable,
)
from kvplane.p2p import wire
from kvplane.p2p.manifest import Manifest, validate

T = TypeVar("T")
_BY_STATUS = {401: Unauthorized, 404: NotFound, 409: Conflict, 400: InvalidArgument,
              413: InvalidArgument, 422: InvalidArgument}


class TrackerClient:
    """Talks to the tracker at ``url`` (``http://host:port``, the metadata server's root).

    Args:
        url: the tracker's base URL.
        token: shared token (sent as ``X-KVPlane-Token``).
        timeout: default seconds per call.
    """

    def __init__(self, url: str, token: str = "", timeout: float = 10.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise InvalidArgument(f"tracker URL must be http(s)://host:port, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout = timeout
        headers = {"X-KVPlane-Token": token} if token else {}
        self._http = httpx.Client(base_url=self.url + wire.PREFIX, headers=headers,
                                  timeout=timeout, trust_env=False)

    def _call(self, method: str, path: str, body: Any = None, typ: type[T] | None = None,
              timeout: float | None = None, **params: Any) -> Any:
        content = msgspec.json.encode(body) if body is not None else None
        try:
            resp = self._http.request(method, path, content=content, params=params or None,
                                      timeout=timeout or self.timeout,
                                      headers={"content-type": "application/json"})
        except httpx.TimeoutException as exc:
            raise Timeout(f"tracker {self.url}{path} timed out") from exc
        except httpx.HTTPError as exc:
            raise Unavailable(f"tracker {self.url} unreachable: {exc}") from exc
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("detail", resp.text)
            except ValueError:
                detail = resp.text
            raise _BY_STATUS.get(resp.status_code, KVPlaneError)(f"tracker: {detail}")
        return msgspec.json.decode(resp.content, type=typ) if typ else resp.json()

    def publish(self, manifest: Manifest, holder: str, addrs: list[int]) -> int:
        """Register a version (Mooncake Register); returns its number."""
        out = self._call("POST", "/publish", wire.PublishReq(manifest, holder, addrs))
        return int(out["version"])

    def open(self, name: str, reader: str, version: int = 0) -> Manifest:
        """Take a lease on a version (0: latest) and get its manifest."""
        return validate(self._call("POST", "/open", wire.OpenReq(name, reader, version), Manifest))

    def claim(self, req: wire.ClaimReq) -> wire.ClaimResp:
        """Report fetches and get new ones (may wait up to ``req.wait``)."""
        resp: wire.ClaimResp = self._call("POST", "/claim", req, wire.ClaimResp,
                                          timeout=self.timeout + req.wait)
        return resp

    def release(self, name: str, version: int, reader: str) -> None:
        """Release a lease (the reader stays a holder of what it got)."""
        self._call("POST", "/close", wire.CloseReq(name, version, reader))

    def withdraw(self, name: str, holder: str, version: int = 0) -> int:
        """Stop serving ``name`` (a version, or all with 0) from ``holder``."""
        return int(self._call("POST", "/withdraw", wire.WithdrawReq(name, holder, version))["withdrawn"])

    def heartbeat(self, holder: str, holdings: list[tuple[str, int]],
                  reading: list[tuple[str, int]] | None = None,
                  timeout: float | None = None) -> list[tuple[str, int]]:
        """Say ``holder`` is alive (and still reading ``reading``); returns holdings to drop."""
        req = wire.HeartbeatReq(holder, holdings, reading or [])
        resp: wire.HeartbeatResp = self._call("POST", "/heartbeat", req, wire.HeartbeatResp,
                                              timeout=timeout)
        return resp.drop

    def ls(self, prefix: str = "") -> list[dict[str, Any]]:
        """Published names with their versions."""
        out: list[dict[str, Any]] = self._call("GET", "/objects", prefix=prefix)
        return out

    def rm(self, name: str) -> None:
        """Retire every version of ``name``."""
        self._call("DELETE", "/objects", name=name)

    def status(self, name: str, version: int = 0) -> dict[str, Any]:
        """The swarm of one version."""
        out: dict[str, Any] = self._call("GET", "/status", name=name, version=version)
        return out

    def close(self) -> None:
        """Close the HTTP connection pool (idempotent)."""
        self._http.close()
