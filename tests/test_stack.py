"""The distributed system, for real: target, draft and coordinator (on Ray) as separate processes
on tiny random models, exercised through the public gRPC API."""

from __future__ import annotations

import os
import time
from collections import Counter

import grpc
import pytest
import torch
from otlp_collector import start_collector
from stack_util import generate_many, info, live_sessions, request, save_selftest_pair, scrape, stub

from specdec.apps.launcher import local_stack
from specdec.apps.selftest import BASE_SEED, CASES, case_params, case_runs, exact_law, judge
from specdec.v1 import coordinator_pb2 as pb

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STACK_RUNS = int(os.environ.get("SPECDEC_STACK_RUNS", "400"))
MAX_TARGET_SESSIONS = 20
MAX_WAITING_SESSIONS = 2


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("stack-models")
    return root, save_selftest_pair(root)


@pytest.fixture(scope="module")
def collector():
    collector, server, port = start_collector()
    yield collector, port
    server.stop(0)


@pytest.fixture(scope="module")
def stack(models, collector, tmp_path_factory):
    root, _ = models
    logs = tmp_path_factory.mktemp("stack") / "logs"  # not there yet: the stack creates it
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector[1]}",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "OTEL_BSP_MAX_QUEUE_SIZE": "200000",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4096",
    }
    from specdec.apps.launcher import free_port

    metrics_ports = {name: free_port() for name in ("coordinator", "target", "draft")}
    with local_stack(
        str(root / "target"),
        str(root / "draft"),
        num_speculative_tokens=3,
        log_dir=logs,
        extra_target=[
            "--max-sessions",
            str(MAX_TARGET_SESSIONS),
            "--max-waiting-sessions",
            str(MAX_WAITING_SESSIONS),
            "--threads",
            "1",
            "--metrics-port",
            str(metrics_ports["target"]),
        ],
        extra_draft=["--threads", "1", "--metrics-port", str(metrics_ports["draft"])],
        extra_coordinator=[
            "--max-speculative-tokens",
            "8",
            "--metrics-port",
            str(metrics_ports["coordinator"]),
            # the adaptive_k case's block cost, for its requests through the stack
            "--step-cost",
            ",".join(map(str, ADAPTIVE_CASE.adaptive_cost)),
            # the load-aware case under background load certifies a schedule that varies with the
            # load: the lockstep model's prior, under which these tiny models speculate at any
            # load, rather than the shared-CPU one, under which an unmeasured load never would
            "--contention",
            "0",
            # tell every request its prefix-cache hits, scoped or not (this stack's clients are one)
            "--report-unscoped-cached-tokens",
        ],
        env=env,
    ) as s:
        s.logs = logs
        s.metrics_ports = metrics_ports
        yield s


def addresses(stack):
    return {c.name.split("-")[0]: c.address for c in stack.children if c.name.endswith("-0")}


def test_trace_spans_all_three_services(stack, collector):
    col, _ = collector
    reply = stub(stack.coordinator_address).Generate(
        # fixed k: the load-aware default may not speculate (and then never starts a draft session)
        request(
            [1, 2, 3], k=3, adaptive=False, pipeline=True, temperature=1.0, seed=3, max_new_tokens=10, ignore_eos=True
        )
    )
    wanted = {"specdec-coordinator", "specdec-draft", "specdec-target"}
    deadline = time.monotonic() + 60
    trace_id = None
    while time.monotonic() < deadline and trace_id is None:
        for tid, services in col.services_by_trace().items():
            names = {s[2] for s in col.spans_of(tid)}
            ids = {s[3].get("specdec.request_id") for s in col.spans_of(tid)}
            if wanted <= services and reply.request_id in ids:
                trace_id = tid
                # (a pre-draft: the draft drafting the next block while the target verifies)
                assert {
                    "specdec.request",
                    "specdec.step",
                    "draft.propose",
                    "target.verify",
                    "specdec.predraft",
                } <= names
        time.sleep(0.3)
    assert trace_id is not None, [
        (tid, sorted({(s[0], s[2], str(s[3].get("specdec.request_id"))) for s in col.spans_of(tid)}))
        for tid in col.services_by_trace()
    ][:3]
    steps = [s for s in col.spans_of(trace_id) if s[2] == "specdec.step"]
    assert len(steps) == reply.stats.target_passes
    assert all(
        {"specdec.step", "specdec.k", "specdec.accepted", "specdec.first_rejected", "specdec.emitted"} <= set(s[3])
        for s in steps
    )


