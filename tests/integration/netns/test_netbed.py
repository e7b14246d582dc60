"""The multi-host test bed: hosts reach each other, caps limit throughput, partitions cut and heal.

Runs as root (CI is root); elsewhere the ``netbed`` fixture skips with the reason.
"""

import sys

import pytest

from tests.support.netns import leftovers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
PROBE = [sys.executable, "-m", "tests.support.netprobe"]


def sink(host):
    proc = host.spawn(PROBE + ["serve", "--host", host.ip])
    return proc, proc.info["port"]


def send(host, ip, port, nbytes):
    import json

    res = host.run(PROBE + ["send", ip, str(port), str(nbytes)], timeout=90)
    return json.loads(res.stdout.strip().splitlines()[-1])


def connect(host, ip, port, timeout):
    import json

    res = host.run(PROBE + ["connect", ip, str(port), str(timeout)], timeout=timeout + 30)
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_process_in_one_host_reaches_another(netbed):
    bed = netbed(["a", "b"])
    proc, port = sink(bed["b"])
    try:
        out = send(bed["a"], bed["b"].ip, port, 1 << 20)
        assert out["bytes"] == 1 << 20
        hostname = bed["a"].run(["hostname"]).stdout.strip()
        assert hostname == "a"  # each host has its own hostname (so its own kvplane host id)
        assert bed["a"].run(["ip", "-4", "-o", "addr", "show", "eth0"]).stdout.count(bed["a"].ip) == 1
    finally:
        proc.stop()


def test_cap_limits_throughput_within_tolerance(netbed):
    bed = netbed(["a", "b"])
    proc, port = sink(bed["b"])
    try:
        free = send(bed["a"], bed["b"].ip, port, 16 << 20)
        free_rate = free["bytes"] / free["seconds"]
        mbit = 40.0
        bed.cap("a", mbit)
        capped = send(bed["a"], bed["b"].ip, port, 8 << 20)
        rate = capped["bytes"] / capped["seconds"]
        cap_rate = mbit * 1e6 / 8
        # never faster than the cap (plus the 256 KiB bucket), and not far below it
        assert rate <= cap_rate * 1.1 + (256 << 10) / capped["seconds"], (rate, cap_rate)
        assert rate >= cap_rate * 0.5, (rate, cap_rate)
        assert free_rate > 2 * cap_rate, "uncapped link should beat the cap by far"
        bed.uncap("a")
        again = send(bed["a"], bed["b"].ip, port, 16 << 20)
        assert again["bytes"] / again["seconds"] > 2 * cap_rate
    finally:
        proc.stop()


def test_partition_makes_connect_fail_and_heal_restores_it(netbed):
    bed = netbed(["a", "b"])
    proc, port = sink(bed["b"])
    try:
        assert connect(bed["a"], bed["b"].ip, port, 5)["ok"]
        bed.partition("b")
        cut = connect(bed["a"], bed["b"].ip, port, 2)
        assert not cut["ok"], cut
        bed.heal("b")
        assert connect(bed["a"], bed["b"].ip, port, 10)["ok"]
    finally:
        proc.stop()


def test_close_removes_namespaces_links_and_processes(netbed):
    bed = netbed(["a", "b"])
    p = bed["a"].popen(["sleep", "300"])
    bed.close()
    assert p.poll() is not None
    assert leftovers(bed.tag) == []


def test_root_namespace_reaches_hosts_through_the_gateway(netbed):
    import socket

    bed = netbed(["a"])
    proc, port = sink(bed["a"])
    try:
        with socket.create_connection((bed["a"].ip, port), timeout=5) as s:
            assert s.getsockname()[0] == bed.gateway
    finally:
        proc.stop()


def test_sweep_removes_a_bed_whose_creator_was_killed(netbed):
    import json
    import subprocess

    from kvplane.common.procs import wait_for_line
    from tests.support.netns import available, sweep_stale

    assert available()[0]
    code = ("import json,sys,time\nfrom tests.support.netns import NetBed\n"
            "b=NetBed(['a','b'])\nprint(json.dumps({'tag':b.tag}),flush=True)\ntime.sleep(300)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        tag = json.loads(wait_for_line(child.stdout, 30))["tag"]
        assert leftovers(tag)
    finally:
        child.kill()
        child.wait(10)
        child.stdout.close()
    sweep_stale()
    assert leftovers(tag) == []
