"""The OpenAI-compatible HTTP API, for real: the `openai` package (and raw HTTP for what it will
not send) against the stack's coordinator, on tiny random models with a word tokenizer that has
a chat template; every answer checked against the gRPC API's for the same request."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from collections import Counter

import grpc
import httpx
import openai
import pytest
import torch
from stack_util import live_sessions, request, stub

from specdec.apps.launcher import local_stack
from specdec.apps.selftest import BASE_SEED, CASES, DRAFT_SEED, build_target, case_params, case_runs, exact_law, judge
from specdec.modeling.tiny import perturbed, word_tokenizer
from specdec.v1 import coordinator_pb2 as pb

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HTTP_RUNS = int(os.environ.get("SPECDEC_HTTP_RUNS", "400"))
# role markers as words of the vocabulary, so the template's output tokenizes
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}w3{% elif m['role'] == 'user' %}w1{% else %}w2{% endif %} {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}w2{% endif %}"
)
LONG = 16384  # context and max_new_tokens limit of this stack
FIXED_K = {"speculation": {"num_speculative_tokens": 2, "adaptive": False}}  # seeded: one schedule
STALL_S = 3  # a streaming client that reads nothing this long has its generation stopped


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("http-models")
    target = build_target()
    # a long context (the same weights: RoPE does not depend on it) so a generation can outlast
    # a client that hangs up
    target.config.max_position_embeddings = LONG
    target.save_pretrained(root / "target")
    perturbed(target, scale=0.04, seed=DRAFT_SEED).save_pretrained(root / "draft")
    for name in ("target", "draft"):
        tokenizer = word_tokenizer(target.config.vocab_size)
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(root / name)
    with local_stack(
        str(root / "target"),
        str(root / "draft"),
        num_speculative_tokens=2,
        log_dir=tmp_path_factory.mktemp("http-logs"),
        extra_target=["--threads", "1"],
        extra_draft=["--threads", "1"],
        extra_coordinator=[
            "--served-model-name",
            "tiny",
            "--max-new-tokens-limit",
            str(LONG),
            "--stall-timeout",
            str(STALL_S),
        ],
    ) as s:
        s.target = target
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="-", max_retries=0, timeout=120)


def ids(text: str) -> list[int]:
    """Token ids of the word tokenizer's text ("w5 w7" -> [5, 7])."""
    return [int(word[1:]) for word in text.split()]


def grpc_tokens(stack, **kwargs) -> pb.GenerateResponse:
    return stub(stack.coordinator_address).Generate(request(**kwargs), timeout=120)


def test_models_and_health(stack, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with urllib.request.urlopen(f"{stack.http_url}/health", timeout=10) as r:
        assert r.status == 200 and json.load(r)["status"] == "ok"


def test_usage_reports_the_prompt_tokens_copied_from_the_prefix_cache(stack, client):
    """OpenAI's usage.prompt_tokens_details.cached_tokens: the prompt positions the target copied
    from its prefix cache (whole blocks of 16) -- none the first time a prompt is seen in the
    request's scope (its cache_salt here; no key is configured), its whole blocks the next time,
    streamed (in the usage chunk) or not."""
    from specdec.apps.selftest import VOCAB

    prompt = " ".join(f"w{(11 * i + 5) % VOCAB}" for i in range(40))
    salted = {"cache_salt": "tenant-x"}
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, extra_body=salted)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, extra_body=salted)
    whole_blocks = 16 * ((again.usage.prompt_tokens - 1) // 16)  # the last position is fed by the first step
    assert whole_blocks == 32
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == whole_blocks
    assert again.model_extra["specdec"]["choices"][0]["cached_prompt_tokens"] == whole_blocks
    usage = {"include_usage": True}
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options=usage,
            extra_body=salted,
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == whole_blocks
    # cache_salt (vLLM's field) scopes the prefix cache: another salt sees none of it, even the
    # exact prompt -- no client can learn from cached_tokens what another client sent -- and
    # requests of the same salt share their own copy (issue 42, item 6)
    other = [
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=4, temperature=0, extra_body={"cache_salt": "tenant-y"}
        )
        for _ in range(2)
    ]
    assert [r.usage.prompt_tokens_details.cached_tokens for r in other] == [0, whole_blocks]
    assert ids(other[0].choices[0].text) == ids(first.choices[0].text)  # the scope changes nothing else


