"""Prefix caching: the KV of token sequences a replica has already computed, kept as blocks of
its paged pool (specdec.modeling.paged) so a new session whose prompt starts the same way (a
shared system prompt, the earlier turns of a chat) starts from those positions instead of
computing them again (docs/batching.md). Nothing is copied: the cache and every session that
starts from a block hold the same pool block, counted by reference.

Exact, not approximate: a position's keys and values depend only on the tokens up to it, and a
batch-invariant backend computes every row on its own, so they are the same bits whether a prompt
is fed in one pass, in chunks, alongside other sessions or found here. That is why the store
serves only sessions of a batch-invariant lean pass (``SessionStore`` decides).

Blocks form chains: a block is keyed by its parent (the block before it, by id) and its own
tokens, so a lookup walks the prompt block by block and a hit is always a whole prefix. A chain
starts from its scope (``salt``: a tenant's, or a request's cache_salt), so a session never finds
the blocks of another scope -- the number of positions it reuses would otherwise tell one client
whether another sent a prompt. Bounded in bytes (of the blocks it holds); the least recently used
blocks go first, deepest first (a block is touched after its descendants on every use, so a
parent outlives its children), and a block that goes takes its descendants with it (nothing could
reach them). A block that goes is only given back to the pool: a session still holding it keeps it.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec.modeling.paged import BlockPool


def salt_root(salt: str) -> int:
    """The parent a chain's first block hangs from: 0 for the shared scope, else a negative
    number derived from the salt (block ids are positive), so chains of different salts never
    meet and a lookup under one salt can never find another's blocks."""
    if not salt:
        return 0
    return -1 - int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "big")


@dataclass
class Block:
    id: int
    key: tuple[int, tuple[int, ...]]  # (parent id, or salt_root for a first block; this block's tokens)
    pool_block: int  # the pool block holding its positions' keys and values
    children: set[int] = field(default_factory=set)


class PrefixCache:
    """Whole blocks of KV by token prefix, at most ``max_bytes`` of them. Thread-safe."""

    def __init__(self, max_bytes: int, pool: BlockPool):
        if max_bytes < 1:
            raise ValueError(f"need max_bytes >= 1, got {max_bytes}")
        self.pool = pool
        self.block = pool.block
        self.block_bytes = pool.block_bytes
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.hit_tokens = 0  # positions served from here, since start
        self.looked_up_tokens = 0  # positions lookups could have served (whole blocks asked for)
        self._by_key: dict[tuple[int, tuple[int, ...]], Block] = {}
        self._by_id: OrderedDict[int, Block] = OrderedDict()  # least recently used first
        self._next_id = 1
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._by_id)

    def _chain(self, tokens: Sequence[int], limit: int, salt: str = "") -> list[Block]:
        chain: list[Block] = []
        parent, size = salt_root(salt), self.block
        for start in range(0, limit - size + 1, size):
            found = self._by_key.get((parent, tuple(tokens[start : start + size])))
            if found is None:
                break
            chain.append(found)
            parent = found.id
        return chain

    def _touch(self, chain: list[Block]) -> None:
        for found in reversed(chain):  # the root last: most recent, so it goes after its descendants
            self._by_id.move_to_end(found.id)

    def lookup(self, tokens: Sequence[int], limit: int, salt: str = "") -> list[Block]:
        """The longest chain of blocks that spells whole blocks of ``tokens[:limit]``, among
        those kept under ``salt``."""
        with self._lock:
            chain = self._chain(tokens, limit, salt)
            self._touch(chain)
            self.looked_up_tokens += limit // self.block * self.block
            self.hit_tokens += len(chain) * self.block
            return chain

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], salt: str = "") -> int:
        """Keep the whole blocks of ``tokens`` that are not kept yet, under ``salt``: ``blocks``
        are the pool blocks holding their positions (block i: positions [i * block, (i + 1) *
        block)), shared with their holder, not copied. Returns how many blocks were added; none
        is added that would not fit ``max_bytes``."""
        size = self.block
        with self._lock:
            chain = self._chain(tokens, len(tokens), salt)
            self._touch(chain)  # the chain a new block hangs from is the last to go
            parent = chain[-1].id if chain else salt_root(salt)
            added = 0
            for start in range(len(chain) * size, min(len(tokens), len(blocks) * size) - size + 1, size):
                if self.block_bytes > self.max_bytes:
                    break
                self._make_room(self.block_bytes, keep=parent)
                if parent > 0 and parent not in self._by_id:  # evicted to make room: the chain ends here
                    break
                pool_block = blocks[start // size]
                self.pool.share([pool_block])
                new = Block(self._next_id, (parent, tuple(tokens[start : start + size])), pool_block)
                self._next_id += 1
                self._by_key[new.key] = new
                self._by_id[new.id] = new
                if parent > 0:
                    self._by_id[parent].children.add(new.id)
                self.nbytes += self.block_bytes
                chain.append(new)
                self._touch(chain)
                parent, added = new.id, added + 1
            return added

    def _make_room(self, need: int, keep: int) -> None:
        """Evict least recently used blocks (and their descendants) until ``need`` more bytes fit,
        sparing ``keep`` (the block a new one hangs from) while anything else can go."""
        while self.nbytes + need > self.max_bytes and self._by_id:
            victim = next((b for b in self._by_id.values() if b.id != keep), None)
            if victim is None:
                victim = self._by_id[keep]
            self._evict(victim)

    def _evict(self, block: Block) -> None:
        for child in list(block.children):
            if child in self._by_id:
                self._evict(self._by_id[child])
        del self._by_id[block.id]
        del self._by_key[block.key]
        self.nbytes -= self.block_bytes
        self.pool.release([block.pool_block])
        parent = self._by_id.get(block.key[0])
        if parent is not None:
            parent.children.discard(block.id)

    def stats(self) -> dict:
        return {
            "prefix_cache_bytes": self.nbytes,
            "prefix_cache_blocks": len(self._by_id),
            "prefix_cache_hit_tokens": self.hit_tokens,
            "prefix_cache_queried_tokens": self.looked_up_tokens,
        }

    def clear(self) -> None:
        """Give every block back to the pool."""
        with self._lock:
            for block in list(self._by_id.values()):
                if block.id in self._by_id:
                    self._evict(block)
