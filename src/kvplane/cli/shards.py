"""Sharded masters: ``kvplane master --shards N`` / ``--shard I/N``, and ``kvplane shards``
(the shard map, slot moves, shards joining and leaving). Thin: the work is in
``kvplane.store.shard`` (``launch``, ``mover``)."""

from __future__ import annotations

import json
from typing import Any

import typer

from kvplane.cli.lifecycle import announce, token_option, usage_checked, wait_for_signal


def run(shards: int, shard: str | None, peers: str | None, cfg: Any, host: str, port: int,
        admin_port: int | None, metadata_port: int | None, kv_events_port: int | None,
        auth: tuple[str, str, dict[str, str], str | None, bool], ready_file: str | None,
        ha: dict[str, Any]) -> None:
    """``kvplane master`` with ``--shards N`` (N processes) or ``--shard I/N`` (one of them)."""
    from kvplane.store.shard.launch import ha_peers, parse_shard

    if shards > 1 and shard:
        raise typer.BadParameter("--shards N starts every shard; --shard I/N runs one of them",
                                 param_hint="--shard")
    if shards > 1:
        _launch(shards, cfg, host, port, admin_port, metadata_port, auth, ready_file, ha)
        return
    with usage_checked("--shard"):
        index, n = parse_shard(shard or "")
    if ha["ha"]:
        addresses = ha_peers(ha["ha"], ha["cluster"], n)
    elif peers:
        addresses = [p.strip() for p in peers.split(",") if p.strip()]
    else:
        raise typer.BadParameter("--shard needs --peers (or --ha)", param_hint="--peers")
    if len(addresses) != n:
        raise typer.BadParameter(f"--peers names {len(addresses)} shards, --shard says {n}",
                                 param_hint="--peers")
    _one(index, addresses, cfg, host, port, admin_port, metadata_port, kv_events_port, auth,
         ready_file, ha)


def _one(index: int, peers: list[str], cfg: Any, host: str, port: int, admin_port: int | None,
         metadata_port: int | None, kv_events_port: int | None,
         auth: tuple[str, str, dict[str, str], str | None, bool], ready_file: str | None,
         ha: dict[str, Any]) -> None:
    from kvplane.store.shard.launch import start_shard
    from kvplane.transfer.metadata_server import serve_in_thread

    tok, adm, tenant_tokens, _, _ = auth
    meta = serve_in_thread(host, metadata_port, tok) if metadata_port is not None else None
    shard = watch = None
    try:
        shard, watch = start_shard(
            index, peers, ha["ha"], ha["cluster"], config=cfg, host=host, port=port,
            admin_port=admin_port, token=tok, kv_events_port=kv_events_port,
            tenants=tenant_tokens, admin_token=adm, advertise=ha["advertise"],
            lease_ttl=ha["lease_ttl"])
        srv = shard.master
        announce("master", {
            "master": f"{host}:{srv.port}", "admin_port": srv.http.port if srv.http else None,
            "shard": index, "shards": len(peers), "peers": peers, "ha": ha["ha"],
            "cluster": srv.election.where.cluster if srv.election else None,
            "metadata": f"http://{host}:{meta.port}/metadata" if meta else None,
            "kv_events": srv.events.endpoint if srv.events else None}, ready_file)
        wait_for_signal()
    finally:
        for part in (watch, shard, meta):
            if part is not None:
                part.close()


