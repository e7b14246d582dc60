"""A probe for HA tests: asks one master (a plain ``host:port``, no leader lookup) for a put
allocation over and over, and reports when it last acknowledged one.

    python -m tests.support.master_probe --master HOST:PORT --seconds 12 [--token T]

(default token: ``KVPLANE_TOKEN`` or the token file, as a client's).

Prints a ready line, then after ``--seconds`` one JSON line: ``answered`` (PutStart answered
with results), ``not_leader`` (refused with NotLeader), ``failed`` (no answer: timeouts,
refused connections), and ``last_answer`` / ``first_not_leader``: CLOCK_MONOTONIC seconds of
the last acknowledgement and the first NotLeader (the clock is the same in every network
namespace of the machine, so the test compares it with its own). Every call has a 0.5 s
timeout; the probe never writes bytes, so its allocations stay unfinished puts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvplane.common.auth import client_token
from kvplane.common.errors import KVPlaneError
from kvplane.common.rpc import RpcClient
from kvplane.store.errors import NotLeader
from kvplane.store.types import PutStartReq, ReplicateConfig, ResultsRep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--master", required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--token", default=None, help="default: the local client token")
    a = ap.parse_args(argv)
    out = {"answered": 0, "not_leader": 0, "failed": 0, "last_answer": 0.0,
           "first_not_leader": 0.0}
    rpc = RpcClient(a.master, client_token() if a.token is None else a.token, 0.5)
    print(json.dumps({"probe": a.master}), flush=True)
    end, i = time.monotonic() + a.seconds, 0
    while time.monotonic() < end:
        i += 1
        req = PutStartReq("probe", [f"probe-{i}"], [64], ReplicateConfig())
        try:
            rpc.call("put_start", req, ResultsRep, timeout=0.5)
            out["answered"] += 1
            out["last_answer"] = time.monotonic()
        except NotLeader:
            out["not_leader"] += 1
            out["first_not_leader"] = out["first_not_leader"] or time.monotonic()
        except KVPlaneError:
            out["failed"] += 1
        time.sleep(0.02)  # about 50 probes a second
    rpc.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
