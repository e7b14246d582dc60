"""Tokens for tests and scripts that talk HTTP to local kvplane services."""

from __future__ import annotations

from kvplane.common.auth import client_admin_token, client_token


def headers(admin: bool = False) -> dict[str, str]:
    """``X-KVPlane-Token`` with the local token (the admin token with ``admin``), or {}."""
    token = client_admin_token() if admin else client_token()
    return {"X-KVPlane-Token": token} if token else {}
