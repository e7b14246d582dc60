"""Who may do what on the master: tenant key namespaces and segment ownership.

Every RPC runs as the :class:`~kvplane.common.auth.Principal` its connection authenticated as
(``kvplane.common.rpc.current_principal``). This module wraps the master's handlers:

* **Tenants.** Keys live in one namespace per tenant. The ``default`` tenant (service and admin
  tokens) keeps its keys as they are; tenant ``T``'s key ``k`` is stored as ``"\\0T\\0k"``, and
  no key may contain NUL, so namespaces never meet. get/put/upsert/exist/size/remove, replica
  descriptors and replica clear see only the caller's namespace; remove-by-regex and remove-all
  match the caller's own keys only, against the key as the caller wrote it. A copy/move task
  belongs to the tenant whose key it names: another tenant's ``task_start``/``task_done``/
  ``task_query`` find no such task, and a task's runner (``assigned_client``, a client id) is
  shown only to that client and the admin. Repair reports (internal keys the master hands to
  segments) are for default-tenant callers only, and a tenant can neither mount nor heartbeat
  as a client that holds segments. ``list_keys`` lists the caller's own complete keys, as the
  caller wrote them. ``whoami`` tells a caller its tenant. A tenant's lookup, PutStart and
  remove answers carry its data-plane grants (``kvplane.store.master.grants``): without them
  a segment's listener moves no byte for that tenant's connections. Tenants
  are pure clients: only default-tenant principals mount segments (a segment's process can read
  whatever is placed in it).
* **Ownership.** A segment belongs to the client that mounted it (its ``client_id``, which the
  master never shows to other clients). Only that client or the admin token may unmount it.
  When the admin unmounts another client's last segment, that client is forgotten, so its next
  heartbeat is answered ``need_remount`` and it mounts its segment again.

Pure apart from reading the principal: no sockets, no threads, no clocks.
"""

from __future__ import annotations

import heapq
import json
import os
import re
import stat
from collections.abc import Callable, Iterator
from typing import Any

from kvplane.common.auth import DEFAULT_TENANT, Principal
from kvplane.common.errors import InvalidArgument, Unauthorized
from kvplane.common.rpc import current_principal
from kvplane.store import types as store_types
from kvplane.store.errors import InvalidKey, InvalidParams
from kvplane.store.master.grants import MasterGrants
from kvplane.store.master.serving import Serving
from kvplane.store.replica_types import TaskId, TaskInfo
from kvplane.store.types import ListKeysRep, ListKeysReq, MountReq

SEP = "\x00"
_TENANT = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# requests whose ``keys`` are the caller's own keys (scoped to its tenant)
KEYED = frozenset({"put_start", "put_end", "put_revoke", "get_replicas", "exist", "get_size",
                   "remove", "replica_descs", "replica_clear"})
RETURNS_KEYS = frozenset({"replica_clear"})  # of KEYED, those answering with keys
KEY = frozenset({"task_create"})  # one ``key``
TASK = frozenset({"task_start", "task_done", "task_query"})  # a task id: the task's tenant only
NO_TASK = TaskId(0, 0)  # never issued (task ids count from 1)
# work the master hands to segment processes: internal keys, from default-tenant callers only
SERVICE_ONLY = frozenset({"repair_done", "adopt"})  # adopt: re-registering a segment's records
GRANTED = frozenset({"get_replicas", "put_start", "remove"})  # answers a tenant gets grants with


def read_tenants(path: str) -> dict[str, str]:
    """Tenant name -> token from a JSON file ``{"tenants": {"NAME": "TOKEN", ...}}``.

    Raises:
        InvalidArgument: unreadable, readable by others, malformed, a bad name or a short token.
    """
    try:
        with open(path, encoding="utf-8") as f:
            if stat.S_IMODE(os.fstat(f.fileno()).st_mode) & 0o077:
                raise InvalidArgument(f"tenants file {path} is readable by others: chmod 600 it")
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"tenants file {path}: {exc}") from exc
    table = data.get("tenants") if isinstance(data, dict) else None
    if not isinstance(table, dict):
        raise InvalidArgument(f"tenants file {path}: expected {{\"tenants\": {{NAME: TOKEN}}}}")
    for name, token in table.items():
        check_tenant(name)
        if not isinstance(token, str) or len(token) < 16:
            raise InvalidArgument(f"tenant {name!r}: tokens must be strings of >= 16 characters")
    return dict(table)


