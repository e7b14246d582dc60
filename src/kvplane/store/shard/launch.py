"""Running shards as processes: one shard (``kvplane master --shard I/N``), and N at once
(``kvplane master --shards N``, one child process per shard).

**One shard.** ``start_shard`` builds the master of shard ``I`` from the addresses of all ``N``
shards (``--peers``; with ``--ha`` each shard is an HA cluster of its own, ``CLUSTER-sI``, and
the peers are their ``etcd://`` addresses): its first map gives each shard an equal run of
slots. A :class:`MapWatch` then keeps the map current: it asks the other shards (and, with HA,
its own cluster's leader) for theirs every ``WATCH_EVERY`` seconds and installs a newer one.
A shard serves no key until the watch has asked its peers once (at start, and after each
leader change of its own cluster): a shard that restarts, or a standby that takes over, never
serves slots by a map older than the other shards'.

**N shards.** ``Launcher`` starts ``kvplane master --shard I/N`` children on consecutive ports
(``--port + I``, ``--admin-port + I``; free ports when 0), waits for each one's ready line and
stops them all on exit. Binds nothing itself; the children bind.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

from kvplane.common.errors import InvalidArgument, KVPlaneError
from kvplane.common.procs import free_port, wait_for_line
from kvplane.store.etcd import HaAddress, is_ha
from kvplane.store.shard.server import Shard, start
from kvplane.store.shard.slots import MAX_SHARDS, ShardInfo, ShardMap, even

log = logging.getLogger(__name__)
WATCH_EVERY = 1.0  # seconds between two rounds of asking the peers for their maps
READY = 60.0  # seconds a child shard gets to print its ready line


def parse_shard(text: str) -> tuple[int, int]:
    """``I/N`` -> (I, N).

    Raises:
        InvalidArgument: not ``I/N`` with ``0 <= I < N <= MAX_SHARDS``.
    """
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError as exc:
        raise InvalidArgument(f"--shard wants I/N (like 0/4), not {text!r}") from exc
    if not 0 <= i < n <= MAX_SHARDS:
        raise InvalidArgument(f"--shard {text}: want 0 <= I < N <= {MAX_SHARDS}")
    return i, n


def ha_peers(ha: str, cluster: str | None, n: int) -> list[str]:
    """The ``etcd://`` address of each of ``n`` HA shards (cluster ``CLUSTER-sI``)."""
    where = HaAddress.parse(ha, cluster)
    hosts = ";".join(f"{h}:{p}" for h, p in where.endpoints)
    return [f"etcd://{hosts}/{shard_cluster(where.cluster, i)}" for i in range(n)]


def shard_cluster(cluster: str, index: int) -> str:
    """The HA cluster id of shard ``index`` of pool ``cluster``."""
    return f"{cluster}-s{index}"


def first_map(peers: list[str]) -> ShardMap:
    """The map every shard of a new pool starts from: ``peers[i]`` is shard ``i``."""
    return even([ShardInfo(i, addr) for i, addr in enumerate(peers)])


class MapWatch:
    """Keeps a shard's map current by asking the others (see the module docstring).

    Args:
        shard: the running shard.
        own: this shard's own address (HA: its cluster's, to ask the leader as a standby).
        every: seconds between rounds.
    """

    def __init__(self, shard: Shard, own: str, every: float = WATCH_EVERY) -> None:
        self.shard, self.own, self.every = shard, own, every
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shard-map-watch", daemon=True)

    def start(self) -> MapWatch:
        self._thread.start()
        return self

    def round(self) -> None:
        """Ask every other shard (and this shard's HA leader) once; install the newest map."""
        role = self.shard.role
        turn = role.turn
        addresses = {s.address for s in role.map.shards if s.address and s.id != role.me}
        if is_ha(self.own):
            addresses.add(self.own)  # a standby learns its own leader's map
        for addr in sorted(addresses):
            try:
                got = role.peers.link(addr).call("shard_map", "", ShardMap, timeout=1.0,
                                                 once=True)
            except KVPlaneError as exc:
                log.debug("shard map from %s: %s", addr, exc)
                continue
            if got.version > role.map.version:
                try:
                    self.shard.install(got)
                except InvalidArgument as exc:
                    log.warning("shard map v%s from %s refused: %s", got.version, addr, exc)
        role.verified(turn)
        self.rounds += 1

    def _run(self) -> None:
        while True:
            try:
                self.round()
            except Exception:  # keep watching; the next round tries again
                log.exception("shard map watch round failed")
            if self._stop.wait(self.every if not self.shard.role.verify else 0.05):
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)


def start_shard(index: int, peers: list[str], ha: str | None = None,
                cluster: str | None = None, **master_kw: Any) -> tuple[Shard, MapWatch]:
    """Shard ``index`` of the pool whose shards are at ``peers`` (keywords: ``MasterServer``'s;
    with ``ha``, the shard campaigns in its own cluster ``CLUSTER-sI``)."""
    if not 0 <= index < len(peers):
        raise InvalidArgument(f"shard {index} is not among the {len(peers)} peers")
    if ha:  # its own election, and the pool's term counter: terms are epochs, never shared
        pool = HaAddress.parse(ha, cluster)
        master_kw.update(ha=ha, cluster=shard_cluster(pool.cluster, index),
                         term_key=pool.key("term"))
    shard = start(index, first_map(peers), watched=True, **master_kw)  # (serves nothing
    # before its watch asked the peers: a restarted shard never serves by the first map)
    watch = MapWatch(shard, peers[index]).start()
    return shard, watch


@dataclass
class Child:
    """One shard process of a launcher."""

    index: int
    popen: subprocess.Popen[str]
    info: dict[str, Any]


class Launcher:
    """``n`` shard processes (``kvplane master --shard I/N``); see the module docstring.

    Args:
        n: shards.
        host: bind address.
        port: the first shard's RPC port (0: free ports).
        admin_port: the first shard's admin port (0: free ports; None: none).
        args: further ``kvplane master`` options for every child.
        env: environment of the children (tokens go here, never on a command line).
    """

    def __init__(self, n: int, host: str, port: int, admin_port: int | None, args: list[str],
                 env: dict[str, str]) -> None:
        ports = [port + i if port else free_port() for i in range(n)]
        admins = [None if admin_port is None else (admin_port + i if admin_port else 0)
                  for i in range(n)]
        peers = ",".join(f"{host}:{p}" for p in ports)
        self.children: list[Child] = []
        try:
            for i in range(n):
                cmd = [sys.executable, "-m", "kvplane.cli.main", "master", "--shard", f"{i}/{n}",
                       "--peers", peers, "--host", host, "--port", str(ports[i]), *args]
                cmd += ["--admin-port", str(admins[i])] if admins[i] is not None else []
                popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1,
                                         env={**os.environ, **env})
                try:
                    line = wait_for_line(popen.stdout, READY)  # type: ignore[arg-type]  # a PIPE
                except (KVPlaneError, EOFError) as exc:
                    popen.kill()
                    raise InvalidArgument(f"shard {i} did not start: {exc}") from exc
                self.children.append(Child(i, popen, json.loads(line)))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop every child (SIGTERM, then SIGKILL after 10 s)."""
        for c in self.children:
            if c.popen.poll() is None:
                c.popen.terminate()
        for c in self.children:
            try:
                c.popen.wait(10)
            except subprocess.TimeoutExpired:
                c.popen.kill()
                c.popen.wait(5)
            if c.popen.stdout is not None:
                c.popen.stdout.close()
