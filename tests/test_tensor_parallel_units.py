"""Rank 0's journal and its replay by the other ranks (specdec/engine/tensor_parallel.py), in one
process: rank 0's broadcasts are recorded and fed to a second engine's worker_loop, which must end
with the same sessions, the same caches bit for bit, and the same prefix cache (the group itself,
in separate processes over gloo, is exercised in test_tp.py and test_sharding.py)."""

from __future__ import annotations

import logging
import random

import pytest
import torch
import torch.distributed as dist

from specdec.engine import tensor_parallel
from specdec.engine.batching import BatchRunner
from specdec.engine.commits import Commit
from specdec.engine.profile import measure
from specdec.engine.sessions import CacheLimits
from specdec.engine.target import TargetEngine
from specdec.engine.tensor_parallel import DistributedTargetEngine, worker_loop
from specdec.errors import SessionNotFoundError
from specdec.exact.sampling import SamplingParams
from specdec.exact.sparse import SparseDist
from specdec.modeling.tiny import tiny_llama

VOCAB = 48


def model():
    return tiny_llama(VOCAB, seed=1, hidden_size=32, num_heads=4, num_kv_heads=2, num_layers=2)


def engine():
    return TargetEngine(model(), CacheLimits(prefix_cache_bytes=1 << 20))


@pytest.fixture(autouse=True)
def replays(monkeypatch):
    """The ranks' replays, kept: a work left open on a rank must stay open to be seen (the
    garbage collector would close it once worker_loop returns)."""
    kept: list = []
    real = tensor_parallel._Replay

    def keep(engine):
        kept.append(real(engine))
        return kept[-1]

    monkeypatch.setattr(tensor_parallel, "_Replay", keep)
    return kept


@pytest.fixture
def wire(monkeypatch):
    """dist's collectives in one process: rank 0's broadcasts are kept in ``sent``; a rank > 0
    receives ``sent`` in order; gathers answer with the caller's own value."""
    sent: list = []
    state = {"rank": 0}

    def broadcast_object_list(box, src):
        assert src == 0
        if state["rank"] == 0:
            sent.append(box[0])
        else:
            box[0] = sent.pop(0)

    def all_gather_object(out, value, group=None):
        out[:] = [value] * len(out)

    monkeypatch.setattr(dist, "broadcast_object_list", broadcast_object_list)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(dist, "get_rank", lambda: state["rank"])
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    return sent, state


def assert_same_sessions(a: TargetEngine, b: TargetEngine) -> None:
    assert sorted(a.store) == sorted(b.store)
    for sid in a.store:
        x, y = a.store.get(sid), b.store.get(sid)
        assert x.tokens == y.tokens and x.cached == y.cached and x.cache.length == y.cache.length
        n = x.cache.length
        for mine, theirs in zip(x.cache.positions(n), y.cache.positions(n), strict=True):
            assert torch.equal(mine, theirs)
    assert a.store.stats() == b.store.stats()  # the prefix cache too


def drive(mirror: DistributedTargetEngine, seed: int) -> list:
    """Sessions through rank 0's batch runner: starts (some sharing a prompt prefix), verify
    blocks with commits that roll back, a cancelled start, a refused verify, releases."""
    rng = random.Random(seed)
    runner = BatchRunner(mirror.store, max_batch_tokens=24, max_batch_sessions=4)
    shared = [rng.randrange(VOCAB) for _ in range(20)]
    results = []

    def run(jobs):
        while not all(job.finished for job in jobs):
            runner.iterate()
        results.extend((job.result, repr(job.error)) for job in jobs)

    params = [SamplingParams(temperature=1.0, seed=i) for i in range(5)]
    run(
        [
            runner.add(mirror.prefill_work(f"s{i}", shared + [i] * (3 + i), params[i]), f"s{i}", admit_tokens=23 + i)
            for i in range(4)
        ]
    )
    cancelled = runner.add(mirror.prefill_work("gone", shared + [7] * 40, params[4]), "gone", admit_tokens=60)
    runner.iterate()  # it starts (one chunk fed) ...
    cancelled.cancelled = True  # ... and its client goes away
    runner.iterate()
    steps = dict.fromkeys(["s0", "s1", "s2", "s3"], 0)
    pending: dict[str, Commit | None] = dict.fromkeys(steps)
    for _ in range(4):
        jobs = []
        for sid in steps:
            steps[sid] += 1
            block = [rng.randrange(VOCAB) for _ in range(rng.randrange(4))]
            q = [SparseDist.one_hot(t) for t in block]
            jobs.append(runner.add(mirror.verify_work(sid, steps[sid], block, q, pending[sid]), sid))
        jobs.append(runner.add(mirror.verify_work("nobody", 1, [], [], None), "nobody"))  # refused
        run(jobs)
        for sid, job in zip(steps, jobs, strict=False):
            length = len(mirror.engine.store.get(sid).tokens)
            accepted = job.result.p_proposed[: rng.randrange(len(job.result.p_proposed) + 1)]
            pending[sid] = Commit(steps[sid], length, (*[rng.randrange(VOCAB) for _ in accepted], job.result.bonus))
    mirror.commit("s0", pending["s0"])
    mirror.release("s1")  # into the prefix cache
    run([runner.add(mirror.prefill_work("s5", [*shared, 9, 9], params[0]), "s5", admit_tokens=22)])
    return results


