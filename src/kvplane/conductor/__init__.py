"""Conductor: a global KV cache index fed by vLLM KV events, answering Mooncake's tiered queries.

Modules: ``hashing`` (vLLM block hashes), ``events`` (event decoding), ``indexer`` (the pure
index), ``service`` (in-process API), ``ingest`` (ZMQ SUB + replay), ``api`` (HTTP),
``server`` (wiring), ``fakes`` (a vLLM-compatible publisher for tests). Importing this package
does not import zmq or the HTTP stack.
"""

from kvplane.conductor.config import DEFAULT_PORT, ConductorConfig
from kvplane.conductor.events import Tier
from kvplane.conductor.hashing import HashProfile
from kvplane.conductor.indexer import ContextKey, Holder, Match, PrefixIndex
from kvplane.conductor.service import Conductor, QueryRequest, Registration

__all__ = [
    "DEFAULT_PORT", "Conductor", "ConductorConfig", "ContextKey", "HashProfile", "Holder",
    "Match", "PrefixIndex", "QueryRequest", "Registration", "Tier",
]
