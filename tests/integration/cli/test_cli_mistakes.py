"""The newcomer's mistakes of issue 33, one test each: one line on stderr, the documented exit
code (2 usage, 1 runtime, 0 when only an optional part is skipped), nothing left running and no
/dev/shm file (tests.support.cli_run), and the help and results that were missing."""

from __future__ import annotations

import inspect
import json
import os
import pathlib
import re
import signal
import subprocess
import time

import pytest

from kvplane.cli import status
from kvplane.cli.lifecycle import memory_room
from kvplane.common.procs import wait_for_line, wait_until
from tests.support.cli_run import CLI, group_pids, one_line, run, shm_files

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
GiB = 1 << 30


@pytest.fixture(scope="module")
def master():
    """A master on free ports; yields its ready line."""
    with subprocess.Popen([*CLI, "master", "--port", "0", "--admin-port", "0"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
        try:
            yield json.loads(wait_for_line(proc.stdout, 60))
        finally:
            proc.terminate()
            proc.wait(30)


@pytest.fixture
def no_matplotlib(tmp_path):
    """PYTHONPATH for a child in which ``import matplotlib`` fails, as without the extra."""
    (tmp_path / "matplotlib").mkdir()
    (tmp_path / "matplotlib" / "__init__.py").write_text(
        "raise ImportError('No module named matplotlib (hidden by the test)')\n")
    return os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])


# -- sizes and limits, checked before anything starts -------------------------------------------
@pytest.mark.parametrize("size", ["100TiB", "host+1GiB"])
def test_a_segment_larger_than_the_host_is_a_usage_error_at_once(size):
    room = memory_room()
    assert room is not None
    if size == "host+1GiB":  # the "30GiB on a 23 GiB machine", sized to this host
        size = f"{room[0] // GiB + 1}GiB"
    start = time.monotonic()
    res = run(["segment", "--size", size, "--master", "127.0.0.1:1"], timeout=30)
    line = one_line(res, 2, "kvplane segment:", "'--size'", "more than this host can give")
    assert time.monotonic() - start < 10  # before any master connect, allocation or retry
    assert "MemAvailable" in line or "/dev/shm" in line


def test_serve_and_client_server_check_their_segment_sizes_too():
    one_line(run(["serve", "--segment-size", "100TiB"]), 2, "--segment-size", "can give")
    one_line(run(["client-server", "--size", "100TiB"]), 2, "--size", "can give")


@pytest.mark.parametrize("args, option", [
    (["bench", "store", "--repeat", "0"], "--repeat"),
    (["bench", "store", "--batch", "x"], "--batch"),
    (["bench", "store", "--clients", "0"], "--clients"),
    (["bench", "transfer", "--duration", "0"], "--duration"),
    (["bench", "store", "--segment-mb", "0"], "--segment-mb"),  # the old flag is still read
    (["bench", "store", "--segment-size", "1KiB"], "--segment-size"),
])
def test_bench_options_out_of_range_are_usage_errors(args, option):
    one_line(run(args), 2, option)


# -- help texts ---------------------------------------------------------------------------------
def _help(*words: str) -> str:
    res = subprocess.run([*CLI, *words, "--help"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "200"})
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_help_shows_sizes_as_sizes_and_flags_without_a_type():
    seg = _help("segment")
    assert re.search(r"--size\s+SIZE\s", seg) and re.search(r"--disk-size\s+SIZE\s", seg)
    assert "<bool>" not in seg and "<bool>" not in _help("serve")
    assert re.search(r"--segment-size\s+SIZE\s", _help("bench", "store"))
    assert "--segment-mb" not in _help("bench", "store")  # hidden: kept for old scripts only


def test_status_and_top_sort_the_same_way_by_default():
    def default(fn: object, name: str) -> object:
        return inspect.signature(fn).parameters[name].default.default  # typer's OptionInfo

    assert default(status.status, "sort") == default(status.top, "sort") == "usage"
    assert "--reverse" in _help("status") and "--reverse" in _help("top")


def test_top_against_a_dead_master_exits_1_like_status():
    dead = ["--admin", "http://127.0.0.1:1", "--timeout", "1"]
    one_line(run(["status", *dead]), 1, "kvplane status:", "unreachable", "--admin")
    res = run(["top", *dead, "--iterations", "1"])
    one_line(res, 1, "kvplane top:", "unreachable", "--admin")


