"""Prometheus metrics of ``kvplane router`` (default registry, served at its ``/metrics``).

Must not import sockets or the HTTP stack.
"""

from __future__ import annotations

from kvplane.common.metrics import Counter, Gauge, Histogram

__all__ = ["ROUTED", "REJECTED", "FAILED", "RETRIES", "RECONNECTS", "STREAM_ERRORS", "HIT_BLOCKS",
           "PROMPT_BLOCKS", "UPSTREAM_ERRORS", "EJECTIONS", "BACKEND_UP", "BACKEND_QUEUE", "SLOWDOWN",
           "TOKENIZE_SECONDS", "TOKENIZE_ERRORS", "ROUTE_SECONDS"]

ROUTED = Counter("kvplane_router_routed_total", "Requests sent to a backend (retries included)",
                 ["backend", "phase"])
REJECTED = Counter("kvplane_router_rejected_total",
                   "Requests refused with 429 (policy predicted an SLO miss)", ["reason"])
FAILED = Counter("kvplane_router_failed_total",
                 "Requests answered with an error status (no backend, upstream failure)", ["reason"])
RETRIES = Counter("kvplane_router_retries_total",
                  "Requests re-sent to another backend after a failure before the first token",
                  ["phase"])
RECONNECTS = Counter("kvplane_router_reconnects_total",
                     "Requests sent once more, on a fresh connection to the same backend, after "
                     "it dropped the connection before any answer (a kept-alive connection it "
                     "had just closed)", ["backend"])
STREAM_ERRORS = Counter("kvplane_router_stream_errors_total",
                        "Streams ended with an SSE error event after the first token", ["reason"])
HIT_BLOCKS = Counter("kvplane_router_hit_blocks_total",
                     "Prompt blocks the index showed cached on the chosen prefill instance")
PROMPT_BLOCKS = Counter("kvplane_router_prompt_blocks_total", "Complete prompt blocks routed")
UPSTREAM_ERRORS = Counter("kvplane_router_upstream_errors_total",
                          "Failed upstream calls by backend and kind", ["backend", "kind"])
EJECTIONS = Counter("kvplane_router_ejections_total", "Backends taken out of rotation",
                    ["backend", "reason"])
BACKEND_UP = Gauge("kvplane_router_backend_up", "1 while a backend is in rotation", ["backend"])
SLOWDOWN = Gauge("kvplane_router_prefill_slowdown",
                 "Measured / predicted time to the first token (running mean); booked prefill "
                 "work is scaled by it")
BACKEND_QUEUE = Gauge("kvplane_router_backend_queue",
                      "Per-backend load: in_flight (ours), queued_prefill (ours), predicted_queue_s, "
                      "and the engine's running / waiting from its /metrics", ["backend", "what"])
TOKENIZE_SECONDS = Histogram("kvplane_router_tokenize_seconds", "Prompt tokenization latency",
                             buckets=(5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0))
TOKENIZE_ERRORS = Counter("kvplane_router_tokenize_errors_total",
                          "Tokenizations that failed (the request was routed cache-blind)")
ROUTE_SECONDS = Histogram("kvplane_router_route_seconds",
                          "From a request's arrival to its routing decision (tokenize, hash, "
                          "index match, policy)",
                          buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 0.1))