# (the selftest's load_aware_k case feeds its policy a simulated load; here the load is real: below)
# (the constrained cases need a vocabulary a grammar engine reads: tests/test_structured_law_stack.py)
STACK_CASES = [
    c for c in CASES if c.draft in ("model", "ngram") and c.top_m == 0 and not c.load_aware and c.constraint is None
]
ADAPTIVE_CASE = next(c for c in STACK_CASES if c.adaptive_cost is not None)


@pytest.mark.statistical
@pytest.mark.parametrize("case", STACK_CASES, ids=[c.name for c in STACK_CASES])
def test_exactness_through_the_stack(stack, models, case):
    """The selftest's statistical cases through Generate: chi-square at alpha = 1e-3, fixed seeds."""
    _, target = models
    params = case_params(case)
    law = exact_law(target, case.prompt, params, case.tokens)
    n = case_runs(case, STACK_RUNS)
    method = "ngram" if case.draft == "ngram" else "draft_model"
    # each case as the selftest runs it: its own sampling mode (rejection sampling unless it says:
    # a seed alone would mean invariant sampling), fixed k unless it says, and the load-aware k
    sampling = dict(case.params, max_new_tokens=case.tokens, ignore_eos=True)
    sampling.setdefault("invariant", False)
    schedule = {
        "k": case.k,
        "method": method,
        "adaptive": case.adaptive_cost is not None,
        "replayable": False,
        "pipeline": case.pipeline,
    }
    adaptive = schedule["adaptive"]
    requests = [request(list(case.prompt), seed=BASE_SEED + i, **schedule, **sampling) for i in range(n)]
    copied = {s: scrape(stack.metrics_ports[s])["specdec_prefix_cache_hit_tokens"] for s in ("target", "draft")}
    replies = generate_many(stack.coordinator_address, requests)
    if case.name == "long_prompt":  # the law below is then that of runs on copied positions
        for service, before in copied.items():
            hits = scrape(stack.metrics_ports[service])["specdec_prefix_cache_hit_tokens"] - before
            # all but the first few (8 start at once, before any prefill has ended) copy 32 positions
            assert hits >= 32 * (n - 8), (service, hits)
    observed = Counter(tuple(r.token_ids) for r in replies)
    proposed = sum(r.stats.proposed_tokens for r in replies)
    accepted = sum(r.stats.accepted_tokens for r in replies)
    verdict = judge(case, observed, law, n, proposed, accepted)
    assert verdict.passed, verdict
    assert all(r.stats.draft_fallbacks == 0 for r in replies)
    if case.pipeline:  # blocks drafted ahead were used, and the first runs are those drafted serially
        assert sum(r.stats.predraft_hits for r in replies) > 0
        serial = [
            request(list(case.prompt), seed=BASE_SEED + i, **{**schedule, "pipeline": False}, **sampling)
            for i in range(40)
        ]
        assert [list(r.token_ids) for r in generate_many(stack.coordinator_address, serial)] == [
            list(r.token_ids) for r in replies[:40]
        ]
    if adaptive:  # the server's default adaptive policy chose the ks (its schedule: the test below)
        assert all(r.stats.policy == "load_aware" for r in replies), Counter(r.stats.policy for r in replies)


class BackgroundLoad:
    """Sampled streams running until stopped, so the requests under test share their passes
    (and their policy sees a loaded batch)."""

    def __init__(self, address: str, streams: int):
        import threading

        self.stop = threading.Event()
        self.tokens = [0] * streams

        def run(i):
            s = stub(address)
            while not self.stop.is_set():
                req = request([4 + i % 8, 2, 6], k=3, temperature=1.0, seed=900 + i, max_new_tokens=60, ignore_eos=True)
                for chunk in s.GenerateStream(req, timeout=120):
                    self.tokens[i] += len(chunk.token_ids)
                    if self.stop.is_set():
                        break

        self.threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(streams)]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(120)


