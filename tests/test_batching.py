"""Continuous batching (specdec/engine/batching.py over the batched pass of kernels/fewrow.c): a
session's logits are the same bits whatever other sessions share its passes, however many there
are, and however its prompt is split into prefill chunks -- through rollbacks and cache growth."""

from __future__ import annotations

import random
import time

import pytest
import torch
from test_fewrow import kernel_llama

from specdec.engine.batching import BatchRunner
from specdec.engine.commits import Commit
from specdec.engine.draft import DraftEngine
from specdec.engine.sessions import PassRequest, SessionStore, run_alone
from specdec.engine.target import TargetEngine, VerifyRows
from specdec.errors import SessionNotFoundError
from specdec.exact.sampling import SamplingParams
from specdec.modeling import fewrow
from specdec.modeling.paged import BLOCK
from specdec.modeling.tiny import perturbed, tiny_llama

PARAMS = SamplingParams(temperature=1.0, seed=3)
BATCHED_KERNEL = fewrow.layers_available()


def scripted_session(store: SessionStore, session_id: str, seed: int, steps: int, vocab: int):
    """A work that starts a session and runs ``steps`` verify-shaped passes on it (k random
    proposals, k + 1 logits rows), each followed by a commit of a random accepted prefix plus one
    token (a rollback of the rest); returns every pass's logits, in order."""
    rng = random.Random(seed)
    prompt = [rng.randrange(vocab) for _ in range(rng.choice([1, 2, 5, 17, 40, 70]))]
    session = store.create(session_id, prompt, PARAMS)
    logits_seen = []
    request = PassRequest(session, prefill=True, upto=len(prompt) - 1)
    while store.feed_length(request):
        yield request
    for step in range(1, steps + 1):
        proposals = [rng.randrange(vocab) for _ in range(rng.randrange(0, 7))]
        logits, _ = yield PassRequest(session, proposals, len(proposals) + 1)
        logits_seen.append(logits)
        accepted = proposals[: rng.randrange(len(proposals) + 1)]
        store.commit(session, Commit(step, len(session.tokens), (*accepted, rng.randrange(vocab))))
    return logits_seen


def recorded_prefill(store: SessionStore, session_id: str, prompt: list[int]):
    """A work that starts a session and feeds its prompt in the chunks the scheduler gives;
    returns how many positions each pass fed."""
    session = store.create(session_id, prompt, PARAMS)
    fed = []
    request = PassRequest(session, prefill=True, upto=len(prompt) - 1)
    while store.feed_length(request):
        before = len(session.cached)
        yield request
        fed.append(len(session.cached) - before)
    return fed


def run_all(store: SessionStore, sessions: int, steps: int, runner: BatchRunner | None):
    vocab = store.vocab_size
    works = {f"s{i}": scripted_session(store, f"s{i}", 100 + i, steps, vocab) for i in range(sessions)}
    if runner is None:
        results = {sid: run_alone(store, work) for sid, work in works.items()}
    else:
        jobs = {sid: runner.add(work, sid) for sid, work in works.items()}
        seen_sessions = set()
        while runner.busy:
            iteration = runner.iterate()
            assert iteration.rows <= runner.max_batch_tokens or iteration.sessions == 1
            assert iteration.sessions <= runner.max_batch_sessions
            seen_sessions.add(iteration.sessions)
        for job in jobs.values():
            assert job.error is None, job.error
        results = {sid: job.result for sid, job in jobs.items()}
        if runner.max_batch_sessions > 1:
            assert max(seen_sessions) > 1  # passes really were shared
    for sid in works:
        store.release(sid)
    return results


def assert_same_bits(alone, batched):
    assert alone.keys() == batched.keys()
    for sid in alone:
        assert len(alone[sid]) == len(batched[sid])
        for a, b in zip(alone[sid], batched[sid], strict=True):
            assert torch.equal(a, b), sid


