"""The master's /dashboard in a real headless Chromium (DevTools protocol): it refuses without
the token, loads with it, shows each live segment, updates after a put; a screenshot is kept."""

import json

import pytest

from kvplane.common.auth import client_token
from kvplane.testing.needs import need_module, requires
from tests.support.store_procs import spawn_master, spawn_segment, spawn_worker

need_module("websocket", "pip install websocket-client (the dev extra)")
from tests.support.browser import Browser  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

REFUSED = "document.body.innerText.includes('missing or wrong token') && !document.getElementById('segments')"
ROWS = "Array.from(document.querySelectorAll('#segments tbody tr')).map(r => r.dataset.segment).sort()"


@pytest.fixture
def cluster():
    master = spawn_master()
    procs = [master]
    try:
        procs += [spawn_segment(master.info["master"], "8MiB") for _ in range(2)]
        procs.append(spawn_worker(master.info["master"]))
        yield {"admin": f"http://127.0.0.1:{master.info['admin_port']}",
               "segments": sorted(p.info["segment"] for p in procs[1:3]), "worker": procs[3]}
    finally:
        for p in reversed(procs):
            p.stop()


@pytest.fixture
def browser(tmp_path):
    requires("chromium")
    with Browser(str(tmp_path / "profile")) as b:
        yield b


def test_dashboard_in_chromium(cluster, browser, tmp_path):
    admin, token = cluster["admin"], client_token()
    assert token, "the services run with a token by default"

    page = browser.open(f"{admin}/dashboard")
    assert page.wait_for(REFUSED, 10)
    page.navigate(f"{admin}/dashboard?token=wrong-token")
    assert page.wait_for(REFUSED, 10)

    page.navigate(f"{admin}/dashboard?token={token}")
    page.wait_for("Number(document.body.dataset.refreshes || 0) >= 1", 30)
    assert page.evaluate("location.search") == ""  # the token left the address bar...
    assert page.evaluate("sessionStorage.getItem('kvplane-token')") == token  # ...for this tab
    assert page.evaluate(ROWS) == cluster["segments"]
    statuses = page.evaluate("Array.from(document.querySelectorAll('#segments tbody tr td:nth-child(2)'))"
                             ".map(td => td.textContent)")
    assert statuses == ["alive", "alive"]
    assert page.evaluate("document.querySelector('#card-objects b').textContent") == "0"

    keys = [f"dash-{i}" for i in range(3)]
    put = json.dumps({"op": "put", "keys": keys, "size": 300_000})
    assert cluster["worker"].ask(put)["result"] == [0] * 3
    page.wait_for("document.querySelector('#card-objects b').textContent === '3'", 30)
    page.wait_for("document.querySelector('#card-replicas b').textContent === '3'", 10)
    used = page.evaluate("Array.from(document.querySelectorAll('#segments tbody tr td:nth-child(4)'))"
                         ".map(td => td.textContent)")
    assert any(u != "0 B" for u in used), used
    # the charts drew from the master's samples: a path per series once two samples exist
    page.wait_for("document.querySelectorAll('#chart-objects path').length === 1", 30)
    assert page.evaluate("document.querySelectorAll('#chart-ops path').length") == 4

    shot = tmp_path / "dashboard.png"
    size = page.screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and size > 10_000
    print(f"dashboard screenshot: {shot}")

    # it keeps polling with the header from sessionStorage
    n = page.evaluate("Number(document.body.dataset.refreshes)")
    page.wait_for(f"Number(document.body.dataset.refreshes) > {n}", 30)
