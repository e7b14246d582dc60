"""Run Mooncake's own Python store and transfer-engine tests, unchanged, against kvplane.

    python tests/data/mooncake_peer/run_mooncake_tests.py --mooncake-src /path/to/Mooncake \
        [--only NAME ...] [--out results.json]

Each suite is a test file from a Mooncake checkout (the ones Mooncake's CI runs, plus the other
store-API tests of ``mooncake-wheel/tests`` and ``scripts``). The runner starts what the file
expects, as Mooncake's ``scripts/run_tests.sh`` does, but with kvplane: ``kvplane master``
(RPC 50051, admin 9003, HTTP metadata 8080, lease 500 ms: ``DEFAULT_KV_LEASE_TTL=500``), a
``kvplane client-server`` on 50052 for the dummy-client suites, the transfer-engine target for
the TE suite. The test files import ``mooncake``, which resolves to kvplane's shim
(``kvplane/integrations/mooncake_shim`` first on PYTHONPATH). Nothing of Mooncake is imported.

Those ports are hard-coded in Mooncake's tests, so as root the whole run happens inside a
private network namespace (``unshare -n``, loopback only): it cannot collide with anything
else on the machine. Without root it needs the ports free.

Results: one line per test (pytest's junit XML) and a summary; ``--out`` writes them as JSON.
Exit status 0 when every suite that applies here passed. Tests that cannot apply (GPU, RDMA,
CXL, SSD tier, ...) are listed with the reason and not run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

HERE = pathlib.Path(__file__).resolve()
REPO = HERE.parents[3]
SRC = REPO / "src"
SHIM = SRC / "kvplane" / "integrations" / "mooncake_shim"
META = "http://127.0.0.1:8080/metadata"


@dataclass
class Suite:
    name: str
    path: str  # relative to the Mooncake checkout
    needs: tuple[str, ...] = ("master",)
    env: dict[str, str] = field(default_factory=dict)
    timeout: float = 900.0
    script_runs: tuple[tuple[str, ...], ...] = ()  # run as scripts with these argv (concurrently)
    build_module: bool = False  # the test imports the built extension as top-level ``store``


SUITES = [
    Suite("transfer_engine", "mooncake-wheel/tests/transfer_engine_initiator_test.py",
          needs=("master", "te_target"), env={"MC_FORCE_TCP": "true"}),
    Suite("import_structure", "mooncake-wheel/tests/test_import_structure.py", needs=()),
    Suite("mooncake_config", "mooncake-wheel/tests/test_mooncake_config.py", needs=()),
    Suite("distributed_object_store", "mooncake-wheel/tests/test_distributed_object_store.py"),
    Suite("replicated_object_store",
          "mooncake-wheel/tests/test_replicated_distributed_object_store.py"),
    Suite("batch_replica_clear", "mooncake-wheel/tests/test_batch_replica_clear.py"),
    Suite("buffer_pool", "mooncake-wheel/tests/test_buffer_pool_native.py"),
    Suite("put_get_tensor", "mooncake-wheel/tests/test_put_get_tensor.py"),
    Suite("safetensor_functions", "mooncake-wheel/tests/test_safetensor_functions.py"),
    Suite("structured_object_store", "mooncake-wheel/tests/test_structured_object_store.py"),
    Suite("dummy_client", "mooncake-wheel/tests/test_dummy_client.py",
          needs=("master", "client_server")),
    Suite("multi_dummy_clients", "mooncake-wheel/tests/test_multi_dummy_clients.py",
          needs=("master", "client_server"),
          script_runs=(("--client-id", "client1"), ("--client-id", "client2"))),
    Suite("tensor_api", "scripts/test_tensor_api.py"),
    Suite("async_store", "scripts/test_async_store.py"),
    Suite("copy_move_api", "scripts/test_copy_move_api.py"),
    Suite("upsert_api", "scripts/test_upsert_api.py"),
    Suite("session_ranges_e2e", "mooncake-store/tests/e2e/session_ranges_tcp_e2e.py",
          script_runs=((),), build_module=True),
]

NOT_APPLICABLE = {
    "mooncake-wheel/tests/test_transfer_on_cuda.py": "needs a CUDA GPU (none here)",
    "mooncake-wheel/tests/test_transfer_on_hip.py": "needs a ROCm GPU (none here)",
    "mooncake-wheel/tests/test_distributed_object_store_cxl.py": "needs CXL memory (--enable_cxl)",
    "mooncake-wheel/tests/test_regmr_overhead.py": "measures RDMA memory registration (no RDMA)",
    "mooncake-wheel/tests/test_mooncake_ep.py": "Mooncake EP kernels need CUDA",
    "mooncake-wheel/tests/test_spdk_tgt_create.py": "NVMe-oF target tooling (SPDK), not the store API",
    "mooncake-wheel/tests/test_ssd_offload_in_evict.py": "SSD tier: issue 11 item 1, not built yet",
    "mooncake-wheel/tests/test_offload_on_eviction.py": "SSD tier: issue 11 item 1, not built yet",
    "mooncake-wheel/tests/test_promotion_on_hit.py": "SSD tier: issue 11 item 1, not built yet",
    "mooncake-wheel/tests/test_mooncake_store_service_api.py":
        "Mooncake's standalone REST store service (mooncake_store_service), not the Python API",
    "mooncake-wheel/tests/test_http_metadata_server.py":
        "Mooncake's own metadata-server module (kvplane serves /metadata itself)",
    "mooncake-wheel/tests/test_meta_server.py": "Mooncake's own metadata-server module",
    "mooncake-wheel/tests/test_cli.py": "Mooncake's console-script entry points (wheel packaging)",
    "mooncake-wheel/tests/test_release_wheel_tags.py": "Mooncake's wheel tagging",
    "mooncake-wheel/tests/test_fast_copy.py": "Mooncake's private C copy helper (_fast_copy)",
    "mooncake-wheel/tests/test_dataproto_catalog.py": "Mooncake's dataproto catalog module",
    "scripts/test_drain_http_api.py": "the master's drain-job admin HTTP API, not the Python API",
    "scripts/test_engram_store.py": "EngramStore (a separate Mooncake product)",
    "scripts/test_hicache_hugepage_requirements.py": "a hugepage sizing helper script",
    "mooncake-store/tests/e2e/store_client_e2e.py":
        "an NVMe-oF workload (nof_replica_num=1 by default): no NoF pool here",
}


def _wait_port(port: int, timeout: float = 30.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"port {port} did not open within {timeout} s")


class Services:
    """kvplane processes one suite needs; stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, env: dict[str, str], logdir: pathlib.Path) -> None:
        self.env, self.logdir, self.procs = env, logdir, []

    def _spawn(self, name: str, argv: list[str], port: int) -> None:
        log = open(self.logdir / f"{name}.log", "w")
        proc = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append((proc, log))
        _wait_port(port)

    def start(self, needs: tuple[str, ...], mc_src: pathlib.Path) -> None:
        cli = [sys.executable, "-m", "kvplane.cli.main"]
        if "master" in needs:
            self._spawn("master", [*cli, "master", "--port", "50051", "--admin-port", "9003",
                                   "--metadata-port", "8080", "--lease-ttl", "0.5",
                                   "--high-watermark", "0.95"], 50051)
            _wait_port(8080)
        if "client_server" in needs:
            self._spawn("client_server", [*cli, "client-server", "--port", "50052", "--size",
                                          "1GiB", "--metadata", META], 50052)
        if "te_target" in needs:
            target = mc_src / "mooncake-wheel/tests/transfer_engine_target.py"
            self._spawn("te_target", [sys.executable, str(target)], 12345)

    def stop(self) -> None:
        for proc, log in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
            log.close()
        self.procs = []


