"""A missing optional dependency is one clear error that names the pip extra."""

import sys

import pytest

from kvplane.common.errors import KVPlaneError, MissingExtra
from kvplane.common.extras import require

pytestmark = pytest.mark.timeout(10)


def test_missing_module_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)  # makes `import redis` fail
    with pytest.raises(MissingExtra) as info:
        require("redis", "redis", "Redis metadata")
    msg = str(info.value)
    assert "\n" not in msg and "pip install 'kvplane[redis]'" in msg and "Redis metadata" in msg
    assert isinstance(info.value, ImportError) and isinstance(info.value, KVPlaneError)


def test_present_module_is_returned():
    assert require("json", "none").dumps([1]) == "[1]"


def test_redis_metadata_backend_reports_the_extra(monkeypatch):
    from kvplane.transfer.metadata import RedisMetadata

    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(MissingExtra, match=r"kvplane\[redis\]"):
        RedisMetadata("redis://127.0.0.1:1/0")
