"""Tokens for tests and scripts that talk HTTP to local kvplane services."""

from kvplane.common.auth import token_headers as headers

__all__ = ["headers"]