def test_token_without_one_is_one_line(tmp_path):
    res = run(["token"], KVPLANE_TOKEN_FILE=str(tmp_path / "none"))
    one_line(res, 1, "kvplane token:", "no token yet", str(tmp_path / "none"))
    path = run(["token", "--path"], KVPLANE_TOKEN_FILE=str(tmp_path / "none"))
    assert path.returncode == 0 and path.stdout.strip() == str(tmp_path / "none")


# -- a client pointed at the wrong port -----------------------------------------------------------
def test_a_master_address_that_is_an_http_port_names_it_at_once(master):
    admin = f"127.0.0.1:{master['admin_port']}"
    res = run(["segment", "--size", "64MiB", "--metrics-port", "-1", "--master", admin])
    line = one_line(res, 1, "kvplane segment:", admin, "answered HTTP", "--master")
    assert f"pid {master['pid']} listens there: kvplane master" in line


def test_the_store_client_does_not_retry_a_port_that_speaks_http(master):
    """The library's error: a ProtocolError naming the port, raised at once (a refused port is
    retried until the deadline: it may be a master still starting)."""
    from kvplane.common.rpc import NotRpcPeer
    from kvplane.store import StoreClient

    start = time.monotonic()
    with pytest.raises(NotRpcPeer, match=rf"127.0.0.1:{master['admin_port']} is not a kvplane RPC"):
        StoreClient(master=f"127.0.0.1:{master['admin_port']}", timeout=5)
    assert time.monotonic() - start < 2.5


def test_a_master_address_where_nothing_listens_says_so():
    res = run(["segment", "--size", "64MiB", "--metrics-port", "-1", "--master", "127.0.0.1:1"])
    one_line(res, 1, "cannot reach the master at 127.0.0.1:1", "nothing listens on that port")


