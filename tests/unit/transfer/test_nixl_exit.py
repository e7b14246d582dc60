"""nixl.avoid_exit_crash: UCX's EFA module is kept out exactly when it would load a second
libnl (the wheel's EFA module names the system libibverbs, and the host has one), and never
over the user's own UCX_MODULES."""

from __future__ import annotations

import pytest

from kvplane.transfer.transports import nixl

pytestmark = pytest.mark.timeout(10)


def _wheel(tmp_path, efa_needs: bytes):
    pkg = tmp_path / "nixl_cu12"
    pkg.mkdir()
    ucx = tmp_path / "nixl_cu12.libs" / "ucx"
    ucx.mkdir(parents=True)
    (ucx / "libuct_ib_efa.so.0.0.0").write_bytes(b"\x7fELF..." + efa_needs + b"...")
    (ucx / "libuct_tcp.so.0.0.0").write_bytes(b"\x7fELF\x00libibverbs.so.1\x00")
    return str(pkg)


@pytest.fixture
def system_verbs(monkeypatch):
    monkeypatch.delenv("UCX_MODULES", raising=False)
    found = {"ibverbs": "libibverbs.so.1"}
    monkeypatch.setattr(nixl.ctypes.util, "find_library", lambda name: found.get(name))
    return found


def test_unbundled_efa_with_a_system_libibverbs_is_kept_out(tmp_path, system_verbs, monkeypatch):
    assert nixl.avoid_exit_crash(_wheel(tmp_path, b"\x00libibverbs.so.1\x00")) == "^efa"
    assert nixl.os.environ["UCX_MODULES"] == "^efa"


def test_no_system_libibverbs_changes_nothing(tmp_path, system_verbs):
    system_verbs.clear()
    assert nixl.avoid_exit_crash(_wheel(tmp_path, b"\x00libibverbs.so.1\x00")) == ""
    assert "UCX_MODULES" not in nixl.os.environ


def test_a_bundled_efa_module_changes_nothing(tmp_path, system_verbs):
    assert nixl.avoid_exit_crash(_wheel(tmp_path, b"\x00libibverbs-1de1263b.so.1.14\x00")) == ""
    assert "UCX_MODULES" not in nixl.os.environ


def test_the_users_ucx_modules_wins(tmp_path, system_verbs, monkeypatch):
    monkeypatch.setenv("UCX_MODULES", "ib,efa,tcp")
    assert nixl.avoid_exit_crash(_wheel(tmp_path, b"\x00libibverbs.so.1\x00")) == ""
    assert nixl.os.environ["UCX_MODULES"] == "ib,efa,tcp"


def test_a_package_without_ucx_modules_changes_nothing(tmp_path, system_verbs):
    assert nixl.avoid_exit_crash(str(tmp_path / "elsewhere")) == ""
