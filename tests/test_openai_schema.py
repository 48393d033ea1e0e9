"""The HTTP API's pure parts: the schema's translation to GenerateRequests and the one mapping
of failures to HTTP statuses."""

from __future__ import annotations

import pytest

from coordinator import openai_schema as schema
from coordinator.http_api import error_of
from specdec.errors import InvalidArgumentError, PeerError, ResourceExhaustedError, SessionNotFoundError


def completion(**body):
    return schema.completion_requests(schema.parse(schema.CompletionRequest, {"prompt": "hi", **body}), "cmpl-x")


def test_parameters_keep_their_meaning_on_the_grpc_request():
    (req,) = completion(max_tokens=7, temperature=0.5, top_k=-1, stop="END", stop_token_ids=[3], seed=9)
    s = req.sampling
    assert (s.max_new_tokens, s.temperature, s.top_k, list(s.stop), list(s.stop_token_ids), s.seed) == (
        7,
        0.5,
        0,  # vLLM's -1: off
        ["END"],
        [3],
        9,
    )
    assert req.request_id == "cmpl-x-0" and req.prompt == "hi"
    (ids,) = completion(prompt=[4, 5, 6])
    assert list(ids.prompt_token_ids) == [4, 5, 6] and not ids.prompt
    (bias,) = completion(logit_bias={"17": -100})
    assert dict(bias.sampling.logit_bias) == {17: -100.0}


def test_n_choices_are_seed_plus_i_and_prompts_come_first():
    reqs = completion(prompt=["a", "b"], n=3, seed=10)
    assert [r.prompt for r in reqs] == ["a"] * 3 + ["b"] * 3
    assert [r.sampling.seed for r in reqs] == [10, 11, 12, 10, 11, 12]
    assert len({r.request_id for r in reqs}) == 6
    unseeded = completion(n=2)
    assert not any(r.sampling.HasField("seed") for r in unseeded)  # each gets its own random seed


def test_chat_messages_and_speculation_extension():
    body = {
        "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        "max_completion_tokens": 5,
        "max_tokens": 50,
        "speculation": {"num_speculative_tokens": 3, "method": "ngram", "adaptive": False, "replayable": True},
        "invariant": True,
    }
    (req,) = schema.chat_requests(schema.parse(schema.ChatCompletionRequest, body), "chatcmpl-x")
    assert req.sampling.HasField("invariant") and req.sampling.invariant  # the extension reaches gRPC
    assert req.speculation.HasField("replayable") and req.speculation.replayable
    assert [(m.role, m.content) for m in req.messages] == [("system", "be brief"), ("user", "hi")]
    assert req.sampling.max_new_tokens == 5  # max_completion_tokens wins over the deprecated max_tokens
    assert (req.speculation.num_speculative_tokens, req.speculation.method, req.speculation.adaptive) == (
        3,
        "ngram",
        False,
    )


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompt": "hi", "functions": []}, "functions"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "n": 17}, "n"),
        ({"prompt": "hi", "stream": "yes"}, "stream"),
        ({"prompt": "hi", "speculation": {"k": 2}}, "speculation.k"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "best_of": 3}, "best_of"),
        ({"prompt": "hi", "logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"prompt": ["x"] * 17}, "prompt"),
        ({"prompt": "hi", "top_k": -2}, "top_k"),
        ({"prompt": "hi", "response_format": {"type": "yaml"}}, "response_format.type"),
        ({"prompt": "hi", "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"prompt": "hi", "structured_outputs": {}}, "structured_outputs"),
        ({"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"prompt": "hi", "structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        (
            {"prompt": "hi", "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
        ),
    ],
)
def test_unknown_unsupported_or_bad_fields_name_themselves(body, field):
    with pytest.raises(InvalidArgumentError) as info:
        schema.completion_requests(schema.parse(schema.CompletionRequest, body), "cmpl-x")
    assert info.value.field == field


def test_failures_map_to_http_statuses_with_the_field_as_http_spells_it():
    bad = error_of(InvalidArgumentError("sampling.max_new_tokens", "too many"))
    assert (bad.status, bad.kind, bad.param) == (400, "invalid_request_error", "max_tokens")
    assert error_of(InvalidArgumentError("sampling.top_p", "no")).param == "top_p"
    assert error_of(ResourceExhaustedError("64 requests in flight")).status == 429
    assert error_of(PeerError("UNAVAILABLE", "no target")).status == 503
    assert error_of(SessionNotFoundError("gone")).status == 404
    crash = error_of(RuntimeError("boom"))
    assert crash.status == 500 and "error id" in crash.message and "boom" not in crash.message  # logged, not sent


def test_structured_output_reaches_the_grpc_constraint():
    import json

    schema_ = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        ({"response_format": {"type": "json_object"}}, "json_object", True),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema_, "strict": True},
                }
            },
            "json_schema",
            schema_,
        ),
        ({"structured_outputs": {"json": schema_}}, "json_schema", schema_),
        ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
        ({"structured_outputs": {"grammar": 'start: "a"'}}, "grammar", 'start: "a"'),
    ]
    for body, kind, value in cases:
        (req,) = completion(**body)
        out = req.sampling.structured_output
        assert out.WhichOneof("constraint") == kind
        got = getattr(out, kind)
        got = json.loads(got) if kind == "json_schema" else list(got.choices) if kind == "choice" else got
        assert got == value
    (plain,) = completion(response_format={"type": "text"})
    assert not plain.sampling.HasField("structured_output")
