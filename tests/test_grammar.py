"""specdec.modeling.grammar: constraints compiled by llguidance over the default target's real
tokenizer (49k tokens) -- what they admit, refuse and force, how a matcher follows commits and
rollbacks, the k+1 masks of a verify block, the bounded compile cache, and the errors a caller
turns into 400s."""

from __future__ import annotations

import asyncio
import itertools
import json
import string
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from specdec.errors import InvalidArgumentError, ResourceExhaustedError
from specdec.exact.constraint import MAX_SPEC_CHARS, Constraint, constrained
from specdec.modeling.grammar import (
    MAX_ERROR_CHARS,
    MAX_GBNF_RULES,
    CompileJob,
    CompileWorkers,
    GrammarError,
    Grammars,
    MatcherError,
    UnfollowableConstraintError,
    template_bytes,
    unpack_bitmask,
)
from specdec.modeling.loading import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, vocab_size=49152, eos_tokens=[tokenizer.eos_token_id])


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_bitmask_bit_order():
    words = (0b1010 | (1 << 31)).to_bytes(4, "little") + (1).to_bytes(4, "little")
    mask = unpack_bitmask(words, 40)
    assert mask.nonzero().flatten().tolist() == [1, 3, 31, 32]


def test_a_schema_admits_a_valid_document_token_by_token_and_then_only_eos(grammars, tokenizer):
    matcher = grammars.matcher(Constraint("json_schema", json.dumps(SCHEMA)))
    document = encode(tokenizer, json.dumps({"name": "Ada", "age": 36}))
    for token in document:
        assert matcher.allowed()[token], tokenizer.decode([token])
        matcher.advance([token])
    assert matcher.complete
    assert matcher.allowed().nonzero().flatten().tolist() == [tokenizer.eos_token_id]


def test_a_schema_refuses_a_wrong_type_where_it_goes_wrong(grammars, tokenizer):
    matcher = grammars.matcher(Constraint("json_schema", json.dumps(SCHEMA)))
    good = encode(tokenizer, '{"name": "Ada", "age": ')
    bad = good + encode(tokenizer, '"36"}')
    assert matcher.admits(bad) == len(good)
    assert matcher.consumed == 0  # admits() leaves the state alone
    with pytest.raises(MatcherError, match="not admitted"):
        matcher.advance(bad)


def test_masks_along_a_block_equal_stepwise_masks_and_leave_the_state(grammars, tokenizer):
    matcher = grammars.matcher(Constraint("json_schema", json.dumps(SCHEMA)))
    matcher.advance(encode(tokenizer, '{"name": "'))
    before = matcher.allowed()
    block = encode(tokenizer, 'Ada", "age')
    masks = matcher.masks_along(block)
    assert masks.shape == (len(block) + 1, 49152)
    assert torch.equal(matcher.allowed(), before) and matcher.consumed == len(encode(tokenizer, '{"name": "'))
    stepwise = grammars.matcher(Constraint("json_schema", json.dumps(SCHEMA)))
    stepwise.advance(encode(tokenizer, '{"name": "'))
    for i, token in enumerate(block):
        assert torch.equal(masks[i], stepwise.allowed())
        stepwise.advance([token])
    assert torch.equal(masks[-1], stepwise.allowed())
    # a refused token: the rows past it repeat the row where it was refused
    refused = [block[0], tokenizer.eos_token_id, block[1]]
    rows = matcher.masks_along(refused)
    assert torch.equal(rows[2], rows[1]) and torch.equal(rows[3], rows[1])
    assert torch.equal(matcher.allowed(), before)  # and the matcher is still usable
    # an admitted EOS ends the sequence: only EOS after it, and nothing of it is consumed
    done = grammars.matcher(Constraint("regex", "ab"))
    tokens = [*encode(tokenizer, "ab"), tokenizer.eos_token_id, tokenizer.eos_token_id]
    rows = done.masks_along(tokens)
    eos_only = rows[-1].nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    assert eos_only and torch.equal(rows[-2], rows[-1]) and done.consumed == 0
    assert done.allowed_after(tokens[:-1]).nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    done.follow(tokens)  # a committed EOS is not consumed either
    assert done.consumed == len(tokens) - 2 and done.complete


