"""The status document of a sharded pool, joined from every shard's own.

Every shard's ``/status`` answers for the whole pool (what ``kvplane status``, ``kvplane top``
and ``/dashboard`` read, unchanged): the shard asks the others for their own documents
(``shard_status``) and joins them with :func:`pool`. A segment appears in every shard (each
holds a share of it): its rows are joined into one (capacity, usage and replicas added, the
worst liveness kept). Objects, evictions, ops and rates are added; the history samples are
joined by the wall-clock second they were taken in. ``masters`` lists every shard's master,
and ``shard.shards`` what each shard holds (or that it did not answer).

Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

WORST = {"alive": 0, "late": 1, "suspect": 2}


def pool(me: int, docs: dict[int, dict[str, Any] | None]) -> dict[str, Any]:
    """The pool's document from each shard's own (None: that shard did not answer); ``me``
    is the shard answering (its ``master`` block heads the document)."""
    got = {sid: d for sid, d in sorted(docs.items()) if d is not None}
    local = got[me]
    parts = list(got.values())
    out = dict(local)
    out["masters"] = [{**d["master"], "shard": sid} for sid, d in got.items()]
    out["capacity_bytes"] = sum(d["capacity_bytes"] for d in parts)
    out["used_bytes"] = sum(d["used_bytes"] for d in parts)
    out["clients"] = max(d["clients"] for d in parts)
    out["segments"] = segments([d["segments"] for d in parts])
    out["objects"] = _added([d["objects"] for d in parts])
    out["evictions"] = _added([d["evictions"] for d in parts])
    out["ops"] = {"total": _added([d["ops"]["total"] for d in parts]),
                  "per_s": {k: round(v, 3) for k, v in
                            _added([d["ops"]["per_s"] for d in parts]).items()},
                  "rpc_calls": _added([d["ops"]["rpc_calls"] for d in parts])}
    if all("history" in d for d in parts):
        out["history"] = history([d["history"] for d in parts])
    out["shard"] = {**local.get("shard", {}), "shards": [
        _summary(sid, docs.get(sid)) for sid in sorted(docs)]}
    return out


def _added(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for row in rows:
        for k, v in row.items():
            out[k] = out.get(k, 0) + v
    return out


def segments(per_shard: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per segment, its shares' rows joined."""
    rows: dict[str, dict[str, Any]] = {}
    for shard_rows in per_shard:
        for r in shard_rows:
            have = rows.get(r["name"])
            if have is None:
                rows[r["name"]] = dict(r)
                continue
            for k in ("capacity_bytes", "used_bytes", "replicas"):
                have[k] += r[k]
            if WORST.get(r["status"], 0) > WORST.get(have["status"], 0):
                have["status"] = r["status"]
            ages = [a for a in (have["heartbeat_age_s"], r["heartbeat_age_s"]) if a is not None]
            have["heartbeat_age_s"] = max(ages) if ages else None
    for r in rows.values():
        cap = r["capacity_bytes"]
        r["usage_percent"] = round(100 * r["used_bytes"] / cap, 2) if cap else 0.0
    return list(rows.values())


def history(per_shard: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Samples joined by the second they were taken in (counters and levels added), only the
    seconds every shard sampled."""
    by_second: dict[int, list[dict[str, Any]]] = {}
    for samples in per_shard:
        seen = set()
        for s in samples:
            sec = int(s["wall"])
            if sec not in seen:
                seen.add(sec)
                by_second.setdefault(sec, []).append(s)
    out = []
    for sec in sorted(by_second):
        group = by_second[sec]
        if len(group) < len(per_shard):
            continue
        out.append({"wall": float(sec), "ops": _added([g["ops"] for g in group]),
                    **{k: sum(g[k] for g in group) for k in
                       ("evicted", "objects", "used_bytes", "capacity_bytes")},
                    "segments": max(g["segments"] for g in group)})
    return out


def _summary(sid: int, doc: dict[str, Any] | None) -> dict[str, Any]:
    if doc is None:
        return {"id": sid, "reachable": False}
    shard = doc.get("shard", {})
    return {"id": sid, "reachable": True, "address": doc["master"].get("address"),
            "role": doc["master"].get("role"), "epoch": doc["master"].get("epoch"),
            "map_version": shard.get("map_version"), "slots": shard.get("slots"),
            "moving_out": shard.get("moving_out"), "moving_in": shard.get("moving_in"),
            "objects": doc["objects"]["objects"], "segments": len(doc["segments"]),
            "used_bytes": doc["used_bytes"],
            "ops_per_s": doc["ops"]["per_s"]}
