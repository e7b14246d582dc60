"""Configuration of ``kvplane router``: backend specs and one frozen config, every field documented.

Must not import sockets or the HTTP stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from kvplane.common.errors import InvalidArgument
from kvplane.conductor.hashing import HashProfile

Role = Literal["both", "prefill", "decode"]
Mode = Literal["colocated", "pd"]
_SPEC_KEYS = ("id", "events", "replay", "topic")
_POOL_KEYS = ("replay", "token", "id", "type")


def _check_endpoints(*endpoints: str | None) -> None:
    """Refuse a ZMQ endpoint that is not tcp://, ipc:// or inproc:// (None: not given)."""
    for ep in endpoints:
        if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
            raise InvalidArgument(f"bad ZMQ endpoint {ep!r}")


def _options(text: str, keys: tuple[str, ...], what: str,
             echo: bool = True) -> tuple[str, dict[str, str]]:
    """``HEAD[,key=value]...``: the head and the options, each key one of ``keys``.
    ``echo``: a bad option's error quotes it and the text (off where values are secrets).

    Raises:
        InvalidArgument: an unknown key or a part without ``=``.
    """
    head, *parts = [p.strip() for p in text.split(",")]
    kw: dict[str, str] = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq or key not in keys:
            shown = f"{part!r} in {text!r}" if echo else repr(key)
            raise InvalidArgument(f"bad {what} option {shown}; keys: {keys}")
        kw[key] = value
    return head, kw


@dataclass(frozen=True)
class BackendSpec:
    """One vLLM OpenAI server behind the router.

    Attributes:
        url: base URL, e.g. ``http://127.0.0.1:8001`` (no trailing slash).
        role: ``both`` (colocated), ``prefill`` or ``decode`` (PD mode).
        id: instance id in the index and in metrics (default: ``host:port`` of the URL).
        events: the engine's ZMQ PUB endpoint to connect to (vLLM binds it when it has a ``*``
            or is ``ipc://``); None when the engine connects to the router's ``--bind`` socket
            with ``topic``, or publishes no events.
        replay: the engine's ZMQ ROUTER replay endpoint (heals sequence gaps).
        topic: the topic the engine publishes under (default ``kv@<id>``).
    """

    url: str
    role: Role = "both"
    id: str = ""
    events: str | None = None
    replay: str | None = None
    topic: str = ""

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidArgument(f"backend URL must be http(s)://host:port, got {self.url!r}")
        if self.role not in ("both", "prefill", "decode"):
            raise InvalidArgument(f"backend role must be both|prefill|decode, got {self.role!r}")
        object.__setattr__(self, "url", self.url.rstrip("/"))
        if not self.id:
            object.__setattr__(self, "id", parts.netloc)
        if not self.topic:
            object.__setattr__(self, "topic", f"kv@{self.id}")
        _check_endpoints(self.events, self.replay)

    @classmethod
    def parse(cls, text: str, role: Role = "both") -> BackendSpec:
        """``URL[,id=NAME][,events=ENDPOINT][,replay=ENDPOINT][,topic=TOPIC]``.

        Raises:
            InvalidArgument: an unknown key or a malformed part.
        """
        url, kw = _options(text, _SPEC_KEYS, "backend")
        return cls(url, role, kw.get("id", ""), kw.get("events"), kw.get("replay"),
                   kw.get("topic", ""))

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> BackendSpec:
        """A spec from a discovery record ``{"url", "role"?, "id"?, "events"?, "replay"?, "topic"?}``.

        Raises:
            InvalidArgument: missing URL or a bad field.
        """
        if not isinstance(data, dict) or not isinstance(data.get("url"), str):
            raise InvalidArgument(f"a backend record needs a string 'url': {data!r}")
        kw = {k: data[k] for k in ("role", "id", "events", "replay", "topic")
              if isinstance(data.get(k), str)}
        return cls(data["url"], **kw)  # type: ignore[arg-type]  # only str fields are kept


