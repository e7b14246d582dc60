import pytest

from kvplane.common import envs
from kvplane.common.config import parse_hostport, parse_size
from kvplane.common.deadline import Deadline
from kvplane.common.errors import (
    AddressNotRegistered,
    Conflict,
    InvalidArgument,
    KVPlaneError,
    Timeout,
    from_code,
)
from kvplane.common.registry import Registry


@pytest.mark.parametrize("text,expected", [
    ("4096", 4096), ("64KiB", 64 << 10), ("4GiB", 4 << 30), ("512MB", 512 * 10**6),
    ("4 GB", 4 * 10**9), ("1.5MiB", int(1.5 * (1 << 20))), (123, 123),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "4XB", "-1", "1..2"])
def test_parse_size_rejects(bad):
    with pytest.raises(InvalidArgument):
        parse_size(bad)


def test_parse_hostport():
    assert parse_hostport("127.0.0.1:50051") == ("127.0.0.1", 50051)
    assert parse_hostport("[::1]:80") == ("::1", 80)
    assert parse_hostport("host", 9) == ("host", 9)
    with pytest.raises(InvalidArgument):
        parse_hostport("host")
    with pytest.raises(InvalidArgument):
        parse_hostport("host:99999")


def test_error_codes_round_trip():
    for cls in (AddressNotRegistered, Conflict, Timeout):
        exc = from_code(cls.code, "m")
        assert type(exc) is cls and str(exc) == "m"
    assert type(from_code(-424242, "x")) is KVPlaneError
    assert Timeout.retryable and not InvalidArgument.retryable


def test_deadline():
    d = Deadline.after(0)
    assert d.expired() and d.remaining() == 0
    with pytest.raises(Timeout):
        d.check("x")
    assert Deadline.after(10).remaining() > 9


def test_envs_table(monkeypatch):
    assert envs.get("KVPLANE_TCP_STREAMS") == 2
    monkeypatch.setenv("KVPLANE_LOG_JSON", "yes")
    assert envs.get("KVPLANE_LOG_JSON") is True
    monkeypatch.setenv("KVPLANE_SLICE_SIZE", "1MiB")
    assert envs.get("KVPLANE_SLICE_SIZE") == 1 << 20
    monkeypatch.setenv("KVPLANE_LOG_JSON", "maybe")
    with pytest.raises(InvalidArgument):
        envs.get("KVPLANE_LOG_JSON")
    with pytest.raises(KeyError):
        envs.get("KVPLANE_NO_SUCH_VAR")


def test_registry():
    r: Registry[object] = Registry("thing")
    r.register("od", "collections:OrderedDict")
    assert r.load("od").__name__ == "OrderedDict"
    assert r.load("collections:deque").__name__ == "deque"
    with pytest.raises(Conflict):
        r.register("od", "x:y")
    with pytest.raises(InvalidArgument, match="od"):
        r.load("nope")