@pytest.mark.statistical
def test_exactness_with_the_load_aware_policy_under_background_load(stack, models):
    """The default policy chooses each step's k from the load it sees (here: 6 background streams
    plus 8 requests of the case at once): chi-square at alpha = 1e-3, fixed seeds; the schedule
    varied (several k, target-only steps among them), and the law is still the target's."""
    _, target = models
    case = ADAPTIVE_CASE
    params = case_params(case)
    law = exact_law(target, case.prompt, params, case.tokens)
    n = case_runs(case, STACK_RUNS)
    sampling = dict(case.params, max_new_tokens=case.tokens, ignore_eos=True, invariant=False)  # rejection sampling
    requests = [
        request(list(case.prompt), k=case.k, seed=BASE_SEED + i, adaptive=True, replayable=False, **sampling)
        for i in range(n)
    ]
    with BackgroundLoad(stack.coordinator_address, 6) as load:
        replies = generate_many(stack.coordinator_address, requests)
    assert sum(load.tokens) > 0
    observed = Counter(tuple(r.token_ids) for r in replies)
    proposed = sum(r.stats.proposed_tokens for r in replies)
    accepted = sum(r.stats.accepted_tokens for r in replies)
    verdict = judge(case, observed, law, n, proposed, accepted)
    assert verdict.passed, verdict
    assert all(r.stats.policy == "load_aware" for r in replies)
    by_k = Counter()
    for r in replies:
        by_k.update({k: steps for k, steps in enumerate(r.stats.steps_by_k) if steps})
    assert by_k[0] > 0 and len(by_k) >= 2, by_k


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "method, k", [("draft_model", 3), ("draft_model", 8), ("ngram", 4), ("none", 3), ("draft_model", 0)]
)
def test_greedy_equals_transformers_generate(stack, models, method, k):
    _, target = models
    prompt = [3, 9, 3, 9, 14, 2]
    expected = hf_greedy(target, prompt, 30)
    reply = stub(stack.coordinator_address).Generate(
        request(prompt, k=k, method=method, temperature=0.0, max_new_tokens=30, ignore_eos=True)
    )
    assert list(reply.token_ids) == expected
    assert reply.finish_reason == "length"
    if method == "none" or k == 0:
        assert reply.stats.proposed_tokens == 0 and reply.stats.target_passes == 30


@pytest.mark.parametrize("concurrency", [1, 16])
def test_concurrent_greedy_streams_each_equal_transformers_generate(stack, models, concurrency):
    """16 streams, one at a time and all at once (their passes batched on each replica, the
    load-aware policy choosing each step's k from that load): each one's tokens are the target's
    own greedy continuation, whatever shared its passes; and under load the passes were shared."""
    _, target = models
    before = scrape(stack.metrics_ports["target"])
    policy_before = scrape(stack.metrics_ports["coordinator"])
    prompts = [[3 + i % 8, 9, 3, 9, 14, 2][: 2 + i % 5] for i in range(16)]
    methods = [("draft_model", 1 + i % 5) if i % 3 else ("none", 0) for i in range(16)]
    reqs = [
        request(p, k=k, method=m, temperature=0.0, max_new_tokens=24, ignore_eos=True)
        for p, (m, k) in zip(prompts, methods, strict=True)
    ]
    replies = generate_many(stack.coordinator_address, reqs, concurrency=concurrency)
    assert [list(r.token_ids) for r in replies] == [hf_greedy(target, p, 24) for p in prompts]
    after = scrape(stack.metrics_ports["target"])
    policy_after = scrape(stack.metrics_ports["coordinator"])
    steps = [f"specdec_policy_steps_total|policy=load_aware|speculating={on}" for on in ("true", "false")]
    chosen = sum(policy_after.get(key, 0) - policy_before.get(key, 0) for key in steps)
    assert chosen > 0  # the default (load-aware) policy chose these steps' ks, speculating or not
    passes = after["specdec_batch_sessions_count"] - before.get("specdec_batch_sessions_count", 0)
    alone = after["specdec_batch_sessions_bucket|le=1.0"] - before.get("specdec_batch_sessions_bucket|le=1.0", 0)
    if concurrency > 1:
        assert passes > alone  # some passes carried more than one session


