"""ZMQ ingest of vLLM KV events: SUB sockets, sequence tracking, gap replay, restarts.

One named daemon thread owns every ZMQ socket of the ingest path (zmq sockets are not
thread-safe): a SUB per registered stream that has an ``endpoint`` (the conductor connects to the
engine's PUB), the SUB sockets it binds for engines that connect to it (``bind``; messages are
routed by topic), and short-lived DEALER sockets for replay requests.

Per stream the last sequence number is kept. A jump forward is a gap: the missing range is asked
from the publisher's ROUTER replay socket (``[b"", start(8B BE)]`` -> ``[b"", (topic,) seq,
payload]``... ``seq == -1``) and applied in order before the new batch; if the range cannot be
fully replayed, the stream's entries are dropped (stale hits are worse than misses) and rebuilt
from live events. A jump backwards means the publisher restarted with an empty cache: its entries
are dropped and whatever its replay ring holds is applied. Malformed frames, undecodable batches,
oversized payloads and unknown topics are counted and skipped; ingest never stops on content.

Every socket finishes its ZMQ handshake within the handshake timeout, drops silent peers with
ZMTP heartbeats and refuses frames past 4x ``max_batch_bytes``. A stream registered with a
``token`` connects with ZMQ PLAIN (the token as password), as an authenticated kvplane master
requires; bound SUB sockets cannot authenticate (vLLM's publisher sends no credentials).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass

import zmq

from kvplane.common.errors import ProtocolError
from kvplane.common.guard import Limits
from kvplane.conductor import instruments
from kvplane.conductor.service import Conductor, Stream
from kvplane.kvevents import EventBatch, decode_batch, decode_seq
from kvplane.kvevents.secure import harden

log = logging.getLogger(__name__)
_ids = itertools.count()
_HARD_LIMIT_FACTOR = 4


@dataclass
class IngestStats:
    """Counters of the ingest thread (read them from any thread; only it writes)."""

    messages: int = 0
    batches: int = 0
    events: int = 0
    malformed: int = 0
    oversized: int = 0
    unknown_stream: int = 0
    gaps: int = 0
    replayed: int = 0
    replay_failures: int = 0
    restarts: int = 0
    resets: int = 0


class EventIngestor:
    """Receives KV event batches for every registered stream and applies them to a Conductor.

    Args:
        conductor: where batches go; registration changes are picked up through its listener.
        bind: SUB endpoints to bind (``tcp://127.0.0.1:0`` picks a free port; read
            :attr:`endpoints`).

    Use as a context manager, or call :meth:`start` and :meth:`close`.
    """

    def __init__(self, conductor: Conductor, bind: tuple[str, ...] = ()) -> None:
        self._c = conductor
        self._limit = conductor.config.max_batch_bytes
        self._limits = Limits.from_env()
        self.stats = IngestStats()
        self._zctx = zmq.Context()
        self._wake_addr = f"inproc://kvplane-ingest-{next(_ids)}"
        self._wake_rx = self._zctx.socket(zmq.PAIR)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self._zctx.socket(zmq.PAIR)
        self._wake_tx.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._cmds: queue.SimpleQueue[tuple[str, Stream | None]] = queue.SimpleQueue()
        self._bound: list[zmq.Socket] = []
        self.endpoints: list[str] = []
        for ep in bind:
            self._bind(ep)
        self._subs: dict[tuple[str, str, int], zmq.Socket] = {}
        self._by_sock: dict[zmq.Socket, Stream] = {}
        self._last: dict[tuple[str, str, int], int] = {}
        self._thread = threading.Thread(target=self._main, name="kvplane-conductor-ingest", daemon=True)
        self._started = threading.Event()
        self._closed = False
        conductor.add_listener(self._on_change)

    def _sub(self, token: str = "") -> zmq.Socket:
        s = self._zctx.socket(zmq.SUB)
        self._harden(s, token)
        s.setsockopt(zmq.RCVHWM, 100_000)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        return s

    def _harden(self, sock: zmq.Socket, token: str) -> None:
        harden(sock, self._limits, _HARD_LIMIT_FACTOR * self._limit, server=False)
        if token:
            sock.setsockopt(zmq.PLAIN_USERNAME, b"kvplane")
            sock.setsockopt(zmq.PLAIN_PASSWORD, token.encode())

    def _bind(self, ep: str) -> None:
        s = self._sub()
        if ep.startswith("tcp://") and ep.endswith(":0"):
            port = s.bind_to_random_port(ep[: -len(":0")])
            ep = f"{ep[: -len(':0')]}:{port}"
        else:
            s.bind(ep)
        self._bound.append(s)
        self.endpoints.append(ep)

    # lifecycle ---------------------------------------------------------------------------------
    def start(self, timeout: float = 5.0) -> EventIngestor:
        """Start the ingest thread and subscribe to already-registered streams."""
        for s in self._c.streams():
            self._cmds.put(("add", s))
        self._thread.start()
        self._started.wait(timeout)
        self._wake()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread, close every socket (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._cmds.put(("stop", None))
            self._wake()
            self._thread.join(timeout)
        with self._wake_lock:
            self._wake_tx.close(0)
        if not self._thread.is_alive():
            self._zctx.destroy(linger=0)

    def __enter__(self) -> EventIngestor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_change(self, added: list[Stream], removed: list[Stream]) -> None:
        for s in removed:
            self._cmds.put(("remove", s))
        for s in added:
            self._cmds.put(("add", s))
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            if not self._closed or self._thread.is_alive():
                try:
                    self._wake_tx.send(b"", zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # a wake-up is already queued

    # thread ----------------------------------------------------------------------------------
    def _main(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        for s in self._bound:
            poller.register(s, zmq.POLLIN)
        self._started.set()
        while True:
            for sock, _ in poller.poll(1000):
                if sock is self._wake_rx:
                    while self._wake_rx.poll(0):
                        self._wake_rx.recv()
                    if not self._commands(poller):
                        self._shutdown()
                        return
                else:
                    self._drain(sock)

    def _commands(self, poller: zmq.Poller) -> bool:
        while True:
            try:
                op, stream = self._cmds.get_nowait()
            except queue.Empty:
                return True
            if op == "stop" or stream is None:
                return False
            if op == "add" and stream.endpoint is not None and stream.key not in self._subs:
                s = self._sub(stream.reg.token)
                s.connect(stream.endpoint)
                self._subs[stream.key] = s
                self._by_sock[s] = stream
                poller.register(s, zmq.POLLIN)
            elif op == "remove":
                self._last.pop(stream.key, None)
                gone = self._subs.pop(stream.key, None)
                if gone is not None:
                    poller.unregister(gone)
                    del self._by_sock[gone]
                    gone.close(0)

    def _shutdown(self) -> None:
        for s in list(self._subs.values()) + self._bound + [self._wake_rx]:
            s.close(0)

    def _drain(self, sock: zmq.Socket, budget: int = 256) -> None:
        for _ in range(budget):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_message(frames, self._by_sock.get(sock))

    def _skip(self, reason: str) -> None:
        instruments.SKIPPED.labels(reason=reason).inc()
        setattr(self.stats, reason, getattr(self.stats, reason) + 1)
        self._c.notify_waiters()

    def _on_message(self, frames: list[bytes], stream: Stream | None) -> None:
        self.stats.messages += 1
        if len(frames) != 3:
            self._skip("malformed")
            return
        topic, seq_frame, payload = frames
        try:
            seq = decode_seq(seq_frame)
        except ProtocolError:
            self._skip("malformed")
            return
        if len(payload) > self._limit:
            self._skip("oversized")
            self._advance(stream, seq)
            return
        try:
            batch = decode_batch(payload)
        except ProtocolError:
            self._skip("malformed")
            self._advance(stream, seq)
            return
        if stream is None:
            stream = self._c.stream_for_topic(topic.decode("utf-8", "replace"), batch.dp_rank)
            if stream is None:
                self._skip("unknown_stream")
                return
        self._sequence(stream, seq, batch)

    def _advance(self, stream: Stream | None, seq: int) -> None:
        """A skipped batch still consumed its sequence number (no replay storm for it)."""
        if stream is not None and self._last.get(stream.key, -2) == seq - 1:
            self._last[stream.key] = seq

    def _sequence(self, stream: Stream, seq: int, batch: EventBatch) -> None:
        key = stream.key
        last = self._last.get(key)
        if last is None:
            if seq > 0 and stream.replay_endpoint:
                self._replay(stream, 0, seq, catch_up=True)  # what the ring still holds
        elif seq > last + 1:
            self.stats.gaps += 1
            if not self._replay(stream, last + 1, seq):
                self.stats.resets += 1
                self._c.reset_stream(stream, "unhealed_gap")
        elif seq <= last:
            self.stats.restarts += 1
            self.stats.resets += 1
            self._c.reset_stream(stream, "publisher_restart")
            if seq > 0 and stream.replay_endpoint:
                self._replay(stream, 0, seq, catch_up=True)
        self._apply(stream, seq, batch)

    def _apply(self, stream: Stream, seq: int, batch: EventBatch) -> None:
        self._last[stream.key] = seq
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        instruments.BATCHES.labels(outcome="applied").inc()
        self._c.apply(stream, batch, seq)

    def _replay(self, stream: Stream, start: int, stop: int, catch_up: bool = False) -> bool:
        """Fetch and apply batches ``start <= seq < stop``; True if none was missing.

        With ``catch_up`` (first contact, or a restarted publisher) the ring may have lost the
        oldest batches: the contiguous tail it still holds is applied. That is safe: a missed
        early store only under-reports, and no later remove is missed.
        """
        if not stream.replay_endpoint:
            instruments.REPLAY.labels(outcome="no_endpoint").inc()
            self.stats.replay_failures += 1
            return False
        got = self._fetch(stream.replay_endpoint, start, stop, stream.reg.token)
        expected = got[0][0] if catch_up and got else start
        for seq, payload in got:
            if seq != expected:
                break
            expected = seq + 1
            if len(payload) > self._limit:
                self._skip("oversized")
                continue
            try:
                batch = decode_batch(payload)
            except ProtocolError:
                self._skip("malformed")
                continue
            self.stats.replayed += 1
            self._apply(stream, seq, batch)
        ok = expected == stop
        instruments.REPLAY.labels(outcome="healed" if ok else "incomplete").inc()
        if not ok:
            self.stats.replay_failures += 1
            log.warning("replay of %s rank %s seq %d..%d from %s incomplete (got up to %d)",
                        stream.reg.instance_id, stream.dp_rank, start, stop - 1,
                        stream.replay_endpoint, expected - 1)
        return ok

    def _fetch(self, endpoint: str, start: int, stop: int, token: str = "") -> list[tuple[int, bytes]]:
        """One replay round trip on a fresh DEALER, bounded by the configured replay timeout."""
        deadline = time.monotonic() + self._c.config.replay_timeout
        out: list[tuple[int, bytes]] = []
        d = self._zctx.socket(zmq.DEALER)
        self._harden(d, token)
        try:
            d.connect(endpoint)
            d.send_multipart([b"", start.to_bytes(8, "big")])
            while (left := deadline - time.monotonic()) > 0:
                if not d.poll(int(left * 1000) + 1):
                    break
                frames = d.recv_multipart()
                if len(frames) not in (3, 4) or frames[0] != b"":
                    self._skip("malformed")
                    continue
                try:
                    seq = decode_seq(frames[-2])
                except ProtocolError:
                    self._skip("malformed")
                    continue
                if seq == -1:
                    break
                if start <= seq < stop:
                    out.append((seq, frames[-1]))
        finally:
            d.close(0)
        out.sort(key=lambda t: t[0])
        return out