def _launch(n: int, cfg: Any, host: str, port: int, admin_port: int | None,
            metadata_port: int | None, auth: tuple[str, str, dict[str, str], str | None, bool],
            ready_file: str | None, ha: dict[str, Any]) -> None:
    from kvplane.store.shard.launch import Launcher
    from kvplane.transfer.metadata_server import serve_in_thread

    tok, adm, _, tenants_file, no_auth = auth
    args = ["--lease-ttl", str(cfg.lease_ttl), "--client-ttl", str(cfg.client_ttl),
            "--high-watermark", str(cfg.high_watermark), "--evict-ratio", str(cfg.evict_ratio),
            "--allocation-strategy", cfg.allocation_strategy,
            "--recovery-grace", str(cfg.recovery_grace)]
    args += ["--no-auth"] if no_auth else []
    args += ["--tenants", tenants_file] if tenants_file else []
    if ha["ha"]:
        args += ["--ha", ha["ha"], "--ha-lease-ttl", str(ha["lease_ttl"])]
        args += ["--cluster-id", ha["cluster"]] if ha["cluster"] else []
    env = {"KVPLANE_TOKEN": tok, "KVPLANE_ADMIN_TOKEN": adm} if not no_auth else {}
    meta = serve_in_thread(host, metadata_port, tok) if metadata_port is not None else None
    pool = None
    try:
        pool = Launcher(n, host, port, admin_port, args, env)
        first = pool.children[0].info
        announce("master", {
            "master": first["master"], "admin_port": first["admin_port"],
            "shards": [{"shard": c.index, "master": c.info["master"], "pid": c.popen.pid,
                        "admin_port": c.info["admin_port"]} for c in pool.children],
            "metadata": f"http://{host}:{meta.port}/metadata" if meta else None}, ready_file)
        wait_for_signal()
    finally:
        for part in (pool, meta):
            if part is not None:
                part.close()


# -- kvplane shards ------------------------------------------------------------------------------
app = typer.Typer(help="A sharded pool's shard map: show it, move slots, add or remove shards "
                  "(docs/store.md, \"Sharded metadata\").", no_args_is_help=True)
MasterOpt = typer.Option("127.0.0.1:50051", "--master", help="Any shard's master address.")
TimeoutOpt = typer.Option(10.0, help="Seconds each step may take.")


def _mover(master: str, token: str | None, timeout: float, batch: int = 256) -> Any:
    from kvplane.store.shard.mover import Mover

    return Mover(master, token, timeout, batch)


def _report(rep: Any) -> None:
    typer.echo(json.dumps({k: v for k, v in rep.__dict__.items() if k != "versions"}
                          | {"map_version": rep.versions[-1] if rep.versions else None}))


@app.command("map")
def show_map(master: str = MasterOpt, token: str = token_option(),
             timeout: float = TimeoutOpt) -> None:
    """Print the newest shard map (JSON: version, shards, slot runs, moves under way)."""
    import msgspec

    with _mover(master, token, timeout) as mv:
        typer.echo(msgspec.json.encode(mv.newest()).decode())


@app.command("move")
def move(slots: str = typer.Argument(..., help="Slots to move: FIRST-LAST[,FIRST-LAST...]."),
         to: int = typer.Option(..., "--to", help="The shard that takes them."),
         master: str = MasterOpt, token: str = token_option(), timeout: float = TimeoutOpt,
         batch: int = typer.Option(256, min=1, help="Slots moved per step.")) -> None:
    """Move hash slots to a shard, objects included, while the pool serves."""
    chosen: list[int] = []
    with usage_checked("SLOTS"):
        for part in slots.split(","):
            first, _, last = part.partition("-")
            chosen += range(int(first), int(last or first) + 1)
    with _mover(master, token, timeout, batch) as mv:
        _report(mv.move(chosen, to))


@app.command("add")
def add(shard_id: int = typer.Option(..., "--id", help="The new shard's id (0-63)."),
        address: str = typer.Option(..., help="Its master address (HOST:PORT, or etcd://...)."),
        master: str = MasterOpt, token: str = token_option(),
        timeout: float = TimeoutOpt) -> None:
    """Add a running shard (started with --shard and --peers naming the pool) to the map and
    move it an equal part of the slots."""
    from kvplane.store.shard.slots import ShardInfo

    with _mover(master, token, timeout) as mv:
        _report(mv.add_shard(ShardInfo(shard_id, address)))


@app.command("remove")
def remove(shard_id: int = typer.Option(..., "--id", help="The shard to remove."),
           master: str = MasterOpt, token: str = token_option(),
           timeout: float = TimeoutOpt) -> None:
    """Move every slot of a shard to the others, then drop it from the map (stop it after)."""
    with _mover(master, token, timeout) as mv:
        _report(mv.remove_shard(shard_id))


@app.command("abort")
def abort(master: str = MasterOpt, token: str = token_option(),
          timeout: float = TimeoutOpt) -> None:
    """Undo the slot moves a stopped mover left under way, and install the newest map on every
    shard."""
    with _mover(master, token, timeout) as mv:
        n = mv.abort_moves()
        m = mv.sync()
        typer.echo(json.dumps({"undone": n, "map_version": m.version}))


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="shards")
