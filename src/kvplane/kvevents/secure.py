"""An authenticated KV event publisher: ZMQ PLAIN with a token, one event stream per tenant.

Same wire format as :class:`~kvplane.kvevents.publisher.KVEventPublisher` (vLLM's: 3-frame
``[topic, seq, payload]`` messages and a replay ROUTER), but every peer of the PUB and replay
sockets must authenticate in the ZMQ handshake with mechanism PLAIN, the token as password
(any user name). A ZAP handler maps the token to a principal; its tenant becomes the peer's
ZMQ User-Id. Each tenant has its own topic (``"<tenant>@kvplane"``; tenant names cannot contain
``@``, so no topic is a prefix of another), its own sequence numbers and its own replay ring.
The PUB socket runs in manual subscription mode: whatever a peer asks for, it is subscribed to
its own tenant's topic only, and the replay socket answers from its tenant's ring only.

Pre-authentication limits: inbound messages (subscriptions, replay requests) are capped at
``MAX_INBOUND`` bytes, the handshake must finish within the handshake timeout, and ZMTP
heartbeats drop silent peers. Failed authentications are logged once per peer at a time.

Imports only ``kvplane.common`` and ``kvplane.kvevents``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

import msgspec
import zmq

from kvplane.common.auth import Authenticator
from kvplane.common.errors import Timeout
from kvplane.common.guard import Limits, PeerLog
from kvplane.kvevents.codec import END_OF_REPLAY, encode_batch, encode_seq

log = logging.getLogger(__name__)
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"kvplane"
MAX_INBOUND = 4096
HEARTBEAT_MS = 10_000


def topic_of(tenant: str) -> bytes:
    """The topic frame of ``tenant``'s events."""
    return f"{tenant}@kvplane".encode()



def user_id(frame: zmq.Frame) -> str:
    """The ZAP user id of the peer that sent ``frame`` (its tenant), or ""."""
    value = frame.get("User-Id")
    return value if isinstance(value, str) else ""


def harden(sock: zmq.Socket, limits: Limits, max_inbound: int, server: bool = True) -> None:
    """Pre-authentication limits on a ZMQ socket (and PLAIN server mode if ``server``)."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_inbound)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(limits.handshake_timeout * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * HEARTBEAT_MS)
    if server:
        sock.setsockopt(zmq.PLAIN_SERVER, 1)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)


class _Zap(threading.Thread):
    """The context's ZAP handler: PLAIN password -> principal; User-Id = its tenant."""

    def __init__(self, ctx: zmq.Context, authenticate: Authenticator) -> None:
        super().__init__(name="kvplane-zap", daemon=True)
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._auth = authenticate
        self._halt = threading.Event()
        self.peer_log = PeerLog(log)
        self.denied = 0

    def run(self) -> None:
        while not self._halt.is_set():
            if self._sock.poll(100):
                self._sock.send_multipart(self._answer(self._sock.recv_multipart()))
        self._sock.close(0)

    def _answer(self, msg: list[bytes]) -> list[bytes]:
        if len(msg) < 6:
            return [b"1.0", msg[1] if len(msg) > 1 else b"", b"400", b"bad ZAP request", b"", b""]
        version, rid, _domain, address, _identity, mechanism = msg[:6]
        principal = None
        if mechanism == b"PLAIN" and len(msg) == 8:
            principal = self._auth(msg[7].decode("utf-8", "replace"))
        if principal is None:
            self.denied += 1
            self.peer_log.warn(address.decode("ascii", "replace"),
                               "KV-event peer refused: bad or missing token (ZMQ %s)",
                               mechanism.decode("ascii", "replace"))
            return [version, rid, b"400", b"bad token", b"", b""]
        return [version, rid, b"200", b"OK", principal.tenant.encode(), b""]

    def stop(self) -> None:
        self._halt.set()
        self.join(2)


class _Stream:
    """One tenant's sequence counter and replay ring."""

    def __init__(self, steps: int) -> None:
        self.seq = 0
        self.ring: deque[tuple[int, bytes]] = deque(maxlen=steps)