@dataclass(frozen=True)
class PoolSpec:
    """A shared KV pool whose KV events the router indexes: a prefix it holds counts for
    every instance (a kvplane master started with ``--kv-events-port``, or Mooncake's).

    Attributes:
        events: the pool's ZMQ PUB endpoint (a kvplane master: its ``kv_events`` endpoint).
        replay: its ZMQ ROUTER replay endpoint (heals sequence gaps), or None.
        token: presented to a publisher that requires one (a kvplane master with a token:
            the token of the tenant whose objects the engines store); never listed.
        id: its id in the index (not a routing target).
        type: ``kvplane`` or ``mooncake``.
    """

    events: str
    replay: str | None = None
    token: str = field(default="", repr=False)
    id: str = "pool"
    type: str = "kvplane"

    def __post_init__(self) -> None:
        _check_endpoints(self.events, self.replay)
        if self.type not in ("kvplane", "mooncake") or not self.id:
            raise InvalidArgument(f"a pool needs an id and type kvplane|mooncake, got "
                                  f"{self.id!r}, {self.type!r}")

    @classmethod
    def parse(cls, text: str) -> PoolSpec:
        """``ENDPOINT[,replay=ENDPOINT][,token=TOKEN][,id=NAME][,type=kvplane|mooncake]``.

        Raises:
            InvalidArgument: an unknown key or a malformed part.
        """
        events, kw = _options(text, _POOL_KEYS, "pool", echo=False)  # (a token is a secret)
        return cls(events, kw.get("replay"), kw.get("token", ""), kw.get("id", "pool"),
                   kw.get("type", "kvplane"))


