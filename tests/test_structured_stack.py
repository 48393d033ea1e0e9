"""Structured output through the stack (issue 45): the default target and its shipped draft as
separate services, the coordinator on Ray, gRPC requests with `sampling.structured_output`.
Greedy constrained output with speculation equals target-only's, token for token, and is what
the constraint admits (a schema-valid JSON document, a regex match, one of the choices); a seed
fixes a sampled constrained request's tokens; a constraint that does not compile is
INVALID_ARGUMENT naming it; the real `openai` client gets the same document through
`response_format` (and vLLM's `structured_outputs`), and a 400 for a bad schema."""

from __future__ import annotations

import json
import re

import grpc
import pytest
from stack_util import request, stub

from specdec.apps.launcher import local_stack
from specdec.v1 import coordinator_pb2 as pb

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "colour": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}
PROMPT = "Describe a cat called Tom as JSON with its name, age and colour."


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with local_stack(log_dir=tmp_path_factory.mktemp("structured")) as running:
        yield running


def generate(
    stack, structured: pb.StructuredOutput, k: int | None, forced: bool | None = None, **sampling
) -> pb.GenerateResponse:
    req = request(None, prompt=PROMPT, k=k, method="none" if k == 0 else "", adaptive=False, **sampling)
    req.apply_chat_template = True
    if forced is not None:
        req.speculation.forced_tokens = forced
    req.sampling.structured_output.CopyFrom(structured)
    return stub(stack.coordinator_address).Generate(req, timeout=600)


CASES = {
    "json_schema": pb.StructuredOutput(json_schema=json.dumps(SCHEMA)),
    "regex": pb.StructuredOutput(regex=r"Tom is [0-9]{1,2} years old\."),
    "choice": pb.StructuredOutput(choice=pb.ChoiceList(choices=["a cat", "a dog", "a bird"])),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_greedy_constrained_output_with_speculation_is_target_onlys_and_admitted(stack, kind):
    speculative = generate(stack, CASES[kind], 4, temperature=0.0, max_new_tokens=64)
    alone = generate(stack, CASES[kind], 0, temperature=0.0, max_new_tokens=64)
    unforced = generate(stack, CASES[kind], 4, forced=False, temperature=0.0, max_new_tokens=64)
    assert list(speculative.token_ids) == list(alone.token_ids) == list(unforced.token_ids)
    assert unforced.stats.forced_tokens == 0 and alone.stats.forced_tokens == 0
    if kind != "choice":  # the fixed text (keys, punctuation, "Tom is ", the EOS) is forced
        assert speculative.stats.forced_tokens >= 3, speculative.stats
    assert speculative.finish_reason == "eos", speculative.text  # the constraint completed: EOS
    text = speculative.text
    if kind == "json_schema":
        document = json.loads(text)
        assert set(document) == {"name", "age", "colour"} and isinstance(document["age"], int)
        assert document["colour"] in ("red", "green", "blue") and isinstance(document["name"], str)
    elif kind == "regex":
        assert re.fullmatch(r"Tom is [0-9]{1,2} years old\.", text), text
    else:
        assert text in ("a cat", "a dog", "a bird")
    assert speculative.stats.draft_fallbacks == 0  # the draft served every step (none dropped)
    assert unforced.stats.accepted_tokens > 0  # and its masked proposals were accepted


def test_a_seed_fixes_a_sampled_constrained_request(stack):
    runs = [generate(stack, CASES["json_schema"], 4, temperature=0.8, seed=5, max_new_tokens=64) for _ in range(2)]
    assert list(runs[0].token_ids) == list(runs[1].token_ids)
    if runs[0].finish_reason == "eos":
        assert set(json.loads(runs[0].text)) == {"name", "age", "colour"}


@pytest.mark.parametrize(
    ("structured", "message"),
    [
        (pb.StructuredOutput(json_schema="{not json"), "json_schema: not JSON"),
        (pb.StructuredOutput(regex="(unclosed"), "regex"),
        (pb.StructuredOutput(json_schema=json.dumps(SCHEMA)), "cannot be combined with ignore_eos"),
    ],
)
def test_a_constraint_that_cannot_be_served_is_invalid_argument(stack, structured, message):
    with pytest.raises(grpc.RpcError) as info:
        ignore_eos = "ignore_eos" in message
        generate(stack, structured, 4, temperature=0.0, max_new_tokens=8, ignore_eos=ignore_eos)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("sampling.structured_output: ") and message in info.value.details()


def test_the_openai_client_gets_the_same_schema_valid_json(stack):
    import openai

    client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)
    grpc_text = generate(stack, CASES["json_schema"], 4, temperature=0.0, max_new_tokens=64).text
    response_format = {"type": "json_schema", "json_schema": {"name": "cat", "schema": SCHEMA, "strict": True}}
    chat = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": PROMPT}],
        temperature=0,
        max_tokens=64,
        response_format=response_format,  # type: ignore[arg-type]
    )
    content = chat.choices[0].message.content
    assert content == grpc_text and chat.choices[0].finish_reason == "stop"
    assert set(json.loads(content)) == {"name", "age", "colour"}
    vllm_style = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": PROMPT}],
        temperature=0,
        max_tokens=64,
        extra_body={"structured_outputs": {"choice": ["a cat", "a dog"]}},
    )
    assert vllm_style.choices[0].message.content in ("a cat", "a dog")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=8,
            extra_body={"structured_outputs": {"regex": "(unclosed"}},
        )
    assert "structured_output" in str(info.value)


