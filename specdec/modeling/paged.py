"""Paged KV: one pool of fixed-size blocks per replica, a block table per sequence, refcounts.

Why: a sequence's cache that is one contiguous buffer must be copied whole to grow, reserves
room it may never use, and cannot share positions with another sequence -- the prefix cache had
to copy every block it kept and every block it served. Here a sequence holds a list of block ids
(its *table*): position p lives in block ``table[p // block]`` at offset ``p % block``. Growing
takes one more block; a rollback drops the blocks past the new end; the prefix cache and every
session that starts with the same prompt hold the SAME blocks, counted by reference. A block
shared by several holders is never written: a write into one first copies it (copy on write),
which only a rollback into a shared partial prefix can ask for.

Layout: ``keys`` / ``values`` are [layers, blocks, kv_heads, block, head_dim], so one layer's
pool is one tensor (the torch pass gathers a bucket of blocks from it in one index) and one
(layer, block, head) is ``block * head_dim`` contiguous values (what kernels/fewrow.c walks).
Block 0 is never handed out: it stays zeros, the padding a gather past a table's end reads.

Thread-safety: the pool's bookkeeping is under a lock (a cache dropped without ``release`` gives
its blocks back from the garbage collector, on whatever thread that runs).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import torch

BLOCK = 16  # positions per block: the prefix cache's unit too (a hit is counted in blocks)
NULL_BLOCK = 0  # all zeros, never allocated: what a gather reads past a table's end
GROWTH = 1.5  # the pool grows by half when it runs out (amortised copies; preallocate on a GPU)
MIN_BLOCKS = 64


class BlockPool:
    """Fixed-size KV blocks of one model's layers, allocated and freed by refcount."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device,
        block: int = BLOCK,
        blocks: int = MIN_BLOCKS,
    ):
        if block < 1 or blocks < 2:
            raise ValueError(f"need block >= 1 and at least 2 blocks, got {block}, {blocks}")
        self.layers, self.kv_heads, self.head_dim, self.block = layers, kv_heads, head_dim, block
        self.dtype, self.device = dtype, torch.device(device)
        self.keys = self._alloc(blocks)
        self.values = self._alloc(blocks)
        self._refs = [0] * blocks
        self._free = list(range(blocks - 1, NULL_BLOCK, -1))  # pop() hands out the lowest id first
        self._lock = threading.RLock()
        self.most: int | None = None  # the most blocks it may hold (None: no bound)

    def _alloc(self, blocks: int) -> torch.Tensor:
        # zeros: the null block must be, and attention weighs unused positions by exactly 0,
        # which 0 * NaN (what fresh memory may hold) is not
        shape = (self.layers, blocks, self.kv_heads, self.block, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    @property
    def capacity(self) -> int:
        """Blocks the pool holds (allocated or free, the null block included)."""
        return len(self._refs)

    @property
    def block_bytes(self) -> int:
        """Bytes of keys and values one block holds."""
        return 2 * self.layers * self.kv_heads * self.block * self.head_dim * self.keys.element_size()

    @property
    def used(self) -> int:
        """Blocks held by at least one cache (or the prefix cache)."""
        with self._lock:
            return self.capacity - 1 - len(self._free)

    def stats(self) -> dict:
        return {"kv_block_size": self.block, "kv_blocks_used": self.used, "kv_pool_blocks": self.capacity - 1}

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block)

    def bound(self, blocks: int, preallocate: bool = False) -> None:
        """Never hold more than ``blocks`` allocatable blocks (what the replica's KV caps let its
        sessions and prefix cache hold: growth stops there, so a grown pool's copy never
        overshoots it); ``preallocate``: hold them all now (on a GPU, where memory taken at start
        is memory no other allocation fragments)."""
        with self._lock:
            self.most = blocks + 1  # and the null block
            if preallocate and self.most > self.capacity:
                self._grow(self.most)

    def allocate(self) -> int:
        with self._lock:
            if not self._free:
                grown = max(int(self.capacity * GROWTH), self.capacity + MIN_BLOCKS)
                if self.most is not None:
                    if self.capacity >= self.most:  # the caps' accounting keeps this from happening
                        raise MemoryError(f"the KV pool's {self.capacity - 1} blocks are all in use")
                    grown = min(grown, self.most)
                self._grow(grown)
            block = self._free.pop()
            self._refs[block] = 1
            return block

    def _grow(self, blocks: int) -> None:
        old = self.capacity
        for name in ("keys", "values"):
            grown = self._alloc(blocks)
            grown[:, :old] = getattr(self, name)
            setattr(self, name, grown)
        self._refs.extend([0] * (blocks - old))
        self._free = list(range(blocks - 1, old - 1, -1)) + self._free

    def share(self, blocks: Sequence[int]) -> None:
        """One more holder of each of ``blocks``."""
        with self._lock:
            for block in blocks:
                if self._refs[block] < 1:
                    raise ValueError(f"block {block} is not allocated")
                self._refs[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """One holder fewer of each of ``blocks``; a block nobody holds is free again."""
        with self._lock:
            for block in blocks:
                if self._refs[block] < 1:
                    raise ValueError(f"block {block} is not allocated")
                self._refs[block] -= 1
                if self._refs[block] == 0:
                    self._free.append(block)

    def refs(self, block: int) -> int:
        with self._lock:
            return self._refs[block]

    def copy_of(self, block: int) -> int:
        """A new block holding what ``block`` holds (copy on write)."""
        new = self.allocate()
        self.keys[:, new] = self.keys[:, block]
        self.values[:, new] = self.values[:, block]
        return new


class PagedCache:
    """One sequence's KV in a :class:`BlockPool`: its block table and how many positions it
    holds (``length``). The same interface as a contiguous cache: ``reserve``, ``crop``,
    ``nbytes``; ``prepare_write`` before a pass writes positions."""

    def __init__(self, pool: BlockPool, max_length: int):
        self.pool = pool
        self.max_length = max_length
        self.length = 0
        self.blocks: list[int] = []
        self._table: torch.Tensor | None = None
        # blocks go back to the pool however the cache ends (released, dropped, collected)
        self._finalizer = weakref.finalize(self, _give_back, pool, self.blocks)

    @property
    def block(self) -> int:
        return self.pool.block

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.pool.block

    def planned_capacity(self, length: int, most: int | None = None) -> int:
        """The capacity :meth:`reserve` gives for ``length`` positions: whole blocks, no more
        (``most`` is accepted for the contiguous cache's interface; blocks need no headroom)."""
        return max(self.capacity, self.pool.blocks_for(length) * self.pool.block)

    def reserve(self, length: int, most: int | None = None) -> None:
        """Hold blocks for ``length`` positions."""
        if length > self.max_length:
            raise ValueError(f"{length} positions exceed the model context of {self.max_length}")
        while self.capacity < length:
            self.blocks.append(self.pool.allocate())
            self._table = None

    def prepare_write(self, start: int, end: int) -> None:
        """Make positions [start, end) writable: blocks held for them, and none of them shared
        (a shared one is replaced by a copy of it first)."""
        self.reserve(end)
        for index in range(start // self.block, self.pool.blocks_for(end)):
            block = self.blocks[index]
            if self.pool.refs(block) > 1:
                self.blocks[index] = self.pool.copy_of(block)
                self.pool.release([block])
                self._table = None

    def crop(self, n: int) -> None:
        """A negative ``n`` forgets that many trailing positions; blocks past the new end go back."""
        if n >= 0:
            raise ValueError("crop takes a negative count of positions to remove")
        self.length = max(0, self.length + n)
        keep = self.pool.blocks_for(self.length)
        if keep < len(self.blocks):
            dropped = self.blocks[keep:]
            del self.blocks[keep:]
            self.pool.release(dropped)
            self._table = None

    def adopt(self, blocks: Sequence[int]) -> None:
        """Start from ``blocks`` (whole blocks another holder keeps: the prefix cache), shared,
        not copied; the cache must hold no positions yet."""
        if self.length:
            raise ValueError("a cache adopts blocks only before it holds any position")
        self.pool.share(blocks)
        replaced = self.blocks[: len(blocks)]
        self.blocks[: len(blocks)] = list(blocks)
        self.pool.release(replaced)
        self.length = len(blocks) * self.block
        self._table = None

    def release(self) -> None:
        """Every block back to the pool; the cache holds nothing after."""
        held = list(self.blocks)
        self.blocks.clear()
        self.length = 0
        self._table = None
        self.pool.release(held)

    def nbytes(self) -> int:
        """Bytes of the blocks held (a shared block counts for each holder)."""
        return len(self.blocks) * self.pool.block_bytes

    def table(self) -> torch.Tensor:
        """The block ids as a tensor on the pool's device (cached until the table changes)."""
        if self._table is None:
            self._table = torch.tensor(self.blocks or [NULL_BLOCK], dtype=torch.long, device=self.pool.device)
        return self._table

    def positions(self, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first ``n`` positions (default: ``length``) as new tensors
        [layers, kv_heads, n, head_dim] (for checks and inspection; the passes read the pool)."""
        n = self.length if n is None else n
        return gather_positions(self.pool.keys, self.table(), n), gather_positions(self.pool.values, self.table(), n)


def _give_back(pool: BlockPool, blocks: list[int]) -> None:
    if blocks:
        held = list(blocks)
        blocks.clear()
        pool.release(held)


def gather_positions(pool: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """Positions [0, length) of one sequence from a pool tensor [..., blocks, kv_heads, block, D]
    (all layers, or one layer's [blocks, kv_heads, block, D]) by its block table -> [...,
    kv_heads, length, D]; positions past the table read zeros."""
    block = pool.shape[-2]
    count = -(-length // block)
    ids = padded_table(table, count)
    blocks_dim = pool.ndim - 4
    gathered = pool.index_select(blocks_dim, ids)  # [..., count, H, block, D]
    moved = gathered.movedim(blocks_dim, blocks_dim + 1)  # [..., H, count, block, D]
    shape = moved.shape
    merged = moved.reshape(*shape[:-3], shape[-3] * shape[-2], shape[-1])
    return merged[..., :length, :]


def padded_table(table: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` ids of ``table``, the null block past its end."""
    if table.shape[0] >= count:
        return table[:count]
    return torch.cat([table, table.new_full((count - table.shape[0],), NULL_BLOCK)])
