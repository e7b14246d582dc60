"""A holder that dies (kill -9), stalls (SIGSTOP) or is partitioned mid-transfer costs only retries.

Runs on the netns bed (one host per node, every link capped so a chunk takes long enough to be
cut): a full holder ``h`` serves four receivers, and is hit while the tracker shows it serving.
Every receiver must still finish with verified bytes.
"""

import json
import signal
import sys

import pytest

from kvplane.common.procs import wait_for_line, wait_until
from kvplane.p2p import TrackerClient
from kvplane.p2p.tracker_api import mount
from kvplane.transfer.metadata_server import serve_in_thread

pytestmark = [pytest.mark.fault, pytest.mark.timeout(180)]
TOKEN = "fault-token"
MIB = 1 << 20


def start(host, url, chunk_timeout):
    return host.spawn([sys.executable, "-m", "tests.support.p2p_proc", "--tracker", url,
                       "--token", TOKEN, "--host", host.ip, "--chunk-size", str(MIB),
                       "--chunk-timeout", str(chunk_timeout)])


@pytest.mark.parametrize("fault", ["kill", "stop", "partition"])
def test_holder_lost_mid_transfer_costs_only_a_retry(netbed, fault):
    bed = netbed(["pub", "h", "r1", "r2", "r3", "r4"], mtu=9000)
    for host in bed:
        bed.cap(host.name, 80)  # 10 MB/s: a 1 MiB chunk shared four ways takes ~0.4 s
    srv = serve_in_thread(bed.gateway, 0, TOKEN, plugins=[mount])
    tracker = TrackerClient(srv.url, TOKEN)
    procs = []
    try:
        pub = start(bed["pub"], srv.url, 3.0)
        h = start(bed["h"], srv.url, 3.0)
        rx = [start(bed[f"r{i}"], srv.url, 3.0) for i in range(1, 5)]
        procs = [pub, h, *rx]
        want = pub.ask(json.dumps({"op": "publish", "name": "w", "size": 16 * MIB, "seed": 5}))
        assert h.ask('{"op": "get", "name": "w"}', timeout=60)["sha"] == want["sha"]
        victim = h.info["segment"]
        for r in rx:
            r.popen.stdin.write('{"op": "get", "name": "w", "timeout": 120}\n')
            r.popen.stdin.flush()
        # strike while the tracker shows the victim serving (replicas go before the publisher)
        wait_until(lambda: any(victim in f.values() for f in tracker.status("w")["inflight"].values()),
                   30, "a fetch from the victim")
        if fault == "kill":
            h.signal(signal.SIGKILL)
        elif fault == "stop":
            h.signal(signal.SIGSTOP)
        else:
            bed.partition("h")
        outs = [json.loads(wait_for_line(r.popen.stdout, 150)) for r in rx]
        for out in outs:
            assert out.get("sha") == want["sha"], out
        lost = sum(sum(o["failures"].values()) for o in outs)
        assert lost >= 1, outs  # at least one fetch was cut and redone elsewhere
        # a dead peer refuses or resets (unreachable); a stalled or cut-off one lets a transfer
        # time out, or a fresh connection's handshake fail (either counts)
        reasons = ("unreachable",) if fault == "kill" else ("timeout", "unreachable")
        assert sum(o["failures"].get(r, 0) for o in outs for r in reasons) >= 1, outs
        assert "corrupt" not in str(outs)
        assert all(n >= 5 for n in tracker.status("w")["holders_per_chunk"])  # pub + 4 receivers
        if fault == "kill":  # with no heartbeat, the dead holder stops being offered
            wait_until(lambda: victim not in tracker.status("w")["holders"], 20, "victim dropped")
    finally:
        if fault == "stop" and len(procs) > 1:
            procs[1].signal(signal.SIGCONT)
        for p in procs:
            p.stop()
        tracker.close()
        srv.close()
