"""Pipelined drafting (specdec.loop.pipelining): a draft drafts past a block it assumes, without
committing it, exactly as it would once that block is committed; the loop uses such a block only
on the branch it was drafted for, so a pipelined run is token for token the serial run."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from conftest import VOCAB

from specdec.engine.commits import Commit
from specdec.engine.draft import DraftEngine, FeatureDraftEngine
from specdec.engine.ngram import NgramDraft
from specdec.engine.target import TargetEngine
from specdec.errors import InvalidArgumentError
from specdec.exact.proposal import MAX_BLOCK, Branch, DraftProposal
from specdec.exact.sampling import SamplingParams
from specdec.exact.sparse import SparseDist
from specdec.loop.generate import LocalDraft, LocalTarget, SpeculativeRun, speculative_generate
from specdec.loop.pipelining import BUDGET_PROBE_EVERY, BranchBudget, PreDraft
from specdec.runtime.placement import Placement, computes_apart

PROMPT = [1, 2, 3, 4, 5]
SAMPLED = SamplingParams(temperature=1.0, seed=7, max_new_tokens=24, ignore_eos=True, repetition_penalty=1.3)
GREEDY = SamplingParams(temperature=0.0, seed=8, max_new_tokens=24, ignore_eos=True)
INVARIANT = SamplingParams(temperature=0.8, seed=9, max_new_tokens=24, ignore_eos=True, invariant=True)


def block(tokens: list[int]) -> DraftProposal:
    return DraftProposal(tokens, [SparseDist.one_hot(t) for t in tokens])


# -- the pure choice ---------------------------------------------------------------------------
def test_a_pre_draft_is_used_only_on_the_branch_it_assumed():
    rejected_first = Branch((6,), block([1, 2, 3]))  # the target is guessed to recover 6 for 7
    drafted = dataclasses.replace(block([9, 10, 11, 12]), branches=(rejected_first,))
    ahead = PreDraft(base_len=3, assumed=(7, 8), drafted=drafted)
    assert [b.prefix for b in ahead.branches()] == [(7, 8, 9), (6,)]  # all accepted + the guessed bonus first

    def used(sequence, k):
        found = ahead.block_for(sequence, k)
        return None if found is None else (found[0].tokens, found[1])

    assert used([0, 1, 2, 7, 8, 9], 3) == ([10, 11, 12], False)
    assert used([0, 1, 2, 7, 8, 9], 2) == ([10, 11], False)  # a smaller k takes a prefix
    assert used([0, 1, 2, 6], 3) == ([1, 2, 3], True)  # the rejection branch
    assert used([0, 1, 2, 7, 8, 5], 3) is None  # another bonus token
    assert used([0, 1, 2, 7, 4], 3) is None  # a rejection at a position not drafted for
    assert used([0, 1, 2, 5], 3) is None  # another recovered token
    assert used([0, 1, 2, 7, 8, 9, 1], 3) is None  # more committed since (a forced run)
    assert used([0, 1, 2, 7, 8, 9], 4) is None  # a longer block than was drafted
    assert used([0, 1], 1) is None
    assert PreDraft(3, (7,), block([9])).block_for([0, 1, 2, 7, 9], 1) is None  # only a guess


def test_a_pre_draft_drafts_as_many_branches_as_fit_in_a_verify():
    budget = BranchBudget(k=2)
    assert budget.passes(0) == 3 and budget.passes(2) == 1 + 3 + 4  # the guesses' pass, chain, branches
    assert budget.rejections(2) == 2  # nothing measured: all
    budget.observe(2, predraft_seconds=0.016, verify_seconds=0.020)  # 2 ms per pass: 8 passes fit in 20
    assert budget.rejections(2) == 2 and budget.rejections(1) == 1
    budget.observe(2, predraft_seconds=0.028, verify_seconds=0.020)  # the draft got busier: 3.5 ms per pass
    assert budget.pass_seconds == pytest.approx(0.7 * 0.0035 + 0.3 * 0.002)
    assert budget.rejections(2) == 1  # 6 passes x 3.05 ms fit in 20 ms, 8 do not
    budget.observe(1, predraft_seconds=0.030, verify_seconds=0.020)  # 5 ms per pass
    assert budget.rejections(2) == 0  # the chain alone: 3 passes
    for _ in range(3):
        budget.observe(0, predraft_seconds=0.030, verify_seconds=0.020)  # 10 ms per pass: not even the chain
    assert [budget.rejections(2) for _ in range(BUDGET_PROBE_EVERY)] == [None] * (BUDGET_PROBE_EVERY - 1) + [0]
    assert BranchBudget(k=2, fixed=1).rejections(2) == 1 and BranchBudget(k=2, fixed=5).rejections(2) == 2


# -- the engines -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["model", "ngram"])
@pytest.mark.parametrize("params", [SAMPLED, GREEDY], ids=["sampled", "greedy"])
def test_a_draft_proposes_after_assumed_tokens_what_it_proposes_once_they_are_committed(draft_model, kind, params):
    def started():
        engine = DraftEngine(draft_model) if kind == "model" else NgramDraft(VOCAB)
        engine.prefill("s", prompt, params)
        return engine

    prompt = [*PROMPT, 1, 2, 3, 4] if kind == "ngram" else PROMPT  # something for the lookup to find
    ahead, serial, other_serial = started(), started(), started()
    first = ahead.propose("s", 1, 3)
    assert serial.propose("s", 1, 3).tokens == other_serial.propose("s", 1, 3).tokens == first.tokens
    assumed = [*first.tokens, 4]
    drafted = ahead.propose("s", 2, 3, None, assumed)
    serial_block = serial.propose("s", 2, 3, Commit(1, len(prompt), tuple(assumed)))
    assert drafted.tokens and drafted.tokens == serial_block.tokens
    assert [q.prob(y) for y, q in zip(drafted.tokens, drafted.q, strict=True)] == pytest.approx(
        [q.prob(y) for y, q in zip(serial_block.tokens, serial_block.q, strict=True)]
    )
    # nothing was committed: another branch commits and drafts as if the pre-draft never ran
    other = (first.tokens[0], 6)
    assert (
        ahead.propose("s", 2, 3, Commit(1, len(prompt), other)).tokens
        == other_serial.propose("s", 2, 3, Commit(1, len(prompt), other)).tokens
    )
    if kind == "model":
        session = ahead.store.get("s")
        assert session.tokens == [*prompt, *other]
        assert session.cached[: len(session.tokens)] == session.tokens  # the assumed KV is gone


@pytest.mark.parametrize("params", [SAMPLED, GREEDY, INVARIANT], ids=["sampled", "greedy", "invariant"])
def test_rejection_branches_are_the_blocks_a_serial_draft_proposes_after_them(draft_model, params):
    ahead = DraftEngine(draft_model)
    ahead.prefill("s", PROMPT, params)
    first = ahead.propose("s", 1, 3)
    drafted = ahead.propose("s", 2, 3, None, first.tokens, rejections=3)
    assert [len(b.prefix) for b in drafted.branches] == [1, 2, 3]  # one per position of the block
    for j, branch in enumerate(drafted.branches):
        assert branch.prefix[:j] == tuple(first.tokens[:j]) and branch.prefix[j] != first.tokens[j]
        serial = DraftEngine(draft_model)
        serial.prefill("s", PROMPT, params)
        serial.propose("s", 1, 3)
        assert serial.propose("s", 2, 2, Commit(1, len(PROMPT), branch.prefix)).tokens == branch.block.tokens
    if params.greedy:  # the guess is the draft's next best token there
        session = DraftEngine(draft_model)
        session.prefill("t", PROMPT, params)
        logits = session.store.forward(session.store.get("t"))[0]
        assert drafted.branches[0].prefix[0] == int(logits.topk(2).indices[1])


def test_a_pre_draft_leaves_the_committed_state_alone(target_model, draft_model):
    draft = DraftEngine(draft_model)
    draft.prefill("s", PROMPT, SAMPLED)
    session = draft.store.get("s")
    counts = session.counts.clone()
    draft.propose("s", 1, 2, None, [9, 9, 9])
    assert session.tokens == PROMPT
    assert torch.equal(session.counts, counts)
    assert session.ledger.committed_step == 0


def test_a_feature_draft_cannot_draft_ahead(target_model):
    from specdec.training.distill_features import build_feature_draft

    model = build_feature_draft(
        target_model, list(range(VOCAB)), embed_size=8, heads=4, kv_heads=2, intermediate=32, seed=1
    )
    engine = FeatureDraftEngine(model.eval().requires_grad_(False))
    with pytest.raises(InvalidArgumentError, match="assumed"):
        engine.propose("s", 1, 2, None, [1])


@pytest.mark.parametrize("assumed", [[VOCAB], [-1], [1] * (MAX_BLOCK + 2)])
def test_bad_assumed_tokens_are_invalid_arguments(draft_model, assumed):
    for engine in (DraftEngine(draft_model), NgramDraft(VOCAB)):
        engine.prefill("s", PROMPT, SAMPLED)
        with pytest.raises(InvalidArgumentError, match="assumed"):
            engine.propose("s", 1, 2, None, assumed)


# -- the loop ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "temperature, invariant", [(0.0, False), (1.0, False), (1.0, True)], ids=["greedy", "sampled", "invariant"]
)
def test_a_pipelined_run_is_token_for_token_the_serial_run(target_model, draft_model, temperature, invariant):
    target, draft = TargetEngine(target_model), DraftEngine(draft_model)
    hits = predrafts = rejection_hits = 0
    for seed in range(12):
        params = SamplingParams(temperature=temperature, seed=seed, max_new_tokens=20, ignore_eos=True)
        params = dataclasses.replace(params, invariant=invariant)
        serial = speculative_generate(target, draft, PROMPT, params, 2)
        piped = speculative_generate(target, draft, PROMPT, params, 2, pipeline=True, pipeline_branches=2)
        assert piped.token_ids == serial.token_ids
        assert piped.stats.target_passes == serial.stats.target_passes
        hits, predrafts = hits + piped.stats.predraft_hits, predrafts + piped.stats.predrafts
        rejection_hits += piped.stats.predraft_rejection_hits
        assert serial.stats.predrafts == 0
    assert 0 < rejection_hits < hits < predrafts  # blocks of both kinds of branch used, and misses
    assert len(target.store) == len(draft.store) == 0


class _FailingPreDrafts(LocalDraft):
    """A draft replica whose pre-drafts fail (an older replica that refuses the field, a timeout)."""

    async def propose(self, session_id, step, k, commit, assumed=()):
        if assumed:
            raise RuntimeError("no pre-drafts here")
        return await super().propose(session_id, step, k, commit)


def test_a_failing_pre_draft_costs_nothing_but_itself(target_model, draft_model):
    target, draft = TargetEngine(target_model), DraftEngine(draft_model)
    serial = speculative_generate(target, draft, PROMPT, SAMPLED, 2)
    run = SpeculativeRun(
        LocalTarget(target), _FailingPreDrafts(draft), PROMPT, SAMPLED, 2, pipeline=True, pipeline_branches=2
    )

    async def go():
        async for _ in run.steps():
            pass

    asyncio.run(go())
    result = run.result()
    assert result.token_ids == serial.token_ids
    assert result.stats.predrafts > 0 and result.stats.predraft_hits == 0
    assert result.stats.draft_fallbacks == 0  # the draft itself still serves its own proposals
    assert len(target.store) == len(draft.store) == 0


def test_a_lost_verify_cancels_its_pre_draft_and_frees_everything(target_model, draft_model):
    target, draft = TargetEngine(target_model), DraftEngine(draft_model)

    class Fails(LocalTarget):
        calls = 0

        async def verify(self, *args, **kwargs):
            Fails.calls += 1
            if Fails.calls == 3:
                raise RuntimeError("target gone")
            return await super().verify(*args, **kwargs)

    run = SpeculativeRun(Fails(target), LocalDraft(draft), PROMPT, SAMPLED, 2, pipeline=True, pipeline_branches=2)

    async def go():
        async for _ in run.steps():
            pass

    with pytest.raises(RuntimeError, match="target gone"):
        asyncio.run(go())
    assert run.stats.predrafts >= 2
    assert len(target.store) == len(draft.store) == 0


# -- separate cores on one machine ---------------------------------------------------------------
def test_cpu_lists_parse_as_linux_writes_them():
    import argparse

    from specdec.apps.cli import build_parser
    from specdec.runtime.flags import cpu_set

    assert cpu_set("0") == {0}
    assert build_parser("serve").parse_args(["serve", "--target-cpus", "0-1", "--draft-cpus", "1"]).target_cpus == "0-1"
    with pytest.raises(SystemExit):  # a usage error naming the flag, before anything starts
        build_parser("serve").parse_args(["serve", "--draft-cpus", "one"])
    assert cpu_set("0-2,5") == {0, 1, 2, 5}
    for bad in ("", "a", "2-1", "-1", "0,,1"):
        with pytest.raises(argparse.ArgumentTypeError, match="CPU numbers"):
            cpu_set(bad)


def test_a_replica_pinned_to_cpus_runs_every_thread_there_with_a_thread_each():
    """--cpus pins the threads a process already has and those it starts later, and sets torch's
    thread count to the CPUs' count unless --threads says."""
    import os
    import subprocess
    import sys

    cpu = min(os.sched_getaffinity(0))
    code = f"""
import argparse, os, threading
from replica.servicer import add_replica_arguments, apply_pass_arguments
early = threading.Thread(target=threading.Event().wait, args=(5,), daemon=True)
early.start()
p = argparse.ArgumentParser()
add_replica_arguments(p)
args = p.parse_args(["--cpus", "{cpu}"])
apply_pass_arguments(args)
late = []
t = threading.Thread(target=lambda: late.append(os.sched_getaffinity(0)))
t.start(); t.join()
print(sorted(os.sched_getaffinity(early.native_id)), sorted(late[0]), args.threads)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[-2] == f"[{cpu}] [{cpu}] 1"
    bad = subprocess.run(
        [sys.executable, "-m", "specdec", "draft", "--model", "ngram", "--cpus", "4096"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "may run on CPUs" in bad.stderr


# -- where it pays: the coordinator pipelines a session whose draft and target compute apart ----
CPU_HERE = Placement("node-a", ("cpu",))


@pytest.mark.parametrize(
    "a, b, apart",
    [
        (CPU_HERE, Placement("node-a", ("cpu",)), False),  # one machine's CPUs: the draft slowed the target
        (CPU_HERE, Placement("node-b", ("cpu",)), True),  # two machines
        (Placement("node-a", ("cuda:GPU-1",)), Placement("node-a", ("cuda:GPU-2",)), True),  # GPUs of their own
        (Placement("node-a", ("cuda:GPU-1",)), Placement("node-a", ("cuda:GPU-1",)), False),  # one GPU shared
        (Placement("node-a", ("cuda:GPU-1", "cuda:GPU-2")), Placement("node-a", ("cuda:GPU-2",)), False),  # TP rank
        (Placement("node-a", ("cuda:GPU-1",)), CPU_HERE, False),  # a CPU draft beside a GPU target's host
        (Placement("", ("cpu",)), Placement("node-b", ("cpu",)), False),  # unknown: assume shared
        (Placement("node-a", ()), Placement("node-b", ("cpu",)), False),
    ],
)
def test_replicas_compute_apart_only_on_other_nodes_or_gpus_of_their_own(a, b, apart):
    assert computes_apart(a, b) is apart and computes_apart(b, a) is apart


def test_a_session_pipelines_as_asked_else_where_its_draft_and_target_compute_apart():
    from coordinator.routing import pipelines
    from specdec.runtime.registry import Replica

    def replica(kind: str, node: str, devices: str) -> Replica:
        return Replica(kind, f"{kind}-{node}", f"{node}:1", "m", "fp", node=node, devices=devices)

    target = replica("target", "a", "cpu")
    assert not pipelines(None, replica("draft", "a", "cpu"), target)
    assert pipelines(None, replica("draft", "b", "cpu"), target)
    assert not pipelines(None, replica("draft", "b", ""), target)  # a replica that does not say where it runs
    assert not pipelines(None, None, target)  # no draft replica
    assert pipelines(True, replica("draft", "a", "cpu"), target)  # the request (or --pipeline-drafts on) wins
    assert not pipelines(False, replica("draft", "b", "cpu"), target)


def test_placement_round_trips_the_registry_record_and_is_bounded():
    from specdec.runtime.registry import MAX_RECORD_DEVICES_TEXT, Replica, record_problem

    gpus = Replica("target", "t", "h:1", "m", "fp", node="node-a", devices="cuda:GPU-1,cuda:GPU-2")
    back = Replica.from_hash(gpus.to_hash())
    assert back == gpus and back.placement == Placement("node-a", ("cuda:GPU-1", "cuda:GPU-2"))
    assert Replica("target", "t", "h:1").placement == Placement("", ())  # an older record: unknown
    assert record_problem(gpus, "target") is None
    too_many = dataclasses.replace(gpus, devices="x" * (MAX_RECORD_DEVICES_TEXT + 1))
    assert "devices" in (record_problem(too_many, "target") or "")
    assert "node" in (record_problem(dataclasses.replace(gpus, node="n" * 5000), "target") or "")


def test_pipeline_drafts_is_auto_by_default_and_a_flag_a_serve_arg_or_an_environment_variable():
    import argparse

    from coordinator import settings
    from coordinator.main import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(["--target", "h:1"])).pipeline_drafts == "auto"
    assert config_from_args(parser.parse_args(["--target", "h:1", "--pipeline-drafts"])).pipeline_drafts == "on"
    assert config_from_args(parser.parse_args(["--target", "h:1", "--pipeline-drafts", "off"])).pipeline_drafts == "off"
    with pytest.raises(SystemExit):
        parser.parse_args(["--target", "h:1", "--pipeline-drafts", "sometimes"])
    assert settings.parse_values({"pipeline_drafts": True}) == {"pipeline_drafts": "on"}  # a YAML boolean
    assert settings.values_from_env({"SPECDEC_PIPELINE_DRAFTS": "false"}) == {"pipeline_drafts": "off"}
    with pytest.raises(ValueError, match=r"pipeline_drafts.*auto, on, off"):
        settings.parse_values({"pipeline_drafts": "sometimes"})


@pytest.mark.parametrize("setting, parsed", [("auto", None), ("on", True), ("off", False)])
def test_a_request_that_does_not_say_takes_the_setting_and_auto_is_decided_per_session(setting, parsed):
    from coordinator.config import CoordinatorConfig
    from coordinator.requests import RequestParser, canonical
    from specdec.v1 import coordinator_pb2 as pb

    parser = RequestParser(CoordinatorConfig(target_address="h:1", pipeline_drafts=setting))
    parser.vocab_size, parser.context_length = 32, 64
    request = pb.GenerateRequest(prompt_token_ids=[1, 2, 3])
    mine = parser.parse(request, "r")
    assert mine.pipeline is parsed
    stored = pb.GenerateRequest.FromString(canonical(request, "r", mine.resolved()))
    # auto stays a choice of whichever coordinator runs it (the same tokens either way)
    assert stored.speculation.HasField("pipeline") is (parsed is not None)
    asked = pb.GenerateRequest(prompt_token_ids=[1, 2, 3])
    asked.speculation.pipeline = False
    assert parser.parse(asked, "r").pipeline is False  # the request's own word wins


@pytest.mark.integration
def test_a_draft_on_another_node_is_pipelined_by_default_and_gives_the_same_tokens(tmp_path, target_model, draft_model):
    """Through a real stack: a draft replica that reports another node (--node-name) gets
    pre-drafts without the request asking; a request saying off gets none; the tokens agree."""
    from stack_util import info, request, stub

    from specdec.apps.launcher import local_stack
    from specdec.modeling.tiny import word_tokenizer

    for name, model in (("target", target_model), ("draft", draft_model)):
        model.save_pretrained(tmp_path / name)
        word_tokenizer(VOCAB).save_pretrained(tmp_path / name)
    with local_stack(
        str(tmp_path / "target"),
        str(tmp_path / "draft"),
        num_speculative_tokens=2,
        log_dir=tmp_path / "logs",
        extra_draft=["--node-name", "another-node"],
        http_port=0,
    ) as stack:
        draft_address = next(c.address for c in stack.children if c.name == "draft-0")
        assert info(draft_address, "draft").node == "another-node"
        coordinator = stub(stack.coordinator_address)
        replies = {
            asked: coordinator.Generate(
                request(PROMPT, k=2, adaptive=False, pipeline=asked, temperature=1.0, seed=11, max_new_tokens=40),
                timeout=120,
            )
            for asked in (None, False)
        }
    assert replies[None].stats.predrafts > 0 and replies[None].stats.predraft_hits > 0
    assert replies[False].stats.predrafts == 0
    assert list(replies[None].token_ids) == list(replies[False].token_ids)
