"""The draft is an optimization: killing it mid-request must not fail or change the request."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from stack_util import request, stub

from specdec.apps.launcher import local_stack
from specdec.modeling.tiny import perturbed, tiny_llama, word_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NEW_TOKENS = 600


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill-models")
    target = tiny_llama(32, seed=8, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_positions=2048)
    target.save_pretrained(root / "target")
    word_tokenizer(32).save_pretrained(root / "target")
    perturbed(target, scale=0.04, seed=1).save_pretrained(root / "draft")
    word_tokenizer(32).save_pretrained(root / "draft")  # same tokenizer: a compatible draft
    with local_stack(
        str(root / "target"),
        str(root / "draft"),
        num_speculative_tokens=2,
        log_dir=tmp_path_factory.mktemp("kill-logs"),
        extra_coordinator=["--draft-timeout", "2"],
    ) as s:
        s.target_model = target
        yield s


def test_draft_killed_mid_request_changes_nothing(stack):
    prompt = [5, 6, 7, 8]
    with torch.inference_mode():
        expected = stack.target_model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    draft = stack.child("draft-0")
    # fixed k: speculation must be on before the kill (the load-aware default may choose k = 0)
    req = request(prompt, k=2, adaptive=False, temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    tokens, last = [], None
    for chunk in stub(stack.coordinator_address).GenerateStream(req, timeout=300):
        if not tokens:
            os.kill(draft.process.pid, signal.SIGKILL)  # kill -9 after the first committed tokens
        tokens.extend(chunk.token_ids)
        last = chunk
    assert tokens == expected
    assert last.finish_reason == "length"
    assert last.stats.draft_fallbacks == 1
    assert last.stats.accepted_tokens > 0  # speculation was on before the kill

    # with the draft gone for good, new requests still complete (target-only), unchanged (fixed
    # k: a load-aware request that never speculates would never start, nor miss, a draft session)
    again = stub(stack.coordinator_address).Generate(
        request(prompt, k=2, adaptive=False, temperature=0.0, max_new_tokens=40, ignore_eos=True), timeout=120
    )
    assert list(again.token_ids) == expected[:40]
    assert again.stats.draft_fallbacks == 1 and again.stats.proposed_tokens == 0


def test_draft_killed_mid_pipeline_changes_nothing(stack):
    """The same with pipelined drafting (docs/pipelining.md): the draft dies with a pre-draft in
    flight or its blocks drafted ahead in hand; the request loses nothing and changes nothing."""
    prompt = [9, 6, 7, 8]
    with torch.inference_mode():
        expected = stack.target_model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=200, min_new_tokens=200, pad_token_id=0
        )[0, len(prompt) :].tolist()
    draft = stack.add_replica("draft", "draft-1")  # (the first test killed draft-0 for good)
    req = request(prompt, k=2, adaptive=False, pipeline=True, temperature=0.0, max_new_tokens=200, ignore_eos=True)
    tokens, last = [], None
    for chunk in stub(stack.coordinator_address).GenerateStream(req, timeout=300):
        if len(tokens) < 20 <= len(tokens) + len(chunk.token_ids):
            os.kill(draft.process.pid, signal.SIGKILL)  # mid-request, pre-drafts under way
        tokens.extend(chunk.token_ids)
        last = chunk
    assert tokens == expected
    assert last.finish_reason == "length"
    assert last.stats.draft_fallbacks == 1
    assert last.stats.predrafts > 0 and last.stats.accepted_tokens > 0  # it pipelined before the kill