class SecurePublisher:
    """Authenticated, per-tenant KV event publisher (see the module docstring). Thread-safe.

    Args:
        authenticate: token -> principal (None refuses the peer).
        host: bind address of both sockets.
        port: PUB port (0 picks one; read :attr:`endpoint`).
        buffer_steps: replay ring length per tenant.
        limits: handshake timeout source (default: from the environment).
    """

    def __init__(self, authenticate: Authenticator, host: str = "127.0.0.1", port: int = 0,
                 buffer_steps: int = 10_000, limits: Limits | None = None) -> None:
        lim = limits or Limits.from_env()
        self._ctx = zmq.Context()
        self._zap = _Zap(self._ctx, authenticate)
        self._zap.start()
        self._lock = threading.Lock()
        self._steps = buffer_steps
        self._streams: dict[str, _Stream] = {}
        self._pub = self._ctx.socket(zmq.XPUB)
        harden(self._pub, lim, MAX_INBOUND)
        self._pub.setsockopt(zmq.XPUB_MANUAL, 1)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self.endpoint = self._bind(self._pub, host, port)
        self._router = self._ctx.socket(zmq.ROUTER)
        harden(self._router, lim, MAX_INBOUND)
        self.replay_endpoint = self._bind(self._router, host, 0)
        self.replay_requests = 0
        self.subscribed: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, name="kvplane-kv-replay",
                                        daemon=True)
        self._thread.start()

    @staticmethod
    def _bind(sock: zmq.Socket, host: str, port: int) -> str:
        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{port}"

    # -- subscriptions (manual mode) --------------------------------------------------------------
    def _subscriptions(self, timeout_ms: int = 0) -> int:
        """Apply pending subscription messages; each peer gets its own tenant's topic. Locked."""
        applied = 0
        while self._pub.poll(timeout_ms):
            timeout_ms = 0
            frame = self._pub.recv(copy=False)
            data = frame.bytes
            tenant = user_id(frame)
            if not data or data[0] not in (0, 1) or not tenant:
                continue
            opt = zmq.SUBSCRIBE if data[0] == 1 else zmq.UNSUBSCRIBE
            self._pub.setsockopt(opt, topic_of(tenant))
            if opt == zmq.SUBSCRIBE:
                self.subscribed[tenant] = self.subscribed.get(tenant, 0) + 1
                applied += 1
        return applied

    def wait_subscribed(self, timeout: float = 5.0) -> None:
        """Block until a subscriber's subscription arrives (and apply it).

        Raises:
            Timeout: none within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            with self._lock:
                if self._subscriptions(int(min(left, 0.05) * 1000) + 1):
                    return
        raise Timeout(f"no subscriber on {self.endpoint} within {timeout}s")

    # -- publishing ----------------------------------------------------------------------------
    def publish(self, tenant: str, events: Sequence[msgspec.Struct], dp_rank: int = 0) -> int:
        """Send one batch on ``tenant``'s stream; returns its sequence number."""
        payload = encode_batch(events, dp_rank, time.time())
        with self._lock:
            self._subscriptions()
            stream = self._streams.setdefault(tenant, _Stream(self._steps))
            seq = stream.seq
            stream.seq += 1
            stream.ring.append((seq, payload))
            self._pub.send_multipart([topic_of(tenant), encode_seq(seq), payload], copy=False)
        return seq

    def last_seq(self, tenant: str) -> int:
        """The last sequence number sent on ``tenant``'s stream (-1: none)."""
        with self._lock:
            stream = self._streams.get(tenant)
            return stream.seq - 1 if stream is not None else -1

    # -- replay ----------------------------------------------------------------------------------
    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self._router.poll(50):
                continue
            frames = self._router.recv_multipart(copy=False)
            tenant = user_id(frames[-1]) if frames else ""
            if len(frames) != 3 or not tenant:
                continue
            ident, start = frames[0].bytes, int.from_bytes(frames[2].bytes[:8], "big")
            self.replay_requests += 1
            with self._lock:
                stream = self._streams.get(tenant)
                items = [(s, p) for s, p in stream.ring if s >= start] if stream else []
            for s, p in items:
                self._router.send_multipart([ident, b"", encode_seq(s), p])
            self._router.send_multipart([ident, b"", encode_seq(END_OF_REPLAY), b""])
        self._router.close(0)

    def close(self) -> None:
        """Stop the threads and close the sockets (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(5)
        with self._lock:
            self._pub.close(0)
        self._zap.stop()
        self._ctx.destroy(linger=0)

    def __enter__(self) -> SecurePublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