def test_stream_equals_unary_and_last_chunk_carries_stats(stack):
    # fixed k: a seeded sampled request's tokens depend on its k schedule, which under the
    # default load-aware policy follows the load (docs/goodput.md)
    req = request(
        prompt="w1 w2 w3 w4", k=3, adaptive=False, temperature=0.8, seed=77, max_new_tokens=25, ignore_eos=True
    )
    s = stub(stack.coordinator_address)
    unary = s.Generate(req)
    chunks = list(s.GenerateStream(req))
    assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids)
    assert "".join(c.text for c in chunks) == unary.text
    assert all(not c.finish_reason for c in chunks[:-1])
    last = chunks[-1]
    assert last.finish_reason == "length" and last.seed == 77 == unary.seed
    assert last.stats.target_passes == unary.stats.target_passes > 0
    assert len(chunks) > 2  # really streamed, not one blob


def test_unseeded_request_reports_its_seed(stack):
    # A request without a seed samples by rejection (the best acceptance) with the schedule the
    # server chooses; its reported seed replays it sent back with invariant: false and a fixed k
    # (docs/exactness.md, "What a seed fixes") -- sent alone, a seed means invariant sampling.
    s = stub(stack.coordinator_address)
    first = s.Generate(request([1, 2, 3], k=3, adaptive=False, max_new_tokens=12, ignore_eos=True))
    assert first.seed != 0
    replay = {"k": 3, "adaptive": False, "max_new_tokens": 12, "ignore_eos": True, "seed": first.seed}
    again = s.Generate(request([1, 2, 3], invariant=False, **replay))
    assert list(again.token_ids) == list(first.token_ids)


def test_concurrent_requests_equal_sequential(stack):
    reqs = [
        request(
            [1 + i, 2, 3],
            k=1 + i % 4,
            adaptive=False,
            temperature=1.0,
            seed=100 + i,
            max_new_tokens=16,
            ignore_eos=True,
        )
        for i in range(8)
    ]  # fixed k (see above); an adaptive schedule that reproduces: test_failover's --replayable-schedule
    s = stub(stack.coordinator_address)
    one_by_one = [list(s.Generate(r).token_ids) for r in reqs]
    together = [list(r.token_ids) for r in generate_many(stack.coordinator_address, reqs, concurrency=8)]
    assert together == one_by_one


