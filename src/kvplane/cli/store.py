"""``kvplane master``, ``kvplane segment`` and ``kvplane client-server``: the store's processes."""

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
    usage_checked,
    wait_for_signal,
)
from kvplane.common import envs
from kvplane.common.config import parse_hostport


def load_tenants(path: str | None) -> dict[str, str]:
    """Tenant tokens from ``path`` (default KVPLANE_TENANTS_FILE); {} when none is named."""
    from kvplane.common.errors import InvalidArgument
    from kvplane.store.master.access import read_tenants

    path = path or envs.get("KVPLANE_TENANTS_FILE")
    try:
        return read_tenants(path) if path else {}
    except InvalidArgument as exc:
        raise typer.BadParameter(str(exc), param_hint="--tenants") from exc


def master(
    host: str = typer.Option("127.0.0.1", help="Bind address of the RPC and admin listeners."),
    port: int = typer.Option(50051, "--port", "--rpc-port", **PORT,
                             help="Master RPC port (Mooncake's default; 0 = any)."),
    admin_port: int = typer.Option(9003, **PORT,
                                   help="Admin HTTP: /metrics /health /query_key /segments (0 = any)."),
    metadata_port: int = typer.Option(None, **PORT,
                                      help="Also serve the HTTP metadata server on this port (e.g. 8080)."),
    lease_ttl: float = typer.Option(10.0, min=0.001,
                                    help="Read lease, seconds (blocks remove and eviction)."),
    client_ttl: float = typer.Option(10.0, min=0.001,
                                     help="Seconds without a heartbeat before a client's segments go."),
    high_watermark: float = typer.Option(0.90, help="Used ratio that starts eviction.", min=0.0, max=1.0),
    evict_ratio: float = typer.Option(0.05, min=0.0, max=1.0,
                                      help="Share of capacity one eviction pass frees."),
    allocation_strategy: str = typer.Option("random", help="random | free_ratio_first"),
    kv_events_port: int = typer.Option(None, **PORT,
                                       help="Publish BlockStored/BlockRemoved (vLLM format, medium CPU) on "
                                            "this ZMQ port (0 = any); register the store with the conductor "
                                            "as type kvplane."),
    token: str = token_option(),
    no_auth: bool = no_auth_option("the RPC port (anyone can read, overwrite and delete every "
                                   "object and unmount any segment), the admin port (key "
                                   "listing, replica addresses, /metrics), the KV-event stream "
                                   "and, with --metadata-port, the metadata server"),
    admin_token: str = admin_token_option(),
    tenants: str = typer.Option(None, help="JSON file of tenant tokens ({\"tenants\": {NAME: "
                                "TOKEN}}): each tenant sees only its own keys (default "
                                "KVPLANE_TENANTS_FILE). The service token is tenant default."),
    ha: str = typer.Option(None, "--ha",
                           help="High availability: etcd://h1:2379;h2:2379 (one or more etcd 3.4+ "
                                "endpoints). Masters of one cluster elect a leader; clients then use the "
                                "master address etcd://h1:2379;h2:2379/CLUSTER (the /CLUSTER part is "
                                "optional)."),
    cluster_id: str = typer.Option(None, "--cluster-id",
                                   help="HA cluster id (default KVPLANE_CLUSTER_ID or kvplane)."),
    advertise: str = typer.Option(None,
                                  help="HA: the HOST:PORT clients reach this master at (default --host and "
                                       "the bound port)."),
    ha_lease_ttl: int = typer.Option(3,
                                     help="HA: leader lease in seconds (>= 2); a dead leader is replaced "
                                          "about this long after it died."),
    recovery_grace: float = typer.Option(3.0,
                                         help="Seconds a new leader (or a restarted master) answers misses "
                                              "with 'retry' while segments re-register what they hold."),
    ready_file: str = typer.Option(None, help="Write the bound ports here as JSON once ready."),
) -> None:
    """Run the store master: metadata only (placement, leases, eviction, liveness).

    Clients connect with master address HOST:PORT, or etcd://... with --ha; bytes never pass
    through the master. Segments re-register the objects they hold with a restarted master or
    a new leader.
    """
    from kvplane.store.master.config import MasterConfig

    tok = resolve_token(token, no_auth)
    adm = resolve_token(admin_token, no_auth, admin=True)
    with usage_checked():
        cfg = MasterConfig(lease_ttl=lease_ttl, client_ttl=client_ttl,
                           high_watermark=high_watermark, evict_ratio=evict_ratio,
                           allocation_strategy=allocation_strategy,  # type: ignore[arg-type]  # str from typer; the config checks it
                           recovery_grace=recovery_grace)
    tenant_tokens = load_tenants(tenants)
    check_ports(host, {"--port": port, "--admin-port": admin_port,
                       "--metadata-port": metadata_port, "--kv-events-port": kv_events_port})
    _run_master(cfg, host, port, admin_port, metadata_port, kv_events_port,
                (tok, adm, tenant_tokens), ready_file,
                {"ha": ha, "cluster": cluster_id, "advertise": advertise,
                 "lease_ttl": ha_lease_ttl})


