"""Constraints through the engines (issue 45): a target and a model draft in process, a tiny random
Llama over the default target's real tokenizer (llguidance needs a real byte-level vocabulary).
Greedy constrained output with speculation equals the target's own constrained greedy decoding
(target-only), token for token; every output, greedy or sampled, is admitted by the constraint;
a complete constraint ends with EOS; what the engines cannot combine a constraint with is
refused, naming the field."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import replace

import pytest

from specdec.engine.draft import DraftEngine
from specdec.engine.ngram import NgramDraft
from specdec.engine.target import TargetEngine
from specdec.errors import InvalidArgumentError
from specdec.exact.constraint import Constraint
from specdec.exact.proposal import DraftProposal
from specdec.exact.sampling import SamplingParams
from specdec.exact.sparse import SparseDist
from specdec.loop.adaptive_k import StepCost
from specdec.loop.generate import (
    FORCED_RUN_MAX,
    LocalDraft,
    LocalTarget,
    SpeculativeRun,
    cut_where_forbidden,
    forced_run_limit,
    generate_async,
    speculative_generate,
)
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


def run(engines, tokenizer, params, k, forced=True, **schedule):
    """As the coordinator runs a constrained request: with k > 0 the loop follows the constraint
    and proposes its forced runs itself (``forced``)."""
    target, draft = engines
    follower = target.store.grammars.matcher(params.constraint) if k and params.constraint else None
    return speculative_generate(
        target,
        draft if k else None,
        PROMPT,
        params,
        k,
        eos_token_ids=[tokenizer.eos_token_id],
        tokenizer=tokenizer,
        constraint=follower,
        forced_runs=forced,
        **schedule,
    )


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


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
        for forced in (True, False):
            assert run(engines, tokenizer, params, k, forced).token_ids == alone.token_ids
    assert admitted(tokenizer, constraint, alone.token_ids)
    if alone.finish_reason == "eos":  # the constraint completed: EOS was the only token left
        assert alone.token_ids[-1] == tokenizer.eos_token_id


def test_forced_runs_are_committed_without_a_pass_and_counted(engines, tokenizer):
    """A schema's fixed keys and punctuation: the loop commits them as they are (forced_tokens),
    the draft and the target see them in the next step's commit; without forced runs the draft
    proposes them and the target verifies them. Same tokens, fewer passes and draft calls."""
    params = SamplingParams(temperature=0.0, seed=1, max_new_tokens=40, constraint=CONSTRAINTS[0])
    on, off = run(engines, tokenizer, params, 3, forced=True), run(engines, tokenizer, params, 3, forced=False)
    assert on.token_ids == off.token_ids
    assert on.stats.forced_tokens >= 6 and off.stats.forced_tokens == 0  # '{"ok": ', ', "n": ', ...
    assert on.stats.drafts < off.stats.drafts
    assert on.stats.target_passes < off.stats.target_passes
    if on.finish_reason == "eos":  # the complete document's EOS is forced too (nothing else is admitted)
        assert on.token_ids[-1] == tokenizer.eos_token_id


def test_logprobs_turn_forced_runs_off(engines, tokenizer):
    """A forced run has no target rows, hence no logprobs: a request asking for them verifies all."""
    params = SamplingParams(temperature=0.0, seed=1, max_new_tokens=20, constraint=CONSTRAINTS[0], logprobs=2)
    result = run(engines, tokenizer, params, 3)
    assert result.stats.forced_tokens == 0
    assert result.token_ids == run(engines, tokenizer, replace(params, logprobs=None), 0).token_ids


def test_a_resumed_adaptive_run_with_forced_runs_continues_as_the_undisturbed_one(engines, tokenizer):
    """Forced steps are not the policy's: a run resumed from committed tokens (a takeover) replays
    only the steps the policy chose, and continues with the same ks, hence the same sampled tokens."""
    target, draft = engines
    params = SamplingParams(temperature=1.0, seed=5, max_new_tokens=40, constraint=CONSTRAINTS[0])
    schedule = {"adaptive": True, "step_cost": StepCost(0.5, 0.3)}  # pauses blocks that do not pay

    def steps_of(committed=(), committed_steps=None):
        follower = target.store.grammars.matcher(params.constraint)
        run = SpeculativeRun(
            LocalTarget(target),
            LocalDraft(draft),
            PROMPT,
            params,
            3,
            [tokenizer.eos_token_id],
            tokenizer,
            committed=committed,
            committed_steps=committed_steps,
            constraint=follower,
            **schedule,
        )

        async def go():
            return [list(tokens) async for tokens in run.steps()], run.stats

        return asyncio.run(go())

    whole, stats = steps_of()
    assert stats.forced_tokens > 0 and stats.steps_by_k[0] > 0  # both paths taken
    for cut in range(1, len(whole)):
        committed = [t for step in whole[:cut] for t in step]
        rest, _ = steps_of(committed, [len(step) for step in whole[:cut]])
        assert rest == whole[cut:], cut


def test_an_ngram_block_ends_where_the_constraint_forbids_its_next_token(engines, tokenizer):
    """The n-gram draft knows no constraint: the loop cuts its block at the first token the
    constraint forbids (a lookup is a function of the context: the cut keeps the law exact), which
    only drops proposals the target would reject. Greedy: the same tokens, the same accepted ones."""
    target, _ = engines
    prompt = encode(
        tokenizer, '{"ok": true, "n": 12, "tag": "red"}\n{"ok": false, "n": 7, "tag": "blue"}\n{"ok": true,"n":5}\n'
    )
    params = SamplingParams(temperature=0.0, seed=1, max_new_tokens=40, constraint=CONSTRAINTS[0])

    def with_ngram(follow: bool, forced: bool):
        follower = target.store.grammars.matcher(params.constraint) if follow else None
        eos = [tokenizer.eos_token_id]
        return speculative_generate(
            target, NgramDraft(VOCAB), prompt, params, 4, eos, tokenizer, constraint=follower, forced_runs=forced
        )

    unfiltered, cut, forced = with_ngram(False, False), with_ngram(True, False), with_ngram(True, True)
    assert unfiltered.token_ids == cut.token_ids == forced.token_ids
    assert admitted(tokenizer, params.constraint, cut.token_ids)
    assert cut.stats.accepted_tokens == unfiltered.stats.accepted_tokens
    assert cut.stats.proposed_tokens < unfiltered.stats.proposed_tokens
    assert forced.stats.forced_tokens > 0 and forced.stats.target_passes < cut.stats.target_passes


def test_forced_runs_and_cuts_as_pure_functions():
    assert forced_run_limit(room=2, remaining=100) == 2
    assert forced_run_limit(room=100, remaining=100) == FORCED_RUN_MAX
    assert forced_run_limit(room=100, remaining=3) == 3  # never computed past max_tokens
    assert forced_run_limit(room=0, remaining=5) == forced_run_limit(room=5, remaining=-1) == 0
    lookup = DraftProposal([3, 4, 5], [SparseDist.one_hot(t) for t in (3, 4, 5)])
    assert cut_where_forbidden(lookup, admitted=1) == DraftProposal([3], [SparseDist.one_hot(3)])
    assert cut_where_forbidden(lookup, admitted=3) == lookup
    # a sampled proposal is not cut: whether it is would depend on the draw (the verifier rejects it)
    sampled = DraftProposal([3, 4], [SparseDist.one_hot(3), SparseDist.of([4, 9], [0.5, 0.5])])
    assert cut_where_forbidden(sampled, admitted=1) == sampled
    assert cut_where_forbidden(DraftProposal([3, 4]), admitted=0) == DraftProposal([3, 4])  # invariant: no q


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


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_invariant_sampling_under_a_constraint_depends_on_the_seed_alone(engines, tokenizer, seed):
    """Gumbel-max under the masks on both sides: with speculation (and forced runs committed
    without a pass) every token is the target-only run's of the same seed, and admitted."""
    for constraint in CONSTRAINTS[:2]:
        params = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=30, constraint=constraint, invariant=True)
        alone = run(engines, tokenizer, params, 0)
        speculative = run(engines, tokenizer, params, 3)
        assert speculative.token_ids == alone.token_ids
        assert speculative.stats.drafts > 0 and admitted(tokenizer, constraint, alone.token_ids)


