"""The page allocator of a paged KV cache: one pool of pages per cache shard, with prefix caching of full pages.

The cache of each layer is [pages, page_size, K, E] (`model.paged`); its page dimension is split over the mesh axes
that split the attention batch (the partitions under the starscream layouts), so each shard holds its own pages
and its own sequences. A `ShardPages` allocates that shard's pages by local index; index 0 is never handed out: it
is the shard's null page, which the block tables of padding rows point at and nothing writes.

A full page of a prompt is registered under a hash of every token up to its end (the chain of its page's tokens and
its predecessor's hash), so a later prompt with the same prefix reuses the page, counted once per holder. A page no
sequence holds stays registered (and counted free) until it is taken for new tokens, oldest released first. A
request's cache salt (vLLM's `cache_salt`) stands in for the first page's predecessor (`salt_key`), so prompts with
different salts (or one salted, one not) never share a page, and prompts with the same salt do.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from ..errors import StarscreamError

NULL_PAGE = 0


def page_hashes(tokens: list[int], page_size: int, previous: bytes = b"") -> list[bytes]:
    """The prefix hash of each full page of `tokens`: hash i covers tokens[: (i + 1) * page_size] (after the pages
    whose last hash is `previous`, when `tokens` continue them)."""
    hashes = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(b",".join(str(token).encode() for token in tokens[start:start + page_size]))
        previous = digest.digest()
        hashes.append(previous)
    return hashes


def salt_key(salt: str | None) -> bytes:
    """What the first page's hash chains from: nothing without a salt, else a hash of the salt kept apart from
    every page hash (its own personalization), so a salted chain never meets an unsalted one."""
    if salt is None:
        return b""
    return hashlib.blake2b(salt.encode(), digest_size=16, person=b"cache_salt").digest()


@dataclass
class PrefixStats:
    """Prefix-cache counters of a pool: full prompt pages looked up and found."""

    queried_pages: int = 0
    hit_pages: int = 0


class ShardPages:
    """The pages of one cache shard: local indices 1 .. pages - 1 (0 is the null page)."""

    def __init__(self, pages: int):
        if pages < 2:
            raise StarscreamError(f"a cache shard of {pages} page(s) holds no sequence (page 0 is reserved); give the "
                                  "cache more pages (--cache-pages) or fewer shards")
        self.pages = pages
        self._free = list(range(pages - 1, 0, -1))  # never registered; popped from the end
        self._holders = [0] * pages
        self._hash_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self._released: OrderedDict[int, None] = OrderedDict()  # registered, held by none, oldest first
        self.stats = PrefixStats()

    @property
    def free(self) -> int:
        """Pages that can be handed out now (never used, or registered and held by no sequence)."""
        return len(self._free) + len(self._released)

    @property
    def used(self) -> int:
        """Pages held by at least one sequence."""
        return self.pages - 1 - self.free

    def cached_prefix(self, hashes: list[bytes]) -> int:
        """How many leading pages of `hashes` are registered here (without taking them)."""
        count = 0
        for digest in hashes:
            if digest not in self._page_of:
                break
            count += 1
        return count

    def can_hold(self, hashes: list[bytes], needed: int) -> bool:
        """Whether a sequence of `needed` pages whose full prefix pages have `hashes` fits: its registered prefix
        pages are shared, and those held by none stop counting free once taken."""
        prefix = [self._page_of[digest] for digest in hashes[:self.cached_prefix(hashes)]]
        idle = sum(1 for page in prefix if self._holders[page] == 0)
        return needed - len(prefix) <= self.free - idle

    def take_prefix(self, hashes: list[bytes]) -> list[int]:
        """The registered pages of the leading `hashes`, each now held once more; counts the look-up."""
        pages = [self._page_of[digest] for digest in hashes[:self.cached_prefix(hashes)]]
        for page in pages:
            self._hold(page)
        self.stats.queried_pages += len(hashes)
        self.stats.hit_pages += len(pages)
        return pages

    def allocate(self, count: int) -> list[int]:
        """`count` pages for new tokens, held once each; StarscreamError when fewer are free (callers check
        `free` first)."""
        if count > self.free:
            raise StarscreamError(f"{count} pages asked of a cache shard with {self.free} free")
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._released.popitem(last=False)
                del self._page_of[self._hash_of.pop(page)]
            self._holders[page] = 1
            pages.append(page)
        return pages

    def register(self, page: int, digest: bytes) -> None:
        """Records that held `page` is full with the prefix of hash `digest` (kept as is when that prefix already
        has a page, or the page is registered)."""
        if digest not in self._page_of and page not in self._hash_of:
            self._page_of[digest] = page
            self._hash_of[page] = digest

    def release(self, pages: list[int]) -> None:
        """Drops one hold of each page; a page held by none is free again (kept registered if it was)."""
        for page in pages:
            if self._holders[page] < 1:
                raise StarscreamError(f"page {page} released more often than it was taken")
            self._holders[page] -= 1
            if self._holders[page] == 0:
                if page in self._hash_of:
                    self._released[page] = None
                else:
                    self._free.append(page)

    def _hold(self, page: int) -> None:
        if self._holders[page] == 0:
            del self._released[page]
        self._holders[page] += 1
