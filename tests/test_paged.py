"""The paged KV pool (specdec/modeling/paged.py): block tables, refcounts, rollback by whole
blocks, sharing without copies and copy on write."""

from __future__ import annotations

import gc

import pytest
import torch

from specdec.modeling.paged import NULL_BLOCK, BlockPool, PagedCache, gather_positions


def pool_of(blocks: int = 8) -> BlockPool:
    return BlockPool(layers=2, kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu", block=4, blocks=blocks)


def write(cache: PagedCache, values: list[float]) -> None:
    """Append positions holding ``values`` (keys and values alike, every layer), as a pass does."""
    start = cache.length
    cache.prepare_write(start, start + len(values))
    for offset, value in enumerate(values):
        position = start + offset
        block, slot = cache.blocks[position // cache.block], position % cache.block
        cache.pool.keys[:, block, :, slot] = value
        cache.pool.values[:, block, :, slot] = value
    cache.length = start + len(values)


def held(cache: PagedCache) -> list[float]:
    keys, _ = cache.positions()
    return keys[0, 0, :, 0].tolist()


def test_a_cache_holds_whole_blocks_and_a_rollback_gives_back_the_ones_past_its_end():
    pool = pool_of()
    cache = PagedCache(pool, max_length=64)
    write(cache, [1, 2, 3, 4, 5, 6])
    assert len(cache.blocks) == 2 and pool.used == 2 and cache.nbytes() == 2 * pool.block_bytes
    assert NULL_BLOCK not in cache.blocks
    cache.crop(-3)  # back to 3 positions: the second block is free again
    assert cache.length == 3 and len(cache.blocks) == 1 and pool.used == 1
    write(cache, [7, 8])
    assert held(cache) == [1, 2, 3, 7, 8]
    with pytest.raises(ValueError, match="context of 64"):
        cache.reserve(65)
    with pytest.raises(ValueError, match="negative"):
        cache.crop(2)
    cache.release()
    assert pool.used == 0 and cache.length == 0 and cache.blocks == []


def test_a_shared_block_is_never_written_a_writer_gets_a_copy():
    pool = pool_of()
    first = PagedCache(pool, max_length=64)
    write(first, [1, 2, 3, 4, 5, 6, 7, 8])
    second = PagedCache(pool, max_length=64)
    second.adopt(first.blocks)  # both hold the same two blocks
    assert second.blocks == first.blocks and pool.used == 2 and pool.refs(first.blocks[0]) == 2
    assert held(second) == [1, 2, 3, 4, 5, 6, 7, 8]
    second.crop(-2)  # a rollback into the shared second block ...
    write(second, [60, 70])  # ... and a write there copies it first
    assert second.blocks[0] == first.blocks[0] and second.blocks[1] != first.blocks[1]
    assert held(second) == [1, 2, 3, 4, 5, 6, 60, 70]
    assert held(first) == [1, 2, 3, 4, 5, 6, 7, 8]  # untouched
    assert pool.refs(first.blocks[1]) == 1 and pool.used == 3
    with pytest.raises(ValueError, match="before it holds"):
        second.adopt(first.blocks)


def test_blocks_come_back_however_a_cache_ends_and_the_pool_grows_keeping_them():
    pool = pool_of(blocks=3)  # the null block and 2 more
    kept = PagedCache(pool, max_length=64)
    write(kept, [1, 2, 3, 4, 5])
    dropped = PagedCache(pool, max_length=64)
    write(dropped, [9] * 10)  # 3 blocks: the pool grows under it
    assert pool.capacity > 3 and pool.used == 5
    assert held(kept) == [1, 2, 3, 4, 5] and held(dropped) == [9] * 10
    del dropped
    gc.collect()
    assert pool.used == 2  # given back by the collector, without a release
    with pytest.raises(ValueError, match="not allocated"):
        pool.release([NULL_BLOCK])


def test_a_gather_reads_blocks_in_table_order_and_zeros_past_the_table():
    pool = torch.arange(5 * 1 * 2 * 1, dtype=torch.float32).view(5, 1, 2, 1)  # 5 blocks of 2 positions
    pool[NULL_BLOCK] = 0
    table = torch.tensor([3, 1])
    assert gather_positions(pool, table, 3)[0, :, 0].tolist() == [6.0, 7.0, 2.0]
    assert gather_positions(pool, table, 6)[0, :, 0].tolist() == [6.0, 7.0, 2.0, 3.0, 0.0, 0.0]