# The backends of the batched pass (specdec/modeling/lean_llama.py): the layer kernel where it
# runs; torch's invariant operations for widths it does not cover, for the kernel's widths with the
# kernel off, and in bfloat16 (the dtype of a GPU deployment).
MODELS = {
    "kernel_widths": lambda: kernel_llama(seed=5),
    "torch_widths": lambda: tiny_llama(48, seed=2, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2),
    "kernel_widths_in_torch": lambda: kernel_llama(seed=5),
    "torch_bfloat16": lambda: tiny_llama(48, seed=2, hidden_size=32, num_heads=4, num_kv_heads=2).to(torch.bfloat16),
}


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("tokens, sessions", [(7, 3), (24, 16), (64, 2), (1000, 8)])
def test_a_sessions_logits_are_the_same_bits_alone_and_in_any_batch(model_name, tokens, sessions, monkeypatch):
    if model_name == "kernel_widths_in_torch":
        monkeypatch.setenv(fewrow.LAYERS_SWITCH_ENV, "0")
    store = SessionStore(MODELS[model_name](), name="target")
    expected = "kernel" if model_name == "kernel_widths" and BATCHED_KERNEL else "torch-invariant"
    assert store.batches and store.batch_invariant and store.pass_backend == expected
    alone = run_all(store, 16, 8, None)
    batched = run_all(store, 16, 8, BatchRunner(store, max_batch_tokens=tokens, max_batch_sessions=sessions))
    assert_same_bits(alone, batched)


def test_prefill_is_fed_in_chunks_of_the_budget_and_decodes_go_first():
    store = SessionStore(kernel_llama(seed=1), name="target")
    runner = BatchRunner(store, max_batch_tokens=10, max_batch_sessions=8)
    rng = random.Random(0)
    short = store.create("short", [1, 2], PARAMS)
    store.warm(short)  # each of its passes is one row
    long_prompt = [rng.randrange(64) for _ in range(35)]

    def decode_forever(session, passes):
        for _ in range(passes):
            yield PassRequest(session, [], 1)
        return "decoded"

    decoding = runner.add(decode_forever(short, 6), "short")
    prefilling = runner.add(recorded_prefill(store, "long", long_prompt), "long")
    rows = []
    while runner.busy:
        iteration = runner.iterate()
        rows.append((iteration.rows, iteration.prefill_rows))
    assert decoding.result == "decoded"
    if store.batches:  # split only where splitting keeps the bits (the batched kernel)
        assert prefilling.result == [9, 9, 9, 7]  # the budget less the decoding session's row
        assert rows[:4] == [(10, 9)] * 3 + [(8, 7)]
    else:
        assert prefilling.result == [34]
    assert all(total <= 10 for total, _ in rows) or not store.batches


def test_a_failing_work_fails_alone_and_the_others_finish():
    store = SessionStore(kernel_llama(seed=2), name="target")
    runner = BatchRunner(store, max_batch_tokens=64, max_batch_sessions=8)
    good = store.create("good", [1, 2, 3], PARAMS)
    doomed = store.create("doomed", [4, 5, 6], PARAMS)

    def passes(session, n):
        for _ in range(n):
            yield PassRequest(session, [7], 2)
        return session.session_id

    def raises():
        raise ValueError("bad block")
        yield  # a generator

    jobs = [runner.add(passes(good, 3), "good"), runner.add(passes(doomed, 3), "doomed"), runner.add(raises(), "x")]
    runner.iterate()
    store.release("doomed")  # released while its work is in flight: its next pass is refused
    while runner.busy:
        runner.iterate()
    assert jobs[0].result == "good" and jobs[0].error is None
    assert isinstance(jobs[1].error, SessionNotFoundError)
    assert isinstance(jobs[2].error, ValueError)