# -- results before plots ---------------------------------------------------------------------------
def test_simulate_without_matplotlib_prints_its_table_and_one_line(no_matplotlib, tmp_path):
    res = subprocess.run([*CLI, "--log-level", "WARNING", "simulate", "--policy", "mooncake",
                          "--limit", "50", "--plots", str(tmp_path)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": no_matplotlib})
    assert res.returncode == 0, res.stderr
    assert "mooncake" in res.stdout and "TTFT mean" in res.stdout
    skipped = [ln for ln in res.stderr.splitlines() if "plots skipped" in ln]
    assert len(skipped) == 1 and "pip install 'kvplane[plots]'" in skipped[0], res.stderr
    assert "Traceback" not in res.stderr and list(tmp_path.glob("*.png")) == []


# -- a benchmark a person can run -----------------------------------------------------------------
def test_bench_store_reports_skips_and_steps_and_keeps_results_on_ctrl_c(tmp_path):
    """Piped (so one line per step), with redis-server and etcd hidden from PATH: a skip line
    for each missing side; Ctrl-C as the kvplane side starts prints the rows measured so far
    (the floor's) and exits 130, leaving no process or shm file."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for d in os.environ["PATH"].split(os.pathsep):
        for name in os.listdir(d) if os.path.isdir(d) else []:
            if name not in ("redis-server", "etcd") and not (bindir / name).exists():
                (bindir / name).symlink_to(os.path.join(d, name))
    args = ["bench", "store", "--sizes", "4KiB", "--batch", "1", "--clients", "1", "--duration",
            "0.2", "--topologies", "remote", "--plot", "", "--sides", "redis,kvplane-tcp-ha,kvplane-tcp"]
    env = {**os.environ, "PATH": str(bindir), "KVPLANE_NIXL": "off"}
    with subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env, start_new_session=True) as proc:
        try:
            seen = []
            while not any("kvplane-tcp remote x1" in ln for ln in seen):
                seen.append(wait_for_line(proc.stderr, 90))
            os.killpg(proc.pid, signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    err = "".join(seen) + err
    assert proc.returncode == 130, err
    assert seen[:2] == ["skipped redis: redis-server is not installed (apt-get install "
                        "redis-server)\n", "skipped kvplane-tcp-ha: etcd is not installed "
                        "(apt-get install etcd-server)\n"]
    assert seen[2:] == ["[1/3] floor 4096 x1\n", "[2/3] floor 4096 x1\n",
                        "[3/3] kvplane-tcp remote x1\n"]
    assert "interrupted in step 3 of 3" in err
    assert re.search(r"floor\W+remote\W+1\W+get\W+4096", out), out  # what was measured
    assert "kvplane-tcp" not in out  # the side Ctrl-C stopped has no row
    assert "Traceback" not in err and "Warning" not in err
    # multiprocessing's resource tracker (the floor's responder) ends just after its parent
    wait_until(lambda: group_pids(proc.pid) == [], 10, "the bench's processes to end")
    assert shm_files(proc.pid) == []


def test_piped_tables_keep_whole_names(capsys, monkeypatch):
    """A bench table is wider than 80 columns; piped, rich would cut its cells (``kvpl…``)."""
    from rich.table import Table

    from kvplane.bench.report import table_console

    monkeypatch.delenv("COLUMNS", raising=False)
    table = Table(title="t")
    for col in ("side", "topology", "clients", "op", "size", "batch", "obj/s", "GB/s", "p50 us",
                "p99 us"):
        table.add_column(col)
    table.add_row("kvplane-tcp-nocache", "remote", "1", "get", "4096", "32", "12345", "0.123",
                  "250", "1200")
    table_console().print(table)  # stdout is captured here: not a terminal
    assert "kvplane-tcp-nocache" in capsys.readouterr().out


def test_bench_plots_are_skipped_in_one_line_without_matplotlib(no_matplotlib, tmp_path):
    res = subprocess.run([*CLI, "bench", "transfer", "--impls", "limits", "--sizes", "4KiB",
                          "--batches", "1", "--duration", "0.05", "--plot",
                          str(tmp_path / "t.png")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": no_matplotlib})
    assert res.returncode == 0, res.stderr
    assert "raw-socket" in res.stdout and not (tmp_path / "t.png").exists()
    assert [ln for ln in res.stderr.splitlines() if "plots skipped" in ln] == [
        "kvplane bench transfer: plots skipped: matplotlib is needed for plots: "
        "pip install 'kvplane[plots]'"]


# -- the conductor without vLLM ---------------------------------------------------------------------
def test_conductor_demo_shows_the_query_answering(tmp_path):
    with subprocess.Popen([*CLI, "conductor", "--port", "0"], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True) as conductor:
        try:
            url = json.loads(wait_for_line(conductor.stdout, 60))["conductor"]
            res = run(["conductor", "demo", "--conductor", url])
            again = run(["conductor", "demo", "--conductor", url, "--blocks", "2"])  # replaces it
        finally:
            conductor.terminate()
            conductor.wait(30)
    assert res.returncode == 0, res.stderr
    assert re.search(r"prompt 1 \(64 tokens, cached\)\s+-> longest_matched 64", res.stdout)
    assert re.search(r"32 new\s+-> longest_matched 32", res.stdout)
    assert re.search(r"never seen \(64 tokens\)\s+-> longest_matched 0", res.stdout)
    assert again.returncode == 0 and "longest_matched 32" in again.stdout, again.stderr


def test_conductor_demo_without_a_conductor_is_one_line():
    res = run(["conductor", "demo", "--conductor", "http://127.0.0.1:1", "--timeout", "1"])
    one_line(res, 1, "kvplane conductor demo:", "no conductor answers at http://127.0.0.1:1",
             "kvplane conductor")


# -- the test tree ----------------------------------------------------------------------------------
def test_no_test_module_imports_a_module_named_conftest():
    """``from conftest import X`` resolves to whichever conftest pytest imported last, so running
    one test by node id next to another directory's tests broke collection (issue 33)."""
    root = pathlib.Path(__file__).resolve().parents[2]
    bad = [str(p.relative_to(root)) for p in root.rglob("*.py")
           if re.search(r"^\s*(from conftest import|import conftest)", p.read_text(), re.M)]
    assert bad == []


def test_the_redis_skip_reason_says_each_thing_once():
    from kvplane.testing.needs import REQUIREMENTS

    req = REQUIREMENTS["redis"]
    reason = f"{req.what} is not available: {req.how}"
    assert reason == "Redis is not available: apt-get install redis-server"

