"""Store keys of SGLang HiCache pages (pure: imports neither SGLang nor torch).

One page is ``parts`` objects (MHA page-first: K and V; MLA: one), each one contiguous region of
the host pool. A key names everything that changes the bytes, so incompatible KV never matches:

    {namespace}/{page hash}/{part}/0x{event hash}
    namespace = sglang/{prefix}/{layout}/{dtype}/ps{page}/{shard}

``shard`` is ``tp{rank}of{size}`` (plus ``pp{rank}of{size}`` when pipelined), or ``mla`` (every
rank holds the same latent KV). The last component is the page's KV-event hash, the one SGLang's
own events publish for a page without extra key or salt (the first 8 bytes of the page's sha256,
as u64): the store master publishes it (``BlockStored``/``BlockRemoved``, medium CPU), so a
conductor sees which pages sit in the pool. A page hash that is not hex gets no event component.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_HEX = re.compile(r"^[0-9a-fA-F]{16,}$")
_UNSAFE = re.compile(r"[/@:\s]")
PARTS = {1: ("kv",), 2: ("k", "v")}


def event_hash(page_hash: str) -> int | None:
    """The u64 KV-event hash of an SGLang page hash (sha256 hex), or None if it is not hex."""
    if not _HEX.match(page_hash):
        return None
    return int(page_hash[:16], 16)


def safe(name: str) -> str:
    """``name`` with the characters keys use as separators replaced."""
    return _UNSAFE.sub("-", name) or "model"


@dataclass(frozen=True)
class PageKeys:
    """Key space of one SGLang worker's pages.

    Attributes:
        prefix: model name or configured key prefix.
        layout: host-pool layout (``page_first``, ``page_first_direct``).
        dtype: KV dtype name.
        page_size: tokens per page.
        shard: ``tp0of1``-style shard name, or ``mla``.
        parts: objects per page (2 for MHA K/V, 1 for MLA).
    """

    prefix: str
    layout: str
    dtype: str
    page_size: int
    shard: str
    parts: int

    @property
    def namespace(self) -> str:
        return (f"sglang/{safe(self.prefix)}/{self.layout}/{self.dtype}/ps{self.page_size}/"
                f"{self.shard}")

    def part_names(self) -> tuple[str, ...]:
        return PARTS.get(self.parts) or tuple(f"p{i}" for i in range(self.parts))

    def page(self, page_hash: str) -> list[str]:
        """The ``parts`` keys of one page, in the order of the host pool's buffer pointers."""
        h = event_hash(page_hash)
        tail = "" if h is None else f"/{h:#018x}"
        return [f"{self.namespace}/{page_hash}/{p}{tail}" for p in self.part_names()]

    def pages(self, page_hashes: list[str]) -> list[str]:
        """Keys of many pages, page by page."""
        return [k for h in page_hashes for k in self.page(h)]


def shard_name(tp_rank: int, tp_size: int, pp_rank: int, pp_size: int, is_mla: bool) -> str:
    """The shard component of a worker's keys."""
    if is_mla:
        return "mla" if pp_size == 1 else f"mla-pp{pp_rank}of{pp_size}"
    name = f"tp{tp_rank}of{tp_size}"
    return name if pp_size == 1 else f"{name}-pp{pp_rank}of{pp_size}"


def leading_pages(found: list[bool], parts: int) -> int:
    """How many pages from the start have every part present."""
    n = 0
    for i in range(0, len(found) - parts + 1, parts):
        if not all(found[i:i + parts]):
            break
        n += 1
    return n
