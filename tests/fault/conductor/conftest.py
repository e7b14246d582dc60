"""Conductor fixtures live in the shipped test kit (one copy for every suite)."""

from tests.support.conductor_fixtures import http, make_server, publishers, server, wait_seq  # noqa: F401
