"""The SSD-tier options shared by ``kvplane segment`` and ``kvplane serve``."""

from __future__ import annotations

from typing import Any

import typer

from kvplane.cli.lifecycle import size_option

DISK_DIR = typer.Option(None, "--disk-dir", help="Directory of this node's SSD tier (off when unset).")
DISK_SIZE = size_option("64GiB", "--disk-size", help="Quota of the SSD tier, e.g. 64GiB.")
WRITE_THROUGH = typer.Option(False, "--disk-write-through",
                             help="Copy every object to disk once put (default: ahead of eviction).")
DIRECT = typer.Option(False, "--disk-direct/--disk-page-cache",
                      help="Read disk files with O_DIRECT instead of through the page cache.")


def disk_config(disk_dir: str | None, disk_size: int, write_through: bool,
                direct: bool) -> dict[str, Any]:
    """StoreConfig fields for these options (none without ``--disk-dir``)."""
    if not disk_dir:
        return {}
    return {"disk_dir": disk_dir, "disk_size": disk_size,
            "disk_write_through": write_through, "disk_direct": direct}


def announced(client: Any) -> dict[str, Any]:
    """What the ready line says about the tier."""
    disk = getattr(client, "disk", None)
    if disk is None:
        return {}
    return {"disk_dir": str(disk.store.root), "disk_size": disk.store.quota,
            "disk_endpoint": f"{disk.rpc.host}:{disk.rpc.port}"}
