"""docs/transfer.md's "Adding a transport": the example is the real module, registered here and
run through the engine; its optional capability is discovered; broken plugins fail loudly."""

from __future__ import annotations

import pathlib
import re
import uuid

import numpy as np
import pytest

from kvplane.common.errors import InvalidArgument
from kvplane.transfer import OpCode, TransferEngine, TransferRequest, TransferStatus
from kvplane.transfer.jobs import Item
from kvplane.transfer.transports import TRANSPORTS, loopback

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _register(name: str, path: str) -> None:
    if name not in TRANSPORTS.names():
        TRANSPORTS.register(name, path)


def test_the_doc_shows_the_example_module_verbatim():
    doc = (ROOT / "docs" / "transfer.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    code = pathlib.Path(loopback.__file__).read_text(encoding="utf-8")
    assert code in blocks, "docs/transfer.md must show transports/loopback.py as it is"


def test_the_example_transport_runs_through_the_engine():
    _register("loopback", "kvplane.transfer.transports.loopback:LoopbackTransport")
    kw = dict(transports=("tcp", "local", "loopback"), protocol="loopback",
              metadata=f"memory://loop-{uuid.uuid4().hex}")
    with TransferEngine(**kw) as a, TransferEngine(**kw) as b:
        src = np.arange(4096, dtype=np.uint8)
        dst = np.zeros(4096, np.uint8)
        back = np.zeros(4096, np.uint8)
        a.register_memory(src)
        a.register_memory(back)
        b.register_memory(dst)
        seg = a.open_segment(b.name)
        loop = a.transports["loopback"]
        assert isinstance(loop, loopback.LoopbackTransport)
        got = a.transfer([TransferRequest(OpCode.WRITE, src.ctypes.data, seg, dst.ctypes.data, 4096)])
        assert got == [TransferStatus.COMPLETED] and np.array_equal(src, dst)
        assert loop.fast == 0  # a batch goes through run()
        st = a.read_one(seg, back.ctypes.data, dst.ctypes.data, 1024)
        assert st == TransferStatus.COMPLETED and loop.fast == 1  # the one-item capability
        many = a.read_many([Item(seg, back.ctypes.data + 1024, dst.ctypes.data + 1024, 3072)])
        assert many == [TransferStatus.COMPLETED] and np.array_equal(back, src)
        assert not a.via_listener(seg, dst.ctypes.data, 16)  # it declares no listener


def test_a_broken_plugin_fails_loudly():
    """Explicit "module:Class" names load as registered ones do (and leave the registry,
    which test_public_api checks entry by entry, alone)."""
    with pytest.raises(InvalidArgument, match="not a Transport"):
        TransferEngine(transports=("tcp", "kvplane.transfer.transports.loopback:view_at"))
    with pytest.raises(InvalidArgument, match="names no class"):
        TransferEngine(transports=("tcp", "kvplane.transfer.transports.loopback:Nope"))
    with pytest.raises(ModuleNotFoundError):
        TransferEngine(transports=("tcp", "kvplane.transfer.transports.no_such_module:X"))


def test_an_engine_needs_a_control_channel():
    _register("loopback", "kvplane.transfer.transports.loopback:LoopbackTransport")
    with pytest.raises(InvalidArgument, match="control channel"):
        TransferEngine(transports=("local", "loopback"))
