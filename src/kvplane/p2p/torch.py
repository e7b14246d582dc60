"""``broadcast_state_dict``: the RL weight update on the P2P store.

The trainer publishes its model's state dict as a new version (its tensors are registered in
place, not copied); every rollout worker fetches the latest version straight into its own
parameters, helping the others as it goes. torch is an optional extra, imported when called.
Imports ``kvplane.common`` and ``kvplane.p2p``.
"""

from __future__ import annotations

import threading
from typing import Any

from kvplane.common.errors import InvalidArgument
from kvplane.common.extras import require
from kvplane.p2p.node import P2PConfig, P2PNode

_default: P2PNode | None = None
_lock = threading.Lock()


def default_node() -> P2PNode:
    """A process-wide node configured from the environment (KVPLANE_P2P_TRACKER, KVPLANE_TOKEN)."""
    global _default
    with _lock:
        if _default is None:
            _default = P2PNode(P2PConfig.from_env())
        return _default


def _tensors(model: Any) -> dict[str, Any]:
    sd = model.state_dict() if hasattr(model, "state_dict") else dict(model)
    out = {}
    for k, t in sd.items():
        t = t.detach()
        if t.device.type != "cpu" or not t.is_contiguous():
            raise InvalidArgument(f"{k}: only contiguous CPU tensors can be broadcast")
        out[k] = t
    return out


def broadcast_state_dict(model: Any, name: str, *, src: bool = False, node: P2PNode | None = None,
                         version: int = 0, timeout: float | None = None) -> int:
    """Publish (``src=True``) or receive in place (``src=False``) a model's weights.

    Args:
        model: a ``torch.nn.Module`` or a dict of tensors (contiguous, on CPU).
        name: the object name (one per model, e.g. ``"policy"``).
        src: True on the trainer: publish the current weights as a new version.
        node: the P2P node to use (default: :func:`default_node`).
        version: receivers: the version to fetch (0: latest); trainer: the number (0: next).
        timeout: seconds for the fetch.

    Returns:
        The version published or received.

    Raises:
        InvalidArgument: a tensor that is not contiguous on CPU, or names, dtypes or shapes that
            differ from the published ones (checked before any byte lands).
        MissingExtra: torch is not installed.
    """
    require("torch", "torch", "broadcast_state_dict")
    node = node or default_node()
    tensors = _tensors(model)
    if src:
        return node.publish(name, tensors, version)
    m = node.tracker.open(name, node.name, version)
    want = {i.name: (i.dtype, list(i.shape)) for i in m.items}
    have = {k: (str(t.dtype).removeprefix("torch."), list(t.shape)) for k, t in tensors.items()}
    if want != have:
        diff = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
        raise InvalidArgument(f"{name} v{m.version} does not match this model: {diff[:8]}")
    res = node.get(name, m.version, out=tensors, timeout=timeout)
    return res.manifest.version
