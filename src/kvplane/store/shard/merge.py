"""Splitting a keyed master request by shard, and merging the shards' answers into one.

A client call names keys of many hash slots; the sharded link (``link.py``) sends each shard the
keys it owns, as a request of the same type whose per-key lists are cut the same way
(:data:`PARALLEL`), and joins the answers back into the answer one master would have given:
per-key lists in the caller's order, key indexes (``stale``, ``retire``) renumbered, columns
joined (or turned into results when some shard answered in full), leases the shortest.

Pure: no I/O. Imports the store's wire types only.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvplane.store.replica_types import DescRep
from kvplane.store.types import CodesRep, Columns, KeyResult, ResultsRep, Retire, column_results

# keyed method -> the request's fields that hold one entry per key (besides ``keys``)
PARALLEL: dict[str, tuple[str, ...]] = {
    "put_start": ("sizes", "checksums"),
    "put_end": ("versions", "checksums", "renames"),
    "put_revoke": ("versions", "checksums", "renames"),
    "get_replicas": ("expect",),
    "exist": (), "get_size": (), "remove": (), "replica_descs": (), "replica_clear": (),
}


def part(req: Any, method: str, idx: list[int]) -> Any:
    """``req`` cut down to the keys at ``idx`` (and their entries of every per-key list)."""
    cut: dict[str, Any] = {"keys": [req.keys[i] for i in idx]}
    for name in PARALLEL[method]:
        col = getattr(req, name)
        if col:  # an empty list (or None) means "none given" for every key
            cut[name] = [col[i] for i in idx]
    return msgspec.structs.replace(req, **cut)


def merge(n: int, parts: list[tuple[list[int], Any]]) -> Any:
    """One answer for ``n`` keys from the shards' answers (``(indexes, answer)`` each)."""
    first = parts[0][1]
    if isinstance(first, ResultsRep):
        return _results(n, parts)
    if isinstance(first, CodesRep):
        return _codes(n, parts)
    if isinstance(first, DescRep):
        return DescRep(_ordered(n, [(idx, rep.results) for idx, rep in parts]))
    if isinstance(first, list):  # replica_clear: the keys cleared
        return [k for _, rep in parts for k in rep]
    raise TypeError(f"no merge for {type(first).__name__}")


def _ordered(n: int, parts: list[tuple[list[int], list[Any]]]) -> list[Any]:
    out: list[Any] = [None] * n
    for idx, values in parts:
        for i, v in zip(idx, values, strict=True):
            out[i] = v
    return out


def _retire(parts: list[tuple[list[int], list[Retire] | None]]) -> list[Retire] | None:
    out = [(idx[k], seg, gen) for idx, got in parts for k, seg, gen in got or ()]
    return out or None


def _grants(reps: list[Any]) -> list[tuple[str, bytes]] | None:
    out = [g for rep in reps for g in rep.grants or ()]
    return out or None


def _codes(n: int, parts: list[tuple[list[int], Any]]) -> CodesRep:
    reps = [rep for _, rep in parts]
    return CodesRep(_ordered(n, [(idx, rep.codes) for idx, rep in parts]),
                    retire=_retire([(idx, rep.retire) for idx, rep in parts]),
                    spare=None, grants=_grants(reps))


def _results(n: int, parts: list[tuple[list[int], ResultsRep]]) -> ResultsRep:
    reps = [rep for _, rep in parts]
    ttl = min(rep.ttl for rep in reps)
    common: dict[str, Any] = {
        "retry_after": max(rep.retry_after for rep in reps),
        "retire": _retire([(idx, rep.retire) for idx, rep in parts]), "grants": _grants(reps)}
    cols = [(i, r.columns) for i, r in parts if r.columns is not None]
    if len(cols) == len(parts):
        return ResultsRep([], ttl, columns=_columns(n, cols), **common)
    if any(rep.stale is not None for rep in reps):  # keys confirmed where expected: absent
        stale = sorted((idx[j], r) for idx, rep in parts for j, r in _stale_of(rep))
        return ResultsRep([r for _, r in stale], ttl, stale=[i for i, _ in stale], **common)
    full = [(idx, column_results(rep.columns) if rep.columns is not None else rep.results)
            for idx, rep in parts]
    return ResultsRep(_ordered(n, full), ttl, **common)


def _stale_of(rep: ResultsRep) -> list[tuple[int, KeyResult]]:
    """(index in the part, result) of the keys a part answered."""
    if rep.columns is not None:
        return list(enumerate(column_results(rep.columns)))
    if rep.stale is None:
        return list(enumerate(rep.results))
    return list(zip(rep.stale, rep.results, strict=True))


def _columns(n: int, parts: list[tuple[list[int], Columns]]) -> Columns:
    names: list[str] = []
    where: dict[str, int] = {}
    seg, addr, size, gen = [0] * n, [0] * n, [0] * n, [0] * n
    for idx, cols in parts:
        local = []
        for name in cols.segments:
            if name not in where:
                where[name] = len(names)
                names.append(name)
            local.append(where[name])
        for j, i in enumerate(idx):
            seg[i], addr[i] = local[cols.seg[j]], cols.addr[j]
            size[i], gen[i] = cols.size[j], cols.gen[j]
    return Columns(names, seg, addr, size, gen)
