"""deploy/k8s: every manifest validates against the Kubernetes schema (kubernetes-validate,
offline, strict: unknown fields fail), and the kvplane containers run real subcommands with
flags those subcommands have."""

import pathlib

import pytest
import typer.main
import yaml

from kvplane.cli.main import build
from kvplane.testing.needs import need_module

pytestmark = pytest.mark.timeout(60)
K8S = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "k8s"
VERSION = "1.30.0"


def documents():
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path.name, doc


def test_manifests_match_the_kubernetes_schema():
    validate = need_module("kubernetes_validate", "pip install kubernetes-validate (the dev extra)")
    kinds = []
    for _name, doc in documents():
        validate.validate(doc, VERSION, strict=True)  # raises ValidationError
        kinds.append(doc["kind"])
    assert {"StatefulSet", "DaemonSet", "Service", "Secret", "Deployment"} <= set(kinds)


def test_schema_check_catches_a_bad_field():
    validate = need_module("kubernetes_validate", "pip install kubernetes-validate (the dev extra)")
    doc = next(d for _, d in documents() if d["kind"] == "DaemonSet")
    bad = yaml.safe_load(yaml.safe_dump(doc))
    bad["spec"]["template"]["spec"]["containers"][0]["portz"] = []
    with pytest.raises(validate.ValidationError):
        validate.validate(bad, VERSION, strict=True)


def test_containers_run_real_subcommands_and_flags():
    cli = typer.main.get_command(build())
    seen = 0
    for _, doc in documents():
        if doc["kind"] not in ("StatefulSet", "DaemonSet", "Deployment"):
            continue
        for c in doc["spec"]["template"]["spec"]["containers"]:
            if not c["image"].startswith("kvplane"):
                continue
            sub, *args = c["args"]
            cmd = cli.commands[sub]
            flags = {o for p in cmd.params for o in p.opts}
            for arg in args:
                assert arg.split("=", 1)[0] in flags, f"{sub}: unknown flag {arg}"
            seen += 1
    assert seen == 3  # master, segment, conductor
