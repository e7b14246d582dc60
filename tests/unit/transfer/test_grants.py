"""GrantTable: what a tenant's connection may touch (kvplane.transfer.grants)."""

from __future__ import annotations

import pytest

from kvplane.transfer import grants as g

SECRET = b"s" * 32
A, B = g.tenant_id("tenant-a-token-0123456789"), g.tenant_id("tenant-b-token-0123456789")
SEG = ("seg-1", 0x10000, 1 << 20)
NOW = 1_000_000.0  # seconds


@pytest.fixture
def table():
    t = g.GrantTable(keep=8, clock=lambda: NOW)
    t.mounted(SECRET, [SEG], [A, B])
    return t


def _grant(tenant=A, gen=7, base=0x10000 + 4096, span=4096, until=(NOW + 10) * 1000,
           mode=g.READ, segment="seg-1"):
    return g.make(g.segment_key(SECRET, segment), tenant, gen, base, span, int(until), mode)


def test_a_valid_grant_admits_exactly_its_range_mode_and_generation(table):
    assert table.install(A, _grant()) == [g.OK]
    base = 0x10000 + 4096
    assert table.admits(A, 7, base, 4096, g.READ)
    assert table.admits(A, 7, base + 100, 100, g.READ)  # inside
    assert not table.admits(A, 7, base, 4097, g.READ)  # past the end
    assert not table.admits(A, 7, base - 1, 10, g.READ)  # before it
    assert not table.admits(A, 8, base, 4096, g.READ)  # another generation
    assert not table.admits(A, 0, base, 4096, g.READ)  # unfenced: never for a tenant
    assert not table.admits(A, 7, base, 4096, g.WRITE)  # another mode
    assert not table.admits(B, 7, base, 4096, g.READ)  # another tenant
    assert not table.may_retire(A, [7])


def test_forged_expired_foreign_and_misplaced_grants_are_not_kept(table):
    forged = _grant()[:-16] + bytes(16)
    other_tenant = _grant(tenant=B)  # B's grant presented on A's connection
    other_segment = _grant(segment="seg-2")
    expired = _grant(until=(NOW - 1) * 1000)
    outside = _grant(base=0x10000 + (1 << 20) - 10, span=100)
    widened = bytearray(_grant())
    widened[16:24] = (8192).to_bytes(8, "little")  # span doubled, MAC unchanged
    codes = table.install(A, b"".join([forged, other_tenant, other_segment, expired, outside,
                                       bytes(widened)]))
    assert codes == [g.BAD_MAC, g.BAD_MAC, g.BAD_MAC, g.EXPIRED, g.NO_SEGMENT, g.BAD_MAC]
    assert not table.admits(A, 7, 0x10000 + 4096, 10, g.READ) and table.bad == 6


def test_grants_expire_and_retire_grants_cover_generations():
    now = [NOW]
    t = g.GrantTable(clock=lambda: now[0])
    t.mounted(SECRET, [SEG], [A])
    t.install(A, _grant(until=(NOW + 1) * 1000) + _grant(gen=9, base=SEG[1], span=0,
                                                         mode=g.RETIRE))
    assert t.admits(A, 7, 0x10000 + 4096, 4096, g.READ) and t.may_retire(A, [9])
    assert not t.may_retire(A, [9, 10])
    now[0] += 2
    assert not t.admits(A, 7, 0x10000 + 4096, 4096, g.READ)


def test_before_mount_everyone_is_refused_after_it_non_tenants_are_exempt():
    t = g.GrantTable()
    svc = g.tenant_id("service-token-0123456789")
    assert not t.admits(svc, 7, 0, 1, g.READ) and not t.exempt(svc)
    t.mounted(SECRET, [SEG], [A])
    assert t.exempt(svc) and t.admits(svc, 7, 0, 1, g.READ) and not t.exempt(A)


def test_the_table_is_bounded_per_tenant(table):
    for gen in range(1, 20):
        table.install(A, _grant(gen=gen))
    assert not table.admits(A, 1, 0x10000 + 4096, 10, g.READ)  # forgotten first
    assert table.admits(A, 19, 0x10000 + 4096, 10, g.READ)