def test_a_cancelled_prefill_is_closed_and_releases_its_session():
    store = SessionStore(kernel_llama(seed=3), name="target")
    engine_runner = BatchRunner(store, max_batch_tokens=4, max_batch_sessions=8)

    from specdec.engine.sessions import SessionEngine

    engine = SessionEngine(store)
    job = engine_runner.add(engine.start_work("p", list(range(1, 30)), PARAMS), "p")
    if store.batches:  # chunked: cancelled between two chunks
        engine_runner.iterate()
        assert "p" in list(store) and not job.finished  # started, one chunk fed
    job.cancelled = True  # (without the batched kernel the prompt is one pass: cancelled before it)
    iteration = engine_runner.iterate()
    assert job in iteration.finished and job.result is None and job.error is None
    assert "p" not in list(store) and not engine_runner.busy


def engines(model, draft_model):
    return TargetEngine(model), DraftEngine(draft_model)


MIXED = [  # one session each: what the verdicts of a pass are computed for together
    SamplingParams(temperature=0.0, seed=11),
    SamplingParams(temperature=0.8, seed=12),
    SamplingParams(temperature=1.0, top_k=5, seed=13),
    SamplingParams(temperature=0.7, top_p=0.9, seed=14),
    SamplingParams(temperature=1.2, min_p=0.05, top_k=20, seed=15),
    SamplingParams(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.5, seed=16),
    SamplingParams(temperature=0.0, logit_bias={3: 5.0}, frequency_penalty=0.4, seed=17),
    SamplingParams(temperature=0.8, invariant=True, seed=18),
    SamplingParams(temperature=0.8, logprobs=2, seed=19),
    SamplingParams(temperature=1.0, top_p=0.5, min_tokens=3, stop_token_ids=(2,), seed=20),
]


@pytest.mark.parametrize("temperature", [0.0, 0.8, "mixed"])
def test_batched_propose_and_verify_equal_the_same_calls_alone(temperature, monkeypatch):
    """The draft and target engines' works, for 10 sessions of mixed prompts and k, batched
    (small budget: chunked prefill, partial batches) and alone: the same proposals, q and verdicts
    -- with one set of sampling parameters, or each session its own ("mixed": the verdicts of a
    pass computed together over rows with different parameters, penalties and modes)."""
    target = kernel_llama(seed=7)
    draft = perturbed(target, 0.05, seed=1)
    rng = random.Random(1)
    prompts = {f"s{i}": [rng.randrange(64) for _ in range(rng.randrange(1, 45))] for i in range(10)}
    params_of = {
        s: MIXED[i] if temperature == "mixed" else SamplingParams(temperature=float(temperature), seed=11)
        for i, s in enumerate(prompts)
    }
    together = []  # blocks per verdict computation (specdec.engine.target.VerifyRows.run_many)
    run_many = VerifyRows.run_many.__func__

    def spy(cls, requests):
        together.append(len(requests))
        return run_many(cls, requests)

    monkeypatch.setattr(VerifyRows, "run_many", classmethod(spy))

    def run(batched: bool):
        t, d = engines(target, draft)
        runners = (BatchRunner(t.store, 12, 6), BatchRunner(d.store, 12, 6))

        def drive(runner, works):
            if not batched:
                return [run_alone(runner.store, w) for _, w in works]
            jobs = [runner.add(w, sid) for sid, w in works]
            while runner.busy:
                runner.iterate()
            assert all(j.error is None for j in jobs), [j.error for j in jobs]
            return [j.result for j in jobs]

        drive(runners[0], [(s, t.prefill_work(s, p, params_of[s])) for s, p in prompts.items()])
        drive(runners[1], [(s, d.prefill_work(s, p, params_of[s])) for s, p in prompts.items()])
        commits: dict[str, Commit | None] = dict.fromkeys(prompts)
        log = []
        for step in range(1, 6):
            ks = {s: (step + i) % 5 for i, s in enumerate(prompts)}
            props = drive(runners[1], [(s, d.propose_work(s, step, ks[s], commits[s])) for s in prompts])
            verdicts = drive(
                runners[0],
                [(s, t.verify_work(s, step, p.tokens, p.q, commits[s])) for s, p in zip(prompts, props, strict=True)],
            )
            for s, p, v in zip(prompts, props, verdicts, strict=True):
                log.append((s, step, list(p.tokens), [(q.token_ids.tolist(), q.probs.tolist()) for q in p.q], repr(v)))
                accepted = min(len(p.tokens), step % 3)  # any prefix: both runs commit the same
                session = t.store.get(s)
                commits[s] = Commit(step, len(session.tokens), (*p.tokens[:accepted], 1 + step))
        return log

    batched = run(True)
    assert max(together) > 1  # blocks did share a verdict computation
    together.clear()
    assert batched == run(False) and set(together) == {1}