def _cases(xml_path: pathlib.Path) -> list[dict[str, str]]:
    if not xml_path.exists():
        return []
    out = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        status = "passed"
        detail = ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                status = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                detail = (node.get("message") or "")[:300]
        out.append({"test": f"{case.get('classname', '')}::{case.get('name')}",
                    "status": status, "detail": detail})
    return out


def run_suite(suite: Suite, mc_src: pathlib.Path, env: dict[str, str],
              workdir: pathlib.Path) -> dict[str, object]:
    path = mc_src / suite.path
    if not path.exists():
        return {"suite": suite.name, "file": suite.path, "status": "missing", "cases": []}
    logdir = workdir / suite.name
    logdir.mkdir(parents=True, exist_ok=True)
    suite_env = dict(env, **suite.env)
    if suite.build_module:  # Mooncake's build tree has the extension as ``store``: the same here
        alias = logdir / "build_module"
        alias.mkdir(exist_ok=True)
        (alias / "store.py").write_text("from mooncake.store import *  # noqa: F401,F403\n")
        suite_env["PYTHONPATH"] = os.pathsep.join([str(alias), env["PYTHONPATH"]])
    services = Services(suite_env, logdir)
    t0 = time.monotonic()
    try:
        services.start(suite.needs, mc_src)
        if suite.script_runs:
            procs = [subprocess.Popen([sys.executable, str(path), *argv], cwd=path.parent,
                                      env=suite_env, stdout=open(logdir / f"run{i}.log", "w"),
                                      stderr=subprocess.STDOUT)
                     for i, argv in enumerate(suite.script_runs)]
            codes = [p.wait(suite.timeout) for p in procs]
            cases = [{"test": f"{suite.path} {' '.join(a)}",
                      "status": "passed" if c == 0 else "failed", "detail": f"exit {c}"}
                     for a, c in zip(suite.script_runs, codes)]
        else:
            xml = logdir / "junit.xml"
            with open(logdir / "pytest.log", "w") as log:
                subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                                "-o", "addopts=", f"--junitxml={xml}", str(path)],
                               cwd=path.parent, env=suite_env, stdout=log,
                               stderr=subprocess.STDOUT, timeout=suite.timeout, check=False)
            cases = _cases(xml)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        cases = [{"test": suite.path, "status": "error", "detail": str(exc)}]
    finally:
        services.stop()
    bad = [c for c in cases if c["status"] in ("failed", "error")]
    return {"suite": suite.name, "file": suite.path, "seconds": round(time.monotonic() - t0, 1),
            "status": "failed" if bad or not cases else "passed",
            "passed": sum(c["status"] == "passed" for c in cases),
            "failed": len(bad), "skipped": sum(c["status"] == "skipped" for c in cases),
            "cases": cases}


