"""kvplane.testing.needs: a missing outside dependency skips with a one-line reason, and under
``CI`` fails; the ``requires`` marker (tests/conftest.py) applies the same rule."""

from __future__ import annotations

import pytest

from kvplane.testing import needs


@pytest.fixture
def absent(monkeypatch):
    monkeypatch.setitem(needs.REQUIREMENTS, "nothing",
                        needs.Requirement("the nothing binary", lambda: None, "apt-get install it"))
    monkeypatch.setattr(needs.shutil, "which", lambda name: None)  # etcd, redis, chromium hidden
    return monkeypatch


@pytest.mark.parametrize("name", ["nothing", "etcd", "redis", "chromium"])
def test_missing_skips_with_the_reason_locally(absent, name):
    absent.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception) as got:
        needs.requires(name)
    msg = str(got.value)
    assert "is not available: " in msg and "\n" not in msg and "apt-get install" in msg


def test_missing_fails_under_ci(absent):
    absent.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must install it"):
        needs.requires("nothing")


def test_present_returns_what_was_found(monkeypatch):
    monkeypatch.setitem(needs.REQUIREMENTS, "here", needs.Requirement("x", lambda: "/bin/x", ""))
    assert needs.requires("here") == "/bin/x" and needs.available("here")


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(KeyError, match="etcd"):
        needs.requires("etdc")


def test_every_outside_dependency_is_in_the_table():
    assert {"etcd", "redis", "chromium", "torch", "vllm", "engines"} <= set(needs.REQUIREMENTS)


# the marker is read before any fixture runs: this entry is in the table from collection on
needs.REQUIREMENTS.setdefault("_absent_for_tests", needs.Requirement(
    "the absent-for-tests binary", lambda: None, "nothing to install"))


@pytest.mark.skipif(bool(__import__("os").environ.get("CI")), reason="under CI the marker fails "
                    "the test instead (test_missing_fails_under_ci checks that rule)")
@pytest.mark.requires("_absent_for_tests")
def test_the_marker_skips_before_the_test_runs():
    pytest.fail("the requires marker let a test with a missing dependency run")