def test_session_starts_wait_for_kv_room_then_start_and_past_the_queue_are_refused():
    from specdec.engine.sessions import CacheLimits, SessionEngine
    from specdec.errors import ResourceExhaustedError

    model = kernel_llama(seed=4)
    probe = SessionStore(model)
    per_token = probe.bytes_per_token
    cap = 40 * per_token  # two and a half blocks of 16 positions
    store = SessionStore(model, CacheLimits(max_sessions=8, max_total_kv_bytes=cap), name="target")
    engine = SessionEngine(store)
    runner = BatchRunner(store, max_batch_tokens=64, max_batch_sessions=8, max_waiting=2)
    prompt = list(range(1, 9))  # 8 tokens, a block each: two fit, a third does not

    def start(sid):
        return runner.add(engine.start_work(sid, prompt, PARAMS), sid, admit_tokens=len(prompt))

    first, second = start("a"), start("b")
    runner.iterate()
    assert first.finished and second.finished and first.error is None and second.error is None
    waiting = [start(s) for s in ("c", "d")]
    refused = start("e")
    runner.iterate()
    assert runner.waiting() == 2 and not any(j.finished for j in waiting)
    assert isinstance(refused.error, ResourceExhaustedError) and "already wait" in str(refused.error)
    assert store.total_kv_bytes <= cap
    store.release("a")
    runner.iterate()
    assert waiting[0].finished and waiting[0].error is None and not waiting[1].finished
    waiting[1].cancelled = True  # its client left while it waited
    runner.iterate()
    assert waiting[1].finished and runner.waiting() == 0 and "d" not in list(store)
    # a start that could not fit even an empty pool fails at once, naming the cap
    too_big = runner.add(engine.start_work("f", list(range(1, 50)), PARAMS), "f", admit_tokens=49)
    runner.iterate()
    assert isinstance(too_big.error, ResourceExhaustedError) and "in all" in str(too_big.error)


def test_the_pool_accounts_whole_blocks_and_growth_stops_at_the_cap():
    from specdec.engine.sessions import CacheLimits
    from specdec.errors import ResourceExhaustedError

    model = kernel_llama(seed=4)
    per_token = SessionStore(model).bytes_per_token
    cap = 3 * BLOCK * per_token  # three blocks
    store = SessionStore(model, CacheLimits(max_session_kv_bytes=cap), name="target")
    session = store.create("s", [1, 2, 3, 4, 5], PARAMS)
    store.warm(session)
    assert session.kv_bytes == BLOCK * per_token == session.cache.nbytes()  # a block for the prompt
    store.forward(session, [6, 7, 8], rows=4)  # 8 positions: the same block
    assert session.kv_bytes == BLOCK * per_token
    proposals = [1 + i % 60 for i in range(40)]  # 45 positions: three blocks, the cap
    store.forward(session, proposals, rows=len(proposals) + 1)
    assert session.kv_bytes == cap == store.total_kv_bytes and len(session.cache.blocks) == 3
    with pytest.raises(ResourceExhaustedError, match="per-session cap"):
        store.forward(session, [*proposals, 1, 2, 3, 4], rows=45)  # 49 positions: a fourth block
    assert store.total_kv_bytes <= cap


