"""Transports behind one seam. Built-ins are registered here by name and imported lazily.

An RDMA (or any other) transport is added by registering ``name -> "module:Class"`` with
:data:`TRANSPORTS`; the engine needs no change.
"""

from kvplane.common.registry import Registry
from kvplane.transfer.transports.base import Transport, Capabilities, Route

TRANSPORTS: Registry[Transport] = Registry("transport")
TRANSPORTS.register("tcp", "kvplane.transfer.transports.tcp:TcpTransport")
TRANSPORTS.register("shm", "kvplane.transfer.transports.shm:ShmTransport")
TRANSPORTS.register("file", "kvplane.transfer.transports.file:FileTransport")
TRANSPORTS.register("local", "kvplane.transfer.transports.local:LocalTransport")

__all__ = ["TRANSPORTS", "Transport", "Capabilities", "Route"]
