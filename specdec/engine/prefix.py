"""Prefix caching: the KV of token sequences a replica has already computed, kept in blocks so a
new session whose prompt starts the same way (a shared system prompt, the earlier turns of a
chat) copies those positions instead of computing them again (docs/batching.md).

Exact, not approximate: a position's keys and values depend only on the tokens up to it, and the
layer kernel computes every row on its own, so they are the same bits whether a prompt is fed in
one pass, in chunks, alongside other sessions or copied from here. That is why the store serves
only sessions of the lean pass with the layer kernel (``SessionStore`` decides).

Blocks of ``block`` tokens form chains: a block is keyed by its parent (the block before it, by
id) and its own tokens, so a lookup walks the prompt block by block and a hit is always a whole
prefix. A chain starts from its scope (``salt``: a tenant's, or a request's cache_salt), so a
session never finds the blocks of another scope -- the number of positions it reuses would
otherwise tell one client whether another sent a prompt. Bounded in bytes; the least recently
used blocks go first, deepest first (a block is touched after its descendants on every use, so a
parent outlives its children), and a block that goes takes its descendants with it (nothing could
reach them).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

DEFAULT_BLOCK = 16  # tokens per block: what a hit is counted in


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
    keys: torch.Tensor  # [layers, kv_heads, block, head_dim]
    values: torch.Tensor
    children: set[int] = field(default_factory=set)

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


class PrefixCache:
    """Whole blocks of KV by token prefix, at most ``max_bytes`` of them. Thread-safe."""

    def __init__(self, max_bytes: int, block: int = DEFAULT_BLOCK):
        if block < 1 or max_bytes < 1:
            raise ValueError(f"need block >= 1 and max_bytes >= 1, got {block}, {max_bytes}")
        self.block = block
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

    def insert(self, tokens: Sequence[int], keys: torch.Tensor, values: torch.Tensor, salt: str = "") -> int:
        """Keep the whole blocks of ``tokens`` (whose positions ``keys`` / ``values``
        [layers, kv_heads, >= len(tokens), head_dim] hold) that are not kept yet, copied, under
        ``salt``; returns how many blocks were added. Nothing is added that would not fit
        ``max_bytes``."""
        size = self.block
        with self._lock:
            chain = self._chain(tokens, len(tokens), salt)
            self._touch(chain)  # the chain a new block hangs from is the last to go
            parent = chain[-1].id if chain else salt_root(salt)
            added = 0
            for start in range(len(chain) * size, len(tokens) - size + 1, size):
                block_keys = keys[:, :, start : start + size].clone()
                block_values = values[:, :, start : start + size].clone()
                block_bytes = block_keys.numel() * block_keys.element_size() * 2
                if block_bytes > self.max_bytes:
                    break
                self._make_room(block_bytes, keep=parent)
                if parent > 0 and parent not in self._by_id:  # evicted to make room: the chain ends here
                    break
                new = Block(self._next_id, (parent, tuple(tokens[start : start + size])), block_keys, block_values)
                self._next_id += 1
                self._by_key[new.key] = new
                self._by_id[new.id] = new
                if parent > 0:
                    self._by_id[parent].children.add(new.id)
                self.nbytes += new.nbytes
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
        self.nbytes -= block.nbytes
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