def test_a_pass_waits_for_every_session_stepping_not_only_the_last_passes():
    """The gather window (replica/batcher.py): two sessions that fell out of phase -- A's
    pass ran alone while B was elsewhere -- are brought back into one pass: A's next request waits
    (up to the window) for B, which is stepping, although the pass before carried A alone. Waiting
    only for as many as the last pass carried kept such a pair in one-session passes for good. A
    session that sent no work lately (idle, or released) is not waited for."""
    import asyncio

    from replica.batcher import IterationLoop

    store = SessionStore(kernel_llama(seed=4), name="target")
    runner = BatchRunner(store, max_batch_tokens=64, max_batch_sessions=8)
    sessions = {sid: store.create(sid, [1, 2, 3], PARAMS) for sid in ("a", "b", "idle")}
    for session in sessions.values():
        store.warm(session)

    def one_pass(session):
        yield PassRequest(session, [], 1)
        return session.session_id

    async def main():
        batching = IterationLoop(runner, gather_seconds=0.2)
        step = batching.run_with_load
        await asyncio.gather(step(one_pass(sessions["a"]), "a"), step(one_pass(sessions["b"]), "b"))

        async def a_twice():
            first = await step(one_pass(sessions["a"]), "a")  # B is late: A waits the window, then runs alone
            await asyncio.sleep(0.05)
            return first, await step(one_pass(sessions["a"]), "a")

        async def b_late():
            await asyncio.sleep(0.3)
            return await step(one_pass(sessions["b"]), "b")

        (a_alone, a_next), b_next = await asyncio.gather(a_twice(), b_late())
        await batching.stop()
        return a_alone, a_next, b_next

    a_alone, a_next, b_next = asyncio.run(main())
    assert a_alone[1].sessions == 1
    assert a_next[1].sessions == 2 and b_next[1].sessions == 2  # together again
    assert runner.stepping() == 2  # "idle" sent nothing: not waited for
    store.release("b")
    assert runner.stepping() == 1 and runner.stepping(within=0.0) == 0


# -- the loop survives its own failures (issue 42, item 2) ----------------------------------------
def one_pass_work(session, passes: int = 1):
    for _ in range(passes):
        yield PassRequest(session, [], 1)
    return session.session_id


def test_a_failed_pass_fails_its_works_with_unavailable_releases_their_sessions_and_the_next_pass_runs():
    from specdec.errors import ReplicaFaultError

    store = SessionStore(kernel_llama(seed=5), name="target")
    runner = BatchRunner(store, max_batch_tokens=64, max_batch_sessions=8)
    sessions = {sid: store.create(sid, [1, 2, 3], PARAMS) for sid in ("a", "b")}
    jobs = [runner.add(one_pass_work(sessions[sid]), sid) for sid in ("a", "b")]
    real = store.run_requests
    store.run_requests = lambda requests: (_ for _ in ()).throw(MemoryError("no room for the pass"))
    runner.iterate()
    for job in jobs:
        assert isinstance(job.error, ReplicaFaultError) and job.error.code == "UNAVAILABLE"
        assert "the batched pass failed (MemoryError)" in str(job.error)
    assert set(store) == set() and not runner.busy  # half-stepped sessions are not kept
    store.run_requests = real
    fresh = store.create("c", [4, 5], PARAMS)
    job = runner.add(one_pass_work(fresh, 2), "c")
    while runner.busy:
        runner.iterate()
    assert job.result == "c" and job.error is None


def test_a_failed_admission_check_fails_that_start_alone():
    from specdec.errors import ReplicaFaultError

    store = SessionStore(kernel_llama(seed=5), name="target")
    runner = BatchRunner(store, max_batch_tokens=64, max_batch_sessions=8)
    calls = {"n": 0}
    real = store.has_room

    def flaky_room(tokens):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("accounting broke")
        return real(tokens)

    store.has_room = flaky_room

    def start(sid):
        yield PassRequest(store.create(sid, [1, 2], PARAMS), [], 1)
        return sid

    doomed, fine = runner.add(start("x"), "x", admit_tokens=2), runner.add(start("y"), "y", admit_tokens=2)
    while runner.busy:
        runner.iterate()
    assert isinstance(doomed.error, ReplicaFaultError) and "admission failed" in str(doomed.error)
    assert fine.result == "y"


