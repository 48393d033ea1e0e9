"""The coordinator as a Ray Serve application (what deploy/'s RayService runs), on a real Ray."""
from __future__ import annotations

import grpc
import pytest
import torch

from specdec.apps.launcher import Stack, free_port
from specdec.runtime.redis_embedded import EmbeddedRedis
from specdec.modeling.tiny import perturbed, tiny_llama, word_tokenizer

from stack_util import request, stub

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def serve_app(tmp_path_factory):
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

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
            port = free_port()
            ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"REDIS_URL": redis.url}})
            serve.start(http_options={"port": free_port()}, grpc_options=gRPCOptions(port=port, grpc_servicer_functions=[
                "specdec.v1.coordinator_pb2_grpc.add_CoordinatorServicer_to_server",
                "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server"]))
            from coordinator.serve_app import build_app

            serve.run(build_app({"num_speculative_tokens": 3, "redis_url": redis.url}), name="specdec", route_prefix="/")
            yield f"127.0.0.1:{port}", target
        finally:
            try:
                serve.shutdown()
                ray.shutdown()
            finally:
                stack.stop()


def test_serve_app_generates_streams_and_answers_health(serve_app):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address, target = serve_app
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(address)).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    prompt = [3, 1, 4, 1, 5]
    expected = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, min_new_tokens=20,
                               pad_token_id=0)[0, len(prompt):].tolist()
    req = request(prompt, k=3, temperature=0.0, max_new_tokens=20, ignore_eos=True)
    assert list(stub(address).Generate(req).token_ids) == expected
    chunks = list(stub(address).GenerateStream(req))
    assert [t for c in chunks for t in c.token_ids] == expected and chunks[-1].finish_reason == "length"


def test_serve_app_maps_errors_to_clean_statuses(serve_app):
    address, _ = serve_app
    for call in (stub(address).Generate, lambda r: list(stub(address).GenerateStream(r))):
        with pytest.raises(grpc.RpcError) as info:
            call(request([1, 2], top_p=1.5))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("sampling.top_p") and "Traceback" not in info.value.details()
