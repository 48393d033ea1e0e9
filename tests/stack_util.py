"""Helpers for integration tests that talk to a real stack over gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable

import grpc

from specdec.v1 import coordinator_pb2 as pb
from specdec.v1 import coordinator_pb2_grpc, draft_pb2_grpc, engine_pb2, target_pb2_grpc


def request(
    prompt_ids=None,
    prompt=None,
    k=None,
    method="",
    request_id="",
    resume_from_index=0,
    adaptive=None,
    replayable=None,
    pipeline=None,
    **sampling,
) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id, resume_from_index=resume_from_index)
    if prompt_ids is not None:
        req.prompt_token_ids.extend(prompt_ids)
    if prompt is not None:
        req.prompt = prompt
    logit_bias = sampling.pop("logit_bias", None) or {}
    req.sampling.CopyFrom(pb.SamplingParams(**sampling))
    for token, bias in logit_bias.items():
        req.sampling.logit_bias[token] = bias
    if k is not None:
        req.speculation.num_speculative_tokens = k
    req.speculation.method = method
    if adaptive is not None:  # else the server's default
        req.speculation.adaptive = adaptive
    if replayable is not None:  # else the server's choice (docs/exactness.md, "What a seed fixes")
        req.speculation.replayable = replayable
    if pipeline is not None:  # else the server's default (specdec.loop.pipelining)
        req.speculation.pipeline = pipeline
    return req


def stub(address: str) -> coordinator_pb2_grpc.CoordinatorStub:
    return coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(address))


def info(address: str, kind: str):
    """A draft or target replica's EngineInfo."""
    channel = grpc.insecure_channel(address)
    s = (target_pb2_grpc.TargetStub if kind == "target" else draft_pb2_grpc.DraftStub)(channel)
    return s.Info(engine_pb2.InfoRequest(), timeout=10)


def live_sessions(address: str, kind: str) -> int:
    return info(address, kind).live_sessions


async def _gather(address: str, requests, concurrency: int):
    sem = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address) as channel:
        s = coordinator_pb2_grpc.CoordinatorStub(channel)

        async def one(req):
            async with sem:
                return await s.Generate(req, timeout=120)

        return await asyncio.gather(*(one(r) for r in requests))


def generate_many(address: str, requests, concurrency: int = 8):
    """Unary Generate for every request, ``concurrency`` in flight at once; results in order."""
    return asyncio.run(_gather(address, list(requests), concurrency))


def scrape(port: int) -> dict[str, float]:
    """A Prometheus /metrics page as {name|label=value...: value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f"|{k}={v}" for k, v in sorted(sample.labels.items()))
            out[key] = sample.value
    return out


def save_tiny_pair(root, vocab: int, seed: int, draft_scale: float = 0.04, chat_template: str | None = None, **dims):
    """A tiny random Llama target and a perturbed copy as its draft, each with a word tokenizer,
    saved as ``root/target`` and ``root/draft`` (what the stack tests serve); their paths."""
    from specdec.modeling.tiny import perturbed, tiny_llama, word_tokenizer

    target = tiny_llama(vocab, seed=seed, **dims)
    target.save_pretrained(root / "target")
    perturbed(target, scale=draft_scale, seed=seed + 1).save_pretrained(root / "draft")
    for name in ("target", "draft"):
        tokenizer = word_tokenizer(vocab)
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        tokenizer.save_pretrained(root / name)
    return str(root / "target"), str(root / "draft")


def save_selftest_pair(root, tokenizer: str = "words"):
    """The selftest's target and its perturbed draft, saved as root/target and root/draft: the
    pair the stack tests serve (its exact law is enumerable). -> the target. ``tokenizer``:
    "words" (token i is the text "wi") or "chars" (the selftest's byte-level CHAR_TOKENS, which a
    grammar engine reads: for structured output)."""
    from specdec.apps.selftest import CHAR_TOKENS, DRAFT_SEED, build_target
    from specdec.modeling.tiny import char_tokenizer, perturbed, word_tokenizer

    target = build_target()
    target.save_pretrained(root / "target")
    perturbed(target, scale=0.04, seed=DRAFT_SEED).save_pretrained(root / "draft")
    for name in ("target", "draft"):
        if tokenizer == "chars":
            char_tokenizer(list(CHAR_TOKENS)).save_pretrained(root / name)
        else:
            word_tokenizer(target.config.vocab_size).save_pretrained(root / name)
    return target


def greedy_continuations(model, prompts, tokens: int) -> list[list[int]]:
    """transformers' own greedy continuation of each prompt, exactly ``tokens`` long."""
    import torch

    settings = {"do_sample": False, "max_new_tokens": tokens, "min_new_tokens": tokens, "pad_token_id": 0}
    return [model.generate(torch.tensor([p]), **settings)[0, len(p) :].tolist() for p in prompts]


