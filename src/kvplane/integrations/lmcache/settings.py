"""Where the kvplane LMCache connector reads its settings (pure: imports neither LMCache nor
torch).

LMCache's plugin convention: every key of the plugin sits in ``extra_config`` under
``remote_storage_plugin.<plugin>.``; ``module_path`` and ``class_name`` are LMCache's, ``url``
is the ``kvplane://HOST:PORT`` of the master, and the rest are
:class:`~kvplane.integrations.store_backend.StoreBackendConfig` keys.
"""

from __future__ import annotations

from typing import Any

from kvplane.common.errors import InvalidArgument
from kvplane.integrations.store_backend import StoreBackendConfig

SCHEME = "kvplane://"
PLUGIN_TYPE = "kvplane"
LMCACHE_KEYS = ("module_path", "class_name", "url")


def claims(url: str) -> bool:
    """Whether the adapter serves ``url``: ``kvplane://...`` or ``plugin://kvplane[.name]``."""
    if url.startswith(SCHEME):
        return True
    return url.startswith("plugin://") and url[len("plugin://"):].split(".", 1)[0] == PLUGIN_TYPE


def plugin_settings(extra: dict[str, Any] | None, plugin: str, url: str) -> StoreBackendConfig:
    """The kvplane settings of plugin ``plugin``, with the master taken from a
    ``kvplane://host:port`` URL (the one LMCache passed, else the plugin's ``url`` key).

    Raises:
        InvalidArgument: an unknown setting or a URL that is not ``kvplane://``.
    """
    head = f"remote_storage_plugin.{plugin}."
    mine = {k[len(head):]: v for k, v in (extra or {}).items() if k.startswith(head)}
    address = url if url.startswith(SCHEME) else str(mine.get("url", ""))
    settings = {k: v for k, v in mine.items() if k not in LMCACHE_KEYS}
    if address:
        if not address.startswith(SCHEME):
            raise InvalidArgument(f"{head}url must be kvplane://host:port, got {address!r}")
        hostport = address[len(SCHEME):].split("/", 1)[0]
        if hostport:
            settings["master_server_address"] = hostport
    return StoreBackendConfig.from_mapping(settings)