def test_specdec_generate_takes_a_constraint_from_its_flags(stack, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    specdec = str(Path(sys.executable).with_name("specdec"))
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    base = [specdec, "generate", "--addr", stack.coordinator_address, PROMPT, "--max-new-tokens", "64"]
    proc = subprocess.run(
        [*base, "--json-schema", str(schema)], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert set(json.loads(proc.stdout)) == {"name", "age", "colour"}
    assert "tokens forced by the constraint" in proc.stderr and "finish=eos" in proc.stderr
    proc = subprocess.run(
        [*base, "--choice", "a cat", "--choice", "a dog"], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0 and proc.stdout.strip() in ("a cat", "a dog"), proc.stderr
    proc = subprocess.run(
        [*base, "--json-schema", "{not json"], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 2 and "INVALID_ARGUMENT: sampling.structured_output: json_schema: not JSON" in proc.stderr


# -- hostile constraints (issue 62): none takes the coordinator down or stalls it -----------------
def chained_rules(count: int) -> str:
    return "\n".join(["start: r0", *(f'r{i}: "t{i}" | r{i + 1}' for i in range(count)), f'r{count}: "end"'])


def gbnf_rules(count: int) -> str:
    return "\n".join(["root ::= r0", *(f'r{i} ::= "t{i}" | r{i + 1}' for i in range(count)), f'r{count} ::= "end"'])


# each: the constraint, what its refusal names, whether it may be served instead
HOSTILE = {
    # 61 KB: it overflowed the compiling thread's stack -- a segfault of the coordinator; it
    # compiles now, and llguidance's parser gives up on its first token (too many items)
    "rule_chain": (pb.StructuredOutput(grammar=chained_rules(2800)), "too complex", True),
    # compiled again on every request, 3.8 s each, on the threads that tokenize
    "gbnf_rules": (pb.StructuredOutput(grammar=gbnf_rules(2500)), "GBNF rules; at most", False),
    # past Python's recursion limit when read: INTERNAL
    "deep_json": (pb.StructuredOutput(json_schema='{"a":' * 2000 + "1" + "}" * 2000), "nested too deeply", False),
    # its lexer gives up after the first tokens: a MatcherError and HTTP 500
    "lexer_limit": (pb.StructuredOutput(regex="(a{1000}){1000}"), "too complex", False),
}


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_a_hostile_constraint_is_served_or_refused_and_the_server_carries_on(stack, kind):
    structured, refusal, may_serve = HOSTILE[kind]
    try:
        answer = generate(stack, structured, 4, temperature=0.0, max_new_tokens=4)
        assert may_serve, f"served a constraint expected to be refused: {answer.text!r}"
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
        assert error.details().startswith("sampling.structured_output: ") and len(error.details()) < 600
        assert refusal in error.details(), error.details()
    after = generate(stack, CASES["choice"], 4, temperature=0.0, max_new_tokens=8)
    assert after.text in ("a cat", "a dog", "a bird")


def test_a_long_forced_run_is_computed_only_as_far_as_max_tokens(stack):
    # (ab){1500}: 3,000 forced characters, computed whole on the event loop (13 s) before
    # max_tokens cut them; with max_tokens 1, one token
    answer = generate(stack, pb.StructuredOutput(regex="(ab){1500}"), 4, temperature=0.0, max_new_tokens=1)
    assert len(answer.token_ids) == 1 and answer.finish_reason == "length"


def test_the_openai_client_gets_400_for_a_constraint_past_the_matchers_limits(stack):
    import openai

    client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)
    for grammar in ({"regex": "(a{1000}){1000}"}, {"grammar": gbnf_rules(2500)}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=client.models.list().data[0].id,
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=8,
                temperature=0,
                extra_body={"structured_outputs": grammar},
            )
        assert "structured_output" in str(info.value) and "Traceback" not in str(info.value)
