"""Constraints through the engines (issue 45): a target and a model draft in process, a tiny random
Llama over the default target's real tokenizer (llguidance needs a real byte-level vocabulary).
Greedy constrained output with speculation equals the target's own constrained greedy decoding
(target-only), token for token; every output, greedy or sampled, is admitted by the constraint;
a complete constraint ends with EOS; what the engines cannot combine a constraint with is
refused, naming the field."""

from __future__ import annotations

import json

import pytest

from specdec.engine.draft import DraftEngine
from specdec.engine.target import TargetEngine
from specdec.errors import InvalidArgumentError
from specdec.exact.constraint import Constraint
from specdec.exact.sampling import SamplingParams
from specdec.loop.generate import speculative_generate
from specdec.modeling.grammar import Grammars
from specdec.modeling.loading import load_tokenizer
from specdec.modeling.tiny import perturbed, tiny_llama

VOCAB = 49152
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}, "tag": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}
CONSTRAINTS = [
    Constraint("json_schema", json.dumps(SCHEMA)),
    Constraint("regex", r"(yes|no), [0-9]{2,4}\."),
    Constraint("choice", json.dumps(["alpha", "beta", "gamma delta"])),
    Constraint("json_object"),
]
PROMPT = [1, 504, 3100, 28, 2]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def engines(tokenizer):
    target_model = tiny_llama(VOCAB, seed=11, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    draft_model = perturbed(target_model, 0.3, seed=2)
    target, draft = TargetEngine(target_model), DraftEngine(draft_model)
    for engine in (target, draft):
        engine.store.grammars = Grammars(tokenizer, VOCAB, [tokenizer.eos_token_id])
    return target, draft


def run(engines, tokenizer, params, k):
    target, draft = engines
    return speculative_generate(
        target, draft if k else None, PROMPT, params, k, eos_token_ids=[tokenizer.eos_token_id], tokenizer=tokenizer
    )


def admitted(tokenizer, constraint, tokens) -> bool:
    matcher = Grammars(tokenizer, VOCAB, [tokenizer.eos_token_id]).matcher(constraint)
    body = tokens[:-1] if tokens and tokens[-1] == tokenizer.eos_token_id else tokens
    return matcher.admits(body) == len(body) and (body == tokens or matcher.complete or _complete(matcher, body))


def _complete(matcher, body) -> bool:
    matcher.advance(body)
    return matcher.complete


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=[c.kind for c in CONSTRAINTS])
def test_greedy_with_speculation_is_the_targets_constrained_greedy(engines, tokenizer, constraint):
    params = SamplingParams(temperature=0.0, seed=1, max_new_tokens=40, constraint=constraint)
    alone = run(engines, tokenizer, params, 0)
    for k in (1, 3):
        assert run(engines, tokenizer, params, k).token_ids == alone.token_ids
    assert admitted(tokenizer, constraint, alone.token_ids)
    if alone.finish_reason == "eos":  # the constraint completed: EOS was the only token left
        assert alone.token_ids[-1] == tokenizer.eos_token_id


def test_a_short_constraint_completes_and_ends_with_eos(engines, tokenizer):
    constraint = Constraint("choice", json.dumps(["alpha", "beta", "gamma delta"]))
    params = SamplingParams(temperature=0.0, seed=1, max_new_tokens=40, constraint=constraint)
    result = run(engines, tokenizer, params, 3)
    assert result.finish_reason == "eos"
    assert tokenizer.decode(result.token_ids[:-1]) in ("alpha", "beta", "gamma delta")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sampled_output_is_always_admitted(engines, tokenizer, seed):
    constraint = CONSTRAINTS[1]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=seed, max_new_tokens=30, constraint=constraint)
    for k in (0, 3):
        result = run(engines, tokenizer, params, k)
        assert admitted(tokenizer, constraint, result.token_ids), tokenizer.decode(result.token_ids)


@pytest.mark.parametrize(
    "settings",
    [{"invariant": True, "temperature": 1.0}, {"ignore_eos": True}, {"min_tokens": 2}],
    ids=["invariant", "ignore_eos", "min_tokens"],
)
def test_what_a_constraint_cannot_be_combined_with_is_refused(engines, tokenizer, settings):
    params = SamplingParams(seed=1, max_new_tokens=8, constraint=CONSTRAINTS[1], **{"temperature": 0.0, **settings})
    with pytest.raises(InvalidArgumentError, match=r"sampling\.structured_output: cannot be combined"):
        run(engines, tokenizer, params, 3)


def test_a_replica_without_grammars_refuses_a_constraint(tokenizer):
    target = TargetEngine(tiny_llama(VOCAB, seed=11, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2))
    params = SamplingParams(temperature=0.0, seed=1, max_new_tokens=4, constraint=CONSTRAINTS[2])
    with pytest.raises(InvalidArgumentError, match="does not serve constraints"):
        speculative_generate(target, None, PROMPT, params, 0)