def _run_master(cfg: Any, host: str, port: int, admin_port: int, metadata_port: int | None,
                kv_events_port: int | None, auth: tuple[str, str, dict[str, str]],
                ready_file: str | None, ha: dict[str, Any]) -> None:
    """Start the master (and metadata server), announce, wait; close whatever started.
    ``ha``: the HA keywords of ``MasterServer`` (ha, cluster, advertise, lease_ttl)."""
    from kvplane.store.master.server import MasterServer
    from kvplane.transfer.metadata_server import serve_in_thread

    tok, adm, tenant_tokens = auth
    meta = serve_in_thread(host, metadata_port, tok) if metadata_port is not None else None
    srv = None
    try:
        srv = MasterServer(cfg, host, port, admin_port, tok, kv_events_port=kv_events_port,
                           tenants=tenant_tokens, admin_token=adm, **ha)
        announce("master", {
            "master": f"{host}:{srv.port}", "admin_port": srv.http.port if srv.http else None,
            "ha": ha["ha"], "cluster": srv.election.where.cluster if srv.election else None,
            "metadata": f"http://{host}:{meta.port}/metadata" if meta else None,
            "kv_events": srv.events.endpoint if srv.events else None,
            "kv_events_replay": srv.events.replay_endpoint if srv.events else None}, ready_file)
        wait_for_signal()
    finally:
        for part in (srv, meta):
            if part is not None:
                part.close()


def segment(
    size: int = size_option("4GiB", help="DRAM this process contributes to the pool.",
                            memory=True),
    master_addr: str = typer.Option("127.0.0.1:50051", "--master",
                                    help="Master RPC address: HOST:PORT, or etcd://h1:2379;h2:2379/CLUSTER "
                                         "for HA masters (the /CLUSTER part is optional)."),
    metadata: str = typer.Option("P2PHANDSHAKE", help="Transfer-engine metadata: P2PHANDSHAKE or a URL."),
    host: str = typer.Option("127.0.0.1", help="Address the data listener binds and advertises."),
    data_port: int = typer.Option(0, min=0, max=65535,
                                  help="Port of the data listener (0 = any free port; fix it "
                                  "to open one port in a firewall). The segment is named HOST:PORT."),
    token: str = token_option(),
    no_auth: bool = no_auth_option("the data port (anyone can read and overwrite this segment's "
                                   "memory) and the /metrics port"),
    metrics_port: int = typer.Option(0, help="Prometheus /metrics port (0 = any free port, -1 = off).",
                                     min=-1, max=65535),
    tenants: str = typer.Option(None, help="The master's tenants file: tenants' clients may then "
                                "reach this segment's data port (default KVPLANE_TENANTS_FILE)."),
    ready_file: str = typer.Option(None, help="Write the segment name here as JSON once mounted."),
    protocol: str = typer.Option("auto", help="Transfer protocol: auto (shm on one host, then "
                                 "nixl when installed, else tcp), tcp, shm, nixl, or rdma (nixl "
                                 "when installed, else tcp with a warning). The ready line, "
                                 "/status and kvplane_transfer_fabric_info say what it chose."),
    disk_dir: str = disk_opts.DISK_DIR,
    disk_size: int = disk_opts.DISK_SIZE,
    disk_write_through: bool = disk_opts.WRITE_THROUGH,
    disk_direct: bool = disk_opts.DIRECT,
) -> None:
    """Contribute a shared-memory DRAM segment to the pool (Mooncake's mooncake_client role),
    optionally backed by an SSD tier (--disk-dir, docs/store.md "SSD tier")."""
    from kvplane.common.auth import token_authenticator
    from kvplane.common.http import ServerThread, metrics_app
    from kvplane.store.config import StoreConfig
    from kvplane.transfer import fabric

    tok = resolve_token(token, no_auth)
    peers = tuple(load_tenants(tenants).values())
    with usage_checked("--master"):
        check_master(master_addr)
        cfg = StoreConfig(master=master_addr, metadata=metadata, local_hostname=host,
                          port=data_port, global_segment_size=size, local_buffer_size=0,
                          token=tok, peer_tokens=peers, protocol=fabric.normalise(protocol),
                          **disk_opts.disk_config(disk_dir, disk_size, disk_write_through,
                                                  disk_direct))
    check_ports(host, {"--metrics-port": metrics_port, "--data-port": data_port})
    c = store_client(cfg)
    http = None
    try:
        if metrics_port >= 0:
            http = ServerThread(metrics_app(lambda: {"segment": c.segment_name, "size": size,
                                                     "fabric": c.engine.fabric.as_dict()}),
                                host, metrics_port, authenticate=token_authenticator(tok),
                                name="segment-metrics")
        announce("segment", {"segment": c.segment_name, "size": size,
                             "metrics_port": http.port if http else None,
                             "fabric": c.engine.fabric.as_dict(),
                             **disk_opts.announced(c)}, ready_file)
        wait_for_signal()
    finally:
        c.close()
        if http:
            http.close()


