"""``kvplane serve``: master + HTTP metadata server + one DRAM segment, in one process."""

from __future__ import annotations

from typing import Any

import typer

from kvplane.cli import disk_opts
from kvplane.cli.errors import PORT, check_ports
from kvplane.cli.lifecycle import (
    admin_token_option,
    announce,
    no_auth_option,
    resolve_token,
    size_option,
    store_client,
    token_option,
    wait_for_signal,
)


def serve(
    host: str = typer.Option("127.0.0.1", help="Bind address of every service."),
    master_port: int = typer.Option(50051, help="Master RPC port (Mooncake's default; 0 = any).",
                                    **PORT),
    metadata_port: int = typer.Option(8080, help="HTTP metadata server port (served at "
                                      "/metadata; 0 = any).", **PORT),
    admin_port: int = typer.Option(9003, help="Admin HTTP port: /metrics /health /query_key "
                                   "/segments (0 = any).", **PORT),
    kv_events_port: int = typer.Option(None, **PORT,
                                       help="Publish the pool's objects as vLLM KV events "
                                            "(BlockStored/BlockRemoved, medium CPU) on this ZMQ "
                                            "port (0 = any), for the conductor (docs/store.md)."),
    segment_size: int = size_option("1GiB", help="DRAM this node contributes, e.g. 4GiB.",
                                    memory=True),
    token: str = token_option(),
    no_auth: bool = no_auth_option("the master RPC port (read, overwrite and delete every object, "
                                   "unmount segments), the admin port (key listing, replica "
                                   "addresses, /metrics), the metadata server (segment "
                                   "descriptors) and the segment's data port (its raw memory)"),
    admin_token: str = admin_token_option(),
    tenants: str = typer.Option(None, help="JSON file of tenant tokens ({\"tenants\": {NAME: "
                                "TOKEN}}); default KVPLANE_TENANTS_FILE."),
    ready_file: str = typer.Option(None, help="Write the bound addresses here as JSON once ready."),
    protocol: str = typer.Option("auto", help="The segment's transfer protocol: auto (shm on one "
                                 "host, then nixl when installed, else tcp), tcp, shm, nixl, or "
                                 "rdma (nixl when installed, else tcp with a warning). The ready "
                                 "line, /status and kvplane_transfer_fabric_info say what it chose."),
    disk_dir: str = disk_opts.DISK_DIR,
    disk_size: int = disk_opts.DISK_SIZE,
    disk_write_through: bool = disk_opts.WRITE_THROUGH,
    disk_direct: bool = disk_opts.DIRECT,
) -> None:
    """Run a whole store node on embedded defaults, on loopback.

    Clients (kvplane.store.StoreClient, or Mooncake code through kvplane.compat.mooncake) use
    master HOST:MASTER_PORT and metadata http://HOST:METADATA_PORT/metadata; on this host they
    find the token in the token file. Ctrl-C stops it.
    """
    from kvplane.cli.store import load_tenants
    from kvplane.transfer import fabric

    tok = resolve_token(token, no_auth)
    adm = resolve_token(admin_token, no_auth, admin=True)
    tenant_tokens = load_tenants(tenants)
    check_ports(host, {"--master-port": master_port, "--metadata-port": metadata_port,
                       "--admin-port": admin_port, "--kv-events-port": kv_events_port})
    with_cli = {**disk_opts.disk_config(disk_dir, disk_size, disk_write_through, disk_direct),
                "protocol": fabric.normalise(protocol)}  # the segment's StoreConfig keywords
    _run(host, (master_port, metadata_port, admin_port, kv_events_port), segment_size, tok, adm,
         tenant_tokens, ready_file, with_cli)


def _run(host: str, ports: tuple[int, int, int, int | None], segment_size: int,
         tok: str, adm: str, tenant_tokens: dict[str, str], ready_file: str | None,
         disk: dict[str, Any]) -> None:
    """Start the three parts, announce, wait; whatever started is closed on the way out.
    ``ports``: master, metadata, admin, KV events (None: off). ``disk``: more StoreConfig
    keywords of the segment (its SSD tier, its protocol)."""
    from kvplane.p2p.tracker_api import mount
    from kvplane.store.config import StoreConfig
    from kvplane.store.master.server import MasterServer
    from kvplane.transfer.metadata_server import serve_in_thread

    master_port, metadata_port, admin_port, kv_events_port = ports
    meta = serve_in_thread(host, metadata_port, tok, plugins=[mount])  # also the P2P tracker
    master = seg = None
    try:
        url = f"http://{host}:{meta.port}/metadata"
        master = MasterServer(host=host, port=master_port, admin_port=admin_port, token=tok,
                              tenants=tenant_tokens, admin_token=adm,
                              kv_events_port=kv_events_port)
        seg = store_client(StoreConfig(master=f"{host}:{master.port}", metadata=url,
                                       local_hostname=host, global_segment_size=segment_size,
                                       local_buffer_size=0, token=tok,
                                       peer_tokens=tuple(tenant_tokens.values()), **disk))
        master.extras["fabric"] = seg.engine.fabric.as_dict()  # in the master's /status
        announce("serve", {"master": f"{host}:{master.port}", "metadata": url,
                           "p2p_tracker": f"http://{host}:{meta.port}",
                           "admin": f"http://{host}:{master.http.port}" if master.http else None,
                           "segment": seg.segment_name, "segment_size": segment_size,
                           "fabric": seg.engine.fabric.as_dict(),
                           **_events(master), **disk_opts.announced(seg)}, ready_file)
        wait_for_signal()
    finally:
        for part in (seg, master, meta):
            if part is not None:
                part.close()


def _events(master: Any) -> dict[str, Any]:
    """The ready line's KV-event endpoints (none unless --kv-events-port)."""
    if master.events is None:
        return {}
    return {"kv_events": master.events.endpoint, "kv_events_replay": master.events.replay_endpoint}


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