def test_rollback_returns_to_the_earlier_mask(grammars, tokenizer):
    matcher = grammars.matcher(Constraint("regex", r"[a-z]+@[a-z]+\.(com|org)"))
    tokens = encode(tokenizer, "ada@example.org")
    matcher.advance(tokens[:2])
    at_two = matcher.allowed()
    matcher.advance(tokens[2:])
    assert matcher.complete
    matcher.rollback(len(tokens) - 2)
    assert torch.equal(matcher.allowed(), at_two) and not matcher.complete
    with pytest.raises(MatcherError, match="cannot roll back"):
        matcher.rollback(3)


def test_forced_runs(grammars, tokenizer):
    schema = {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}
    matcher = grammars.matcher(Constraint("json_schema", json.dumps(schema)))
    forced = matcher.forced(16)
    # one key, required: all of it is forced -- up to the space, which the model's next token may
    # carry (" true" is one token), so a forced run stops short of a token boundary it cannot know
    assert tokenizer.decode(forced) in ('{"answer":', '{"answer": ')
    matcher.advance(forced)
    assert not matcher.forced(16)  # true or false: the model's choice
    choice = grammars.matcher(Constraint("choice", json.dumps(["positive", "negative"])))
    assert choice.forced(16) == []
    for token in encode(tokenizer, "pos"):
        choice.advance([token])
    assert tokenizer.decode(choice.forced(16)) == "itive"
    choice.advance(choice.forced(16))
    assert choice.complete and choice.forced(16) == [tokenizer.eos_token_id]  # EOS, the only token left
    assert choice.forced(0) == []


def test_a_forced_run_is_computed_only_as_far_as_asked(grammars, tokenizer):
    # (ab){1500} forces all of its 3000 characters: a mask per token, computed only up to the limit
    matcher = grammars.matcher(Constraint("regex", "(ab){1500}"))
    first = matcher.forced(5)
    assert len(first) == 5 and matcher.consumed == 0
    longer = matcher.forced(9)
    assert longer[:5] == first and len(longer) == 9


def test_json_object_and_grammars(grammars, tokenizer):
    anything = grammars.matcher(Constraint("json_object"))
    assert anything.admits(encode(tokenizer, '{"x": [1, 2]}')) == len(encode(tokenizer, '{"x": [1, 2]}'))
    assert anything.admits(encode(tokenizer, "[1]")) == 0  # an object, not any JSON
    lark = grammars.matcher(Constraint("grammar", 'start: "yes" | "no"'))
    gbnf = grammars.matcher(Constraint("grammar", 'root ::= "yes" | "no"'))
    for matcher in (lark, gbnf):
        assert matcher.admits(encode(tokenizer, "yes")) == len(encode(tokenizer, "yes"))
        assert matcher.admits(encode(tokenizer, "maybe")) == 0


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("yaml", "a: 1", "not one of"),
        ("regex", "", "needs its regex"),
        ("choice", "[]", "non-empty JSON list"),
        ("choice", '["a", 3]', "non-empty JSON list"),
        ("choice", "not json", "not a JSON list"),
        ("regex", "a" * (MAX_SPEC_CHARS + 1), "at most"),
    ],
)
def test_bad_constraints_are_refused_as_data(kind, spec, message):
    with pytest.raises(InvalidArgumentError, match=f"constraint: .*{message}"):
        Constraint(kind, spec)


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint("json_schema", "{not json"), "json_schema: not JSON"),
        (Constraint("json_schema", "[1, 2]"), "a JSON schema is an object"),
        (Constraint("json_schema", json.dumps({"type": "no-such-type"})), "json_schema"),
        (Constraint("regex", "(unclosed"), "regex"),
        (Constraint("grammar", "start: undefined_rule"), "grammar"),
        (Constraint("grammar", 'root ::= "unclosed'), "not valid GBNF"),
    ],
)
def test_constraints_that_do_not_compile_are_named(grammars, constraint, message):
    with pytest.raises(GrammarError, match=message) as raised:
        grammars.matcher(constraint)
    assert isinstance(raised.value, InvalidArgumentError) and raised.value.field == "constraint"  # a 400