def _in_private_netns() -> bool:
    return os.environ.get("KVPLANE_MC_NETNS") == "1"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mooncake-src", required=True, type=pathlib.Path)
    ap.add_argument("--only", nargs="*", default=None, help="suite names to run")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="write results as JSON")
    ap.add_argument("--workdir", type=pathlib.Path, default=None, help="logs (default: a tmp dir)")
    ap.add_argument("--no-netns", action="store_true", help="use the host's loopback ports")
    args = ap.parse_args(argv)
    if os.geteuid() == 0 and not args.no_netns and not _in_private_netns() and shutil.which("unshare"):
        cmd = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
               sys.executable, str(HERE), *(argv if argv is not None else sys.argv[1:])]
        return subprocess.call(cmd, env=dict(os.environ, KVPLANE_MC_NETNS="1"))
    workdir = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="kvplane-mc-tests-"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SHIM), str(SRC)]),
               MC_METADATA_SERVER=META, MOONCAKE_TE_META_DATA_SERVER=META,
               MOONCAKE_MASTER="127.0.0.1:50051", MOONCAKE_PROTOCOL="tcp",
               LOCAL_HOSTNAME=os.environ.get("LOCAL_HOSTNAME", "localhost"),
               DEFAULT_KV_LEASE_TTL="500", KVPLANE_SEGMENT_POPULATE="0",
               KVPLANE_LOG_LEVEL="WARNING", PYTHONUNBUFFERED="1")
    results = []
    for suite in SUITES:
        if args.only and suite.name not in args.only:
            continue
        res = run_suite(suite, args.mooncake_src.resolve(), env, workdir)
        results.append(res)
        print(f"{res['suite']:28s} {res['status']:8s} passed={res.get('passed', 0)} "
              f"failed={res.get('failed', 0)} skipped={res.get('skipped', 0)} "
              f"({res.get('seconds', 0)} s)", flush=True)
        for case in res["cases"]:  # type: ignore[union-attr]
            if case["status"] in ("failed", "error"):
                print(f"    {case['status']}: {case['test']}: {case['detail'][:160]}", flush=True)
    na = {p: r for p, r in NOT_APPLICABLE.items() if (args.mooncake_src / p).exists()}
    print(f"not applicable here ({len(na)}):")
    for p, reason in na.items():
        print(f"    {p}: {reason}")
    print(f"logs: {workdir}")
    if args.out:
        args.out.write_text(json.dumps({"suites": results, "not_applicable": na}, indent=1))
    return 0 if all(r["status"] == "passed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
