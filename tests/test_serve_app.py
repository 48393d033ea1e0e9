"""The coordinator's two hosts, one front: the Ray Serve application (what deploy/'s RayService
runs) and ``specdec coordinator`` on its grpc.aio server with Ray actors (what ``specdec serve``
runs), side by side on one real Ray, one Redis and the same target and draft replicas. The same
requests give the same tokens, statuses, metrics, health and traces on both."""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from otlp_collector import start_collector
from stack_util import request, scrape, stub

from specdec.apps.launcher import Stack, free_port
from specdec.modeling.tiny import perturbed, tiny_llama, word_tokenizer
from specdec.runtime.redis_embedded import EmbeddedRedis

pytestmark = [pytest.mark.integration, pytest.mark.slow]

K = 3
FRONTS = ("serve", "local")


def health(address: str) -> int:
    return health_pb2_grpc.HealthStub(grpc.insecure_channel(address)).Check(health_pb2.HealthCheckRequest()).status


def wait_serving(address: str, timeout: float) -> None:
    """Poll the health check as Kubernetes' readiness probe does (a probe never blocks)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if health(address) == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass  # the proxy is not routing yet
        time.sleep(0.5)
    raise AssertionError(f"{address} is not SERVING after {timeout:.0f}s")


def init_ray(ray, runtime_env, attempts: int = 3):
    """ray.init, tried again when the raylet misses Ray's fixed 30 s registration wait (seen on a
    busy 2-core CI machine): a slow start of the harness, not of the code under test."""
    for attempt in range(attempts):
        try:
            return ray.init(num_cpus=2, include_dashboard=False, runtime_env=runtime_env)
        except Exception as exc:  # Ray raises a bare Exception for it
            if "timed out during startup" not in str(exc) or attempt == attempts - 1:
                raise
            ray.shutdown()


@pytest.fixture(scope="module")
def fronts(tmp_path_factory):
    """{"serve" | "local": (gRPC address, metrics port)}, the target model, the trace collector."""
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    collector, collector_server, otlp_port = start_collector()
    tracing_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}", "OTEL_BSP_SCHEDULE_DELAY": "200"}
    root = tmp_path_factory.mktemp("serve-models")
    target = tiny_llama(32, seed=4, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    for name, model in (("target", target), ("draft", perturbed(target, 0.04, seed=1))):
        model.save_pretrained(root / name)
        word_tokenizer(32).save_pretrained(root / name)
    with EmbeddedRedis() as redis:
        stack = Stack(redis_url=redis.url, log_dir=root)
        try:
            for kind in ("target", "draft"):
                stack.wait_healthy(stack.start_replica(kind, str(root / kind), ["--threads", "1"], f"{kind}-0"), 120)
            init_ray(ray, runtime_env={"env_vars": {"REDIS_URL": redis.url, **tracing_env}})
            serve_port, serve_metrics, http_port = free_port(), free_port(), free_port()
            serve.start(
                http_options={"port": http_port},
                grpc_options=gRPCOptions(
                    port=serve_port,
                    grpc_servicer_functions=[
                        "specdec.v1.coordinator_pb2_grpc.add_CoordinatorServicer_to_server",
                        "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
                    ],
                ),
            )
            from coordinator.serve_app import build_app

            app = build_app({"num_speculative_tokens": K, "metrics_port": serve_metrics})
            serve.run(app, name="specdec", route_prefix="/")
            local_port, local_metrics = free_port(), free_port()
            # the grpc.aio front joins the same Ray cluster for its actors
            args = ["coordinator", "--redis", redis.url, "--port", str(local_port), "--host", "127.0.0.1"]
            args += ["--num-speculative-tokens", str(K), "--metrics-port", str(local_metrics)]
            args += ["--ray-address", ray.get_runtime_context().gcs_address]
            local = stack.start("coordinator", args, f"127.0.0.1:{local_port}", root, tracing_env)
            stack.wait_healthy(local, 120)
            wait_serving(f"127.0.0.1:{serve_port}", 120)
            yield (
                {
                    "serve": (f"127.0.0.1:{serve_port}", serve_metrics),
                    "local": (local.address, local_metrics),
                    "serve_http": (f"http://127.0.0.1:{http_port}", 0),
                },
                target,
                collector,
            )
        finally:
            try:
                stack.stop()
                serve.shutdown()
                ray.shutdown()
            finally:
                collector_server.stop(0)


@pytest.mark.parametrize("front", FRONTS)
def test_each_front_generates_the_targets_tokens_streams_and_answers_health(fronts, front):
    addresses, target, _ = fronts
    address, _ = addresses[front]
    assert health(address) == health_pb2.HealthCheckResponse.SERVING
    prompt = [3, 1, 4, 1, 5]
    expected = target.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=20, min_new_tokens=20, pad_token_id=0
    )[0, len(prompt) :].tolist()
    req = request(prompt, k=K, temperature=0.0, max_new_tokens=20, ignore_eos=True)
    assert list(stub(address).Generate(req).token_ids) == expected
    chunks = list(stub(address).GenerateStream(req))
    assert [t for c in chunks for t in c.token_ids] == expected and chunks[-1].finish_reason == "length"


def test_both_fronts_map_errors_to_the_same_clean_statuses(fronts):
    addresses, _, _ = fronts
    bad = (request([1, 2], top_p=1.5), request([1, 99]), request([1, 2], k=40))
    answers = {}
    for front in FRONTS:
        coordinator = stub(addresses[front][0])
        calls = (("unary", coordinator.Generate), ("stream", lambda r, s=coordinator: list(s.GenerateStream(r))))
        for name, call in calls:
            for i, req in enumerate(bad):
                with pytest.raises(grpc.RpcError) as info:
                    call(req)
                answers[front, name, i] = (info.value.code(), info.value.details())
    for key, (code, details) in answers.items():
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "Traceback" not in details, key
        assert answers[("local", *key[1:])] == (code, details), key  # word for word on both fronts
    assert answers["serve", "unary", 0][1].startswith("sampling.top_p")


def test_both_fronts_serve_the_same_metrics_after_the_same_requests(fronts):
    addresses, _, _ = fronts
    reqs = [
        request(
            [1 + i, 2, 3],
            k=1 + i % K,
            adaptive=False,
            temperature=1.0,
            seed=700 + i,
            max_new_tokens=8 + i,
            ignore_eos=True,
        )
        for i in range(4)
    ]
    deltas, replies = {}, {}
    for front in FRONTS:
        address, port = addresses[front]
        before = scrape(port)
        replies[front] = [stub(address).Generate(r) for r in reqs]
        with pytest.raises(grpc.RpcError):
            list(stub(address).GenerateStream(request([1, 2], top_p=2.0)))
        after = scrape(port)
        deltas[front] = {k: after[k] - before.get(k, 0.0) for k in after if k.startswith("specdec_")}
    # seeded requests: the same tokens and stats through either front
    assert [list(r.token_ids) for r in replies["serve"]] == [list(r.token_ids) for r in replies["local"]]
    counters = [
        "specdec_requests_total|finish_reason=length",
        "specdec_request_errors_total|code=INVALID_ARGUMENT",
        "specdec_emitted_tokens_total",
        "specdec_target_passes_total",
        "specdec_draft_tokens_total",
        "specdec_accepted_tokens_total",
        "specdec_drafts_total",
        "specdec_time_to_first_token_seconds_count",
        "specdec_request_latency_seconds_count",
        "specdec_inter_token_latency_seconds_count",
        "specdec_rpc_seconds_count|method=Generate",
        "specdec_rpc_seconds_count|method=GenerateStream",
    ]
    counters += [k for k in deltas["local"] if k.startswith("specdec_accepted_tokens_by_position_total")]
    for key in counters:
        assert deltas["serve"].get(key, 0.0) == deltas["local"].get(key, 0.0), key
    stats = [r.stats for r in replies["local"]]
    assert deltas["local"]["specdec_requests_total|finish_reason=length"] == len(reqs)
    assert deltas["local"]["specdec_request_errors_total|code=INVALID_ARGUMENT"] == 1
    assert deltas["local"]["specdec_target_passes_total"] == sum(s.target_passes for s in stats)
    assert deltas["local"]["specdec_accepted_tokens_total"] == sum(s.accepted_tokens for s in stats)
    assert deltas["local"]["specdec_emitted_tokens_total"] == sum(len(r.token_ids) for r in replies["local"])


@pytest.mark.parametrize("front", FRONTS)
def test_each_front_continues_the_callers_trace(fronts, front):
    addresses, _, collector = fronts
    address, _ = addresses[front]
    trace_id = f"{int(time.time() * 1e6):016x}{FRONTS.index(front) + 1:016x}"
    traceparent = f"00-{trace_id}-{'ab' * 8}-01"
    reply = stub(address).Generate(request([2, 7, 1], k=K, max_new_tokens=6), metadata=(("traceparent", traceparent),))
    wanted = {"coordinator.Generate", "specdec.request", "specdec.step"}
    deadline = time.monotonic() + 60
    names: set[str] = set()
    while time.monotonic() < deadline and not wanted <= names:
        spans = collector.spans_of(trace_id)
        names = {name for service, _, name, _ in spans if service == "specdec-coordinator"}
        time.sleep(0.3)
    assert wanted <= names, names
    front_span = next(s for s in collector.spans_of(trace_id) if s[2] == "coordinator.Generate")
    assert front_span[3].get("specdec.request_id") == reply.request_id


def test_the_serve_deployment_is_the_openai_http_ingress_too(fronts):
    """Serve's HTTP proxy reaches the same front: the openai client gets the gRPC API's tokens."""
    import openai

    addresses, _, _ = fronts
    client = openai.OpenAI(base_url=f"{addresses['serve_http'][0]}/v1", api_key="-", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    prompt = [3, 1, 4, 1, 5]
    want = stub(addresses["serve"][0]).Generate(
        request(prompt, k=K, temperature=0.0, max_new_tokens=12, ignore_eos=True)
    )
    got = client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [int(w[1:]) for w in got.choices[0].text.split()] == list(want.token_ids)
    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        if c.choices
    ]
    assert [int(w[1:]) for w in "".join(pieces).split()] == list(want.token_ids)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=prompt, top_p=1.5)