@contextlib.contextmanager
def http_api_alone(keys=None, tls=None):
    """The real HTTP API (uvicorn, the OpenAI routes, the front) on a free port of 127.0.0.1,
    with API ``keys`` and ``tls`` (a Security); yields the port. Its request path is never
    started: for what the API's door does before a request reaches it."""
    from coordinator.config import CoordinatorConfig
    from coordinator.front import CoordinatorFront, LocalBackend
    from coordinator.http_server import HttpServer
    from specdec.apps.launcher import free_port

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port = free_port()
    backend = LocalBackend(CoordinatorConfig(target_address="127.0.0.1:9"))
    front = CoordinatorFront(backend, model_name="tiny", keys=keys)
    started = HttpServer.start(front, "tiny", "127.0.0.1", port, tls)
    server = asyncio.run_coroutine_threadsafe(started, loop).result(60)
    try:
        yield port
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


# -- the fault suites' streams (tests/test_faults.py, tests/test_supervision.py) ------------------
RETRYABLE = frozenset({"UNAVAILABLE", "ABORTED"})  # what a client resumes after


def save_fault_pair(root):
    """The fault suites' tiny pair (vocabulary 32, 4,096 positions: room for their long
    streams), saved under ``root``. -> (target, draft) folders."""
    return save_tiny_pair(
        root, 32, seed=41, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_positions=4096
    )


def long_greedy(tokens: int, rid: str = "", resume_from_index: int = 0) -> pb.GenerateRequest:
    """A greedy request of exactly ``tokens`` tokens (ignore_eos) at k = 2 every step: long
    enough for a fault to land mid-stream, its tokens fixed by the prompt alone."""
    return request(
        [3, 1, 4, 1],
        k=2,
        adaptive=False,
        temperature=0.0,
        max_new_tokens=tokens,
        ignore_eos=True,
        request_id=rid,
        resume_from_index=resume_from_index,
    )


def stream_resuming(
    address: str,
    rid: str,
    tokens_wanted: int,
    on_first: Callable[[], None] | None = None,
    patience: float = 240.0,
    keep_trying: Callable[[], bool] = lambda: True,
) -> tuple[list[int], list[str]]:
    """Stream request ``rid`` (:func:`long_greedy`), calling ``on_first`` once after its first
    tokens; after a retryable status, resume from the tokens received so far, for up to
    ``patience`` seconds (a killed process is back once its restart has loaded the model) and
    while ``keep_trying()``. Stops at a status that is not retryable. -> (tokens, "CODE: details"
    of each status seen)."""
    tokens: list[int] = []
    errors: list[str] = []
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        try:
            for chunk in stub(address).GenerateStream(long_greedy(tokens_wanted, rid, len(tokens)), timeout=300):
                tokens.extend(chunk.token_ids)
                if on_first is not None and tokens:
                    on_first()
                    on_first = None
            break
        except grpc.RpcError as exc:
            errors.append(f"{exc.code().name}: {exc.details()}")
            if exc.code().name not in RETRYABLE or not keep_trying():
                break
            time.sleep(0.5)
    return tokens, errors
