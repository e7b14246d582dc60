"""A multi-host test bed on one machine: Linux network namespaces on a bridge.

Each host is a network namespace with one veth into a shared bridge, its own address in a
198.18.x.0/24 benchmark subnet (RFC 2544), its own loopback and its own hostname for the
processes it runs (so kvplane's host identity differs per host and engines talk TCP between
hosts, never shared memory). The root namespace owns the bridge address (``bed.gateway``): a
test's own process reaches every host there, and hosts reach services it binds there.

    with NetBed(["pub", "r1", "r2"]) as bed:
        bed.cap("pub", mbit=400)                  # tc tbf both ways: a 400 Mbit/s NIC
        proc = bed["r1"].spawn([sys.executable, "-m", "tests.support.netprobe", "serve"])
        bed.partition("r1"); ...; bed.heal("r1")  # link down / up

Names carry a per-bed tag (and the creating pid), so parallel runs never collide;
``close()`` kills every process left in the bed's namespaces and deletes namespaces, veths and
the bridge, and :func:`sweep_stale` removes beds whose creator died (kill -9 of a test run).
Needs root, ``ip`` and ``tc`` (iproute2) and ``unshare`` (util-linux); :func:`available` says
why not. Must not import kvplane components (only ``kvplane.common`` and ``kvplane.testing``).
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvplane.common.errors import InvalidArgument, Unavailable
from kvplane.common.procs import Proc

PREFIX = "kvpnet"
_NAME = re.compile(r"^[a-z][a-z0-9]{0,11}$")
_NS = re.compile(rf"^{PREFIX}-(\d+)-([0-9a-f]{{6}})-")
CMD_TIMEOUT = 15.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(["ip", *args], check)


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=CMD_TIMEOUT)
    if check and res.returncode != 0:
        raise Unavailable(f"{' '.join(cmd)} failed: {res.stderr.strip()}")
    return res


def available() -> tuple[bool, str]:
    """(True, "") when this process can build beds, else (False, why)."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return False, f"`{tool}` is missing (apt-get install {pkg})"
    probe = f"{PREFIX}-probe-{os.getpid()}-{secrets.token_hex(3)}"
    res = _ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        return False, f"cannot create a network namespace: {res.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return True, ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_ns_pids(ns: str) -> None:
    res = _ip("netns", "pids", ns, check=False)
    for pid in res.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def sweep_stale() -> int:
    """Delete beds (namespaces and bridges) left by processes that died; returns how many."""
    res = _ip("netns", "list", check=False)
    tags: set[str] = set()
    for line in res.stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        m = _NS.match(ns)
        if m and not _alive(int(m.group(1))):
            _kill_ns_pids(ns)
            _ip("netns", "del", ns, check=False)
            tags.add(m.group(2))
    links = _ip("-o", "link", check=False).stdout.splitlines()
    for tag in tags:  # namespace teardown is asynchronous: delete the bridge-side ends now
        for ln in links:
            name = ln.split(":")[1].strip().split("@")[0] if ln.count(":") > 1 else ""
            if name.startswith((f"kv{tag}", f"kb{tag}")):
                _ip("link", "del", name, check=False)
    return len(tags)


def _free_subnet() -> ipaddress.IPv4Network:
    used = _ip("-4", "addr", check=False).stdout
    for _ in range(64):
        third = secrets.randbelow(256)
        net = ipaddress.IPv4Network(f"198.{18 + secrets.randbelow(2)}.{third}.0/24")
        if f" {str(net.network_address)[:-1]}" not in used:
            return net
    raise Unavailable("no free 198.18.0.0/15 subnet for a test bed")


@dataclass
class Host:
    """One simulated host: a namespace, its address and its link.

    Attributes:
        name: the short name the test gave it.
        ns: the network namespace.
        ip: its address on the bed's bridge.
        link: the bridge-side end of its veth (what caps and partitions act on, with ``dev``).
        dev: its own end of the veth, inside the namespace (``eth0``).
    """

    name: str
    ns: str
    ip: str
    link: str
    dev: str = "eth0"
    procs: list[Any] = field(default_factory=list, repr=False)

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` wrapped to run inside this host (its namespace and its own hostname)."""
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', self.name, *cmd]

    def run(self, cmd: Sequence[str], timeout: float = 60.0,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` inside the host to completion; raises Unavailable on a non-zero exit."""
        res = subprocess.run(self.argv(cmd), capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise Unavailable(f"{cmd} on {self.name} exited {res.returncode}: {res.stderr[-2000:]}")
        return res

    def popen(self, cmd: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``cmd`` inside the host (``subprocess.Popen`` keywords pass through)."""
        p = subprocess.Popen(self.argv(cmd), **kw)
        self.procs.append(p)
        return p

    def spawn(self, cmd: Sequence[str], env: dict[str, str] | None = None,
              ready_timeout: float = 30.0) -> Proc:
        """Start ``cmd`` inside the host as a :class:`Proc` (waits for its JSON ready line)."""
        p = Proc(self.argv(cmd), env=env, ready_timeout=ready_timeout)
        self.procs.append(p.popen)
        return p