def test_a_request_without_a_scope_of_its_own_is_told_no_cache_hits(stack, client):
    """Issue 62, item 11: requests with neither an API key nor a cache_salt share one scope of
    the prefix cache, so their cache hits tell what other such clients sent: a guess of another's
    secret prompt was told 16 cached tokens when wrong after its first block, 32 when right. Now
    such a request is told 0 (the server's default; --report-unscoped-cached-tokens opts in) on
    both APIs -- usage, the specdec extension, a stream's usage chunk, gRPC's stats -- and its
    tokens are the same."""
    from specdec.apps.selftest import VOCAB

    secret = [f"w{(13 * i + 7) % VOCAB}" for i in range(40)]
    wrong = secret[:16] + [f"w{(3 * i + 1) % VOCAB}" for i in range(24)]  # its first block right
    victim = client.completions.create(model="tiny", prompt=" ".join(secret), max_tokens=4, temperature=0)
    for guess in (wrong, secret):
        told = client.completions.create(model="tiny", prompt=" ".join(guess), max_tokens=4, temperature=0)
        assert told.usage.prompt_tokens_details.cached_tokens == 0, guess
        assert told.model_extra["specdec"]["choices"][0]["cached_prompt_tokens"] == 0
        streamed = list(
            client.completions.create(
                model="tiny",
                prompt=" ".join(guess),
                max_tokens=4,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert streamed[-1].usage.prompt_tokens_details.cached_tokens == 0
        over_grpc = grpc_tokens(stack, prompt=" ".join(guess), temperature=0.0, max_new_tokens=4)
        assert over_grpc.stats.cached_prompt_tokens == 0
    assert ids(told.choices[0].text) == ids(victim.choices[0].text) == list(over_grpc.token_ids)


def test_greedy_completion_equals_the_grpc_api_streamed_or_not(stack, client):
    want = grpc_tokens(stack, prompt="w5 w6 w7", temperature=0.0, max_new_tokens=12, ignore_eos=True)
    got = client.completions.create(
        model="tiny", prompt="w5 w6 w7", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert ids(got.choices[0].text) == list(want.token_ids) and len(want.token_ids) == 12
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == 3 and got.usage.completion_tokens == 12
    stats = got.model_extra["specdec"]["choices"][0]
    assert stats["target_passes"] > 0 and stats["policy"] in ("fixed", "adaptive", "load_aware")
    pieces, finish = [], None
    for chunk in client.completions.create(
        model="tiny",
        prompt="w5 w6 w7",
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        else:
            assert chunk.usage.completion_tokens == 12  # the usage chunk, last
    assert ids("".join(pieces)) == list(want.token_ids) and finish == "length"
    echoed = client.completions.create(
        prompt="w5 w6 w7", model="tiny", max_tokens=2, temperature=0, echo=True, extra_body={"ignore_eos": True}
    )
    text = echoed.choices[0].text
    assert text.startswith("w5 w6 w7") and ids(text[len("w5 w6 w7") :]) == list(want.token_ids)[:2]


def test_chat_goes_through_the_template_multi_turn_and_equals_grpc(stack, client):
    messages = [
        {"role": "system", "content": "w9"},
        {"role": "user", "content": "w4 w5"},
        {"role": "assistant", "content": "w6"},
        {"role": "user", "content": "w7"},
    ]
    req = request(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    for m in messages:
        req.messages.add(role=m["role"], content=m["content"])
    want = stub(stack.coordinator_address).Generate(req, timeout=120)
    assert want.prompt_tokens == 10  # the template's words: w3 w9 w1 w4 w5 w2 w6 w1 w7 w2
    got = client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].message.role == "assistant"
    assert ids(got.choices[0].message.content) == list(want.token_ids)
    assert got.usage.prompt_tokens == want.prompt_tokens
    deltas, roles = [], []
    for chunk in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True, extra_body={"ignore_eos": True}
    ):
        delta = chunk.choices[0].delta
        roles += [delta.role] if delta.role else []
        deltas.append(delta.content or "")
    assert roles == ["assistant"] and ids("".join(deltas)) == list(want.token_ids)


def test_seeded_sampling_is_the_same_on_both_apis_and_n_gives_seed_plus_i(stack, client):
    sampling = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 8, "ignore_eos": True}
    want = [
        list(grpc_tokens(stack, prompt="w5 w6", seed=41 + i, k=2, adaptive=False, **sampling).token_ids)
        for i in range(3)
    ]
    got = client.completions.create(
        model="tiny",
        prompt="w5 w6",
        max_tokens=8,
        temperature=1.0,
        top_p=0.9,
        seed=41,
        n=3,
        extra_body={"ignore_eos": True, **FIXED_K},
    )
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [ids(c.text) for c in got.choices] == want
    assert len({tuple(w) for w in want}) > 1  # three different samples
    assert got.usage.prompt_tokens == 2 and got.usage.completion_tokens == 24  # the prompt counted once


def test_stop_strings_and_stop_token_ids(stack, client):
    base = ids(
        client.completions.create(
            model="tiny", prompt="w8 w9", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    token = base[3]
    cut = base.index(token)
    by_id = client.completions.create(
        model="tiny", prompt="w8 w9", max_tokens=12, temperature=0, extra_body={"stop_token_ids": [token]}
    )
    assert ids(by_id.choices[0].text) == base[: cut + 1] and by_id.choices[0].finish_reason == "stop"
    by_text = client.completions.create(model="tiny", prompt="w8 w9", max_tokens=12, temperature=0, stop=[f"w{token}"])
    assert by_text.choices[0].finish_reason == "stop"
    assert ids(by_text.choices[0].text) == base[:cut]  # the stop string is not returned
    # min_tokens: the stop token (here the greedy first token) cannot be generated before it
    first = base[0]
    held = client.completions.create(
        model="tiny",
        prompt="w8 w9",
        max_tokens=6,
        temperature=0,
        extra_body={"stop_token_ids": [first], "min_tokens": 3},
    )
    held_ids = ids(held.choices[0].text)
    assert held_ids[0] != first and first not in held_ids[:3] and len(held_ids) >= 3
    over_grpc = grpc_tokens(stack, prompt="w8 w9", temperature=0.0, max_new_tokens=12, stop_token_ids=[token])
    assert list(over_grpc.token_ids) == base[: cut + 1] and over_grpc.finish_reason == "stop"


def _sessions_clear(stack, within: float = 15.0) -> bool:
    target = next(c.address for c in stack.children if c.name == "target-0")
    draft = next(c.address for c in stack.children if c.name == "draft-0")
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if live_sessions(target, "target") == 0 and live_sessions(draft, "draft") == 0:
            return True
        time.sleep(0.2)
    return False


def _metric(stack, name: str) -> float:
    text = urllib.request.urlopen(f"{stack.http_url}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_a_client_that_disconnects_mid_stream_frees_both_sessions(stack):
    finished = _metric(stack, "specdec_requests_total")
    body = {
        "model": "tiny",
        "prompt": "w5 w6",
        "max_tokens": LONG - 100,  # tens of seconds of steps, unless cancelled
        "temperature": 1.0,
        "stream": True,
        "ignore_eos": True,
        **FIXED_K,
    }
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{stack.http_url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text":"w' in line:
                break  # tokens are flowing: hang up
    assert _sessions_clear(stack, within=3.0)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "w5"}], "max_tokens": LONG - 100}
    chat["ignore_eos"] = True
    with httpx.Client(timeout=3) as http, pytest.raises(httpx.TimeoutException):  # unary: the client gives up
        http.post(f"{stack.http_url}/v1/chat/completions", json={**chat, **FIXED_K})
    assert _sessions_clear(stack, within=3.0)
    assert _metric(stack, "specdec_requests_total") == finished  # both cut short: neither finished


def test_a_streaming_client_that_stops_reading_stalls_only_itself_and_is_stopped(stack, client):
    """Issue 42, item 4: a client that sends a long streaming request and reads nothing used to
    make the server generate and buffer the whole answer. Now its generation waits for it (a
    bounded buffer, and Ray's backpressure behind it), other requests go on, and after the stall
    timeout its generation is stopped and its sessions freed -- while its socket stays open; if
    it reads at last it gets what was buffered, then an error event, then [DONE]."""
    import socket
    import urllib.parse

    body = {
        "model": "tiny",
        "prompt": "w5 w6",
        "max_tokens": LONG - 100,
        "temperature": 1.0,
        "stream": True,
        "ignore_eos": True,
        "logprobs": 20,  # large events: the kernel's socket buffers fill after fewer tokens
        **FIXED_K,
    }
    data = json.dumps(body).encode()
    where = urllib.parse.urlsplit(stack.http_url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server feels it at once
    sock.connect((where.hostname, where.port))
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
    sock.sendall(head.encode() + b"\r\n\r\n" + data)
    try:
        other = client.completions.create(
            model="tiny", prompt="w7", max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
        )
        assert other.usage.completion_tokens == 20  # the stalled stream holds nobody else up
        assert _sessions_clear(stack, within=120.0)  # stopped after STALL_S, the socket still open
        sock.settimeout(30)
        received = b""
        while b"[DONE]" not in received:
            part = sock.recv(1 << 16)
            if not part:
                break
            received += part
    finally:
        sock.close()
    events = [json.loads(line[6:]) for line in received.decode().splitlines() if line.startswith("data: {")]
    delivered = sum(len(ids(e["choices"][0]["text"])) for e in events if e.get("choices"))
    assert 0 < delivered < LONG - 100, delivered  # generation paused with the reader, then stopped
    assert events[-1]["error"]["type"] == "timeout_error" and "read nothing" in events[-1]["error"]["message"]


def test_a_grpc_stream_whose_client_stops_reading_stalls_only_itself_and_is_stopped(stack):
    """Issue 62, item 12: GenerateStream's equivalent of the test above. A client that reads one
    chunk of a long stream and then nothing (its flow-control window kept small: the server
    feels it at once) used to hold its generation -- its sessions and its slot -- paused for as
    long as it kept the call open. Now the generation waits for it only --stall-timeout seconds
    (the stack's, 3) and is stopped, its sessions freed, while the call is still open; when the
    client reads again it gets the chunks that were waiting, then DEADLINE_EXCEEDED saying so."""
    from stack_util import request as grpc_request

    from specdec.v1 import coordinator_pb2_grpc

    slow = grpc.insecure_channel(stack.coordinator_address, options=[("grpc.http2.bdp_probe", 0)])
    long = grpc_request(
        [5, 6],
        k=2,
        adaptive=False,
        temperature=1.0,
        max_new_tokens=LONG - 100,
        ignore_eos=True,
        logprobs=20,  # large chunks: the window fills after fewer tokens
    )
    call = coordinator_pb2_grpc.CoordinatorStub(slow).GenerateStream(long, timeout=600)
    try:
        delivered = len(next(call).token_ids)
        other = grpc_tokens(stack, prompt="w7", temperature=0.0, max_new_tokens=20, ignore_eos=True)
        assert len(other.token_ids) == 20  # the stalled stream holds nobody else up
        assert _sessions_clear(stack, within=120.0)  # stopped after the stall timeout, the call still open
        with pytest.raises(grpc.RpcError) as stopped:
            for chunk in call:
                delivered += len(chunk.token_ids)
    finally:
        call.cancel()
        slow.close()
    assert 0 < delivered < LONG - 100, delivered  # generation paused with the reader, then stopped
    assert stopped.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, stopped.value
    assert "read nothing" in stopped.value.details()


def test_a_whole_answer_too_large_to_render_at_once_is_refused_naming_stream(stack):
    status, body = _post(
        stack,
        "/v1/completions",
        json.dumps({"model": "tiny", "prompt": "w5", "max_tokens": LONG - 100, "n": 16, "logprobs": 5}).encode(),
    )
    assert status == 400 and body["error"]["param"] == "stream" and "stream: true" in body["error"]["message"]


def test_after_a_429_no_choice_of_the_refused_request_runs_on(stack):
    """16 prompts x n = 16 is 256 generations, past the coordinator's 64 at once: the request is
    refused, and the choices that had started are stopped with it (they used to run to their
    end, unread)."""
    body = {"model": "tiny", "prompt": [f"w{i} w5" for i in range(16)], "n": 16, "max_tokens": LONG - 100}
    body["stream"] = True  # refused before its first event: a 429 all the same
    code, answer = _post(stack, "/v1/completions", json.dumps({**body, "ignore_eos": True, **FIXED_K}).encode())
    assert code == 429 and "requests in flight" in answer["error"]["message"], answer
    assert _sessions_clear(stack, within=30.0)


def test_json_nested_deeper_than_the_parser_goes_is_a_400(stack, client):
    for nested in (b"[" * 100_000 + b"]" * 100_000, b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"):
        code, answer = _post(stack, "/v1/completions", nested)
        assert code == 400 and "nested too deeply" in answer["error"]["message"], answer
    assert client.models.list().data  # and the server answers the next request


def _post(stack, path: str, data: bytes, content_type: str = "application/json"):
    req = urllib.request.Request(f"{stack.http_url}{path}", data=data, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": "tiny", "prompt": "w5", "tools": []}, 400, "tools"),
        ({"model": "tiny", "prompt": "w5", "top_p": 1.5}, 400, "top_p"),
        ({"model": "tiny", "prompt": "w5", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "w5", "max_tokens": 10**9}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "w5", "logit_bias": {"99999": 1.0}}, 400, "logit_bias"),
        ({"model": "tiny", "prompt": "w5", "logit_bias": {"5": 3e38}, "temperature": 0.5}, 400, "logit_bias"),
        ({"model": "tiny", "prompt": "w5", "repetition_penalty": 1e-38}, 400, "repetition_penalty"),
        ({"model": "tiny", "prompt": "w5", "logprobs": 21}, 400, "logprobs"),
        ({"model": "tiny", "prompt": "w5", "speculation": {"num_speculative_tokens": 99}}, 400, None),
        ({"model": "other", "prompt": "w5"}, 404, "model"),
        ({"model": "tiny"}, 400, "prompt"),
        # past int32 (the gRPC fields): 400 naming the field, not a protobuf error's 500
        ({"model": "tiny", "prompt": "w5", "max_tokens": 2**40}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "w5", "stop_token_ids": [2**40]}, 400, "stop_token_ids.0"),
        ({"model": "tiny", "prompt": "w5", "top_k": -(2**40)}, 400, "top_k"),
        ({"model": "tiny", "prompt": "w5", "min_tokens": 2**40}, 400, "min_tokens"),
        ({"model": "tiny", "prompt": [5, 2**40]}, 400, "prompt.1"),
    ],
)
def test_bad_input_gets_the_status_and_an_error_object_naming_the_field(stack, body, status, param):
    code, answer = _post(stack, "/v1/completions", json.dumps(body).encode())
    assert code == status, answer
    error = answer["error"]
    assert error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param, error
    else:
        assert "num_speculative_tokens" in error["message"]


def test_bodies_that_are_not_requests_are_refused_and_the_server_answers_the_next(stack, client):
    assert _post(stack, "/v1/completions", b"{not json")[0] == 400
    assert _post(stack, "/v1/completions", b"[1, 2]")[0] == 400
    assert _post(stack, "/v1/completions", b'{"prompt": "w5"}', content_type="text/plain")[0] == 415
    big = json.dumps({"model": "tiny", "prompt": "w5 " * ((10 << 20) // 3)}).encode()  # ~10 MB
    assert _post(stack, "/v1/completions", big)[0] == 413
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "w5"}])
    ok = client.completions.create(model="tiny", prompt="w5", max_tokens=3, temperature=0)
    assert len(ids(ok.choices[0].text)) >= 1
    tiny = client.completions.create(model="tiny", prompt="w5", max_tokens=3, temperature=1e-38)  # greedy, not NaN
    assert tiny.choices[0].text == ok.choices[0].text


def _vllm_metrics(stack) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{stack.http_url}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:"):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def test_metrics_on_the_http_port_count_http_requests(stack, client):
    before = _metric(stack, "specdec_emitted_tokens_total")
    vllm_before = _vllm_metrics(stack)
    got = client.completions.create(
        model="tiny", prompt="w5", max_tokens=5, temperature=0, extra_body={"ignore_eos": True, **FIXED_K}
    )
    assert _metric(stack, "specdec_emitted_tokens_total") - before == 5
    # and under vLLM's names and labels, so its dashboards work unchanged
    after, stats = _vllm_metrics(stack), got.model_extra["specdec"]["choices"][0]

    def grew(name):
        return after.get(name, 0) - vllm_before.get(name, 0)

    labels = '{engine="0",model_name="tiny"}'
    assert grew("vllm:generation_tokens_total" + labels) == 5 and grew("vllm:prompt_tokens_total" + labels) == 1
    assert grew('vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"}') == 1
    assert grew("vllm:spec_decode_num_draft_tokens_total" + labels) == stats["proposed_tokens"] > 0
    assert grew("vllm:spec_decode_num_accepted_tokens_total" + labels) == stats["accepted_tokens"]
    assert grew("vllm:e2e_request_latency_seconds_count" + labels) == 1
    assert after["vllm:num_requests_running" + labels] == 0 and after["vllm:num_requests_waiting" + labels] == 0
    # the public port's metrics name replicas by registry id, never by their internal addresses
    client.completions.create(model="tiny", prompt="w5", max_tokens=5)  # the load-aware policy reads the curves
    deadline = time.monotonic() + 15  # the cost curves are polled every few seconds
    text = ""
    while "specdec_cost_model_seconds{" not in text and time.monotonic() < deadline:
        time.sleep(0.5)
        text = urllib.request.urlopen(f"{stack.http_url}/metrics", timeout=10).read().decode()
    assert "specdec_cost_model_seconds{" in text
    assert re.search(r"\d+\.\d+\.\d+\.\d+:\d+", text) is None and "127.0.0.1" not in text


CASE = next(c for c in CASES if c.name == "top_k")


@pytest.mark.statistical
def test_sampled_law_through_the_http_api_is_the_targets(stack, client):
    """The selftest's top_k case through /v1/completions (token-id prompt, 16 seeded choices per
    request): chi-square at alpha = 1e-3 (the selftest's judge) against the enumerated law."""
    params = case_params(CASE)
    law = exact_law(stack.target, CASE.prompt, params, CASE.tokens)
    n = case_runs(CASE, HTTP_RUNS)
    per_request = 16
    observed: Counter = Counter()
    proposed = accepted = 0
    for start in range(0, n, per_request):
        got = client.completions.create(
            model="tiny",
            prompt=list(CASE.prompt),
            max_tokens=CASE.tokens,
            n=min(per_request, n - start),
            seed=BASE_SEED + start,
            extra_body={
                "ignore_eos": True,
                "speculation": {"num_speculative_tokens": CASE.k, "adaptive": False},
                # rejection sampling, not the seeded default (invariant sampling: selftest cases)
                "invariant": False,
                **CASE.params,
            },
        )
        for choice, stats in zip(got.choices, got.model_extra["specdec"]["choices"], strict=True):
            observed[tuple(ids(choice.text))] += 1
            proposed += stats["proposed_tokens"]
            accepted += stats["accepted_tokens"]
    assert sum(observed.values()) == n
    verdict = judge(CASE, observed, law, n, proposed, accepted)
    assert verdict.passed, verdict


def test_logprobs_are_the_targets_with_or_without_speculation_streamed_or_not(stack, client):
    from specdec.exact.sampling import SamplingParams, reported_logprobs, token_counts

    def completion(k, **extra):
        return client.completions.create(
            model="tiny",
            prompt="w5 w6 w7",
            max_tokens=10,
            logprobs=2,
            seed=5,
            extra_body={"ignore_eos": True, "speculation": {"num_speculative_tokens": k, "adaptive": False}},
            **extra,
        )

    spec, alone = completion(2, temperature=0), completion(0, temperature=0)
    assert spec.choices[0].text == alone.choices[0].text
    lp, lp_alone = spec.choices[0].logprobs, alone.choices[0].logprobs
    assert lp.tokens == alone.choices[0].logprobs.tokens and "".join(lp.tokens) == spec.choices[0].text.replace(" ", "")
    assert lp.token_logprobs == pytest.approx(lp_alone.token_logprobs, abs=1e-5)
    assert [list(t) for t in lp.top_logprobs] == [list(t) for t in lp_alone.top_logprobs] and len(
        lp.top_logprobs[0]
    ) == 2
    assert spec.model_extra["specdec"]["choices"][0]["accepted_tokens"] > 0
    over_grpc = grpc_tokens(
        stack, prompt="w5 w6 w7", temperature=0.0, max_new_tokens=10, ignore_eos=True, logprobs=2, k=2, adaptive=False
    )
    assert [e.logprob for e in over_grpc.logprobs] == pytest.approx(lp.token_logprobs, abs=1e-6)
    assert [e.token for e in over_grpc.logprobs] == lp.tokens and len(over_grpc.logprobs[0].top_ids) == 2
    # sampled: each token's logprob is the target's transformed law at its prefix
    sampled = completion(2, temperature=0.9, top_p=0.95)
    tokens = ids(sampled.choices[0].text)
    params, vocab = SamplingParams(temperature=0.9, top_p=0.95), stack.target.config.vocab_size
    want = []
    for i, t in enumerate(tokens):
        with torch.inference_mode():
            logits = stack.target(input_ids=torch.tensor([[5, 6, 7, *tokens[:i]]])).logits[0, -1]
        row = reported_logprobs(logits, params, token_counts(tokens[:i], vocab), token_counts([5, 6, 7], vocab) > 0)
        want.append(float(row[t]))
    assert sampled.choices[0].logprobs.token_logprobs == pytest.approx(want, abs=1e-4)
    streamed = []
    for chunk in completion(2, temperature=0.9, top_p=0.95, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed == pytest.approx(sampled.choices[0].logprobs.token_logprobs, abs=1e-6)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "w5"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert [ids(c.token)[0] for c in content] == ids(chat.choices[0].message.content)
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    assert all(bytes(c.bytes).decode() == c.token for c in content)


def test_a_load_generators_request_as_guidellm_sends_it(stack):
    """GuideLLM's completions body (vLLM's continuous_usage_stats, stop: null, ignore_eos):
    accepted, and every chunk carries the usage so far."""
    body = {
        "model": "tiny",
        "prompt": "w5 w6 w7",
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_tokens": 8,
        "stop": None,
        "ignore_eos": True,
    }
    events = []
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{stack.http_url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    with_text = [e for e in events if e["choices"] and e["choices"][0]["text"]]
    assert with_text and all(e["usage"]["prompt_tokens"] == 3 for e in with_text)
    so_far = [e["usage"]["completion_tokens"] for e in with_text]
    assert so_far == sorted(so_far) and events[-1]["usage"]["completion_tokens"] == 8


def test_a_huge_prompt_is_refused_before_tokenizing_and_stalls_nobody(stack, client):
    """Text that cannot fit the context whatever it tokenizes to is INVALID_ARGUMENT before the
    tokenizer runs (which runs off the event loop anyway); past the public port's receive limit,
    gRPC refuses the message itself."""
    import concurrent.futures

    huge = "w5 " * 100_000  # 300 k characters for a 16k-token context of tokens of <= 4 characters
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        refused = pool.submit(_post, stack, "/v1/completions", json.dumps({"model": "tiny", "prompt": huge}).encode())
        small = pool.submit(client.completions.create, model="tiny", prompt="w5", max_tokens=3, temperature=0)
        code, answer = refused.result(timeout=60)
        assert len(ids(small.result(timeout=60).choices[0].text)) >= 1
    assert code == 400 and answer["error"]["param"] == "prompt" and "cannot fit" in answer["error"]["message"]
    with pytest.raises(grpc.RpcError) as info:
        stub(stack.coordinator_address).Generate(request(prompt="w5 " * (2 << 20)), timeout=60)  # ~6 MB
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(grpc_tokens(stack, prompt="w5", temperature=0.0, max_new_tokens=2).token_ids) == 2  # still serving
