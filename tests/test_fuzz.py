"""A fuzz run of every API a client or a peer can reach (issue 24): the public gRPC API, the HTTP
API and the draft/target services' internal RPCs, on a real stack of processes (tiny models,
Redis, the coordinator with its Ray actor). Hypothesis draws the protobuf and JSON fields,
extreme values and garbage included, a fixed number of cases with a fixed seed (derandomized, so
CI runs the same cases every time).

For every case: an answer, never INTERNAL / UNKNOWN (HTTP 500) and never a hang; bad input gets
one of the statuses the README promises, naming the problem. After the run: no session left on
any service, and the server answers a normal request at once."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stack_util import live_sessions, request, save_tiny_pair

from specdec.apps.launcher import local_stack
from specdec.v1 import coordinator_pb2 as pb
from specdec.v1 import coordinator_pb2_grpc, draft_pb2, draft_pb2_grpc, engine_pb2, target_pb2, target_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VOCAB = 32
CASES = settings(
    max_examples=120,
    derandomize=True,  # the same cases in every run
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
# What bad input may get; never INTERNAL, UNKNOWN or DEADLINE_EXCEEDED (a hang).
CLIENT_ERRORS = {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "NOT_FOUND", "ALREADY_EXISTS", "FAILED_PRECONDITION"}
HTTP_CLIENT_ERRORS = {400, 404, 405, 413, 422, 429}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    target, draft = save_tiny_pair(
        tmp_path_factory.mktemp("fuzz-models"),
        VOCAB,
        seed=31,
        draft_scale=0.05,
        chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}",  # chat works too
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        max_positions=256,
    )
    with local_stack(
        target,
        draft,
        num_speculative_tokens=3,
        log_dir=tmp_path_factory.mktemp("fuzz-logs"),
        extra_target=["--threads", "1"],
        extra_draft=["--threads", "1"],
    ) as s:
        yield s


def replica(stack, kind: str) -> str:
    return next(c.address for c in stack.children if c.name == f"{kind}-0")


# -- strategies --------------------------------------------------------------------------------------
INT32 = st.integers(-(1 << 31), (1 << 31) - 1)
SMALL_OR_EXTREME = st.one_of(st.integers(-3, 40), INT32)
FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, -0.0, 1e-38, 1e-30, 3.4e38, -3.4e38, 0.5, 1.0, 2.0]),
)
TOKENS = st.lists(st.one_of(st.integers(0, VOCAB - 1), INT32), max_size=40)
TEXT = st.one_of(st.text(max_size=60), st.sampled_from(["", "w1 w2 w3", "\x00", "w5 " * 200]))


@st.composite
def sampling(draw) -> pb.SamplingParams:
    msg = pb.SamplingParams()
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if draw(st.booleans()):
            setattr(msg, name, draw(FLOATS))
    for name in ("top_k", "min_tokens"):
        if draw(st.booleans()):
            setattr(msg, name, draw(SMALL_OR_EXTREME))
    msg.max_new_tokens = draw(st.one_of(st.integers(-2, 24), INT32))
    if draw(st.booleans()):
        msg.seed = draw(st.integers(0, (1 << 64) - 1))
    if draw(st.booleans()):
        msg.logprobs = draw(SMALL_OR_EXTREME)
    msg.ignore_eos = draw(st.booleans())
    msg.stop.extend(draw(st.lists(TEXT, max_size=3)))
    msg.stop_token_ids.extend(draw(st.lists(SMALL_OR_EXTREME, max_size=3)))
    for token, bias in draw(st.dictionaries(SMALL_OR_EXTREME, FLOATS, max_size=4)).items():
        msg.logit_bias[token] = bias
    return msg


PLAUSIBLE = {  # each sampling field's valid range, so a case can be right but for one field
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "min_p": st.floats(0, 0.5),
    "repetition_penalty": st.floats(0.5, 2),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "top_k": st.integers(0, 40),
    "min_tokens": st.integers(0, 4),
    "logprobs": st.integers(0, 5),
}


@st.composite
def generate_request(draw) -> pb.GenerateRequest:
    if not draw(st.booleans()):  # valid, then a few fields drawn from their range or from anywhere
        req = pb.GenerateRequest(prompt_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)))
        req.sampling.max_new_tokens = draw(st.integers(1, 16))
        for name in draw(st.lists(st.sampled_from(sorted(PLAUSIBLE)), unique=True, max_size=4)):
            integer = name in ("top_k", "min_tokens", "logprobs")
            setattr(
                req.sampling, name, draw(PLAUSIBLE[name] if draw(st.integers(0, 3)) else INT32 if integer else FLOATS)
            )
        if draw(st.booleans()):
            req.speculation.num_speculative_tokens = draw(st.integers(0, 6))
        req.speculation.method = draw(st.sampled_from(["", "draft_model", "ngram", "none"]))
        return req
    req = pb.GenerateRequest(sampling=draw(sampling()))
    which = draw(st.sampled_from(["ids", "text", "messages", "both", "none"]))
    if which in ("ids", "both"):
        req.prompt_token_ids.extend(draw(TOKENS))
    if which in ("text", "both"):
        req.prompt = draw(TEXT)
    if which == "messages":
        for role, content in draw(st.lists(st.tuples(st.sampled_from(["system", "user", "assistant", "x"]), TEXT))):
            req.messages.add(role=role, content=content)
        req.apply_chat_template = draw(st.booleans())
    if draw(st.booleans()):
        req.speculation.num_speculative_tokens = draw(SMALL_OR_EXTREME)
    req.speculation.method = draw(st.sampled_from(["", "draft_model", "ngram", "none", "bogus"]))
    if draw(st.booleans()):
        req.speculation.adaptive = draw(st.booleans())
    if draw(st.integers(0, 3)) == 0:
        req.request_id = draw(st.text(max_size=300))
        req.resume_from_index = draw(st.one_of(st.integers(-1, 5), INT32))
    return req


JSON_VALUES = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(1 << 40), 1 << 40),
        st.sampled_from([(1 << 31), -(1 << 31) - 1, (1 << 63), (1 << 64), -(1 << 70)]),  # past int32, int64
        st.floats(allow_nan=False),
        st.text(),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=12,
)
HTTP_FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "seed", "stop",
    "stop_token_ids", "min_tokens", "ignore_eos", "n", "logprobs", "top_logprobs", "echo", "stream",
    "stream_options", "speculation", "user", "cache_salt", "invariant",
]  # fmt: skip
GOOD_VALUES = {
    "prompt": st.one_of(TEXT, TOKENS),
    "messages": st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "bogus"]), "content": TEXT})
    ),
    "max_tokens": st.integers(-2, 20),
    "temperature": st.floats(-1, 3),
    "n": st.integers(-1, 20),
    "stream": st.booleans(),
}


@st.composite
def http_body(draw, path: str, model: str):
    """Half the cases start from a valid request (so the success paths are fuzzed too), then a
    few fields get drawn values, garbage or not."""
    body: dict = {}
    if not draw(st.booleans()):  # hypothesis starts from False: the valid base first
        body = {"model": model, "max_tokens": draw(st.integers(1, 12))}
        if path.endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": draw(st.sampled_from(["w1 w2", "w3", "w4 w5 w6"]))}]
        else:
            body["prompt"] = draw(st.sampled_from(["w1 w2", "w3", [1, 2, 3]]))
    for name in draw(st.lists(st.sampled_from(HTTP_FIELDS), unique=True, max_size=2 if body else 8)):
        body[name] = draw(GOOD_VALUES[name]) if name in GOOD_VALUES and draw(st.booleans()) else draw(JSON_VALUES)
    if draw(st.integers(0, 4)) == 4:
        body[draw(st.text(min_size=1, max_size=12))] = draw(JSON_VALUES)  # an unknown field
    return body


# -- the public gRPC API -----------------------------------------------------------------------------
def test_fuzz_public_grpc_api(stack):
    channel = grpc.insecure_channel(stack.coordinator_address)
    client = coordinator_pb2_grpc.CoordinatorStub(channel)
    seen: dict[str, int] = {}

    @CASES
    @given(req=generate_request(), streaming=st.booleans())
    def case(req, streaming):
        try:
            if streaming:
                for _ in client.GenerateStream(req, timeout=60):
                    pass
            else:
                client.Generate(req, timeout=60)
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
            assert code in CLIENT_ERRORS, (code, exc.details(), req)
            assert exc.details(), req  # it names the problem
        seen[code] = seen.get(code, 0) + 1

    case()
    print("public gRPC statuses:", seen)  # for the record (pytest -s)
    assert seen.get("OK", 0) > 0 and seen.get("INVALID_ARGUMENT", 0) > 0, seen  # both paths were exercised
    after_a_fuzz_run_nothing_is_left_and_a_request_works(stack, client)


def after_a_fuzz_run_nothing_is_left_and_a_request_works(stack, client):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
        live_sessions(replica(stack, "target"), "target") or live_sessions(replica(stack, "draft"), "draft")
    ):
        time.sleep(0.2)
    assert live_sessions(replica(stack, "target"), "target") == 0
    assert live_sessions(replica(stack, "draft"), "draft") == 0
    reply = client.Generate(request([1, 2, 3], k=2, temperature=0.0, max_new_tokens=8, ignore_eos=True), timeout=30)
    assert len(reply.token_ids) == 8


# -- the HTTP API -----------------------------------------------------------------------------------
def test_fuzz_http_api(stack):
    seen: dict[int, int] = {}

    with urllib.request.urlopen(stack.http_url + "/v1/models", timeout=30) as reply:
        model = json.loads(reply.read())["data"][0]["id"]
    paths = st.sampled_from(["/v1/completions", "/v1/chat/completions"])

    @CASES
    @given(
        call=paths.flatmap(lambda p: st.tuples(st.just(p), http_body(p, model))),
        cut=st.integers(0, 9),
        depth=st.sampled_from([64, 5_000, 200_000]),
    )
    def case(call, cut, depth):
        path, body = call
        data = json.dumps(body).encode()
        if cut == 9:
            data = data[: len(data) // 2]  # malformed JSON too
        if cut == 8:  # a field (or the whole body) nested deeper than any parser goes
            nested = b"[" * depth + b"]" * depth
            data = data[:-1] + b', "prompt": ' + nested + b"}" if len(data) > 2 else nested
        post = urllib.request.Request(
            stack.http_url + path, data=data, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(post, timeout=60) as reply:
                status, payload = reply.status, reply.read()
        except urllib.error.HTTPError as exc:
            status, payload = exc.code, exc.read()
        seen[status] = seen.get(status, 0) + 1
        assert status == 200 or status in HTTP_CLIENT_ERRORS, (status, payload[:300], body)
        if status != 200:
            error = json.loads(payload)["error"]
            assert error["message"] and error["type"], error

    case()
    print("HTTP statuses:", seen)
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 0, seen
    client = coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(stack.coordinator_address))
    after_a_fuzz_run_nothing_is_left_and_a_request_works(stack, client)


# -- the internal RPCs ------------------------------------------------------------------------------
@st.composite
def distribution(draw) -> engine_pb2.SparseDistribution:
    ids = draw(st.lists(SMALL_OR_EXTREME, max_size=6))
    probs = draw(st.lists(FLOATS, min_size=len(ids), max_size=len(ids) + draw(st.integers(0, 1))))
    return engine_pb2.SparseDistribution(token_ids=ids, probs=probs)


@st.composite
def commit(draw) -> engine_pb2.Commit:
    return engine_pb2.Commit(
        step=draw(st.one_of(st.integers(-1, 4), st.integers(-(1 << 63), (1 << 63) - 1))),
        base_len=draw(st.one_of(st.integers(-1, 12), st.integers(-(1 << 63), (1 << 63) - 1))),
        tokens=draw(TOKENS),
    )


SESSION_IDS = st.one_of(st.just("fuzz-a"), st.sampled_from(["fuzz-a", "fuzz-b", "", "fuzz-a/../x", "x" * 300]))


@st.composite
def internal_call(draw):
    kind = draw(st.sampled_from(["target", "draft"]))
    method = draw(st.sampled_from(["StartSession", "Commit", "Release", "Step"]))
    session = draw(SESSION_IDS)
    if method == "StartSession" and draw(st.booleans()):  # a valid start, for the calls after it
        params = pb.SamplingParams(seed=draw(st.integers(0, 99)), max_new_tokens=8, temperature=draw(FLOATS))
        return (
            kind,
            method,
            engine_pb2.StartSessionRequest(session_id=session, prompt_token_ids=[1, 2, 3], sampling=params),
        )
    if method == "StartSession":
        msg = engine_pb2.StartSessionRequest(
            session_id=session,
            prompt_token_ids=draw(TOKENS),
            sampling=draw(sampling()),
            prompt_length=draw(SMALL_OR_EXTREME),
            eos_token_ids=draw(st.lists(SMALL_OR_EXTREME, max_size=3)),
        )
        if draw(st.integers(0, 3)) == 0:
            msg.features.rows, msg.features.dim = draw(SMALL_OR_EXTREME), draw(SMALL_OR_EXTREME)
            msg.features.dtype = draw(st.sampled_from(["float32", "bfloat16", "bogus", ""]))
            msg.features.data = draw(st.binary(max_size=64))
        return kind, method, msg
    if method == "Commit":
        return kind, method, engine_pb2.CommitRequest(session_id=session, commit=draw(commit()))
    if method == "Release":
        return kind, method, engine_pb2.ReleaseRequest(session_id=session)
    if kind == "draft":
        step = draw(st.one_of(st.integers(0, 3), INT32))
        msg = draft_pb2.ProposeRequest(session_id=session, step=step, k=draw(st.one_of(st.integers(0, 6), INT32)))
        if draw(st.booleans()):
            msg.commit.CopyFrom(draw(commit()))
        return kind, "Propose", msg
    header = target_pb2.VerifyChunk(session_id=session, step=draw(st.one_of(st.integers(0, 3), INT32)))
    if draw(st.booleans()):
        header.commit.CopyFrom(draw(commit()))
    tokens = [
        draft_pb2.ProposedToken(token_id=draw(SMALL_OR_EXTREME), q=draw(distribution()))
        for _ in range(draw(st.integers(0, 5)))
    ]
    if tokens and draw(st.booleans()):  # a well-formed block: a token and a q that holds it
        tokens = [draft_pb2.ProposedToken(token_id=5, q=engine_pb2.SparseDistribution(token_ids=[5], probs=[1.0]))]
    return kind, "Verify", [header, target_pb2.VerifyChunk(proposals=tokens)]


def start_both(target, draft, session: str) -> None:
    """A valid session on both services, as a coordinator would start it (the fuzzed calls then
    reach the step paths, not only NOT_FOUND)."""
    start = engine_pb2.StartSessionRequest(
        session_id=session, prompt_token_ids=[1, 2, 3], sampling=pb.SamplingParams(seed=7, max_new_tokens=8)
    )
    target.StartSession(start, timeout=30)
    draft.StartSession(start, timeout=30)


def test_fuzz_internal_rpcs(stack):
    target = target_pb2_grpc.TargetStub(grpc.insecure_channel(replica(stack, "target")))
    draft = draft_pb2_grpc.DraftStub(grpc.insecure_channel(replica(stack, "draft")))
    seen: dict[str, int] = {}

    @CASES
    @given(calls=st.lists(internal_call(), min_size=1, max_size=6))
    def case(calls):
        start_both(target, draft, "fuzz-a")
        for kind, method, msg in calls:
            stub = target if kind == "target" else draft
            try:
                if method == "Verify":
                    stub.Verify(iter(msg), timeout=30)
                else:
                    getattr(stub, method)(msg, timeout=30)
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
                assert code in CLIENT_ERRORS, (code, exc.details(), kind, method, msg)
            seen[f"{method}:{code}"] = seen.get(f"{method}:{code}", 0) + 1
        for session in ("fuzz-a", "fuzz-b", "", "fuzz-a/../x", "x" * 300):  # what a coordinator would free
            for stub in (target, draft):
                stub.Release(engine_pb2.ReleaseRequest(session_id=session), timeout=30)

    case()
    print("internal RPC statuses:", seen)
    # the fuzzed calls got past validation into the sessions' step checks, not only NOT_FOUND
    stepped = {f"{m}:{c}" for m in ("Propose", "Verify", "Commit") for c in ("OK", "FAILED_PRECONDITION")}
    assert "StartSession:OK" in seen and stepped & set(seen), seen
    client = coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(stack.coordinator_address))
    after_a_fuzz_run_nothing_is_left_and_a_request_works(stack, client)


# -- structured-output constraints (issue 62) -----------------------------------------------------
# Shapes that stress what compiles a constraint -- nesting depth, rule count, size, repetition
# counts -- drawn around the bounds; on the selftest's byte-level vocabulary, which llguidance reads.
COUNTS = st.one_of(st.integers(0, 12), st.integers(0, 6000), st.sampled_from([999, 1000, 1001, 2000, 2800, 4800, 9000]))


def nested_schema(depth: int, field: str) -> str:
    return f'{{"type":"object","properties":{{"{field}":' * depth + '{"type":"string"}' + "}}" * depth


SHAPES = {
    "lark_chain": lambda n, m: "\n".join(
        ["start: r0", *(f'r{i}: "{"ab"[i % 2]}" | r{i + 1}' for i in range(n)), f'r{n}: "x"']
    ),
    "gbnf_chain": lambda n, m: "\n".join(
        ["root ::= r0", *(f'r{i} ::= "{"cd"[i % 2]}" | r{i + 1}' for i in range(n)), f'r{n} ::= "y"']
    ),
    "lark_parens": lambda n, m: "start: " + "(" * n + '"a"' + ")" * n,
    "lark_recursion": lambda n, m: f'start: "a" start{"?" * (m % 2)} | ' + " ".join(['"b"'] * max(n % 500, 1)),
    "regex_parens": lambda n, m: "(" * n + "a" + ")" * n,
    "regex_counts": lambda n, m: f"(a{{{n}}}){{{m}}}",
    "regex_range": lambda n, m: f"[ab]{{{min(n, m)},{max(n, m)}}}(xy|yz){{{m % 700}}}",
    "regex_alternatives": lambda n, m: "|".join("ab" * (i % 40) + "c" for i in range(n % 4000)),
    "schema_depth": lambda n, m: nested_schema(n, "a"),
    "schema_items": lambda n, m: '{"type":"array","items":' * n + '{"type":"string"}' + "}" * n,
    "schema_refs": lambda n, m: (
        '{"$ref":"#/$defs/d0","$defs":{'
        + ",".join(f'"d{i}":{{"$ref":"#/$defs/d{i + 1}"}}' for i in range(n))
        + f',"d{n}":{{"type":"string","maxLength":{m}}}}}}}'
    ),
    "schema_any_of": lambda n, m: (
        '{"anyOf":[' + ",".join(f'{{"const":"{"ab" * (i % 9)}{i}"}}' for i in range(n)) + "]}"
    ),
    "json_brackets": lambda n, m: "[" * n + "]" * n,
    "choices": lambda n, m: json.dumps(["ab" * (i % 7) + str(i) for i in range(n % 300)]),
}
KIND_OF = {"lark": "grammar", "gbnf": "grammar", "rege": "regex", "sche": "json_schema", "json": "json_schema"}


@st.composite
def constraint_request(draw) -> pb.GenerateRequest:
    from specdec.exact.constraint import MAX_SPEC_CHARS

    shape = draw(st.sampled_from(sorted(SHAPES)))
    spec = SHAPES[shape](draw(COUNTS), draw(COUNTS))
    spec = spec[: MAX_SPEC_CHARS + draw(st.integers(-64, 64))] if draw(st.booleans()) else spec  # cut at the bound
    structured = pb.StructuredOutput()
    if shape == "choices":
        structured.choice.choices.extend(json.loads(spec) if spec.endswith("]") else [spec])
    else:
        setattr(structured, KIND_OF[shape[:4]], spec)
    req = pb.GenerateRequest(prompt_token_ids=draw(st.lists(st.integers(1, 15), min_size=1, max_size=6)))
    req.sampling.max_new_tokens = draw(st.integers(1, 8))
    req.sampling.temperature = draw(st.sampled_from([0.0, 0.8]))
    req.sampling.structured_output.CopyFrom(structured)
    req.speculation.num_speculative_tokens = draw(st.sampled_from([0, 3]))
    return req


@pytest.fixture(scope="module")
def constrained_stack(tmp_path_factory):
    from stack_util import save_selftest_pair

    root = tmp_path_factory.mktemp("fuzz-constraints")
    save_selftest_pair(root, tokenizer="chars")
    with local_stack(
        str(root / "target"),
        str(root / "draft"),
        num_speculative_tokens=3,
        log_dir=tmp_path_factory.mktemp("fuzz-constraint-logs"),
        extra_target=["--threads", "1"],
        extra_draft=["--threads", "1"],
    ) as s:
        yield s


def test_fuzz_constraints(constrained_stack):
    client = coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(constrained_stack.coordinator_address))
    seen: dict[str, int] = {}

    @settings(CASES, max_examples=100)
    @given(req=constraint_request())
    def case(req):
        try:
            client.Generate(req, timeout=120)
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
            assert code in CLIENT_ERRORS, (code, exc.details()[:500])
            assert exc.details().startswith("sampling.") and len(exc.details()) < 1000, exc.details()[:1200]
        seen[code] = seen.get(code, 0) + 1

    case()
    print("constraint statuses:", seen)
    assert seen.get("OK", 0) > 0 and seen.get("INVALID_ARGUMENT", 0) > 0, seen
    after_a_fuzz_run_nothing_is_left_and_a_request_works(constrained_stack, client)
