"""Conductor: a global KV cache index fed by vLLM KV events, answering Mooncake's tiered queries.

Modules: ``hashing`` (vLLM block hashes), ``indexer`` (the pure prefix index), ``service`` (the
in-process API over the index), ``ingest`` (ZMQ SUB + replay of ``kvplane.kvevents``), ``api``
(HTTP), ``server`` (process wiring), ``instruments`` (its Prometheus metrics), ``config``;
``scheduling/`` holds the routing policies and the trace simulator. Importing this package does
not import zmq or the HTTP stack.
"""

from kvplane.conductor.config import DEFAULT_PORT, ConductorConfig
from kvplane.conductor.hashing import HashProfile
from kvplane.conductor.indexer import ContextKey, Holder, Match, PrefixIndex
from kvplane.conductor.service import Conductor, QueryRequest, Registration
from kvplane.kvevents import Tier

__all__ = [
    "DEFAULT_PORT", "Conductor", "ConductorConfig", "ContextKey", "HashProfile", "Holder",
    "Match", "PrefixIndex", "QueryRequest", "Registration", "Tier",
]