def test_the_transform_leaves_allowed_logits_and_forbids_the_rest():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.5, -1.0, 4.0]])
    allowed = torch.tensor([[True, False, True], [False, True, False]])
    out = constrained(logits, allowed)
    assert out[0].tolist() == [1.0, float("-inf"), 3.0] and out[1].tolist() == [float("-inf"), -1.0, float("-inf")]


def test_the_compile_cache_is_bounded_and_counted(tokenizer):
    grammars = Grammars(tokenizer, vocab_size=49152, eos_tokens=[tokenizer.eos_token_id], max_entries=2)
    for spec in ("a+", "b+", "a+", "c+", "b+"):
        grammars.matcher(Constraint("regex", spec))
    stats = grammars.stats()
    # a+ compiled, b+ compiled, a+ hit, c+ compiled (evicts b+), b+ compiled again
    assert (stats["grammar_compiles"], stats["grammar_cache_hits"], stats["grammar_cache_entries"]) == (4, 1, 2)
    first, second = grammars.matcher(Constraint("regex", "b+")), grammars.matcher(Constraint("regex", "b+"))
    first.advance(encode(tokenizer, "b"))
    assert second.consumed == 0 and not torch.equal(first.allowed(), second.allowed())  # copies, not shared


def test_the_wire_carries_each_constraint_kind_and_names_a_bad_one():
    from specdec.exact.sampling import SamplingParams
    from specdec.runtime import wire
    from specdec.v1 import coordinator_pb2

    for constraint in (
        Constraint("json_object"),
        Constraint("json_schema", json.dumps(SCHEMA)),
        Constraint("regex", "[0-9]+"),
        Constraint("choice", json.dumps(["yes", "no"])),
        Constraint("grammar", 'start: "a"'),
    ):
        params = SamplingParams(temperature=0.0, constraint=constraint)
        assert wire.sampling_from_proto(wire.sampling_to_proto(params)).constraint == constraint
    assert wire.sampling_from_proto(coordinator_pb2.SamplingParams()).constraint is None
    bad = [
        coordinator_pb2.SamplingParams(structured_output=coordinator_pb2.StructuredOutput()),
        coordinator_pb2.SamplingParams(structured_output=coordinator_pb2.StructuredOutput(json_object=False)),
        coordinator_pb2.SamplingParams(structured_output=coordinator_pb2.StructuredOutput(regex="")),
        coordinator_pb2.SamplingParams(
            structured_output=coordinator_pb2.StructuredOutput(choice=coordinator_pb2.ChoiceList())
        ),
    ]
    for msg in bad:
        with pytest.raises(InvalidArgumentError, match=r"sampling\.structured_output: ") as raised:
            wire.sampling_from_proto(msg)
        assert raised.value.field == "sampling.structured_output"


def test_follow_catches_up_with_commits_and_steps_back_after_a_shorter_restart(grammars, tokenizer):
    document = encode(tokenizer, json.dumps({"name": "Ada", "age": 36}))
    matcher = grammars.matcher(Constraint("json_schema", json.dumps(SCHEMA)))
    reference = grammars.matcher(Constraint("json_schema", json.dumps(SCHEMA)))
    for end in (3, 3, 7, 5, len(document)):  # commits extend; a restart from fewer tokens steps back
        matcher.follow(document[:end])
        fresh = grammars.matcher(Constraint("json_schema", json.dumps(SCHEMA)))
        fresh.advance(document[:end])
        assert matcher.consumed == end and torch.equal(matcher.allowed(), fresh.allowed())
    reference.advance(document[:4])
    expected = reference.allowed()

    def reference_at(n: int) -> torch.Tensor:
        at = grammars.matcher(Constraint("json_schema", json.dumps(SCHEMA)))
        at.advance(document[:n])
        return at.allowed()

    matcher.follow(document[:2])
    assert torch.equal(matcher.allowed_after(document[2:4]), expected) and matcher.consumed == 2
    for refused in ([tokenizer.eos_token_id], [document[2], tokenizer.eos_token_id]):
        with pytest.raises(MatcherError):
            matcher.allowed_after(refused)  # EOS is not admitted inside a document
        assert matcher.consumed == 2 and torch.equal(matcher.allowed(), reference_at(2))