def check_tenant(name: str) -> str:
    """Validate a tenant name (letters, digits, ``_.-``; not ``default``)."""
    if not isinstance(name, str) or not _TENANT.fullmatch(name) or name == DEFAULT_TENANT:
        raise InvalidArgument(f"bad tenant name {name!r}: 1-64 of [A-Za-z0-9_.-], not 'default'")
    return name


def scoped(tenant: str, key: str) -> str:
    """The master's internal key for ``tenant``'s ``key``.

    Raises:
        InvalidKey: the key contains NUL.
    """
    if SEP in key:
        raise InvalidKey("keys must not contain NUL")
    return key if tenant == DEFAULT_TENANT else f"{SEP}{tenant}{SEP}{key}"


def unscoped(internal: str) -> tuple[str, str]:
    """(tenant, key) of an internal key."""
    if internal.startswith(SEP):
        _, tenant, key = internal.split(SEP, 2)
        return tenant, key
    return DEFAULT_TENANT, internal


def keys_of(objects: Any, tenant: str) -> Iterator[tuple[str, str]]:
    """(internal, key) of every object of ``tenant`` in ``objects`` (a key -> object mapping)."""
    if tenant == DEFAULT_TENANT:
        return ((k, k) for k in list(objects) if not k.startswith(SEP))
    prefix = f"{SEP}{tenant}{SEP}"
    return ((k, k[len(prefix):]) for k in list(objects) if k.startswith(prefix))


def is_service() -> bool:
    """Whether the RPC being served comes from a default-tenant caller (the service token or
    the admin's)."""
    return current_principal().tenant == DEFAULT_TENANT


def require_service(what: str) -> None:
    """Refuse ``what`` to a tenant (Unauthorized)."""
    if not is_service():
        raise Unauthorized(f"{what} is for callers with the service token")


