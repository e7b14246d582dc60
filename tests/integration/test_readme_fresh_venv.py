"""The README's test command works from nothing: a fresh venv (no system packages), a copy of
the checkout, none of etcd, Redis, torch, vLLM or chromium, then the command itself, whole.

What runs: ``pip install -e '.[dev]' && python -m pytest -q`` exactly as the README says (plus
``-rs`` for the skip reasons), in a shell whose PATH hides etcd, redis-server and chromium
(a directory of links to everything else on PATH), whose vLLM and engines venvs point nowhere,
and without ``CI``: every test that needs one of them must skip with its one-line reason
(kvplane.testing.needs), and the run must end in "N passed" with N >= MIN_PASSED, no failure,
no error. Inside that run this test skips itself (no ``CI``), so it does not recurse.

CI only (``CI`` set, as .ci/run does): it installs the dev extra into a venv and runs the whole
suite a second time (about as long as the first). ``KVPLANE_FRESH_VENV_PYTEST`` (read at
collection, a test-kit variable) replaces the suite with the pytest arguments it holds, e.g.
``tests/unit tests/fault/store/test_ha.py``: a quick check of this mechanism; the bar is then
one passed test.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest

SUBSET = os.environ.get("KVPLANE_FRESH_VENV_PYTEST", "")  # read at collection: see above
MIN_PASSED = 1 if SUBSET else 800  # the suite has ~1300 tests; fewer than 800 ran is not a pass
HIDDEN = ("etcd", "etcdctl", "etcdutl", "redis-server", "redis-cli", "chromium",
          "chromium-browser", "google-chrome", "chrome")
pytestmark = [
    pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(5400),
]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _checkout_copy(dest: pathlib.Path) -> None:
    """The tracked and unignored files of this checkout (what a fresh clone has, plus edits)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, check=True, timeout=60).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def _shadow_path(bindir: pathlib.Path) -> str:
    """A directory of links to every program on PATH but :data:`HIDDEN` (first one wins)."""
    bindir.mkdir()
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            src, dst = os.path.join(d, name), bindir / name
            if name not in HIDDEN and not dst.exists() and os.access(src, os.X_OK) \
                    and os.path.isfile(src):
                dst.symlink_to(src)
    return str(bindir)


def _clean_env(venv: pathlib.Path, home: pathlib.Path, bindir: pathlib.Path) -> dict[str, str]:
    """A new user's shell: the venv first on PATH, none of :data:`HIDDEN`, no vLLM or engines
    venv, no CI, no PYTHONPATH, no kvplane settings."""
    keep = {k: v for k, v in os.environ.items()
            if not k.startswith(("KVPLANE_", "PYTHON", "VIRTUAL_ENV", "CI"))}
    nowhere = str(home / "absent")
    return {**keep, "PATH": f"{venv / 'bin'}:{_shadow_path(bindir)}",
            "VIRTUAL_ENV": str(venv), "XDG_RUNTIME_DIR": str(home), "HOME": str(home),
            "KVPLANE_VLLM_PYTHON": f"{nowhere}/python", "KVPLANE_ENGINES_VENV": nowhere,
            "KVPLANE_ENGINES_PYTHON": f"{nowhere}/python"}


def closing_counts(output: str) -> dict[str, int]:
    """pytest's closing line as counts: {"passed": 812, "skipped": 40, ...}; {} if none."""
    lines = [ln for ln in output.splitlines() if re.search(r"\d+ (passed|failed|errors?)\b", ln)]
    if not lines:
        return {}
    return {("errors" if k.startswith("error") else k): int(n)
            for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|"
                                   r"deselected|warnings?)\b", lines[-1])}


def test_closing_counts_reads_pytests_last_line():
    assert closing_counts("x\n== 3 failed, 1200 passed, 41 skipped, 2 errors in 9.1s ==\n") == \
        {"failed": 3, "passed": 1200, "skipped": 41, "errors": 2}
    assert closing_counts("12 passed in 1.0s") == {"passed": 12}
    assert closing_counts("no tests ran in 0.1s") == {}


@pytest.mark.skipif(not os.environ.get("CI"), reason="creates a venv, pip-installs .[dev] and "
                    "runs the suite again (as long as the suite): runs in CI; set CI=1 to run it "
                    "here, KVPLANE_FRESH_VENV_PYTEST=PATHS for a part")
def test_readme_test_command_passes_in_a_fresh_venv(tmp_path):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = "pip install -e '.[dev]' && python -m pytest -q"
    assert command in readme
    repo, venv, home = tmp_path / "clone", tmp_path / "venv", tmp_path / "home"
    repo.mkdir()
    home.mkdir(mode=0o700)
    _checkout_copy(repo)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = _clean_env(venv, home, tmp_path / "bin")
    env["PIP_CACHE_DIR"] = os.environ.get("PIP_CACHE_DIR", str(pathlib.Path.home() / ".cache/pip"))

    def sh(cmd: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", cmd], cwd=repo, env=env, capture_output=True,
                              text=True, timeout=timeout)

    install_cmd, test_cmd = command.split(" && ")
    install = sh(install_cmd + " -q", 900)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    probe = sh("python -c 'import kvplane, sys; print(kvplane.__file__, sys.prefix)'", 60)
    assert probe.stdout.startswith(str(repo / "src")) and str(venv) in probe.stdout, probe.stdout
    for module in ("torch", "vllm"):
        assert sh(f"python -c 'import {module}'", 60).returncode != 0, f"{module} leaked in"
    for exe in HIDDEN:
        assert sh(f"command -v {exe}", 10).returncode != 0, f"{exe} is still on PATH"

    run = sh(f"{test_cmd} -rs {' '.join(map(shlex.quote, shlex.split(SUBSET)))}", 5000)
    tail = run.stdout[-6000:] + run.stderr[-2000:]
    counts = closing_counts(run.stdout)
    assert counts.get("failed", 0) == 0 and counts.get("errors", 0) == 0, tail
    assert counts.get("passed", 0) >= MIN_PASSED, tail
    assert run.returncode == 0, tail
    if not SUBSET:  # the HA tests were there and skipped for the hidden etcd, with the reason
        assert "etcd is not available: apt-get install etcd-server" in run.stdout, tail
