"""Prometheus metrics of the conductor (default registry, served at ``/metrics``).

Must not import sockets or the HTTP stack.
"""

from __future__ import annotations

from kvplane.common.metrics import Counter, Gauge, Histogram

__all__ = ["BATCHES", "BLOCKS", "SKIPPED", "HASH_MISMATCH", "REPLAY", "QUERY_SECONDS",
           "INDEX_SIZE", "STREAMS"]

BATCHES = Counter("kvplane_conductor_batches_total", "KV event batches received", ["outcome"])
BLOCKS = Counter("kvplane_conductor_block_events_total",
                 "Index entries changed by KV events (cleared counts events)", ["kind"])
SKIPPED = Counter("kvplane_conductor_skipped_total",
                  "Messages or events skipped without stopping ingest", ["reason"])
HASH_MISMATCH = Counter("kvplane_conductor_hash_mismatch_total",
                        "Hash profile mismatches (registration conflicts, events that do not "
                        "reproduce)", ["reason"])
REPLAY = Counter("kvplane_conductor_replay_total", "Replay requests for sequence gaps", ["outcome"])
QUERY_SECONDS = Histogram("kvplane_conductor_query_seconds", "Prefix query latency", ["kind"],
                          buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0))
INDEX_SIZE = Gauge("kvplane_conductor_index_size", "Index sizes at the last scrape", ["what"])
STREAMS = Gauge("kvplane_conductor_streams", "Registered (instance, DP rank) streams")