# -- hostile constraints (issue 62) ------------------------------------------------------------
def chained_rules(count: int) -> str:
    """A Lark grammar of ``count`` rules, each naming the next: ``rN: "tN" | rN+1``."""
    rules = ["start: r0", *(f'r{i}: "t{i}" | r{i + 1}' for i in range(count)), f'r{count}: "end"']
    return "\n".join(rules)


def test_a_deep_chain_of_rules_compiles_without_crashing_the_process():
    # 2,800 chained rules (61 KB, within MAX_SPEC_CHARS) overflowed the 8 MB stack of the thread
    # that compiled them: a segfault that took the coordinator down with every request in it.
    # In a subprocess, so a crash fails this test rather than ending the run.
    code = textwrap.dedent(
        f"""
        from specdec.exact.constraint import Constraint
        from specdec.modeling.grammar import Grammars
        from specdec.modeling.loading import load_tokenizer
        tokenizer = load_tokenizer("smollm2")
        grammars = Grammars(tokenizer, vocab_size=49152, eos_tokens=[tokenizer.eos_token_id])
        matcher = grammars.matcher(Constraint("grammar", {chained_rules(2800)!r}))
        print("allowed", int(matcher.allowed().sum()))
        """
    )
    assert len(chained_rules(2800)) <= MAX_SPEC_CHARS
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    word, allowed = proc.stdout.split()
    assert word == "allowed" and int(allowed) > 0


def test_a_refused_constraint_is_refused_again_without_a_compile(tokenizer):
    grammars = Grammars(tokenizer, vocab_size=49152, eos_tokens=[tokenizer.eos_token_id])
    bad = Constraint("regex", "(unclosed")
    for _ in range(3):
        with pytest.raises(GrammarError, match="regex"):
            grammars.matcher(bad)
    stats = grammars.stats()
    assert (stats["grammar_compiles"], stats["grammar_refusals"]) == (0, 2)  # one attempt, two answers from memory


def test_errors_are_one_bounded_line_without_the_grammar(grammars):
    # llguidance quotes the whole grammar back in its verbose errors; 4,800 chained rules of short
    # lexemes exceed its parser's items at the first token
    names = ["".join(t) for n in (1, 2, 3) for t in itertools.product(string.ascii_lowercase, repeat=n)][:4801]
    rules = [f'{names[i]}:"{names[i]}"|{names[i + 1]}' for i in range(4800)]
    too_complex = "\n".join(["start: a", *rules, f'{names[4800]}: "y"'])
    for constraint in (Constraint("grammar", too_complex), Constraint("grammar", "start: (")):
        with pytest.raises(GrammarError) as raised:
            grammars.matcher(constraint)
        message = str(raised.value)
        assert "\n" not in message and len(message) <= MAX_ERROR_CHARS + 40 and names[4799] not in message


def test_depth_and_rule_count_are_refused_by_name(grammars):
    deep_json = '{"a":' * 2000 + "1" + "}" * 2000  # past Python's recursion limit when read
    with pytest.raises(GrammarError, match="nested too deeply"):
        grammars.matcher(Constraint("json_schema", deep_json))
    gbnf = "\n".join(["root ::= r0", *(f'r{i} ::= "t{i}" | r{i + 1}' for i in range(MAX_GBNF_RULES + 1))])
    with pytest.raises(GrammarError, match=f"at most {MAX_GBNF_RULES}"):
        grammars.matcher(Constraint("grammar", gbnf + f'\nr{MAX_GBNF_RULES + 1} ::= "end"'))


