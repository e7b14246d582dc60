"""deploy/: every metric the Grafana dashboard queries is exported by a running service, and the
Prometheus scrape config's paths answer on those services with the token (and refuse without).

Starts a master (with its metadata server), a segment, a conductor and a router (whose only
backend is down: its metrics are registered all the same), scrapes each with the token."""

import json
import pathlib
import re
import signal
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvplane.common.procs import Proc
from tests.support.auth import headers
from tests.support.store_procs import CLI, spawn_master, spawn_segment

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy"
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
            "gauge": ("",), "summary": ("", "_count", "_sum", "_created")}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
                "unless", "bool", "offset"}


def exposed_names(text: str) -> set[str]:
    """Sample names a /metrics text can carry: its samples and, for families without samples
    yet (labelled, never touched), the names their type gives them."""
    names = set()
    for fam in text_string_to_metric_families(text):
        names |= {s.name for s in fam.samples}
        names |= {fam.name + suffix for suffix in SUFFIXES.get(fam.type, ("",))}
    return names


def queried_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression; fails on an identifier it cannot classify."""
    bare = re.sub(r"\b(by|without)\s*\([^)]*\)", " ", expr)
    bare = re.sub(r"\[[^\]]*\]|\{[^}]*\}|\"[^\"]*\"", " ", bare)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*(\s*\()?", bare):
        word = m.group(0).rstrip("( ")
        if m.group(1) or word in PROMQL_WORDS:
            continue  # a function, or a keyword
        assert word.startswith(("master_", "kvplane_")), f"unexpected identifier {word!r} in {expr!r}"
        names.add(word)
    return names


def dashboard_queries() -> list[str]:
    dash = json.loads((DEPLOY / "grafana" / "kvplane.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) > 20
    return exprs


@pytest.fixture(scope="module")
def services():
    master = spawn_master("--metadata-port", "0")
    procs = [master]
    try:
        seg = spawn_segment(master.info["master"], "4MiB", "--metrics-port", "0")
        procs.append(seg)
        conductor = Proc([*CLI, "conductor", "--port", "0"], stop_signal=signal.SIGINT)
        procs.append(conductor)
        router = Proc([*CLI, "router", "--backend", "http://127.0.0.1:1", "--port", "0"],
                      stop_signal=signal.SIGINT)
        procs.append(router)
        meta = urlsplit(master.info["metadata"])
        yield {"kvplane-master": f"http://127.0.0.1:{master.info['admin_port']}",
               "kvplane-metadata": f"http://{meta.netloc}",
               "kvplane-segment": f"http://127.0.0.1:{seg.info['metrics_port']}",
               "kvplane-conductor": conductor.info["conductor"],
               "kvplane-router": router.info["router"]}
    finally:
        for p in reversed(procs):
            p.stop()


def scrape_config() -> dict[str, str]:
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {}
    for job in cfg["scrape_configs"]:
        assert job["authorization"]["type"] == "Bearer" and job["authorization"]["credentials_file"]
        assert job["static_configs"][0]["targets"]
        jobs[job["job_name"]] = job.get("metrics_path", "/metrics")
    return jobs


def test_scrape_config_paths_answer_with_the_token(services):
    jobs = scrape_config()
    assert sorted(jobs) == sorted(services)
    for job, path in jobs.items():
        url = services[job] + path
        assert httpx.get(url, timeout=10, trust_env=False).status_code == 401, job
        r = httpx.get(url, headers=headers(), timeout=10, trust_env=False)
        assert r.status_code == 200 and "# TYPE" in r.text, (job, r.status_code)


def test_every_dashboard_metric_is_exported(services):
    jobs = scrape_config()
    exported: dict[str, set[str]] = {}
    for job, path in jobs.items():
        text = httpx.get(services[job] + path, headers=headers(), timeout=10, trust_env=False).text
        exported[job] = exposed_names(text)
    everything = set().union(*exported.values())
    used = set().union(*(queried_names(e) for e in dashboard_queries()))
    assert len(used) >= 30
    assert sorted(used - everything) == []
    # each service's own metrics come from that service
    assert {"master_key_count", "master_rpc_requests_total"} <= exported["kvplane-master"]
    assert "kvplane_transfer_server_frames_total" in exported["kvplane-segment"]
    assert "kvplane_conductor_batches_total" in exported["kvplane-conductor"]
    assert "kvplane_router_routed_total" in exported["kvplane-router"]
    assert "kvplane_metadata_keys" in exported["kvplane-metadata"]


def test_queried_names_rejects_unknown_identifiers():
    assert queried_names("sum by (op) (rate(kvplane_x_total{a=\"b\"}[1m])) / master_y") == \
        {"kvplane_x_total", "master_y"}
    with pytest.raises(AssertionError):
        queried_names("rate(http_requests_total[1m])")
