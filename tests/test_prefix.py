"""Prefix caching (specdec/engine/prefix.py): a session whose prompt starts like an earlier one
starts from those positions' KV blocks (shared in the paged pool, not copied), and what it
computes from there is the same bits as without them."""

from __future__ import annotations

import random

import pytest
import torch
from test_fewrow import kernel_llama

from specdec.engine.commits import Commit
from specdec.engine.prefix import PrefixCache
from specdec.engine.sessions import CacheLimits, PassRequest, SessionEngine, SessionStore, run_alone
from specdec.exact.sampling import SamplingParams
from specdec.modeling import fewrow
from specdec.modeling.paged import BlockPool

PARAMS = SamplingParams(temperature=1.0, seed=3)
KERNEL = pytest.mark.skipif(not fewrow.layers_available(), reason="the layer kernel does not run here")


def pool_of(blocks: int = 64) -> BlockPool:
    """A pool of blocks of 4 positions, 2 layers, 1 KV head of width 4."""
    return BlockPool(layers=2, kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu", block=4, blocks=blocks)


def kv(pool: BlockPool, positions: int, fill: float = 0.0) -> list[int]:
    """Blocks of ``pool`` for ``positions`` positions, position p holding fill + p (keys and
    values), as a session holds them."""
    blocks = [pool.allocate() for _ in range(pool.blocks_for(positions))]
    for index, block in enumerate(blocks):
        first = fill + index * pool.block
        row = first + torch.arange(pool.block, dtype=torch.float32)
        pool.keys[:, block, 0] = row.view(pool.block, 1)
        pool.values[:, block, 0] = row.view(pool.block, 1)
    return blocks


def first_keys(pool: BlockPool, block) -> torch.Tensor:
    return pool.keys[0, block.pool_block, 0, :, 0]


def test_lookup_returns_whole_blocks_of_the_longest_kept_prefix_within_the_limit():
    pool = pool_of()
    cache = PrefixCache(max_bytes=1 << 20, pool=pool)
    tokens = list(range(10, 24))  # 14 tokens: 3 whole blocks
    held = kv(pool, 14)
    assert cache.insert(tokens, held) == 3
    assert [pool.refs(b) for b in held] == [2, 2, 2, 1]  # shared with their holder, the partial 4th not kept
    assert cache.insert(tokens, kv(pool, 14, 100)) == 0  # kept already
    chain = cache.lookup([*tokens[:9], 99, 98, 97], limit=12)
    assert len(chain) == 2  # the third block differs at its second token
    assert torch.equal(first_keys(pool, chain[1]), torch.tensor([4.0, 5, 6, 7]))
    assert len(cache.lookup(tokens, limit=11)) == 2  # the limit cuts the third block
    assert cache.lookup([11, *tokens[1:]], limit=14) == []  # a different first token: nothing
    assert cache.lookup(tokens, limit=3) == []
    stats = cache.stats()
    assert stats["prefix_cache_blocks"] == 3 and stats["prefix_cache_hit_tokens"] == 16
    assert stats["prefix_cache_queried_tokens"] == 12 + 8 + 12 + 0  # the whole blocks within each limit
    assert stats["prefix_cache_bytes"] == 3 * 2 * (2 * 1 * 4 * 4) * 4
    pool.release(held)  # the holder goes: the cache's blocks stay, the partial one is free
    assert [pool.refs(b) for b in held] == [1, 1, 1, 0]
    cache.clear()
    assert [pool.refs(b) for b in held] == [0, 0, 0, 0] and cache.nbytes == 0


def test_a_branching_prefix_shares_its_blocks_and_the_bound_evicts_the_least_recent_deepest_first():
    pool = pool_of()
    one_block = 2 * (2 * 1 * 4 * 4) * 4  # keys and values of 4 positions
    assert pool.block_bytes == one_block
    cache = PrefixCache(max_bytes=5 * one_block, pool=pool)
    a = list(range(12))  # 3 blocks
    b = [*a[:8], 50, 51, 52, 53]  # shares 2, adds 1
    a_blocks = kv(pool, 12)
    assert cache.insert(a, a_blocks) == 3
    assert cache.insert(b, kv(pool, 12, 100)) == 1
    assert len(cache) == 4 and cache.nbytes == 4 * one_block
    cache.lookup(a, limit=12)  # a's chain is now the most recent
    c = [7] * 8  # unrelated: 2 blocks, one over the bound
    assert cache.insert(c, kv(pool, 8)) == 2
    assert cache.nbytes <= cache.max_bytes and len(cache) == 5
    assert len(cache.lookup(b, limit=12)) == 2  # b's own block went first (least recent, deepest)
    assert len(cache.lookup(a, limit=12)) == 3
    # evicting a root takes its descendants: nothing unreachable holds memory
    d = [9] * 20  # 5 blocks: everything else must go
    assert cache.insert(d, kv(pool, 20)) == 5
    assert len(cache) == 5 and cache.nbytes == 5 * one_block and cache.lookup(a, limit=12) == []
    assert [pool.refs(block) for block in a_blocks] == [1, 1, 1]  # evicted: back to their holder alone
    with pytest.raises(ValueError):
        PrefixCache(max_bytes=0, pool=pool)


def _prefill(store: SessionStore, session_id: str, prompt: list[int]):
    run_alone(store, SessionEngine(store).start_work(session_id, prompt, PARAMS))
    return store.get(session_id)


def _steps(store: SessionStore, session, seed: int, steps: int) -> list[torch.Tensor]:
    """Verify-shaped passes with rollbacks, as in test_batching: every pass's logits."""
    rng, seen = random.Random(seed), []
    for step in range(1, steps + 1):
        proposals = [rng.randrange(store.vocab_size) for _ in range(rng.randrange(0, 5))]
        seen.append(run_alone(store, _one(PassRequest(session, proposals, len(proposals) + 1)))[0])
        accepted = proposals[: rng.randrange(len(proposals) + 1)]
        store.commit(session, Commit(step, len(session.tokens), (*accepted, rng.randrange(store.vocab_size))))
    return seen


def _one(request):
    return (yield request)


@KERNEL
def test_a_copied_prefix_gives_the_same_bits_as_computing_it():
    model = kernel_llama(seed=5)
    rng = random.Random(1)
    shared = [rng.randrange(64) for _ in range(37)]
    first = shared + [rng.randrange(64) for _ in range(5)]
    second = shared + [rng.randrange(64) for _ in range(9)]
    with_cache = SessionStore(model, CacheLimits(prefix_cache_bytes=1 << 24), name="target")
    plain = SessionStore(model, name="target")
    assert with_cache.prefixes is not None and plain.prefixes is None

    _prefill(with_cache, "a", first)
    copied = _prefill(with_cache, "b", second)
    assert with_cache.prefixes.hit_tokens == 32  # the two whole blocks of the shared 37 tokens
    # what the replica tells the client, per session
    assert with_cache.copied_positions("b") == 32 and with_cache.copied_positions("a") == 0
    assert with_cache.copied_positions("nobody") == 0
    # the blocks themselves are shared: no copy, and no more pool held than one holder's
    assert copied.cache.blocks[:2] == with_cache.get("a").cache.blocks[:2]
    assert with_cache.runner.pool.used == 3 + 3 - 2  # 42 and 46 positions: 3 blocks each, 2 in common
    computed = _prefill(plain, "b", second)
    for mine, theirs in zip(copied.cache.positions(), computed.cache.positions(), strict=True):
        assert torch.equal(mine, theirs)
    for got, want in zip(_steps(with_cache, copied, 7, 6), _steps(plain, computed, 7, 6), strict=True):
        assert torch.equal(got, want)

    # a session released keeps all it cached: the next turn of the chat copies beyond the prompt
    turn = list(copied.tokens)
    with_cache.release("b")
    before = with_cache.prefixes.hit_tokens
    again = _prefill(with_cache, "c", [*turn, 3, 4])
    assert with_cache.prefixes.hit_tokens - before == (len(turn) + 1) // 16 * 16 > 32
    reference = _prefill(plain, "c", [*turn, 3, 4])
    assert torch.equal(_steps(with_cache, again, 9, 3)[-1], _steps(plain, reference, 9, 3)[-1])


@KERNEL
def test_a_session_that_wants_the_prompts_features_computes_them():
    """A feature draft's pairing asks for the prompt's hidden states: a copy has none to give."""
    model = kernel_llama(seed=5)
    store = SessionStore(model, CacheLimits(prefix_cache_bytes=1 << 24), name="target")
    prompt = list(range(1, 40))
    _prefill(store, "a", prompt)
    features = run_alone(store, SessionEngine(store).start_work("b", prompt, PARAMS, return_features=True))
    assert features.shape[0] == len(prompt) - 1 and store.prefixes.hit_tokens == 0


def test_blocks_kept_under_one_salt_are_never_found_under_another():
    """The prefix cache's scope (issue 42, item 6): a chain kept under a tenant's salt is found
    under that salt only; the shared scope ("") neither sees nor is seen by a salted one. Salts
    also keep apart chains of the same tokens, each with its own blocks and eviction."""
    pool = pool_of()
    cache = PrefixCache(max_bytes=1 << 20, pool=pool)
    tokens = list(range(10, 22))  # 3 whole blocks
    assert cache.insert(tokens, kv(pool, 12), salt="tenant-a") == 3
    assert len(cache.lookup(tokens, limit=12, salt="tenant-a")) == 3
    assert cache.lookup(tokens, limit=12, salt="tenant-b") == []
    assert cache.lookup(tokens, limit=12) == []
    assert cache.insert(tokens, kv(pool, 12, 100)) == 3  # the shared scope keeps its own blocks
    (first, *_) = cache.lookup(tokens, limit=12)
    assert torch.equal(first_keys(pool, first), torch.tensor([100.0, 101, 102, 103]))
    assert len(cache) == 6
    # eviction still walks each chain: a salted root takes its descendants with it
    while len(cache):
        cache._evict(next(iter(cache._by_id.values())))
    assert cache.nbytes == 0


@KERNEL
def test_a_session_reuses_only_what_was_kept_in_its_own_scope():
    store = SessionStore(kernel_llama(seed=5), name="target", limits=CacheLimits(prefix_cache_bytes=1 << 24))
    prompt = list(range(1, 40))  # 2 whole blocks of 16 within its first 38 positions
    salted = lambda salt: SamplingParams(temperature=1.0, seed=3, cache_salt=salt)  # noqa: E731
    engine = SessionEngine(store)
    run_alone(store, engine.start_work("a1", prompt, salted("a")))
    store.release("a1")
    for sid, salt, copied in (("b1", "b", 0), ("a2", "a", 32), ("shared", "", 0)):
        run_alone(store, engine.start_work(sid, prompt, salted(salt)))
        assert store.copied_positions(sid) == copied, sid
        store.release(sid)