def test_a_compile_past_its_budget_is_refused_and_stays_refused(tokenizer):
    grammars = Grammars(tokenizer, vocab_size=49152, eos_tokens=[tokenizer.eos_token_id], budget_s=0.01)
    slow = Constraint("regex", "(a{1000}){1000}")  # its first mask takes about a second
    with pytest.raises(GrammarError, match=r"took longer than 0\.01 s"):
        grammars.matcher(slow)
    time.sleep(0.1)
    with pytest.raises(GrammarError, match="took longer"):  # and the compile's later end changes nothing
        asyncio.run(grammars.matcher_async(slow))


def test_the_compile_queue_is_bounded():
    workers = CompileWorkers(threads=1, queue_size=1)
    release = threading.Event()
    running, waiting = CompileJob(release.wait), CompileJob(lambda: "done")
    workers.submit(running)
    running.started.result(timeout=60)  # the worker holds it: the queue is empty again
    workers.submit(waiting)
    with pytest.raises(ResourceExhaustedError, match="waiting to compile"):
        workers.submit(CompileJob(lambda: "refused"))
    release.set()
    assert waiting.done.result(timeout=60) == "done"


def test_compiles_run_on_deep_stack_threads_of_their_own():
    workers = CompileWorkers(threads=1, queue_size=1)
    job = CompileJob(lambda: (threading.current_thread().name, threading.get_ident()))
    workers.submit(job)
    name, ident = job.done.result(timeout=60)
    assert name.startswith("specdec-grammar-") and ident != threading.get_ident()
    assert threading.stack_size() == 0  # the deep stack was only for the workers' creation


def test_the_cache_is_scoped_by_tenant_and_bounded_in_bytes(tokenizer):
    spec = "x" * 10_000 + "[0-9]+"
    room = 2 * template_bytes(Constraint("regex", "0" + spec))  # two of the entries below
    grammars = Grammars(tokenizer, vocab_size=49152, eos_tokens=[tokenizer.eos_token_id], max_bytes=room)
    for scope in ("tenant-a", "tenant-b", "tenant-a"):
        grammars.matcher(Constraint("regex", spec), scope)
    stats = grammars.stats()
    # another tenant's identical constraint is compiled again, never answered from the first's entry
    assert (stats["grammar_compiles"], stats["grammar_cache_hits"]) == (2, 1)
    for i in range(3):
        grammars.matcher(Constraint("regex", f"{i}" + spec), "tenant-a")
    stats = grammars.stats()
    assert stats["grammar_cache_entries"] == 2 and stats["grammar_cache_bytes"] <= room


def test_a_vocabulary_that_cannot_continue_a_constraint_is_the_clients_error():
    # the selftest's 16 tokens have no digits and no byte fallback: a fuzzed schema of digits
    # left the target a row admitting nothing, a token drawn from it, and INTERNAL (issue 62)
    from specdec.apps.selftest import CHAR_TOKENS
    from specdec.modeling.tiny import char_tokenizer

    grammars = Grammars(char_tokenizer(list(CHAR_TOKENS)), vocab_size=len(CHAR_TOKENS), eos_tokens=[0])
    for constraint in (Constraint("regex", "[0-9]+"), Constraint("json_schema", '{"type": "string"}')):
        # (a JSON string opens with a quote, which no token spells: llguidance's mask admits
        # every letter as if it did, and its parser refuses each)
        with pytest.raises(GrammarError, match="no token of the model's vocabulary can begin it"):
            grammars.matcher(constraint)
    a, b = CHAR_TOKENS.index("a"), CHAR_TOKENS.index("b")
    matcher = grammars.matcher(Constraint("regex", "a0"))
    assert matcher.allowed().nonzero().flatten().tolist() == [a]
    with pytest.raises(UnfollowableConstraintError, match="continues the constraint after 1 tokens"):
        matcher.advance([a, b])  # b was drawn after a, where nothing is admitted
    matcher = grammars.matcher(Constraint("regex", "a0"))
    matcher.advance([a])
    with pytest.raises(UnfollowableConstraintError, match="continues the constraint after 1 tokens"):
        matcher.allowed()
    with pytest.raises(MatcherError):  # a token refused where others are admitted is still a bug upstream
        grammars.matcher(Constraint("regex", "ab")).advance([b])
