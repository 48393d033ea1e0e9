"""Incremental detokenization and stop strings (specdec.loop.stopping) against the one-shot decode,
with the default target's tokenizer, on the bench prompts and on text full of multi-byte
characters, fed in blocks of 1-4 tokens as speculative steps emit them."""

from __future__ import annotations

import random

import pytest

from specdec.exact.sampling import SamplingParams
from specdec.loop.stopping import FINISH_LENGTH, FINISH_STOP, IncrementalDetokenizer, StopChecker
from specdec.modeling.loading import load_tokenizer
from specdec.training.prompts import BENCH_PROMPTS, load_prompts

MULTIBYTE = [
    "Grüße aus Köln: 東京タワーは高さ333メートルです。🙂🚀 naïve café — “quoted” ½ ∑ x² ≤ ∞",
    "emoji in a row 👩‍👩‍👧‍👦👍🏽🇫🇷 then ascii, then 한국어 텍스트 and Ελληνικά.",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


def texts() -> list[str]:
    return [p["text"] for p in load_prompts(BENCH_PROMPTS)] + MULTIBYTE


def blocks(tokens: list[int], seed: int) -> list[list[int]]:
    """``tokens`` cut into blocks of 1-4, as steps commit them."""
    rng, out, i = random.Random(seed), [], 0
    while i < len(tokens):
        n = rng.randint(1, 4)
        out.append(tokens[i : i + n])
        i += n
    return out


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 100_000, "ignore_eos": True, "seed": 0, **kw})


@pytest.mark.parametrize("stop", [(), ("a stop string that never occurs",)], ids=["no-stop", "stop-held-back"])
def test_the_streamed_text_is_the_one_shot_decode_for_every_bench_prompt(tokenizer, stop):
    assert len(texts()) == 32 + len(MULTIBYTE)
    for n, text in enumerate(texts()):
        tokens = tokenizer(text)["input_ids"]
        whole = tokenizer.decode(tokens, skip_special_tokens=True)
        stopper = StopChecker(params(stop=stop), tokenizer=tokenizer)
        streamed = []
        for block in blocks(tokens, seed=n):
            assert stopper.feed(block) == block
            piece = stopper.take_text()
            assert "\ufffd" not in piece  # half a character is held back, never sent
            streamed.append(piece)
        streamed.append(stopper.take_text(final=True))
        assert "".join(streamed) == whole == stopper.text(), text[:40]


def test_multibyte_characters_split_over_tokens_are_held_back_until_complete(tokenizer):
    tokens = tokenizer("🚀")["input_ids"]
    assert len(tokens) > 1  # byte-level BPE: the emoji's four bytes come in several tokens
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.add(t) for t in tokens[:-1]] == [""] * (len(tokens) - 1)
    assert detokenizer.unsettled().endswith("\ufffd")
    assert detokenizer.add(tokens[-1]) == "🚀"


def test_a_generation_cut_inside_a_character_ends_with_what_the_one_shot_decode_gives(tokenizer):
    tokens = tokenizer("ok 🚀")["input_ids"][:-1]  # max_new_tokens lands inside the emoji
    stopper = StopChecker(params(max_new_tokens=len(tokens)), tokenizer=tokenizer)
    stopper.feed(tokens)
    assert stopper.finish_reason == FINISH_LENGTH
    assert stopper.take_text() + stopper.take_text(final=True) == tokenizer.decode(tokens) == stopper.text()