class Access:
    """Wraps master handlers with tenant scoping and ownership checks (see module docstring).

    Args:
        serving: the state being served (the caller holds its lock around every wrapped call).
    """

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.grants: MasterGrants | None = None  # tenants' data-plane grants (set by the server)

    def guard(self, method: str, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``fn`` wrapped for ``method``: keys scoped, mounts and unmounts checked."""
        if method in KEYED:
            def keyed(req: Any) -> Any:
                tenant = current_principal().tenant
                if tenant == DEFAULT_TENANT:  # the common case: keys stay as they are
                    for k in req.keys:
                        if SEP in k:
                            raise InvalidKey("keys must not contain NUL")
                    return fn(req)
                req.keys = [scoped(tenant, k) for k in req.keys]
                out = fn(req)
                if method in GRANTED and self.grants is not None:
                    self.grants.attach(method, self.serving.state, req, out, tenant)
                if method in RETURNS_KEYS:  # the caller's own spelling back
                    out = [unscoped(k)[1] for k in out]
                return out
            return keyed
        if method in KEY:
            def one_key(req: Any) -> Any:
                req.key = scoped(current_principal().tenant, req.key)
                return fn(req)
            return one_key
        if method in TASK:
            return self._task_guard(method, fn)
        if method in SERVICE_ONLY:
            def service(req: Any) -> Any:
                if current_principal().tenant != DEFAULT_TENANT:
                    raise Unauthorized(f"{method} is for the pool's own segment processes")
                return fn(req)
            return service
        if method in ("mount", "ping"):
            return self._client_guard(method, fn)
        if method == "unmount":
            def unmount(req: MountReq) -> Any:
                orphans = self._check_unmount(req, current_principal())
                out = fn(req)
                for cid in orphans:
                    clients = self.serving.state.clients
                    client = clients.get(cid)
                    if client is not None and not client.segments:
                        del clients[cid]  # its next ping says need_remount
                return out
            return unmount
        return fn

    def _client_guard(self, method: str, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """Mount and ping: a tenant holds no segments; a mount answer says who is a tenant."""
        def as_client(req: Any) -> Any:
            tenant = current_principal().tenant
            if tenant != DEFAULT_TENANT:
                self._check_tenant_client(req)
            out = fn(req)
            if method == "mount":
                if tenant != DEFAULT_TENANT:
                    out.tenant = tenant  # its transfers go through listeners (grants)
                elif req.segments and self.grants is not None:
                    out.tenants = self.grants.tenant_ids()  # whose connections need grants
            return out
        return as_client

    def _task_guard(self, method: str, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """Another tenant's task does not exist for the caller; its runner stays hidden."""
        def task(req: Any) -> Any:
            who = current_principal()
            tasks = self.serving.state.tasks
            found = tasks.tasks.get((req.task.hi, req.task.lo))
            if found is not None and unscoped(found.key)[0] != who.tenant:
                req.task = NO_TASK  # answered as TASK_NOT_FOUND, like an unknown id
            out = fn(req)
            if (method == "task_start" and self.grants is not None
                    and who.tenant != DEFAULT_TENANT):
                self.grants.attach_work(out, who.tenant, tasks.processing_timeout)
            if isinstance(out, TaskInfo) and not who.admin and out.assigned_client != req.client_id:
                out.assigned_client = ""  # a client id is an owner's credential (unmount)
            return out
        return task

    def whoami(self, _client_id: str) -> str:
        """The caller's tenant (a client checks that its token selects the tenant it meant)."""
        return current_principal().tenant

    def _check_tenant_client(self, req: Any) -> None:
        """A tenant mounts no segment, and never heartbeats as a client that holds one (that
        would acknowledge its fences or take its repair work)."""
        if getattr(req, "segments", None):
            raise Unauthorized("tenants cannot mount segments: mount them with the service token")
        client = self.serving.state.clients.get(req.client_id)
        if client is not None and client.segments:
            raise Unauthorized("that client id holds segments; a tenant cannot act as it")

    def _check_unmount(self, req: MountReq, who: Principal) -> set[str]:
        """Raise unless ``who`` may unmount every named segment; owners other than the caller."""
        others = set()
        for info in req.segments:
            seg = self.serving.state.segments.get(info.name)
            if seg is None:
                continue
            owner = seg.info.client_id
            if owner == req.client_id and who.tenant == DEFAULT_TENANT:
                continue
            if not who.admin:
                raise Unauthorized(f"segment {info.name!r} belongs to another client; only its "
                                   "owner or the admin token may unmount it")
            others.add(owner)
        return others

    def remove_regex(self, pattern: str, force: bool, now: float) -> int:
        """Remove the caller's keys matching ``pattern``; returns how many went."""
        try:
            rx = re.compile(pattern)
        except re.error as exc:
            raise InvalidArgument(f"bad regex {pattern!r}: {exc}") from exc
        tenant = current_principal().tenant
        return sum(1 for internal, key in keys_of(self.serving.state.objects, tenant)
                   if rx.search(key) and self.serving.state.remove(internal, force, now) == 0)

    def remove_all(self, force: bool, now: float) -> int:
        """Remove every removable key of the caller's tenant; returns how many went."""
        tenant = current_principal().tenant
        return sum(1 for internal, _ in keys_of(self.serving.state.objects, tenant)
                   if self.serving.state.remove(internal, force, now) == 0)

    def list_keys(self, req: ListKeysReq) -> ListKeysRep:
        """One page of the caller's complete keys (``ListKeysReq``), as the caller wrote them.

        A page holds at most ``MAX_LIST_KEYS`` keys and, past its first, at most
        ``MAX_LIST_BYTES`` bytes of them; it costs one pass over the master's key table.

        Raises:
            InvalidParams: a negative limit.
            InvalidKey: a prefix or cursor with NUL, or longer than a key may be.
        """
        if req.limit < 0:
            raise InvalidParams(f"list_keys limit must be >= 0, not {req.limit}")
        most = store_types.MAX_KEY
        for text in (req.prefix, req.after or ""):
            if SEP in text or len(text.encode()) > most:
                raise InvalidKey(f"list_keys prefix and cursor: no NUL, at most {most} bytes")
        cap = min(req.limit or store_types.MAX_LIST_KEYS, store_types.MAX_LIST_KEYS)
        objects, prefix, after = self.serving.state.objects, req.prefix, req.after
        found = (key for internal, key in keys_of(objects, current_principal().tenant)
                 if key.startswith(prefix) and (after is None or key > after)
                 and objects[internal].complete)
        first = heapq.nsmallest(cap + 1, found)
        keys: list[str] = []
        size = 0
        for key in first[:cap]:
            size += len(key.encode())
            if keys and size > store_types.MAX_LIST_BYTES:
                break
            keys.append(key)
        return ListKeysRep(keys, more=len(first) > len(keys))
