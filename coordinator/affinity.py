"""Prefix-aware routing: a new session goes to the replica that most likely still holds its
prompt's prefix in its prefix cache (docs/batching.md, "Prefix caching"), unless that replica is
clearly busier than the least-loaded one.

Each replica keeps the KV of what it computed in blocks of whole prompt tokens; a session that
lands on another replica computes its shared prefix again. A coordinator cannot see into the
replicas' caches, so it remembers where it sent each prefix: per replica kind, the replica that
last started a session on each chain of whole blocks of a prompt (keyed like the replicas' own
caches, block by block from the start, so a hit is always a whole prefix). What it remembers is a
guess -- the replica may since have evicted the blocks, or restarted -- and a wrong guess costs
nothing but the balance it traded, which is why that trade is bounded:

- the shared part must be at least ``AFFINITY_MIN_SHARE`` of the prompt (a common system prompt
  alone must not pull every request to one replica), and
- the holder may carry at most ``AFFINITY_MAX_EXTRA_SESSIONS`` more sessions than the least-loaded
  candidate, and must have room.

The same idea as SGLang's cache-aware router, in miniature: one coordinator's memory, no tree of
the replicas' real contents. Pure apart from the memory itself (an LRU of bounded size).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from coordinator.replica_choice import least_loaded, load_with_pending
from specdec.runtime.registry import Replica

AFFINITY_BLOCK = 16  # tokens per block: the replicas' prefix-cache block (specdec.engine.prefix)
AFFINITY_MAX_BLOCKS = 65536  # remembered block chains per replica kind (an LRU: ~10 MB at most)
AFFINITY_MIN_SHARE = 0.5  # of the prompt: a shorter shared prefix is not worth any imbalance
AFFINITY_MAX_EXTRA_SESSIONS = 4  # the holder's sessions beyond the least-loaded candidate's


def prefix_keys(tokens: Sequence[int], block: int = AFFINITY_BLOCK, salt: str = "") -> list[int]:
    """One key per whole block of ``tokens``, each naming the whole prefix up to its block's end
    (a chain: a block's key hashes its parent's key with its own tokens), within the prefix
    cache's scope ``salt`` (the replicas keep each scope apart, so routing does too)."""
    keys: list[int] = []
    key = hash(("salt", salt)) if salt else 0
    for start in range(0, len(tokens) - block + 1, block):
        key = hash((key, tuple(int(t) for t in tokens[start : start + block])))
        keys.append(key)
    return keys


class PrefixAffinity:
    """Which replica last started a session on each remembered prefix (of one replica kind)."""

    def __init__(self, max_blocks: int = AFFINITY_MAX_BLOCKS):
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._holders: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def holders(self, keys: Sequence[int]) -> Iterator[tuple[str, int]]:
        """(replica id, shared blocks) for the remembered prefixes of ``keys``, longest first."""
        for depth in range(len(keys), 0, -1):
            replica_id = self._holders.get(keys[depth - 1])
            if replica_id is not None:
                yield replica_id, depth

    def remember(self, keys: Sequence[int], replica_id: str) -> None:
        """A session on ``keys`` starts on ``replica_id``: it will hold every block of them."""
        for key in keys:
            self._holders[key] = replica_id
            self._holders.move_to_end(key)
        while len(self._holders) > self.max_blocks:
            self._holders.popitem(last=False)


def has_room_near(replica: Replica, least: Replica, pending: dict[str, int] | None) -> bool:
    """Whether ``replica`` may take a session that ``least`` (the least-loaded candidate) would
    otherwise get: not full, and at most AFFINITY_MAX_EXTRA_SESSIONS sessions busier."""
    load = load_with_pending(replica, pending)
    if replica.capacity and load >= replica.capacity:
        return False
    return load <= load_with_pending(least, pending) + AFFINITY_MAX_EXTRA_SESSIONS


def choose_near_prefix(
    candidates: Sequence[Replica],
    holders: Iterator[tuple[str, int]],
    prompt_length: int,
    pending: dict[str, int] | None = None,
    block: int = AFFINITY_BLOCK,
) -> tuple[Replica | None, int]:
    """The candidate to start a session on, and how many of its prompt's tokens it is expected to
    hold (0: none, the least-loaded candidate). ``holders``: :meth:`PrefixAffinity.holders` of the
    prompt, longest prefix first; the first whose replica is a candidate with room near the
    least-loaded one wins, provided the shared part is at least AFFINITY_MIN_SHARE of the prompt."""
    least = least_loaded(candidates, pending)
    if least is None:
        return None, 0
    by_id = {r.replica_id: r for r in candidates}
    for replica_id, depth in holders:
        if depth * block < AFFINITY_MIN_SHARE * prompt_length:
            break  # the rest are shorter still
        replica = by_id.get(replica_id)
        if replica is not None and has_room_near(replica, least, pending):
            return replica, depth * block
    return least, 0