def test_a_cancelled_prefill_whose_release_raises_still_frees_its_session_and_the_loop_goes_on():
    """The case the issue found: a cancelled prefill's release copies its prompt into the prefix
    cache; when that copy fails (an allocation), the session is released all the same and no
    exception leaves the iteration."""
    from specdec.engine.sessions import SessionEngine

    store = SessionStore(kernel_llama(seed=3), name="target")
    runner = BatchRunner(store, max_batch_tokens=4, max_batch_sessions=8)
    engine = SessionEngine(store)
    store.keep_prefix = lambda session: (_ for _ in ()).throw(MemoryError("prefix cache allocation"))
    job = runner.add(engine.start_work("p", list(range(1, 30)), PARAMS), "p")
    if store.batches:
        runner.iterate()
    job.cancelled = True
    runner.iterate()  # raises nothing
    assert job.finished and "p" not in list(store) and not runner.busy
    other = runner.add(one_pass_work(store.create("q", [1, 2], PARAMS)), "q")
    while runner.busy:
        runner.iterate()
    assert other.result == "q"


def test_a_completion_callback_that_raises_does_not_stop_the_others():
    store = SessionStore(kernel_llama(seed=5), name="target")
    runner = BatchRunner(store, max_batch_tokens=64, max_batch_sessions=8)
    told = []

    def boom(job):
        raise RuntimeError("callback bug")

    a = runner.add(one_pass_work(store.create("a", [1], PARAMS)), "a", on_done=boom)
    b = runner.add(one_pass_work(store.create("b", [2], PARAMS)), "b", on_done=told.append)
    while runner.busy:
        runner.iterate()
    assert a.result == "a" and told == [b]


def test_the_iteration_loop_outlives_failed_iterations_and_says_not_serving_while_they_last():
    """Any exception out of a whole iteration (here: the scheduler's) fails the works in flight
    with UNAVAILABLE -- the loop task does not end and later calls do not hang --, and after
    UNHEALTHY_AFTER_FAILURES in a row the replica reports NOT_SERVING until an iteration runs."""
    import asyncio

    from replica.batcher import UNHEALTHY_AFTER_FAILURES, IterationLoop
    from specdec.errors import ReplicaFaultError

    store = SessionStore(kernel_llama(seed=6), name="target")
    runner = BatchRunner(store, max_batch_tokens=64, max_batch_sessions=8)
    health: list[bool] = []
    broken = {"left": UNHEALTHY_AFTER_FAILURES}
    real = runner.schedule

    def schedule():
        if broken["left"]:
            broken["left"] -= 1
            raise RuntimeError("scheduler bug")
        return real()

    runner.schedule = schedule

    async def on_health(serving, reason):
        health.append(serving)

    async def main():
        loop = IterationLoop(runner, on_health=on_health)
        outcomes = []
        for i in range(UNHEALTHY_AFTER_FAILURES):
            session = store.create(f"s{i}", [1, 2], PARAMS)
            try:
                await asyncio.wait_for(loop.run(one_pass_work(session), session.session_id), 10)
            except ReplicaFaultError as exc:
                outcomes.append(exc.code)
        assert health == [False] and not loop.serving
        session = store.create("ok", [3, 4], PARAMS)
        result = await asyncio.wait_for(loop.run(one_pass_work(session), "ok"), 10)
        for _ in range(100):  # the result may reach us before the loop has noted its iteration
            if loop.serving:
                break
            await asyncio.sleep(0.01)
        await loop.stop()
        return outcomes, result

    outcomes, result = asyncio.run(main())
    assert outcomes == ["UNAVAILABLE"] * UNHEALTHY_AFTER_FAILURES
    assert result == "ok" and health == [False, True]


