"""A KV event publisher that speaks vLLM's wire format (the store's pool events use it; tests and
benchmarks use it to play engines).

``KVEventPublisher`` mirrors vLLM's ``ZmqEventPublisher``: msgspec-encoded batches (tagged-map
events, or the older positional arrays), 3-frame messages ``[topic, seq(8B BE), payload]`` with
``seq`` counting from 0, a bounded replay ring served on a ROUTER socket, and a data-parallel rank
in every batch. It uses an XPUB socket so callers can *wait* for the subscriber to connect instead
of sleeping. It can drop chosen sequence numbers, send raw frames and restart. It checks no token
(vLLM's does not), but its sockets cap inbound messages, the handshake time and silent peers
(``kvplane.kvevents.secure.harden``); the authenticated variant is ``secure.SecurePublisher``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

import msgspec
import zmq

from kvplane.common.errors import Timeout
from kvplane.common.guard import Limits
from kvplane.kvevents.codec import END_OF_REPLAY, encode_batch, encode_seq
from kvplane.kvevents.secure import MAX_INBOUND, harden


class KVEventPublisher:
    """A vLLM-compatible KV event publisher (XPUB + replay ROUTER).

    Args:
        connect: connect the XPUB to this endpoint (a conductor's bound SUB) instead of binding.
        host: interface to bind on (port 0, read :attr:`endpoint` / :attr:`replay_endpoint`).
        topic: topic frame of every message.
        dp_rank: rank put in every batch.
        replay: serve a replay ROUTER socket.
        replay_topic: include the topic frame in replay replies (newer vLLM).
        buffer_steps: replay ring length.
    """

    def __init__(self, *, connect: str | None = None, host: str = "127.0.0.1", topic: str = "",
                 dp_rank: int = 0, replay: bool = True, replay_topic: bool = False,
                 buffer_steps: int = 10_000, port: int | None = None) -> None:
        self._ctx = zmq.Context()
        self.topic, self.dp_rank = topic.encode(), dp_rank
        self._host, self._connect, self._replay_topic = host, connect, replay_topic
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._seq = 0
        self._pub, self.endpoint = self._open_pub(port)
        self._stop = threading.Event()
        self.replay_endpoint: str | None = None
        self.replay_requests = 0
        self._thread: threading.Thread | None = None
        if replay:
            self._router = self._ctx.socket(zmq.ROUTER)
            harden(self._router, Limits.from_env(), MAX_INBOUND, server=False)
            port = self._router.bind_to_random_port(f"tcp://{host}")
            self.replay_endpoint = f"tcp://{host}:{port}"
            self._thread = threading.Thread(target=self._serve_replay, name="kvplane-kv-replay",
                                            daemon=True)
            self._thread.start()

    def _open_pub(self, port: int | None, timeout: float = 5.0) -> tuple[zmq.Socket, str]:
        pub = self._ctx.socket(zmq.XPUB)
        harden(pub, Limits.from_env(), MAX_INBOUND, server=False)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        if self._connect is not None:
            pub.connect(self._connect)
            return pub, self._connect
        if port is None:
            port = pub.bind_to_random_port(f"tcp://{self._host}")
        else:  # rebinding the same port right after a close may need a few tries
            deadline = time.monotonic() + timeout
            while True:
                try:
                    pub.bind(f"tcp://{self._host}:{port}")
                    break
                except zmq.ZMQError:
                    if time.monotonic() > deadline:
                        raise
                    threading.Event().wait(0.01)
        return pub, f"tcp://{self._host}:{port}"

    def wait_subscribed(self, timeout: float = 5.0) -> None:
        """Block until a subscriber's subscription reaches this publisher.

        Raises:
            Timeout: if none arrives within ``timeout`` seconds.
        """
        if not self._pub.poll(int(timeout * 1000)):
            raise Timeout(f"no subscriber on {self.endpoint} within {timeout}s")
        self._pub.recv()

    def publish(self, events: Sequence[msgspec.Struct], *, drop: bool = False) -> int:
        """Encode and send one batch (or only record it in the replay ring when ``drop``).

        Returns:
            The batch's sequence number.
        """
        return self.publish_payload(encode_batch(events, self.dp_rank, time.time()), drop=drop)

    def publish_payload(self, payload: bytes, *, drop: bool = False) -> int:
        """Send an already encoded payload with the next sequence number."""
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._ring.append((seq, payload))
        if not drop:
            self._pub.send_multipart([self.topic, encode_seq(seq), payload], copy=False)
        return seq

    def send_raw(self, frames: Sequence[bytes]) -> None:
        """Send arbitrary frames (for malformed-input tests); no sequence number is used."""
        self._pub.send_multipart(list(frames))

    def restart(self) -> None:
        """Simulate a restarted engine: same endpoint, sequence back to 0, empty replay ring."""
        port = None if self._connect else int(self.endpoint.rsplit(":", 1)[1])
        self._pub.close(0)
        with self._lock:
            self._seq = 0
            self._ring.clear()
        self._pub, self.endpoint = self._open_pub(port)

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self._router.poll(50):
                continue
            frames = self._router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, start_b = frames
            start = int.from_bytes(start_b, "big")
            self.replay_requests += 1
            with self._lock:
                items = [(s, p) for s, p in self._ring if s >= start]
            head = [ident, b""] + ([self.topic] if self._replay_topic else [])
            for s, p in items:
                self._router.send_multipart(head + [encode_seq(s), p])
            self._router.send_multipart(head + [encode_seq(END_OF_REPLAY), b""])
        self._router.close(0)

    def close(self) -> None:
        """Stop the replay thread and close the sockets (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._pub.close(0)
        self._ctx.destroy(linger=0)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