class NetBed:
    """Hosts as network namespaces on one bridge, with caps and partitions (a context manager).

    Args:
        hosts: names of the hosts to create (lowercase, up to 12 characters).
        mtu: MTU of every link (9000: datacenter jumbo frames, fewer packets per byte).
    """

    def __init__(self, hosts: Iterable[str] = (), mtu: int = 1500) -> None:
        ok, why = available()
        if not ok:
            raise Unavailable(why)
        sweep_stale()
        self.tag = secrets.token_hex(3)
        self.bridge = f"kb{self.tag}"
        self.net = _free_subnet()
        self.gateway = str(self.net.network_address + 254)
        self.hosts: dict[str, Host] = {}
        self.mtu = mtu
        self._closed = False
        try:
            _ip("link", "add", self.bridge, "mtu", str(mtu), "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            for name in hosts:
                self.add_host(name)
        except BaseException:
            self.close()
            raise

    def add_host(self, name: str) -> Host:
        """Create host ``name`` (namespace, veth on the bridge, address, loopback up)."""
        if not _NAME.match(name) or name in self.hosts:
            raise InvalidArgument(f"bad or duplicate host name {name!r}")
        i = len(self.hosts) + 1
        if i > 200:
            raise InvalidArgument("at most 200 hosts per bed")
        ns = f"{PREFIX}-{os.getpid()}-{self.tag}-{name}"
        inner, outer = f"kv{self.tag}{i}a", f"kv{self.tag}{i}b"
        host = Host(name, ns, str(self.net.network_address + i), outer)
        self.hosts[name] = host
        _ip("netns", "add", ns)
        _ip("link", "add", inner, "mtu", str(self.mtu), "type", "veth", "peer", "name", outer,
            "mtu", str(self.mtu))
        _ip("link", "set", inner, "netns", ns, "name", host.dev)
        _ip("link", "set", outer, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{host.ip}/24", "dev", host.dev)
        _ip("-n", ns, "link", "set", host.dev, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        return host

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts.values())

    # -- links ---------------------------------------------------------------------------
    def cap(self, name: str, mbit: float, burst_kb: int = 256, latency_ms: int = 100) -> None:
        """Cap host ``name``'s link at ``mbit`` Mbit/s each way (tc tbf on both veth ends).

        The token bucket holds ``burst_kb`` KiB (at least 64 KiB, so offloaded segments pass).
        """
        if mbit <= 0:
            raise InvalidArgument("mbit must be > 0")
        h = self.hosts[name]
        spec = ["root", "tbf", "rate", f"{mbit}mbit", "burst", f"{max(64, burst_kb)}kb",
                "latency", f"{latency_ms}ms"]
        _run(["tc", "qdisc", "replace", "dev", h.link, *spec])  # to the host (its download)
        _run(["tc", "-n", h.ns, "qdisc", "replace", "dev", h.dev, *spec])  # from it (upload)

    def uncap(self, name: str) -> None:
        """Remove host ``name``'s caps."""
        h = self.hosts[name]
        _run(["tc", "qdisc", "del", "dev", h.link, "root"], check=False)
        _run(["tc", "-n", h.ns, "qdisc", "del", "dev", h.dev, "root"], check=False)

    def partition(self, name: str) -> None:
        """Cut host ``name`` off from every other host (its link goes down)."""
        _ip("link", "set", self.hosts[name].link, "down")

    def heal(self, name: str) -> None:
        """Bring host ``name``'s link back up."""
        _ip("link", "set", self.hosts[name].link, "up")

    # -- lifecycle -----------------------------------------------------------------------
    def close(self) -> None:
        """Kill what runs in the hosts, delete namespaces, veths and the bridge (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for h in self.hosts.values():
            for p in h.procs:
                if isinstance(p, subprocess.Popen) and p.poll() is None:
                    p.kill()
            _kill_ns_pids(h.ns)
            _ip("netns", "del", h.ns, check=False)  # takes its veth (and the peer) with it
            _ip("link", "del", h.link, check=False)
            for p in h.procs:
                if isinstance(p, subprocess.Popen):
                    try:
                        p.wait(5)
                    except subprocess.TimeoutExpired:
                        pass
        _ip("link", "del", self.bridge, check=False)

    def __enter__(self) -> NetBed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def leftovers(tag: str) -> list[str]:
    """Namespaces and links of bed ``tag`` still present (tests check cleanup with it)."""
    ns = [ln.split()[0] for ln in _ip("netns", "list", check=False).stdout.splitlines()
          if ln.split() and f"-{tag}-" in ln.split()[0]]
    links = [ln for ln in _ip("-o", "link", check=False).stdout.splitlines() if tag in ln]
    return ns + links


@pytest.fixture
def netbed() -> Iterator[Any]:
    """``netbed(["a", "b"])`` builds a :class:`NetBed`; every bed is torn down after the test.

    Skips with the reason where namespaces are unavailable (not root, no ``ip``); in CI (``CI``
    set) that is a failure instead.
    """
    from kvplane.testing.needs import missing

    ok, why = available()
    if not ok:
        missing("the network-namespace test bed", why)
    beds: list[NetBed] = []

    def make(hosts: Iterable[str], mtu: int = 1500) -> NetBed:
        bed = NetBed(hosts, mtu)
        beds.append(bed)
        return bed

    try:
        yield make
    finally:
        for bed in beds:
            bed.close()