@pytest.mark.parametrize("seed", range(6))
def test_stop_strings_across_token_and_block_boundaries_cut_exactly_where_they_start(tokenizer, seed):
    rng = random.Random(seed)
    text = rng.choice(texts())
    tokens = tokenizer(text)["input_ids"]
    whole = tokenizer.decode(tokens)
    start = rng.randrange(len(whole) // 3, len(whole) - 12)
    stop = whole[start : start + rng.randint(2, 9)]  # anywhere: inside a token or across several
    first = whole.find(stop)
    stopper = StopChecker(params(stop=("never there", stop)), tokenizer=tokenizer)
    streamed, emitted = [], []
    for block in blocks(tokens, seed):
        emitted += stopper.feed(block)
        streamed.append(stopper.take_text())
        if stopper.finished:
            break
    streamed.append(stopper.take_text(final=True))
    assert stopper.finish_reason == FINISH_STOP
    assert "".join(streamed) == whole[:first] == stopper.text()
    # the output ends with the token that completed the stop string, not a token later
    assert stop in tokenizer.decode(emitted) and stop not in tokenizer.decode(emitted[:-1])


def test_a_resumed_request_sends_only_the_text_after_what_was_committed(tokenizer):
    tokens = tokenizer(MULTIBYTE[0])["input_ids"]
    cut = len(tokens) // 2
    stopper = StopChecker(params(), tokenizer=tokenizer)
    stopper.resume(tokens[:cut])
    assert stopper.take_text() == ""  # its client has the committed text already
    stopper.feed(tokens[cut:])
    rest = stopper.take_text(final=True)
    settled_before = IncrementalDetokenizer(tokenizer)
    before = "".join(settled_before.add(t) for t in tokens[:cut])
    assert before + rest == tokenizer.decode(tokens) == stopper.text()


class CountingTokenizer:
    """Records how many tokens each decode call is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, tokens, **kw):
        self.lengths.append(len(tokens))
        return self.tokenizer.decode(tokens, **kw)


def test_each_token_costs_a_decode_of_a_few_tokens_not_of_the_whole_output(tokenizer):
    tokens = [t for text in texts() for t in tokenizer(text)["input_ids"]]
    assert len(tokens) > 500
    counting = CountingTokenizer(tokenizer)
    stopper = StopChecker(params(stop=("a stop string that never occurs",)), tokenizer=counting)
    for block in blocks(tokens, seed=1):
        stopper.feed(block)
        stopper.take_text()
    assert len(counting.lengths) == 2 * len(tokens)  # two window decodes per token, no full decode
    assert max(counting.lengths) <= 12  # windows of a few tokens (a character spans at most 4 bytes)


def test_tokens_that_never_complete_a_character_cost_a_bounded_window_each(tokenizer):
    """4096 lone continuation bytes (a model forced to emit them) used to re-decode the whole
    unsettled run for each token -- quadratic, seconds on the event loop (issue 42, item 4).
    Now a run that completes no character for MAX_UNSETTLED_TOKENS is settled as it decodes,
    and the streamed text still adds up to the final text."""
    from specdec.loop.stopping import MAX_UNSETTLED_TOKENS

    lone = next(t for t in range(tokenizer.vocab_size) if tokenizer.decode([t]) == "\ufffd")
    tokens = [lone] * 4096 + tokenizer("then words")["input_ids"]
    counting = CountingTokenizer(tokenizer)
    stopper = StopChecker(params(), tokenizer=counting)
    streamed = []
    for block in blocks(tokens, seed=2):
        stopper.feed(block)
        streamed.append(stopper.take_text())
    streamed.append(stopper.take_text(final=True))
    assert max(counting.lengths) <= 2 * MAX_UNSETTLED_TOKENS  # the settled run as context, and a new one
    assert "".join(streamed) == stopper.text() and stopper.text().endswith("then words")
    assert stopper.text().count("\ufffd") >= 4096 // MAX_UNSETTLED_TOKENS


def test_nothing_ends_the_request_before_min_tokens():
    stopper = StopChecker(SamplingParams(max_new_tokens=8, min_tokens=3, stop_token_ids=(5,)), eos_token_ids=(9,))
    assert stopper.feed([5, 9]) == [5, 9] and not stopper.finished  # a stop id and EOS, too early to count
    assert stopper.feed([5, 7]) == [5] and stopper.finish_reason == FINISH_STOP  # the third token may end it
