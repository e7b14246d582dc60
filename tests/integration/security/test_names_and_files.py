"""Issue 15, finding 14: file segments are told apart by identity, and names are checked whole.

Two engines on one host with different file roots and the same file name used to mix their
files up: the writer's file transport opened *its own* root's file of that name and reported
COMPLETED. Now a same-host peer opens a file only when it is the owner's very file (device and
inode); otherwise the bytes go over TCP to the owner, who writes its own file. And the name
checks match the whole name: ``"ok\\n"`` is not a valid segment or file name.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvplane.common.errors import InvalidArgument
from kvplane.transfer import TransferEngine
from kvplane.transfer.segments import check_name

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
N = 1 << 16


def test_same_file_name_under_two_roots_is_two_files(tmp_path):
    ra, rb = tmp_path / "a", tmp_path / "b"
    ra.mkdir()
    rb.mkdir()
    with TransferEngine(file_root=str(ra), token="t") as a, \
            TransferEngine(file_root=str(rb), token="t") as b:
        a.register_file("seg.bin", N)
        region_b = b.register_file("seg.bin", N)
        src = np.full(N, 0x5A, np.uint8)
        a.register_memory(src)
        seg = a.open_segment(b.name)
        a.write(seg, src.ctypes.data, region_b.addr, N, timeout=10)
        assert (rb / "seg.bin").read_bytes() == b"\x5a" * N  # the owner's file got it
        assert (ra / "seg.bin").read_bytes() == b"\0" * N  # the writer's own file did not
        back = np.zeros(N, np.uint8)
        a.register_memory(back)
        a.read(seg, back.ctypes.data, region_b.addr, N, timeout=10)
        assert (back == 0x5A).all()


def test_one_shared_root_still_uses_the_file_transport(tmp_path):
    with TransferEngine(file_root=str(tmp_path), token="t") as a, \
            TransferEngine(file_root=str(tmp_path), token="t") as b:
        region = b.register_file("shared.bin", N)
        src = np.full(N, 3, np.uint8)
        a.register_memory(src)
        seg = a.open_segment(b.name)
        frames = b._server.frames
        a.write(seg, src.ctypes.data, region.addr, N, timeout=10)
        assert (tmp_path / "shared.bin").read_bytes() == b"\x03" * N
        assert b._server.frames == frames  # no TCP frame: the file was written directly


@pytest.mark.parametrize("name", ["ok\n", "ok\r", "a b", "", "../x", "x" * 256, "ok\x00"])
def test_segment_names_are_checked_whole(name):
    with pytest.raises(InvalidArgument):
        check_name(name)


@pytest.mark.parametrize("name", ["ok\n", "seg.bin\n", "a/b", ".hidden", ""])
def test_file_names_are_checked_whole(tmp_path, name):
    with TransferEngine(file_root=str(tmp_path)) as te, pytest.raises(InvalidArgument):
        te.register_file(name, 4096)
