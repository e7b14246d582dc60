"""File transport: a file-backed region on this host, moved with pread/pwrite into registered memory.

Only files under this engine's own file root are opened, whatever a descriptor says, so a
hostile descriptor cannot make us write outside it. And only when the file found there is the
owner's very file (same device and inode as the descriptor's ``file_id``): two engines with
different roots may use the same file name. Other targets go over TCP, where the owner serves
its own file.
"""

from __future__ import annotations

import os
import threading

from kvplane.common.deadline import Deadline
from kvplane.transfer.batch import Slice
from kvplane.transfer.memory import file_identity
from kvplane.transfer.seam import Capabilities, Route, Transport, TransportContext
from kvplane.transfer.types import OpCode, TransferStatus


class FileTransport(Transport):
    """``os.preadv``/``os.pwritev`` between a same-host file segment and registered memory."""

    name = "file"
    capabilities = Capabilities(same_host_only=True, priority=2, fallbacks=("tcp",))

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _path(self, route: Route) -> str | None:
        if not self.ctx.file_root or route.region.kind != "file" or not route.same_host:
            return None
        root = os.path.realpath(self.ctx.file_root)
        path = os.path.realpath(os.path.join(root, route.region.path))
        if os.path.dirname(path) != root or not os.path.isfile(path):
            return None
        try:
            if not route.region.file_id or file_identity(path) != route.region.file_id:
                return None  # same name, another file (another root): not ours to touch
        except OSError:
            return None
        return path

    def can_reach(self, route: Route) -> bool:
        return self._path(route) is not None

    def _fd(self, path: str, file_id: str) -> int:
        key = f"{path}\0{file_id}"
        with self._lock:
            fd = self._fds.get(key)
            if fd is None:
                fd = os.open(path, os.O_RDWR)
                if file_identity(fd) != file_id:  # replaced between the check and the open
                    os.close(fd)
                    raise OSError(f"{path} is not the segment's file")
                self._fds[key] = fd
            return fd

    def run(self, route: Route, slices: list[Slice], deadline: Deadline) -> None:
        path = self._path(route)
        for s in slices:
            if path is None:
                s.done(TransferStatus.FAILED, "file region not reachable from this host")
                continue
            if deadline.expired():
                s.done(TransferStatus.TIMEOUT, "deadline passed")
                continue
            off = s.remote - route.region.addr
            try:
                fd = self._fd(path, route.region.file_id)
                done = 0
                while done < s.length:
                    part = s.local[done:]
                    if s.op == OpCode.WRITE:
                        n = os.pwritev(fd, [part], off + done)
                    else:
                        n = os.preadv(fd, [part], off + done)
                    if n <= 0:
                        raise OSError("short file transfer (past end of file?)")
                    done += n
            except OSError as exc:
                s.done(TransferStatus.FAILED, f"file transfer failed: {exc}")
                continue
            s.done(TransferStatus.COMPLETED)

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)