@pytest.mark.parametrize("settings", [{"ignore_eos": True}, {"min_tokens": 2}], ids=["ignore_eos", "min_tokens"])
def test_what_a_constraint_cannot_be_combined_with_is_refused(engines, tokenizer, settings):
    params = SamplingParams(seed=1, max_new_tokens=8, constraint=CONSTRAINTS[1], **{"temperature": 0.0, **settings})
    with pytest.raises(InvalidArgumentError, match=r"sampling\.structured_output: cannot be combined"):
        run(engines, tokenizer, params, 3)


def test_a_replica_without_grammars_refuses_a_constraint(tokenizer):
    target = TargetEngine(tiny_llama(VOCAB, seed=11, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2))
    params = SamplingParams(temperature=0.0, seed=1, max_new_tokens=4, constraint=CONSTRAINTS[2])
    with pytest.raises(InvalidArgumentError, match="does not serve constraints"):
        speculative_generate(target, None, PROMPT, params, 0)


class Recording:
    """The real matcher, recording where each of its calls runs and the forced-run limits asked."""

    def __init__(self, matcher):
        self.matcher, self.threads, self.limits = matcher, set(), []

    def follow(self, generated):
        self.threads.add(threading.get_ident())
        self.matcher.follow(generated)

    def forced(self, limit):
        self.threads.add(threading.get_ident())
        self.limits.append(limit)
        return self.matcher.forced(limit)

    def admits(self, tokens):
        self.threads.add(threading.get_ident())
        return self.matcher.admits(tokens)


def test_the_loop_follows_the_constraint_off_the_event_loop_and_within_max_tokens(engines, tokenizer):
    # (ab){1500} forces 3,000 characters: the loop asked for all of the run at once, on the
    # event loop -- about 13 s of masks that held every other request (issue 62, item 2)
    target = engines[0]
    params = SamplingParams(temperature=0.0, seed=1, max_new_tokens=3, constraint=Constraint("regex", "(ab){1500}"))
    follower = Recording(target.store.grammars.matcher(params.constraint))

    async def generate():
        loop_thread = threading.get_ident()
        result = await generate_async(
            LocalTarget(target), LocalDraft(NgramDraft(VOCAB)), PROMPT, params, 2, [tokenizer.eos_token_id],
            tokenizer, constraint=follower,
        )  # fmt: skip
        return result, loop_thread

    result, loop_thread = asyncio.run(generate())
    assert len(result.token_ids) == 3 and result.stats.forced_tokens == 3
    assert follower.limits == [3] and loop_thread not in follower.threads
