"""Tensor-parallel target (--tp N, gloo on CPU): sharding changes nothing the client sees."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import grpc
import pytest
import torch
from stack_util import generate_many, greedy_continuations, request, save_selftest_pair, stub

from coordinator.peers import GrpcTarget
from specdec.apps.launcher import Child, Stack, free_port, local_stack
from specdec.apps.selftest import BASE_SEED, CASES, build_target, case_grammars, case_params, exact_law, judge
from specdec.engine.draft import DraftEngine
from specdec.exact.proposal import DraftProposal
from specdec.exact.sampling import SamplingParams
from specdec.exact.sparse import SparseDist
from specdec.loop.generate import LocalDraft, generate_async
from specdec.modeling.tiny import negated_head

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-models")
    return root, save_selftest_pair(root, tokenizer="chars")  # a grammar engine reads it: constraints too


def start_target(model_dir, tp: int, logs, timeout: float = 300, env: dict | None = None) -> Child:
    port = free_port()
    out = open(logs / f"target-tp{tp}-{port}.log", "wb")  # noqa: SIM115 - the ranks write it all their life
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specdec",
            "target",
            "--model",
            str(model_dir),
            "--tp",
            str(tp),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--threads",
            "1",
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    child = Child(f"target-tp{tp}", f"127.0.0.1:{port}", process)
    Stack().wait_healthy(child, timeout)
    return child


def stop(child: Child) -> None:
    if child.process.poll() is None:
        child.process.send_signal(signal.SIGTERM)
        try:
            child.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(child.process.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def targets(models, tmp_path_factory):
    root, _ = models
    logs = tmp_path_factory.mktemp("tp-logs")
    sharded, plain = start_target(root / "target", 2, logs), start_target(root / "target", 1, logs)
    yield sharded, plain
    stop(sharded)
    stop(plain)


def test_sharded_verifier_output_equals_unsharded(targets):
    async def verdicts(address):
        peer = GrpcTarget(address)
        await peer.info()
        out = []
        for i, params in enumerate(
            [
                SamplingParams(temperature=1.0, seed=5),
                SamplingParams(top_p=0.8, seed=6),
                SamplingParams(repetition_penalty=1.5, seed=7),
            ]
        ):
            sid = f"s{i}"
            await peer.start(sid, [1, 2, 3, 4], params)
            block = DraftProposal(
                [5, 6, 7],
                [SparseDist.of([5, 9], [0.6, 0.4]), SparseDist.one_hot(6), SparseDist.of([7, 1, 2], [0.2, 0.5, 0.3])],
            )
            out.append(await peer.verify(sid, 1, block, None))
            await peer.release(sid)
        await peer.close()
        return out

    sharded, plain = targets
    for a, b in zip(asyncio.run(verdicts(sharded.address)), asyncio.run(verdicts(plain.address)), strict=True):
        assert a.p_proposed == pytest.approx(b.p_proposed, rel=1e-5, abs=1e-6)
        assert a.recovered == b.recovered and a.bonus == b.bonus


def test_sharded_target_returns_the_unsharded_features(targets):
    """What a feature draft reads: the final hidden states, from a sharded target as from a whole one."""

    async def features(address):
        peer = GrpcTarget(address)
        await peer.info()
        prompt = await peer.start("f", [1, 2, 3, 4, 5], SamplingParams(temperature=1.0, seed=5), return_features=True)
        verdict = await peer.verify(
            "f", 1, DraftProposal([6, 7], [SparseDist.one_hot(6), SparseDist.one_hot(7)]), None, return_features=True
        )
        await peer.release("f")
        await peer.close()
        return prompt, verdict.features

    sharded, plain = targets
    (prompt_a, block_a), (prompt_b, block_b) = (
        asyncio.run(features(sharded.address)),
        asyncio.run(features(plain.address)),
    )
    hidden = build_target().config.hidden_size
    assert prompt_a.shape == (4, hidden) and block_a.shape == (3, hidden)
    torch.testing.assert_close(prompt_a, prompt_b, rtol=2e-3, atol=2e-3)  # float16 on the wire
    torch.testing.assert_close(block_a, block_b, rtol=2e-3, atol=2e-3)


def test_each_rank_holds_about_half(targets):
    from specdec.v1 import engine_pb2, target_pb2_grpc

    def info(child):
        return target_pb2_grpc.TargetStub(grpc.insecure_channel(child.address)).Info(engine_pb2.InfoRequest())

    sharded, plain = info(targets[0]), info(targets[1])
    assert sharded.tp_size == 2 and len(sharded.rank_param_bytes) == 2
    from specdec.modeling.sharding import VOCAB_ALIGN

    total = plain.rank_param_bytes[0]
    config = build_target().config
    # each rank: half of everything, but its vocabulary rows (embedding, head) padded to VOCAB_ALIGN
    padding = 2 * (VOCAB_ALIGN - config.vocab_size // 2) * config.hidden_size * 4
    for rank_bytes in sharded.rank_param_bytes:
        assert abs(rank_bytes - (total / 2 + padding)) <= 0.02 * total  # norms are replicated
    assert sharded.kv_bytes_per_token * 2 == plain.kv_bytes_per_token
    # the lean pass, split over the ranks, batches (no transformers forward one session at a time)
    assert (sharded.pass_backend, sharded.batch_invariant) == ("torch-invariant", True)


def test_an_idle_group_outlives_its_collective_timeout(models, tmp_path_factory):
    """Rank 0's heartbeat keeps the ranks' wait for its next step short of the timeout."""
    root, _ = models
    logs = tmp_path_factory.mktemp("tp-idle")
    group = start_target(root / "target", 2, logs, env={"SPECDEC_TP_TIMEOUT_SECONDS": "8"})
    try:
        time.sleep(20)  # idle: more than twice the timeout
        assert group.process.poll() is None

        async def verify():
            peer = GrpcTarget(group.address)
            await peer.info()
            await peer.start("s", [1, 2, 3], SamplingParams(temperature=1.0, seed=1))
            verdict = await peer.verify("s", 1, DraftProposal([4], [SparseDist.one_hot(4)]), None)
            await peer.release("s")
            await peer.close()
            return verdict

        assert len(asyncio.run(verify()).p_proposed) == 1
    finally:
        stop(group)


def test_forced_rejection_then_decoding_matches_plain_decoding(models, targets):
    """Every proposal rejected at index 0 (a draft whose favourite is the target's least likely):
    the caches on both ranks must roll back identically, or greedy decoding would diverge."""
    _, target_model = models
    prompt = [3, 1, 4, 1, 5]
    expected = target_model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=40, min_new_tokens=40, pad_token_id=0
    )[0, len(prompt) :].tolist()

    async def run():
        peer = GrpcTarget(targets[0].address)
        await peer.info()
        draft = DraftEngine(negated_head(target_model))
        result = await generate_async(
            peer,
            LocalDraft(draft),
            prompt,
            SamplingParams(temperature=0.0, seed=1, max_new_tokens=40, ignore_eos=True),
            3,
        )
        await peer.close()
        return result

    result = asyncio.run(run())
    assert result.token_ids == expected
    assert result.stats.accepted_tokens == 0 and result.stats.proposed_tokens > 0


def test_killing_one_rank_takes_the_group_down_cleanly(models, tmp_path_factory):
    import psutil
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    root, _ = models
    group = start_target(root / "target", 2, tmp_path_factory.mktemp("tp-kill"))
    ranks = psutil.Process(group.process.pid).children()
    assert len(ranks) == 2
    started = time.monotonic()
    ranks[1].kill()
    states = []
    while time.monotonic() - started < 10 and group.process.poll() is None:
        try:
            reply = health_pb2_grpc.HealthStub(grpc.insecure_channel(group.address)).Check(
                health_pb2.HealthCheckRequest(), timeout=1
            )
            states.append(reply.status)
        except grpc.RpcError as exc:
            states.append(exc.code().name)
        time.sleep(0.1)
    group.process.wait(10)  # the supervisor exits: no hang
    assert group.process.returncode != 0
    assert time.monotonic() - started < 10
    assert health_pb2.HealthCheckResponse.SERVING not in states[3:]  # not serving within a few checks
    assert not any(r.is_running() and r.status() != psutil.STATUS_ZOMBIE for r in ranks)


@pytest.fixture(scope="module")
def tp_stack(models, tmp_path_factory):
    root, _ = models
    with local_stack(
        str(root / "target"),
        str(root / "draft"),
        num_speculative_tokens=3,
        log_dir=tmp_path_factory.mktemp("tp-stack-logs"),
        extra_target=["--tp", "2", "--threads", "1"],
        extra_draft=["--threads", "1"],
    ) as s:
        yield s


def test_greedy_through_the_stack_with_tp2_equals_transformers(models, tp_stack):
    _, target_model = models
    prompt = [3, 9, 3, 9, 14, 2]
    expected = target_model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=30, min_new_tokens=30, pad_token_id=0
    )[0, len(prompt) :].tolist()
    reply = stub(tp_stack.coordinator_address).Generate(
        request(prompt, k=3, temperature=0.0, max_new_tokens=30, ignore_eos=True)
    )
    assert list(reply.token_ids) == expected


def test_greedy_streams_under_load_through_tp2_are_the_targets_own_and_info_answers_meanwhile(models, tp_stack):
    """Sixteen greedy streams at once (target-only and speculative) share the TP target's passes;
    each is what transformers' generate gives alone, and the target's Info (the health probe)
    answers within a second while they run."""
    import threading

    _, target_model = models
    prompts = [[3 + i % 8, 9, 3, 9, 14, 2, 7, 1][: 2 + i % 7] for i in range(16)]
    reqs = [
        request(p, k=0 if i % 3 == 0 else 1 + i % 4, temperature=0.0, max_new_tokens=24, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    target = next(c for c in tp_stack.children if c.name.startswith("target"))
    answered: list[float] = []
    failed: list[str] = []
    running = threading.Event()
    running.set()

    def probe():
        from specdec.v1 import engine_pb2, target_pb2_grpc

        probe_stub = target_pb2_grpc.TargetStub(grpc.insecure_channel(target.address))
        while running.is_set():
            began = time.monotonic()
            try:
                probe_stub.Info(engine_pb2.InfoRequest(), timeout=1.0)
                answered.append(time.monotonic() - began)
            except grpc.RpcError as exc:  # DEADLINE_EXCEEDED past 1 s: the probe would call it down
                failed.append(exc.code().name)
            time.sleep(0.1)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        replies = generate_many(tp_stack.coordinator_address, reqs, concurrency=16)
    finally:
        running.clear()
        prober.join(5)
    expected = greedy_continuations(target_model, prompts, 24)
    assert [list(r.token_ids) for r in replies] == expected
    assert not failed and len(answered) >= 3


TP_CASES = [c for c in CASES if c.name in ("temperature_1", "top_p", "penalties_and_bias")]


@pytest.mark.statistical
@pytest.mark.parametrize("case", TP_CASES, ids=[c.name for c in TP_CASES])
def test_exactness_through_the_stack_with_tp2(models, tp_stack, case):
    _, target_model = models
    n = 300
    law = exact_law(target_model, case.prompt, case_params(case), case.tokens)
    sampling = dict(case.params, max_new_tokens=case.tokens, ignore_eos=True)
    replies = generate_many(
        tp_stack.coordinator_address,
        # fixed k, as the selftest runs the case (the load-aware default may not speculate at all
        # under these 8 concurrent streams on one machine's CPUs: docs/goodput.md, "Bursts")
        [request(list(case.prompt), k=case.k, adaptive=False, seed=BASE_SEED + i, **sampling) for i in range(n)],
    )
    verdict = judge(
        case,
        Counter(tuple(r.token_ids) for r in replies),
        law,
        n,
        sum(r.stats.proposed_tokens for r in replies),
        sum(r.stats.accepted_tokens for r in replies),
    )
    assert verdict.passed, verdict


@pytest.mark.statistical
def test_structured_output_through_the_stack_with_tp2(models, tp_stack):
    """The selftest's constrained case with a sharded target: every rank follows the constraint
    (they replay the same works), the law is the constrained one (chi-square, alpha 1e-3), and the
    coordinator's forced runs reach the sharded caches in the next commit."""
    from specdec.v1 import coordinator_pb2 as pb

    _, target_model = models
    case = next(c for c in CASES if c.name == "constrained_forced_runs")
    n = 300
    law = exact_law(target_model, case.prompt, case_params(case), case.tokens, case_grammars(case))
    kind, spec = case.constraint
    reqs = []
    for i in range(n):
        req = request(
            list(case.prompt), k=case.k, adaptive=False, seed=BASE_SEED + i, max_new_tokens=case.tokens, **case.params
        )  # fixed k, as the selftest runs it
        req.sampling.structured_output.CopyFrom(pb.StructuredOutput(**{kind: spec}))
        reqs.append(req)
    replies = generate_many(tp_stack.coordinator_address, reqs)
    verdict = judge(
        case,
        Counter(tuple(r.token_ids) for r in replies),
        law,
        n,
        sum(r.stats.proposed_tokens for r in replies),
        sum(r.stats.accepted_tokens for r in replies),
    )
    assert verdict.passed, verdict
    assert sum(r.stats.forced_tokens for r in replies) > 0 and all(r.stats.draft_fallbacks == 0 for r in replies)


def test_default_smollm2_target_with_tp3_equals_transformers(smollm2, tmp_path_factory):
    """SmolLM2-135M has 9 heads / 3 KV heads: it splits 3 ways (not 2: see the next test)."""
    from specdec.modeling.loading import encode_prompt

    model, tokenizer = smollm2
    ids = encode_prompt(tokenizer, "Explain why the sky is blue.", chat=True)
    expected = model.generate(
        torch.tensor([ids]), do_sample=False, max_new_tokens=24, pad_token_id=tokenizer.pad_token_id
    )[0, len(ids) :].tolist()
    group = start_target("smollm2", 3, tmp_path_factory.mktemp("tp3"))
    try:

        async def run():
            from specdec.engine.ngram import NgramDraft

            peer = GrpcTarget(group.address)
            info = await peer.info()
            assert info.tp_size == 3 and len(info.rank_param_bytes) == 3
            result = await generate_async(
                peer,
                LocalDraft(NgramDraft(info.vocab_size)),
                ids,
                SamplingParams(temperature=0.0, seed=0, max_new_tokens=24),
                3,
            )
            await peer.close()
            return result.token_ids

        assert asyncio.run(run()) == expected
    finally:
        stop(group)


def test_a_model_that_cannot_be_split_is_refused_clearly():
    proc = subprocess.run(
        [sys.executable, "-m", "specdec", "target", "--model", "smollm2", "--tp", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "cannot be split 2 ways" in proc.stderr and "num_attention_heads=9" in proc.stderr
    assert "Traceback" not in proc.stderr
