"""``kvplane router``: a cache-aware OpenAI gateway in front of vLLM instances (docs/router.md).

Modules: ``config`` (backend specs, ``GatewayConfig``), ``pool`` (health, ejection, ``/metrics``
scrapes, discovery, index registration), ``relay`` (SSE framing, error events, racing reads
against ejection), ``proxy`` (tokenize, hash, route, relay, retry; colocated and PD),
``app`` (FastAPI), ``server`` (wiring; the only module that binds), ``instruments``
(Prometheus). The policies are the shared ones of ``conductor.scheduling``. Importing this
package imports neither FastAPI nor zmq.
"""

from kvplane.conductor.gateway.config import BackendSpec, GatewayConfig

__all__ = ["BackendSpec", "GatewayConfig"]