def assert_no_live_sessions(addr, within: float = 10.0):
    """Both services hold no session (allowing ``within`` seconds for releases in flight)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if live_sessions(addr["target"], "target") == 0 and live_sessions(addr["draft"], "draft") == 0:
            break
        time.sleep(0.2)
    assert live_sessions(addr["target"], "target") == 0
    assert live_sessions(addr["draft"], "draft") == 0


def test_cancel_mid_stream_frees_both_sessions(stack):
    addr = addresses(stack)
    s = stub(stack.coordinator_address)
    stream = s.GenerateStream(request([1, 2, 3], k=1, temperature=1.0, seed=5, max_new_tokens=120, ignore_eos=True))
    got = 0
    for chunk in stream:
        got += len(chunk.token_ids)
        if got >= 3:
            stream.cancel()
            break
    # and a deadline that expires mid-request
    with pytest.raises(grpc.RpcError) as info:
        s.Generate(request([1, 2, 3], k=1, seed=6, max_new_tokens=120, ignore_eos=True), timeout=0.3)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_no_live_sessions(addr)


def test_cancelled_streams_under_load_free_their_sessions_and_the_rest_finish(stack):
    """8 streams at once (their passes batched); 4 are cancelled a few tokens in, while the others
    go on: the others finish with the tokens they get alone, and every session is released."""
    import asyncio

    addr = addresses(stack)
    reqs = [
        request(
            [2 + i % 4, 5, 7],
            k=1 + i % 3,
            adaptive=False,
            temperature=1.0,
            seed=700 + i,
            max_new_tokens=40,
            ignore_eos=True,
        )
        for i in range(8)
    ]
    alone = [list(stub(stack.coordinator_address).Generate(r).token_ids) for r in reqs[1::2]]

    async def run():
        from specdec.v1 import coordinator_pb2_grpc

        async with grpc.aio.insecure_channel(stack.coordinator_address) as channel:
            s = coordinator_pb2_grpc.CoordinatorStub(channel)

            async def one(i, r):
                call, tokens = s.GenerateStream(r), []
                async for chunk in call:
                    tokens.extend(chunk.token_ids)
                    if i % 2 == 0 and len(tokens) >= 3:
                        call.cancel()
                        return None
                return tokens

            return await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))

    results = asyncio.run(run())
    assert results[1::2] == alone and all(r is None for r in results[0::2])
    assert_no_live_sessions(addr)


BAD = [
    ("negative temperature", {"prompt_ids": [1, 2], "temperature": -0.5}, "sampling.temperature"),
    ("top_p above 1", {"prompt_ids": [1, 2], "top_p": 1.5}, "sampling.top_p"),
    ("top_p zero", {"prompt_ids": [1, 2], "top_p": 0.0}, "sampling.top_p"),
    ("k beyond the maximum", {"prompt_ids": [1, 2], "k": 9}, "speculation.num_speculative_tokens"),
    ("negative k", {"prompt_ids": [1, 2], "k": -1}, "speculation.num_speculative_tokens"),
    ("empty prompt", {}, "prompt"),
    ("unknown method", {"prompt_ids": [1, 2], "method": "medusa"}, "speculation.method"),
    ("prompt longer than the context", {"prompt_ids": [1] * 200}, "prompt"),
    ("token ids outside the vocabulary", {"prompt_ids": [1, 16]}, "prompt_token_ids"),
    ("logit bias outside the vocabulary", {"prompt_ids": [1, 2], "logit_bias": {99: 1.0}}, "sampling.logit_bias"),
    (
        "an empty structured output",
        {"prompt_ids": [1, 2], "structured_output": pb.StructuredOutput()},
        "sampling.structured_output",
    ),
    (  # the tiny models' word-level tokenizer has no byte-level vocabulary for llguidance
        "a constraint this tokenizer cannot compile",
        {"prompt_ids": [1, 2], "structured_output": pb.StructuredOutput(regex="[0-9]+")},
        "sampling.structured_output",
    ),
]


@pytest.mark.parametrize("what, kwargs, field", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_invalid_argument_naming_the_field(stack, what, kwargs, field):
    s = stub(stack.coordinator_address)
    kwargs = dict(kwargs)
    req = request(kwargs.pop("prompt_ids", None), **kwargs)
    for call in (s.Generate, lambda r: list(s.GenerateStream(r))):
        with pytest.raises(grpc.RpcError) as info:
            call(req)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith(field), info.value.details()
    good = s.Generate(request([1, 2, 3], k=2, max_new_tokens=5, ignore_eos=True))
    assert len(good.token_ids) == 5


def test_over_capacity_is_resource_exhausted_and_recovers(stack):
    reqs = [request([1, 2, 3], k=1, seed=i, max_new_tokens=60, ignore_eos=True) for i in range(MAX_TARGET_SESSIONS + 6)]

    async def all_of_them():
        import asyncio

        async with grpc.aio.insecure_channel(stack.coordinator_address) as channel:
            from specdec.v1 import coordinator_pb2_grpc

            s = coordinator_pb2_grpc.CoordinatorStub(channel)

            async def one(r):
                try:
                    await s.Generate(r, timeout=120)
                    return "OK"
                except grpc.aio.AioRpcError as exc:
                    return exc.code().name

            return await asyncio.gather(*(one(r) for r in reqs))

    import asyncio

    codes = Counter(asyncio.run(all_of_them()))
    # 12 run at once, 2 wait for a session slot and run when one frees, the rest are refused
    assert codes["RESOURCE_EXHAUSTED"] >= 1 and codes["OK"] > MAX_TARGET_SESSIONS, codes
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}
    assert (
        len(stub(stack.coordinator_address).Generate(request([1, 2], max_new_tokens=4, ignore_eos=True)).token_ids) == 4
    )


def test_public_port_answers_standard_health_and_reflection(stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    channel = grpc.insecure_channel(stack.coordinator_address)
    for service in ("", "specdec.v1.Coordinator"):
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    responses = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert "specdec.v1.Coordinator" in names


def test_specdec_generate_cli(stack):
    import subprocess
    import sys
    from pathlib import Path

    specdec = str(Path(sys.executable).with_name("specdec"))
    ok = subprocess.run(
        [
            specdec,
            "generate",
            "--addr",
            stack.coordinator_address,
            "w1 w2 w3",
            "--raw",
            "-k",
            "2",
            "--fixed-k",  # speculation on, whatever the load-aware default has measured by now
            "--max-new-tokens",
            "6",
            "--ignore-eos",
            "--seed",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert len(ok.stdout.split()) == 6 and "acceptance rate" in ok.stderr and "seed=4" in ok.stderr
    bad = subprocess.run(
        [specdec, "generate", "--addr", stack.coordinator_address, "w1", "--raw", "-k", "99"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 2
    assert "INVALID_ARGUMENT" in bad.stderr and "speculation.num_speculative_tokens" in bad.stderr
    assert "Traceback" not in bad.stderr
    local = subprocess.run(
        [specdec, "generate", "--addr", stack.coordinator_address, "w1", "--top-p", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )  # refused before it is sent
    assert local.returncode == 2 and "top_p" in local.stderr and "Traceback" not in local.stderr


def test_metrics_counters_equal_the_returned_stats(stack):
    before = scrape(stack.metrics_ports["coordinator"])
    # half of them fixed-k: the load-aware rest may not speculate, and the draft must see passes
    reqs = [
        request(
            [1 + i % 5, 2, 3],
            k=1 + i % 4,
            adaptive=None if i % 2 else False,
            # fixed k, pipelined drafting (docs/pipelining.md); the rest as the server decides
            pipeline=True if i % 4 == 0 else None,
            temperature=1.0,
            seed=500 + i,
            max_new_tokens=10 + i,
            ignore_eos=True,
        )
        for i in range(12)
    ]
    replies = generate_many(stack.coordinator_address, reqs, concurrency=4)
    with pytest.raises(grpc.RpcError):
        stub(stack.coordinator_address).Generate(request([1, 2], top_p=2.0))
    after = scrape(stack.metrics_ports["coordinator"])
    delta = lambda key: after.get(key, 0.0) - before.get(key, 0.0)  # noqa: E731
    assert delta("specdec_accepted_tokens_total") == sum(r.stats.accepted_tokens for r in replies)
    assert delta("specdec_draft_tokens_total") == sum(r.stats.proposed_tokens for r in replies)
    assert delta("specdec_target_passes_total") == sum(r.stats.target_passes for r in replies)
    assert delta("specdec_drafts_total") == sum(r.stats.drafts for r in replies)
    assert delta("specdec_emitted_tokens_total") == sum(len(r.token_ids) for r in replies)
    assert delta("specdec_requests_total|finish_reason=length") == len(replies)
    assert delta("specdec_request_errors_total|code=INVALID_ARGUMENT") == 1
    for position in range(4):
        assert delta(f"specdec_accepted_tokens_by_position_total|position={position}") == sum(
            r.stats.accepted_per_position[position] for r in replies if len(r.stats.accepted_per_position) > position
        )
    assert delta("specdec_predrafts_total") == sum(r.stats.predrafts for r in replies) > 0
    # by default only where draft and target compute apart: not on one machine's CPUs (runtime.placement)
    assert all(
        r.stats.predrafts == 0 for r, req in zip(replies, reqs, strict=True) if not req.speculation.HasField("pipeline")
    )
    rejection_hits = sum(r.stats.predraft_rejection_hits for r in replies)
    assert delta("specdec_predraft_hits_total|branch=rejection") == rejection_hits
    assert (
        delta("specdec_predraft_hits_total|branch=accepted")
        == sum(r.stats.predraft_hits for r in replies) - rejection_hits
    )
    assert delta("specdec_time_to_first_token_seconds_count") == len(replies)
    assert delta("specdec_request_latency_seconds_count") == len(replies)
    for service in ("target", "draft"):
        scraped = scrape(stack.metrics_ports[service])
        assert scraped["specdec_live_sessions"] == 0 and "specdec_kv_cache_bytes" in scraped
        assert any(k.startswith("specdec_rpc_seconds_count|method=") for k in scraped)
        assert scraped["specdec_iterations_total"] > 0 and scraped["specdec_running_works"] == 0
        assert scraped["specdec_waiting_works"] == 0 and scraped["specdec_queue_wait_seconds_count"] > 0


def test_a_repeated_prompt_is_copied_from_the_prefix_cache_and_gives_the_same_tokens(stack):
    """Both replicas keep what they computed (docs/batching.md, prefix caching): the same prompt
    again copies its whole blocks on the target and the draft, and a seeded request draws the
    same tokens from copied positions as from computed ones."""
    from specdec.apps.selftest import VOCAB

    hits = "specdec_prefix_cache_hit_tokens"
    prompt = [(7 * i + 3) % VOCAB for i in range(40)]  # 39 positions prefilled: 2 whole blocks of 16
    # fixed k: the draft session starts with the request (the load-aware default may not speculate)
    same = request(prompt, k=2, adaptive=False, temperature=1.0, seed=91, max_new_tokens=12, ignore_eos=True)
    first = stub(stack.coordinator_address).Generate(same)
    before = {s: scrape(stack.metrics_ports[s])[hits] for s in ("target", "draft")}
    again = stub(stack.coordinator_address).Generate(same)
    assert list(again.token_ids) == list(first.token_ids) and len(first.token_ids) == 12
    # and the client is told (the target's count, in the request's stats: this stack opts in for
    # requests without a key or salt; by default they are told none, tests/test_http_api.py)
    assert first.stats.cached_prompt_tokens == 0 and again.stats.cached_prompt_tokens == 32
    for service in ("target", "draft"):
        scraped = scrape(stack.metrics_ports[service])
        assert scraped[hits] - before[service] == 32, service
        assert scraped["specdec_prefix_cache_bytes"] > 0 and scraped["specdec_prefix_cache_queried_tokens"] > 0


def test_service_logs_go_to_the_log_dir_the_stack_created(stack):
    names = sorted(p.name for p in stack.logs.glob("*.log"))
    assert {"target-0.log", "draft-0.log", "coordinator.log"} <= set(names), names
    assert (stack.logs / "target-0.log").stat().st_size > 0
    assert "KV pool cap: " in (stack.logs / "target-0.log").read_text()  # auto: a cap, not none (issue 24)
    assert "GiB (auto" in (stack.logs / "draft-0.log").read_text()
    # one target and one draft on this host split the default half of its memory
    assert "(auto, 0.25 of the free memory)" in (stack.logs / "target-0.log").read_text()


def test_internal_rpcs_bound_what_a_client_sends(stack):
    """A Verify stream is read only up to the longest block (an endless stream is refused, not
    buffered), and a Propose's k is bounded: both INVALID_ARGUMENT naming the field."""
    from specdec.v1 import draft_pb2, draft_pb2_grpc, engine_pb2, target_pb2, target_pb2_grpc

    addr = addresses(stack)
    one = draft_pb2.ProposedToken(token_id=1, q=engine_pb2.SparseDistribution(token_ids=[1], probs=[1.0]))

    def endless():
        yield target_pb2.VerifyChunk(session_id="nobody", step=1)
        while True:
            yield target_pb2.VerifyChunk(proposals=[one] * 8)

    target = target_pb2_grpc.TargetStub(grpc.insecure_channel(addr["target"]))
    with pytest.raises(grpc.RpcError) as info:
        target.Verify(endless(), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "proposals" in info.value.details()
    draft = draft_pb2_grpc.DraftStub(grpc.insecure_channel(addr["draft"]))
    with pytest.raises(grpc.RpcError) as info:
        draft.Propose(draft_pb2.ProposeRequest(session_id="nobody", step=1, k=(1 << 31) - 1), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("k:")
    with pytest.raises(grpc.RpcError) as info:
        draft.Propose(draft_pb2.ProposeRequest(session_id="nobody", step=1, k=1, assumed=[1] * 66), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("assumed:")
    with pytest.raises(grpc.RpcError) as info:
        request = draft_pb2.ProposeRequest(session_id="nobody", step=1, k=1, assumed=[1], rejection_branches=2)
        draft.Propose(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "rejection_branches" in info.value.details()


def test_replicas_report_where_they_compute(stack):
    """Node and devices in Info (and the registry): what the coordinator's pipelining default reads."""
    import socket

    addr = addresses(stack)
    for kind in ("target", "draft"):
        described = info(addr[kind], kind)
        assert described.node == socket.gethostname() and list(described.devices) == ["cpu"], kind