def client_server(
    port: int = typer.Option(50052, help="RPC port dummies connect to (Mooncake's 50052; 0 = any).",
                             **PORT),
    host: str = typer.Option("127.0.0.1", help="Bind address; dummies must run on this host."),
    segment_size: int = size_option("4GiB", "--global-segment-size", "--size",
                                    help="DRAM this process contributes to the pool.", memory=True),
    local_buffer_size: int = size_option("64MiB", help="Staging for this process's own copies.",
                                         minimum=0),
    master_addr: str = typer.Option("127.0.0.1:50051", "--master", "--master-server-address",
                                    help="Master RPC address."),
    metadata: str = typer.Option("P2PHANDSHAKE", "--metadata", "--metadata-server",
                                 help="Transfer-engine metadata: P2PHANDSHAKE or a URL."),
    token: str = token_option(),
    no_auth: bool = no_auth_option("the dummy-client RPC port (anyone on this host could put, "
                                   "get and remove objects through it) and this process's data "
                                   "port (its segment's memory)"),
    tenants: str = typer.Option(None, help="The master's tenants file: tenants' clients may then "
                                "reach this segment's data port (default KVPLANE_TENANTS_FILE). "
                                "Dummies act with this process's token (tenant default)."),
    ready_file: str = typer.Option(None, help="Write the address and segment here as JSON once up."),
) -> None:
    """Serve dummy clients (Mooncake's `mooncake_client`): one real store client that holds a
    segment and the master connection, shared by many light processes on this host that call
    `MooncakeDistributedStore.setup_dummy(mem_pool_size, local_buffer_size, "HOST:PORT")`."""
    from kvplane.store.config import StoreConfig
    from kvplane.store.dummy.server import ClientServer

    tok = resolve_token(token, no_auth)
    peers = tuple(load_tenants(tenants).values())
    with usage_checked("--master"):
        check_master(master_addr)
        cfg = StoreConfig(master=master_addr, metadata=metadata, local_hostname=host,
                          global_segment_size=segment_size, local_buffer_size=local_buffer_size,
                          token=tok, peer_tokens=peers)
    check_ports(host, {"--port": port})
    client = store_client(cfg)
    try:
        srv = ClientServer(client, host, port, tok)
    except BaseException:
        client.close()
        raise
    announce("client-server", {"client_server": f"{host}:{srv.port}",
                               "segment": client.segment_name}, ready_file)
    wait_for_signal()
    srv.close()


def register(app: typer.Typer) -> None:
    app.command("master")(master)
    app.command("segment")(segment)
    app.command("client-server")(client_server)


def check_master(address: str) -> None:
    """A master address: ``HOST:PORT`` or ``etcd://h1:2379;h2:2379[/CLUSTER]`` (HA).

    Raises:
        InvalidArgument: neither form.
    """
    from kvplane.store.etcd import HaAddress, is_ha

    if is_ha(address):
        HaAddress.parse(address)
    else:
        parse_hostport(address)
