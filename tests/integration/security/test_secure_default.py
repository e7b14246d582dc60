"""Issue 15, findings 10 and 11: tokens by default, and no port left open with a token set.

10: a service started without a token generates one into a 0600 file that local clients read;
    a client without it is refused. ``--no-auth`` says what it opens.
11: with a token, the admin routes, /metrics, the segment's metrics port and the KV-event
    stream all need it (only /health stays open).
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess

import httpx
import pytest
import zmq

from kvplane.common.auth import ADMIN, Principal, TokenTable, client_token, server_token
from kvplane.common.errors import InvalidArgument, Unauthorized
from kvplane.common.procs import Proc
from kvplane.common.rpc import RpcClient
from kvplane.store import StoreClient
from kvplane.store.dummy.types import SessionReq
from kvplane.store.types import PingRep, PingReq
from kvplane.transfer import protocol
from tests.support.auth import headers
from tests.support.services import wait_until
from tests.support.store_procs import CLI, spawn_client_server, spawn_master, spawn_segment

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def test_server_token_is_generated_once_into_a_private_file(tmp_path, monkeypatch):
    path = tmp_path / "d" / "token"
    monkeypatch.setenv("KVPLANE_TOKEN_FILE", str(path))
    first = server_token(None)
    assert first.source == "generated" and len(first.token) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert server_token(None).token == first.token and client_token() == first.token
    assert str(path) in first.describe() and first.token not in first.describe()
    monkeypatch.setenv("KVPLANE_TOKEN", "from-env")
    assert server_token(None).token == client_token() == "from-env"
    assert server_token("flag").token == "flag"
    assert server_token(None, no_auth=True).token == ""
    with pytest.raises(InvalidArgument):
        server_token("flag", no_auth=True)
    monkeypatch.delenv("KVPLANE_TOKEN")
    path.chmod(0o644)
    with pytest.raises(InvalidArgument, match="readable by others"):
        client_token()


def test_token_table_roles():
    table = TokenTable("svc", "adm", {"a": "tok-a-0123456789"})
    assert table("adm") == ADMIN
    assert table("svc") == Principal("default")
    assert table("tok-a-0123456789") == Principal("a")
    assert table("") is None and table("svc ") is None
    open_table = TokenTable("")
    assert open_table("anything") == ADMIN
    with pytest.raises(InvalidArgument):
        TokenTable("same", "same")


def test_master_started_without_a_token_requires_the_generated_one(tmp_path):
    env = {"KVPLANE_TOKEN_FILE": str(tmp_path / "token")}
    with Proc([*CLI, "master", "--port", "0", "--admin-port", "0"], env=env) as m:
        token = (tmp_path / "token").read_text().strip()
        assert stat.S_IMODE((tmp_path / "token").stat().st_mode) == 0o600
        with RpcClient(m.info["master"], token="", timeout=5) as c:
            with pytest.raises(Unauthorized):
                c.call("ping", PingReq("x"), PingRep)
        with RpcClient(m.info["master"], token=token, timeout=5) as c:
            assert c.call("ping", PingReq("x"), PingRep).status == "need_remount"
        admin = f"http://127.0.0.1:{m.info['admin_port']}"
        assert httpx.get(f"{admin}/get_all_keys", timeout=5).status_code == 401
        assert httpx.get(f"{admin}/get_all_keys", timeout=5,
                         headers={"X-KVPlane-Token": token}).status_code == 200
        assert (tmp_path / "admin-token").exists()  # the admin token sits next to it


def test_serve_generates_a_token_local_clients_find(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPLANE_TOKEN_FILE", str(tmp_path / "token"))
    with Proc([*CLI, "serve", "--master-port", "0", "--metadata-port", "0", "--admin-port", "0",
               "--segment-size", "16MiB"]) as node:
        with StoreClient(master=node.info["master"], metadata=node.info["metadata"]) as c:
            c.put("k", b"v" * 100)
            assert c.get("k") == b"v" * 100
        r = httpx.get(node.info["metadata"], params={"key": "x"}, timeout=5)
        assert r.status_code == 401


def test_no_auth_help_says_what_it_opens():
    for cmd, words in (("serve", ("master RPC", "admin", "metadata", "data port")),
                       ("master", ("RPC port", "admin port", "KV-event")),
                       ("segment", ("data port", "/metrics")),
                       ("metadata", ("/metadata", "/metrics")),
                       ("conductor", ("/register", "/query")),
                       ("pd-proxy", ("/v1/completions",)),
                       ("client-server", ("dummy-client RPC port", "data port"))):
        out = subprocess.run([*CLI, cmd, "--help"], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "COLUMNS": "200"}).stdout
        flat = " ".join(out.replace("\u2502", " ").split())  # rich's box edges between lines
        assert "--no-auth" in flat, cmd
        for w in words:
            assert w in flat, (cmd, w)


@pytest.fixture(scope="module")
def pool():
    with spawn_master("--kv-events-port", "0") as m:
        with spawn_segment(m.info["master"], "16MiB") as seg:
            yield m, seg


def test_admin_routes_and_metrics_need_the_token(pool):
    m, seg = pool
    admin = f"http://127.0.0.1:{m.info['admin_port']}"
    for path in ("/get_all_keys", "/query_key?key=k", "/segments", "/get_all_segments",
                 "/get_segments_detail", "/metrics/", "/docs"):
        assert httpx.get(admin + path, timeout=5).status_code == 401, path
        assert httpx.get(admin + path, timeout=5, headers=headers()).status_code != 401, path
    assert httpx.get(admin + "/health", timeout=5).status_code == 200
    metrics = f"http://127.0.0.1:{seg.info['metrics_port']}/metrics"
    assert httpx.get(metrics, timeout=5).status_code == 401
    assert "kvplane" in httpx.get(metrics, timeout=5, headers=headers()).text
    health = httpx.get(f"http://127.0.0.1:{seg.info['metrics_port']}/health", timeout=5)
    assert health.status_code == 200 and "kvplane" not in health.text  # open, and says nothing


def _sub(ctx: zmq.Context, endpoint: str, token: str | None) -> zmq.Socket:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    if token is not None:
        s.setsockopt(zmq.PLAIN_USERNAME, b"kvplane")
        s.setsockopt(zmq.PLAIN_PASSWORD, token.encode())
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(endpoint)
    return s


def test_kv_event_stream_needs_the_token(pool):
    m, _ = pool
    ctx = zmq.Context()
    try:
        anon = _sub(ctx, m.info["kv_events"], None)
        wrong = _sub(ctx, m.info["kv_events"], "wrong")
        good = _sub(ctx, m.info["kv_events"], client_token())
        with StoreClient(master=m.info["master"]) as c:
            n = iter(range(1, 1 << 20))
            wait_until(lambda: c.put(f"m@{next(n):#x}", b"x") is None and good.poll(100), 20,
                       "events for the authenticated subscriber")
            for _ in range(5):
                c.put(f"m@{next(n):#x}", b"x")
        assert good.poll(2000)
        assert not anon.poll(500) and not wrong.poll(100)
    finally:
        ctx.destroy(linger=0)


def test_data_port_needs_the_token(pool):
    _, seg = pool
    port = int(seg.info["segment"].rsplit(":", 1)[1])
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(protocol.pack_req(protocol.OP_DESCRIBE, 1, 0, 0))
    s.settimeout(5)
    assert s.recv(100) == b""  # closed: DESCRIBE before HELLO
    s.close()


def test_pd_proxy_needs_the_token():
    with Proc([*CLI, "pd-proxy", "--prefill", "http://127.0.0.1:9", "--decode",
               "http://127.0.0.1:10", "--port", "0"], stop_signal=signal.SIGTERM) as px:
        url = px.info["proxy"]
        body = {"model": "m", "prompt": "hi"}
        assert httpx.post(url + "/v1/completions", json=body, timeout=5).status_code == 401
        bearer = {"Authorization": f"Bearer {client_token()}"}
        r = httpx.post(url + "/v1/completions", json=body, headers=bearer, timeout=10)
        # past the gate: the (absent) instances are unreachable or ejected
        assert r.status_code in (502, 503), r.text
        # /health is open (503: no instance can serve), never 401
        assert httpx.get(url + "/health", timeout=5).status_code == 503


def test_client_server_needs_the_token(pool):
    """The dummy-client RPC port (``kvplane client-server``) takes the local token by default."""
    m, _ = pool
    with spawn_client_server(m.info["master"], "16MiB") as cs:
        addr = cs.info["client_server"]
        for bad in ("", "wrong-token"):
            with RpcClient(addr, token=bad, timeout=5) as c, pytest.raises(Unauthorized):
                c.call("sessions", SessionReq("x"), int)
        with RpcClient(addr, token=client_token(), timeout=5) as c:
            assert c.call("sessions", SessionReq("x"), int) == 0
