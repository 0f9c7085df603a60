"""The page allocator: null page never handed out, prefix pages shared by hash and counted, eviction oldest first."""
import pytest

from starscream_jax.errors import StarscreamError
from starscream_jax.serving.pages import NULL_PAGE, ShardPages, page_hashes


def test_hashes_cover_whole_prefixes():
    first, second = page_hashes([1, 2, 3, 4, 5], 2), page_hashes([1, 2, 3, 9], 2)
    assert len(first) == 2 and len(second) == 2
    assert first[0] == second[0] and first[1] != second[1]
    assert page_hashes([9, 2, 3, 4], 2)[1] != first[1]  # same page tokens, different prefix


def test_pages_are_handed_out_once_and_never_the_null_page():
    shard = ShardPages(5)
    pages = shard.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4] and NULL_PAGE not in pages
    assert shard.free == 0 and shard.used == 4
    with pytest.raises(StarscreamError, match="free"):
        shard.allocate(1)
    shard.release(pages)
    assert shard.free == 4 and shard.used == 0
    with pytest.raises(StarscreamError, match="released more often"):
        shard.release(pages[:1])


def test_registered_pages_are_shared_and_evicted_last_released_last():
    shard = ShardPages(4)
    hashes = page_hashes([1, 2, 3, 4], 2)
    pages = shard.allocate(2)
    for page, digest in zip(pages, hashes):
        shard.register(page, digest)
    assert shard.take_prefix(hashes) == pages  # a second holder
    assert shard.stats.queried_pages == 2 and shard.stats.hit_pages == 2
    shard.release(pages)
    assert shard.used == 2  # still held once
    shard.release(pages)
    assert shard.used == 0 and shard.free == 3 and shard.cached_prefix(hashes) == 2
    assert shard.can_hold(hashes, 3) and not shard.can_hold(hashes[:0], 4)
    shard.allocate(2)  # the never-used page first, then the oldest released registered page
    assert shard.cached_prefix(hashes) == 0