def test_a_replaying_rank_ends_with_rank_0s_sessions_caches_and_prefix_cache(wire):
    sent, state = wire
    rank0 = engine()
    mirror = DistributedTargetEngine(rank0, 2, heartbeat=False)
    results = drive(mirror, seed=5)
    assert any("unknown session" in error for _, error in results)  # the refused verify was refused
    assert rank0.store.stats()["prefix_cache_hit_tokens"] > 0  # s5 reused s1's prefix
    mirror.shutdown()
    other = engine()
    state["rank"] = 1
    assert worker_loop(other) == 0
    assert not sent  # it read every broadcast, up to the shutdown
    assert_same_sessions(rank0, other)


def test_the_startup_profile_is_replayed_and_leaves_both_ranks_alike(wire):
    _, state = wire
    rank0 = engine()
    mirror = DistributedTargetEngine(rank0, 2, heartbeat=False)
    points = measure(mirror, [1, 2, 4], repeats=1)
    assert [n for n, _ in points] == [1, 2, 4]
    assert len(rank0.store) == 0 and rank0.store.sessions_started == 0
    mirror.shutdown()
    other = engine()
    state["rank"] = 1
    assert worker_loop(other) == 0
    assert_same_sessions(rank0, other)
    assert other.store.prefixes is not None and len(other.store.prefixes) == 0  # scratch sessions kept nothing


def test_a_tensor_parallel_target_is_a_target_engine_whose_works_batch_on_every_rank(wire):
    import argparse

    from replica.servicer import batch_runner_for
    from specdec.engine.interface import ProfiledEngine, VerifyingEngine

    args = argparse.Namespace(max_batch_tokens=256, max_batch_sessions=64, max_waiting_sessions=64)
    mirror = DistributedTargetEngine(engine(), 2, heartbeat=False)
    assert isinstance(mirror, VerifyingEngine) and isinstance(mirror, ProfiledEngine)
    runner = batch_runner_for(mirror, args)
    assert runner is not None and runner.store is mirror.store  # its passes are journaled for the ranks
    ranks = mirror.rank_stats()
    assert mirror.feature_size == 32 and len(ranks) == 2 and all(r["param_bytes"] > 0 for r in ranks)
    mirror.shutdown()


def test_a_request_error_is_rank_0s_to_report_and_the_rank_goes_on(wire):
    sent, state = wire
    sent.extend([[("call", "commit", ("nobody", Commit(1, 3, (1,))))], [("shutdown",)]])
    state["rank"] = 1
    assert worker_loop(engine()) == 0


def test_a_failed_pass_fails_the_rank_at_once(wire, monkeypatch, caplog):
    sent, state = wire
    replica = engine()

    def broken(requests):
        raise RuntimeError("out of memory on this rank")

    params = SamplingParams(temperature=1.0, seed=1)
    sent.extend(
        [
            [("start", 0, "prefill_work", ("s", [1, 2, 3, 4], params)), ("pass", [(0, None)])],
            [("shutdown",)],
        ]
    )
    monkeypatch.setattr(replica.store, "run_requests", broken)
    state["rank"] = 1
    with caplog.at_level(logging.ERROR, logger="specdec.tp"):
        assert worker_loop(replica) == 1
    assert len(sent) == 1  # it stopped at once: nothing after the failure ran
    assert "may now differ from rank 0" in caplog.text and "out of memory on this rank" in caplog.text


def test_a_silent_rank_0_fails_the_rank(wire, monkeypatch, caplog):
    def timed_out(box, src):
        raise RuntimeError("Timed out waiting 120000ms for recv operation to complete")

    monkeypatch.setattr(dist, "broadcast_object_list", timed_out)
    with caplog.at_level(logging.ERROR, logger="specdec.tp"):
        assert worker_loop(engine()) == 1
    assert "no word from rank 0" in caplog.text


def test_a_released_session_is_not_found_on_either_rank(wire):
    _, state = wire
    rank0 = engine()
    mirror = DistributedTargetEngine(rank0, 2, heartbeat=False)
    mirror.prefill("s", [1, 2, 3], SamplingParams(temperature=1.0, seed=1))
    assert mirror.release("s") and not mirror.release("s")
    with pytest.raises(SessionNotFoundError):
        mirror.verify("s", 1, [], [])
    mirror.shutdown()
    other = engine()
    state["rank"] = 1
    assert worker_loop(other) == 0
    assert len(other.store) == 0


def test_the_collective_timeout_is_read_from_the_environment_and_a_bad_one_is_refused(monkeypatch):
    from specdec.errors import InvalidArgumentError

    monkeypatch.delenv(tensor_parallel.TIMEOUT_ENV, raising=False)
    assert tensor_parallel.collective_timeout() == tensor_parallel.DEFAULT_TIMEOUT_SECONDS
    monkeypatch.setenv(tensor_parallel.TIMEOUT_ENV, "8")
    assert tensor_parallel.collective_timeout() == 8.0
    for bad in ("soon", "0", "-3", "nan", "inf"):
        monkeypatch.setenv(tensor_parallel.TIMEOUT_ENV, bad)
        with pytest.raises(InvalidArgumentError, match="positive number of seconds"):
            tensor_parallel.collective_timeout()
