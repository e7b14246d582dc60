"""Real Mooncake services on free loopback ports: ``mooncake_master`` (with its HTTP metadata
server) and a ``mooncake_client`` store server holding the pool (benchmarks/engines.py).

The binaries come from the Mooncake wheel installed at ``<engines venv>/mooncake-real`` (see
tests.support.engines_harness). Readiness is a port that accepts; a child that exits raises.

Test kit, not product.
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess

from tests.support.services import free_port, wait_until


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class RealMooncake:
    """A master and a store server of ``segment`` (Mooncake's size syntax, e.g. ``"1 GB"``).

    Args:
        bin_dir: directory holding ``mooncake_master`` and ``mooncake_client``.
        work: where the logs go.
    """

    def __init__(self, bin_dir: pathlib.Path, work: pathlib.Path, segment: str) -> None:
        self.rpc, self.http, self.metrics, self.store = (free_port() for _ in range(4))
        env = {**os.environ, "GLOG_minloglevel": "1", "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        self.procs: list[tuple[subprocess.Popen[bytes], object]] = []
        try:
            self._start_all(bin_dir, work, segment, env)
        except BaseException:
            self.stop()
            raise

    def _start_all(self, bin_dir: pathlib.Path, work: pathlib.Path, segment: str,
                   env: dict[str, str]) -> None:
        self._start(work / "mooncake_master.log", env, [
            str(bin_dir / "mooncake_master"), "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc}",
            "--rpc_thread_num=2", "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={self.http}",
            "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics}"])
        wait_until(lambda: self._alive() and _port_open(self.rpc) and _port_open(self.http), 60,
                   "mooncake_master")
        self._start(work / "mooncake_client.log", env, [
            str(bin_dir / "mooncake_client"), "--host=127.0.0.1", f"--port={self.store}",
            f"--global_segment_size={segment}", "--local_buffer_size=0", "--protocol=tcp",
            f"--master_server_address={self.master}", f"--metadata_server={self.metadata}"])
        wait_until(lambda: self._alive() and _port_open(self.store), 60, "mooncake_client")

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.rpc}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http}/metadata"

    def _start(self, log: pathlib.Path, env: dict[str, str], args: list[str]) -> None:
        out = open(log, "w")
        self.procs.append((subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env),
                           out))

    def _alive(self) -> bool:
        for proc, out in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[0]} exited ({proc.returncode}); see "
                                   f"{getattr(out, 'name', '?')}")
        return True

    def stop(self) -> None:
        """SIGTERM, then SIGKILL what lingers (store server first)."""
        for proc, out in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
            out.close()  # type: ignore[attr-defined]
        self.procs = []

    def __enter__(self) -> RealMooncake:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