# -- admission and the prefill share (issue 42, item 5) -------------------------------------------
def _pool_of(tokens: int, **runner_options):
    from specdec.engine.sessions import CacheLimits, SessionEngine

    model = kernel_llama(seed=4)
    per_token = SessionStore(model).bytes_per_token
    store = SessionStore(model, CacheLimits(max_sessions=8, max_total_kv_bytes=tokens * per_token), name="target")
    runner = BatchRunner(store, max_batch_tokens=64, max_batch_sessions=8, **runner_options)
    engine = SessionEngine(store)

    def start(sid, n):
        return runner.add(engine.start_work(sid, list(range(1, n + 1)), PARAMS), sid, admit_tokens=n)

    return store, runner, start


def test_a_start_too_big_for_now_lets_smaller_ones_pass_only_within_the_bypass_window():
    store, runner, start = _pool_of(3 * BLOCK, bypass_seconds=30.0)
    start("running", 20)
    runner.iterate()
    big = start("big", 32)  # needs 2 blocks, 1 is free: waits for "running" to end
    small = start("small", 4)  # fits now: starts at once instead of waiting behind "big"
    runner.iterate()
    assert not big.finished and small.finished and small.error is None
    store.release("small")

    store, runner, start = _pool_of(3 * BLOCK, bypass_seconds=0.0)  # no bypass: strict order behind the big one
    start("running", 20)
    runner.iterate()
    big, small = start("big", 32), start("small", 4)
    runner.iterate()
    assert not big.finished and not small.finished
    store.release("running")  # room: the oldest first, then the next
    runner.iterate()
    assert big.finished and big.error is None and small.finished and small.error is None


def test_a_start_that_waits_past_the_bound_is_refused_saying_how_long():
    from specdec.errors import ResourceExhaustedError

    _store, runner, start = _pool_of(3 * BLOCK, bypass_seconds=0.0, max_wait_seconds=0.2)
    start("running", 20)
    runner.iterate()
    big = start("big", 32)
    runner.iterate()
    assert not big.finished
    time.sleep(0.3)
    runner.iterate()
    assert isinstance(big.error, ResourceExhaustedError) and "waited 0 s for KV room" in str(big.error)
    assert runner.waiting() == 0


@pytest.mark.skipif(not BATCHED_KERNEL, reason="prefill is split only with the batched kernel")
def test_prefills_get_their_share_of_a_pass_beside_long_verify_blocks():
    store = SessionStore(kernel_llama(seed=1), name="target")
    runner = BatchRunner(store, max_batch_tokens=16, max_batch_sessions=8)
    verifiers = [store.create(f"v{i}", [1, 2], PARAMS) for i in range(3)]
    for session in verifiers:
        store.warm(session)

    def verify_forever(session, passes):
        for step in range(1, passes + 1):
            yield PassRequest(session, [3, 4, 5, 6], 5)  # a block of k = 4: 5 rows
            store.commit(session, Commit(step, len(session.tokens), (7,)))  # rejected at once
        return "done"

    for session in verifiers:
        runner.add(verify_forever(session, 40), session.session_id)
    prefilling = runner.add(recorded_prefill(store, "p", list(range(1, 41))), "p")
    while not prefilling.finished:
        runner.iterate()
    # 3 blocks of 5 rows would leave a 16-row pass 1 row for the prompt; its share is 4
    assert min(prefilling.result[:-1]) >= runner.prefill_reserve == 4
    assert sum(prefilling.result) == 39


def test_a_cache_grows_by_a_quarter_not_by_doubling():
    from specdec.modeling.cache import GROWTH_MIN, LeanCache

    cache = LeanCache(1, 1, 4, torch.float32, "cpu", max_length=4096, capacity=256)
    assert cache.planned_capacity(257) == 320  # doubling reserved 512
    assert LeanCache(1, 1, 4, torch.float32, "cpu", max_length=4096, capacity=8).planned_capacity(9) == 8 + GROWTH_MIN
    assert cache.planned_capacity(4000) == 4000 and cache.planned_capacity(300, most=300) == 300
