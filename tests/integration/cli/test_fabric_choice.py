"""The protocol choice is visible where engines start (issue 30): ``kvplane serve`` and
``kvplane segment`` asked for ``rdma`` say in their ready line, their ``/status`` and the
``kvplane_transfer_fabric_info`` metric what serves it: TCP (with one warning line) while NIXL is
off, NIXL when it is on and installed. Real processes on free ports, read on their ready lines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from kvplane.common.procs import wait_for_line
from tests.support.auth import headers
from tests.support.store_procs import spawn_master

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
CLI = [sys.executable, "-m", "kvplane.cli.main"]
WARNING = "protocol 'rdma' is served by TCP"


@pytest.fixture(scope="module")
def master():
    with spawn_master() as proc:
        yield proc.info["master"]


@contextmanager
def started(args: list[str], nixl: str) -> Iterator[tuple[dict[str, Any], list[str]]]:
    """Run ``kvplane ARGS`` with ``KVPLANE_NIXL=nixl``; yields (its ready line, a list that holds
    its stderr lines once it has stopped)."""
    env = {**os.environ, "KVPLANE_NIXL": nixl}
    err: list[str] = []
    with subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env) as proc:
        try:
            yield json.loads(wait_for_line(proc.stdout, 60)), err
        finally:
            proc.send_signal(signal.SIGTERM)
            _, rest = proc.communicate(timeout=30)
            err.extend(rest.splitlines())
        assert proc.returncode == 0, rest


def _get(url: str) -> httpx.Response:
    res = httpx.get(url, headers=headers(), timeout=10, trust_env=False)
    res.raise_for_status()
    return res


def _metric(url: str) -> list[str]:
    return [ln for ln in _get(url).text.splitlines()
            if ln.startswith("kvplane_transfer_fabric_info{")]


def test_segment_asked_for_rdma_with_nixl_off_says_tcp_everywhere(master):
    args = ["segment", "--master", master, "--size", "32MiB", "--protocol", "rdma"]
    with started(args, "off") as (line, err):
        assert line["fabric"]["requested"] == "rdma" and line["fabric"]["protocol"] == "tcp"
        assert "nixl" not in line["fabric"]["transports"]
        base = f"http://127.0.0.1:{line['metrics_port']}"
        status = _get(f"{base}/status").json()
        assert status["fabric"] == line["fabric"] and status["segment"] == line["segment"]
        assert _metric(f"{base}/metrics") == [
            'kvplane_transfer_fabric_info{protocol="tcp",requested="rdma",'
            'transports="tcp,shm,file,local"} 1.0']
    warned = [ln for ln in err if WARNING in ln]
    assert len(warned) == 1 and "KVPLANE_NIXL=off" in warned[0], err


def test_serve_asked_for_rdma_says_tcp_in_its_ready_line_and_the_masters_status():
    args = ["serve", "--master-port", "0", "--metadata-port", "0", "--admin-port", "0",
            "--segment-size", "32MiB", "--protocol", "rdma"]
    with started(args, "off") as (line, err):
        assert (line["fabric"]["requested"], line["fabric"]["protocol"]) == ("rdma", "tcp")
        assert _get(f"{line['admin']}/status").json()["fabric"] == line["fabric"]
        assert any('requested="rdma"' in m and 'protocol="tcp"' in m
                   for m in _metric(f"{line['admin']}/metrics"))
    assert len([ln for ln in err if WARNING in ln]) == 1, err


def test_segment_asked_for_rdma_with_nixl_on_says_nixl(master):
    from kvplane.testing.needs import need_module
    from kvplane.transfer.plugins import TRANSPORTS

    need_module("nixl_cu12", "pip install --no-deps nixl-cu12==1.5.1")
    if "nixl" not in TRANSPORTS.names():
        pytest.skip("this tree has no 'nixl' transport registered yet (transfer/plugins.py)")
    args = ["segment", "--master", master, "--size", "32MiB", "--protocol", "rdma"]
    with started(args, "on") as (line, err):
        assert (line["fabric"]["requested"], line["fabric"]["protocol"]) == ("rdma", "nixl")
        assert "nixl" in line["fabric"]["transports"]
        base = f"http://127.0.0.1:{line['metrics_port']}"
        assert _get(f"{base}/status").json()["fabric"]["protocol"] == "nixl"
        assert any('protocol="nixl"' in m for m in _metric(f"{base}/metrics"))
    assert not [ln for ln in err if WARNING in ln], err
