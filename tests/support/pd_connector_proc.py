"""Drive ``KVPlanePDConnector``'s worker side as vLLM's model runner does, on KV caches in
stand-in device memory (runs in the vLLM venv). Test kit, not product.

``python -m tests.support.pd_connector_proc '{"role": "prefill", ...}'``:

* ``prefill``: registers stand-in caches, writes seeded pages into ``blocks``, prints one ready
  line (its handshake: segment, notify address, layers, and the pages' sha256), holds request
  ``p1`` as a prefill worker does after ``request_finished``, and steps ``get_finished`` until
  a decoder's notification releases it (or ``hold_s`` passes); prints ``{"released": ...}``.
* ``decode``: registers zeroed stand-in caches, runs one step whose plan pulls the prefill's
  ``remote_blocks`` into ``blocks`` (``start_load_kv``), steps ``get_finished`` until the pull
  ends, prints the pages' sha256 and ``get_block_ids_with_load_errors``.

Both sides' engines meet device memory only through the stand-in's copier: the prefill's
listener stages device -> host for the READs it serves, the decoder stages host -> device.
``fail_to_host`` / ``fail_to_device`` make that many copy batches fail.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvplane.common.errors import Timeout
from kvplane.common.procs import wait_until
from kvplane.integrations.vllm.pd_connector import KVPlanePDConnector, PDMetadata
from kvplane.integrations.vllm.pd_plan import PullJob
from tests.support.standin_device import StandinDevice, vllm_caches
from tests.support.vllm_connector_proc import GEOM, NAMES, kv_cache_config, vllm_config


def connector() -> KVPlanePDConnector:
    extra = {"protocol": "tcp", "timeout": 10.0, "transfer_timeout": 120.0}
    return KVPlanePDConnector(vllm_config(extra), KVConnectorRole.WORKER, kv_cache_config())


def _within(step: Callable[[], bool], timeout: float) -> bool:
    """Step until ``step`` says done; False when ``timeout`` passed first."""
    try:
        wait_until(step, timeout, "the connector")
    except Timeout:
        return False
    return True


def pages(dev: StandinDevice, conn: KVPlanePDConnector, blocks: list[int]) -> list[str]:
    layout = conn._layout
    assert layout is not None
    addrs, sizes = layout.block_addrs(blocks)
    return [dev.digest(a, n) for a, n in zip(addrs, sizes)]


def run(req: dict[str, Any]) -> None:
    dev = StandinDevice("standin:0")
    dev.fail_to_host = int(req.get("fail_to_host", 0))
    dev.fail_to_device = int(req.get("fail_to_device", 0))
    caches = vllm_caches(dev, NAMES, layout=req.get("layout", "LBHNC"), **GEOM)
    conn = connector()
    try:
        conn.register_kv_caches(caches)
        layout = conn._layout
        assert layout is not None
        blocks = list(req["blocks"])
        if req["role"] == "prefill":
            addrs, sizes = layout.block_addrs(blocks)
            for i, (a, n) in enumerate(zip(addrs, sizes)):
                dev.write(a, hashlib.shake_256(f"{req['seed']}/{i}".encode()).digest(n))
            hs = conn.get_handshake_metadata()
            assert hs is not None
            print(json.dumps({"segment": hs.segment, "notify": hs.notify, "layers": hs.layers,
                              "device": layout.device, "pages": pages(dev, conn, blocks)}),
                  flush=True)
            conn.bind_connector_metadata(PDMetadata(held=["p1"]))
            conn.start_load_kv(None)
            conn.clear_connector_metadata()
            finished = {"p1"}

            def step() -> bool:  # one engine step: vLLM reports the finished request once
                sent, _ = conn.get_finished(finished)
                finished.clear()
                return bool(sent and "p1" in sent)

            print(json.dumps({"released": _within(step, float(req.get("hold_s", 60)))}),
                  flush=True)
            return
        job = PullJob("d1", blocks, list(req["remote_blocks"]), req["segment"], req["notify"],
                      req["layers"], "p1")
        conn.bind_connector_metadata(PDMetadata(pulls=[job]))
        conn.start_load_kv(None)
        conn.clear_connector_metadata()
        def pulled() -> bool:
            _, recv = conn.get_finished(set())
            return bool(recv and "d1" in recv)

        done = _within(pulled, 60)
        print(json.dumps({"done": done, "device": layout.device,
                          "errors": sorted(conn.get_block_ids_with_load_errors()),
                          "pages": pages(dev, conn, blocks)}), flush=True)
    finally:
        conn.shutdown()


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