@dataclass(frozen=True)
class GatewayConfig:
    """Settings of one ``kvplane router`` process.

    Attributes:
        host: HTTP bind address.
        port: HTTP port (0 picks a free one).
        token: shared token for the router's own endpoints (all but ``/health``) and sent to
            the backends (``Authorization: Bearer``); empty = none.
        mode: ``colocated`` (each backend prefills and decodes) or ``pd`` (prefill and decode
            backends; a prefill hands its KV to a decode instance).
        backends: static backends (role ``both`` in colocated mode, ``prefill``/``decode`` in PD).
        pools: shared KV pools whose KV events the router indexes (``--pool``): a prefix a
            pool holds is reusable on every instance.
        model: served model name, used as the index context (``""``: ask the first backend).
        block_size: engine KV block size in tokens (0: read it from a backend's ``/metrics``).
        hash_profile: how the engines hash blocks (``--prefix-caching-hash-algo`` and their
            ``PYTHONHASHSEED``; vLLM 0.32's tagged extra keys, so a ``cache_salt`` hashes right).
        policy: scheduling policy spec (``name@knob=value``), from the shared registry.
        settings: ``section.field=value`` overrides of the policy's time model and knobs.
        reject: early rejection (HTTP 429) when the policy predicts an SLO miss; off by default.
        retry_after_s: ``Retry-After`` seconds sent with a 429.
        pull_hints: keep Mooncake's prefix pulls in decisions (``/route`` reports the source);
            off by default because a proxied vLLM cannot act on them.
        bind: ZMQ SUB endpoints the router binds for engines that connect their publishers.
        discover: metadata service URL (``http://h:p/metadata``, ``etcd://``, ``redis://``)
            holding the backend list; empty = static backends only.
        discover_key: the metadata key whose JSON list of backend records is read.
        discover_interval_s: seconds between reads of the backend list.
        connect_timeout_s: TCP connect timeout of every upstream call.
        read_timeout_s: longest wait for the next bytes of an upstream answer (incl. the first).
        request_timeout_s: longest a whole non-streamed upstream answer may take.
        tokenize_timeout_s: timeout of one ``/tokenize`` call (a failure routes cache-blind).
        health_interval_s: seconds between two health checks of a backend.
        health_timeout_s: timeout of one health check.
        eject_after: consecutive failed checks (timeouts, errors) that eject a backend; a
            refused connection ejects at once.
        admit_after: consecutive good checks that re-admit an ejected backend.
        retries: how many times a request that failed before its first token is sent again,
            each time to an instance not tried yet (colocated, and the prefill in PD; a failed
            decode moves once). 2 by default: on a loaded host a live instance can miss its
            connect timeout while another dies, and the third instance should then serve.
        stream_grace_s: once a backend is ejected, each of its running streams goes on while its
            next event arrives within this many seconds, else it ends with an error event. A
            backend ejected because a loaded host starved its health checks keeps its streams
            through normal gaps between tokens (a long prefill step can take a second); a hung
            one has them ended this long after its ejection.
        metrics_interval_s: seconds between two scrapes of a backend's ``/metrics``.
        max_request_bytes: largest request body accepted (413 beyond).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    token: str = ""
    mode: Mode = "colocated"
    backends: tuple[BackendSpec, ...] = ()
    pools: tuple[PoolSpec, ...] = ()
    model: str = ""
    block_size: int = 0
    hash_profile: HashProfile = field(default_factory=lambda: HashProfile(strategy="vllm_v1_tagged"))
    policy: str = "mooncake"
    settings: tuple[tuple[str, str], ...] = ()
    reject: bool = False
    retry_after_s: int = 1
    pull_hints: bool = False
    bind: tuple[str, ...] = ()
    discover: str = ""
    discover_key: str = "kvplane/router/backends"
    discover_interval_s: float = 2.0
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    tokenize_timeout_s: float = 2.0
    health_interval_s: float = 0.5
    health_timeout_s: float = 0.5
    eject_after: int = 2
    admit_after: int = 1
    retries: int = 2
    stream_grace_s: float = 2.0
    metrics_interval_s: float = 1.0
    max_request_bytes: int = 8 << 20

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise InvalidArgument(f"bad port {self.port}")
        if not self.backends and not self.discover:
            raise InvalidArgument("give at least one backend (--backend, or --prefill and "
                                  "--decode) or a metadata service to discover them (--discover)")
        ids = [p.id for p in self.pools]
        if len(set(ids)) != len(ids) or set(ids) & {b.id for b in self.backends}:
            raise InvalidArgument(f"pool ids must be distinct from each other and from the "
                                  f"backends' ids: {ids}")
        roles = {b.role for b in self.backends}
        if self.mode not in ("colocated", "pd"):
            raise InvalidArgument(f"mode must be colocated or pd, got {self.mode!r}")
        if self.mode == "colocated" and roles - {"both"}:
            raise InvalidArgument("colocated mode takes --backend only (--prefill/--decode mean PD)")
        if self.mode == "pd" and ("both" in roles or (self.backends and not self.discover
                                                      and roles != {"prefill", "decode"})):
            raise InvalidArgument("PD mode needs --prefill and --decode backends (no --backend)")
        ids = [b.id for b in self.backends]
        if len(ids) != len(set(ids)):
            raise InvalidArgument(f"backend ids must be unique: {ids}")
        if min(self.block_size, self.retry_after_s, self.retries) < 0 or min(self.eject_after,
                                                                             self.admit_after) < 1:
            raise InvalidArgument("block_size, retry_after_s, retries >= 0; eject_after, admit_after >= 1")
        for name in ("connect_timeout_s", "read_timeout_s", "request_timeout_s",
                     "tokenize_timeout_s", "health_interval_s", "health_timeout_s",
                     "stream_grace_s", "metrics_interval_s", "discover_interval_s"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be > 0")

    @property
    def pd(self) -> bool:
        """True in prefill/decode mode."""
        return self.mode == "pd"

    @property
    def ejection_bound_s(self) -> float:
        """Worst-case seconds from a backend going silent to its ejection by health checks."""
        return self.health_interval_s + self.eject_after * self.health_timeout_s
