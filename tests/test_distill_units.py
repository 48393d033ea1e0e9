"""Pure helpers of `specdec distill`: self-written prompts and the learning-rate schedule."""

import argparse
import math

import pytest

from specdec.modeling.tiny import word_tokenizer
from specdec.training.corpus import sharded_records
from specdec.training.distill import add_arguments, check_arguments
from specdec.training.self_prompts import finished_messages, user_turn_opening
from specdec.training.trainer import warmup_cosine


def test_finished_messages_cut_at_the_first_end_token_and_drop_unfinished_ones():
    rows = [[5, 6, 2, 7], [5, 6, 7, 8], [2, 9], [9, 3, 2]]
    assert finished_messages(rows, {2, 3}, need_end=True) == [[5, 6], [], [9]]
    # a target without end tokens: every row is a message
    assert finished_messages(rows, set(), need_end=False) == rows


def test_user_turn_opening_of_a_plain_tokenizer_is_one_token():
    assert user_turn_opening(word_tokenizer(32)) == [0]


@pytest.mark.slow
def test_user_turn_opening_is_the_chat_prefix_of_a_user_message(smollm2):
    from specdec.modeling.loading import encode_prompt

    _, tokenizer = smollm2
    opening = user_turn_opening(tokenizer)
    assert tokenizer.decode(opening).endswith("<|im_start|>user\n")
    encoded = encode_prompt(tokenizer, "Name a fruit.", chat=True)
    assert encoded[: len(opening)] == opening  # what the target then writes is the message itself


def test_learning_rate_follows_steps_or_the_time_budget_whichever_is_further():
    def lr(step, spent, floor=0.1):
        return warmup_cosine(step, steps=1000, lr=1.0, warmup=10, floor=floor, budget_fraction=spent)

    assert lr(0, 0.0) == pytest.approx(0.1)  # warm-up
    assert lr(10, 0.0) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.01)))
    assert lr(500, 0.0) == pytest.approx(0.55)  # half way by steps
    assert lr(100, 0.5) == pytest.approx(0.55)  # half way by time
    assert lr(100, 1.0) == pytest.approx(0.1)  # budget spent: the floor
    assert lr(2000, 0.0) == pytest.approx(0.1)  # never below it
    assert lr(2000, 0.0, floor=0.05) == pytest.approx(0.05)  # the feature drafts' floor
    assert lr(500, 0.0, floor=0.05) == pytest.approx(0.525)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--self-prompts", "-3"], "--self-prompts must be >= 0"),
        (["--self-prompt-tokens", "0"], "--self-prompt-tokens must be >= 1"),
        (["--self-prompt-temperature", "0"], "--self-prompt-temperature must be > 0"),
        (["--time-budget-minutes", "-1"], "--time-budget-minutes must be >= 0"),
        (["--device", "gpu0"], "is not a device"),
        (["--corpus-minutes", "-1"], "--corpus-minutes must be >= 0"),
        (["--corpus-minutes", "5", "--time-budget-minutes", "5"], "leaves no training time"),
        (["--bench-tokens", "0"], "--bench-tokens must be >= 1"),
        (["--compare-draft", "/no/such/draft"], "no such model directory"),
        (["--init-from", "/no/such/draft"], "--init-from /no/such/draft: no such model directory"),
        (["--init-from", "/tmp"], "no config.json or model.safetensors there"),
    ],
)
def test_bad_settings_are_refused_before_loading_anything(flags, message):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit, match=message):
        check_arguments(parser.parse_args(["--target", "t", "--out", "o", *flags]))


def test_cuda_without_a_gpu_is_refused_clearly(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit, match="no CUDA GPU"):
        check_arguments(parser.parse_args(["--target", "t", "--out", "o", "--device", "cuda"]))
    assert check_arguments(parser.parse_args(["--target", "t", "--out", "o", "--device", "auto"])).type == "cpu"


def test_precision_auto_is_bf16_only_where_the_device_has_it_natively():
    import torch

    from specdec.training.trainer import student_bf16

    cpu = torch.device("cpu")
    assert student_bf16("auto", cpu, native=lambda d: True) is True
    assert student_bf16("auto", cpu, native=lambda d: False) is False
    assert student_bf16("bf16", cpu, native=lambda d: False) is True  # asked for: emulated, but done
    assert student_bf16("fp32", cpu, native=lambda d: True) is False
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--target", "t", "--out", "o", "--device", "cpu", "--precision", "fp32"])
    check_arguments(args)
    assert args.student_bf16 is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--target", "t", "--out", "o", "--precision", "fp16"])


def test_a_corpus_past_its_deadline_keeps_its_finished_shards_and_starts_no_new_batch(tmp_path):
    import time
    from dataclasses import asdict, dataclass

    @dataclass
    class Row:
        batch: int

        def as_dict(self):
            return asdict(self)

    made: list[int] = []

    def make(b):
        made.append(b)
        return [Row(b)]

    def build(deadline):
        return [r.batch for r in sharded_records(tmp_path, 5, make, Row, lambda r: 1, deadline)]

    assert build(time.monotonic() - 1) == [] and made == []  # the cap came first: nothing made
    assert build(time.monotonic() + 3600) == [0, 1, 2, 3, 4] and made == [0, 1, 2, 3, 4]
    (tmp_path / "shard-00003.pt").unlink()
    made.clear()
    # finished shards are read past the deadline; the first missing one ends the corpus there
    assert build(time.monotonic() - 1) == [0, 1, 2] and made == []
    assert build(None) == [0, 1, 2, 3, 4] and made == [3]


def test_the_agreement_command_refuses_what_it_cannot_score(capsys):
    from specdec.training.agreement import main

    for argv, message in (
        (["--target", "t", "/no/such/draft"], "/no/such/draft: no such model directory"),
        (["--target", "t", "--tokens", "0", "/tmp"], "--tokens must be >= 1"),
    ):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2 and message in capsys.readouterr().err
