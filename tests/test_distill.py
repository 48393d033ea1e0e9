"""`specdec distill` on a tiny target: a loadable draft, same tokenizer, KL to the target goes down,
and a run resumes from its checkpoint."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.engine.draft import DraftEngine
from specdec.engine.target import TargetEngine
from specdec.exact.sampling import SamplingParams
from specdec.loop.generate import speculative_generate
from specdec.modeling.loading import load_model, load_tokenizer, tokenizer_fingerprint
from specdec.modeling.tiny import tiny_llama, word_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SPECDEC = str(Path(sys.executable).with_name("specdec"))
SMALL = [
    "--num-prompts",
    "6",
    "--samples-per-prompt",
    "2",
    "--gen-tokens",
    "24",
    "--layers",
    "1",
    "--hidden",
    "16",
    "--heads",
    "2",
    "--kv-heads",
    "1",
    "--intermediate",
    "32",
    "--batch-size",
    "4",
    "--seq-len",
    "48",
    "--gen-batch-size",
    "4",
    "--head-vocab",
    "24",
    "--lr",
    "1e-2",
    "--checkpoint-every",
    "20",
    "--eval-sequences",
    "3",
]


def test_distill_tiny_target(tmp_path):
    target = tiny_llama(32, seed=12, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    target.save_pretrained(tmp_path / "target")
    word_tokenizer(32).save_pretrained(tmp_path / "target")
    out = tmp_path / "draft"
    first = subprocess.run(
        [SPECDEC, "distill", "--target", str(tmp_path / "target"), "--out", str(out), "--steps", "40", *SMALL],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert first.returncode == 0, first.stderr[-2000:]
    # resume: the same run continued to 80 steps starts from the step-40 checkpoint
    second = subprocess.run(
        [SPECDEC, "distill", "--target", str(tmp_path / "target"), "--out", str(out), "--steps", "80", *SMALL],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert second.returncode == 0 and "resuming from" in second.stderr and "at step 40" in second.stderr
    # one corpus per prompt file (the default is three files), each guarded by its settings
    assert sorted(p.name for p in (out / "corpus").iterdir()) == [
        "distill_prompts.v1",
        "distill_prompts_extra.v1",
        "distill_prompts_more.v1",
    ]
    changed = list(SMALL)
    changed[changed.index("--gen-tokens") + 1] = "20"
    third = subprocess.run(
        [SPECDEC, "distill", "--target", str(tmp_path / "target"), "--out", str(out), "--steps", "80", *changed],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert third.returncode != 0 and "generated with other settings" in third.stderr
    # the same corpus under another head vocabulary: the checkpoint's head rows meant other tokens
    other_head = list(SMALL)
    other_head[other_head.index("--head-vocab") + 1] = "20"
    fourth = subprocess.run(
        [SPECDEC, "distill", "--target", str(tmp_path / "target"), "--out", str(out), "--steps", "100", *other_head],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert fourth.returncode != 0 and "was trained on other data" in fourth.stderr and "--restart" in fourth.stderr
    assert "head_vocab: 24 tokens" in fourth.stderr and "20 tokens" in fourth.stderr
    report = json.loads((out / "distill.json").read_text())
    assert report["steps"] == 80 and report["kl_end"] < report["kl_start"]
    assert report["top1_end"] >= report["top1_start"] and (out / "README.md").read_text().count("specdec distill")
    assert (out / "head_vocab.json").exists() and len(
        json.loads((out / "head_vocab.json").read_text())["token_ids"]
    ) == 24
    draft = load_model(str(out), "cpu", quiet=True)  # a normal HF directory
    assert draft.config.vocab_size == 32
    assert tokenizer_fingerprint(load_tokenizer(str(out))) == tokenizer_fingerprint(
        load_tokenizer(str(tmp_path / "target"))
    )
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as weights:  # shipped in bf16
        assert {weights.get_tensor(k).dtype for k in weights.keys()} == {torch.bfloat16}  # noqa: SIM118 - safe_open is not iterable
    # and it works as a draft: greedy speculative output is the target's own
    greedy = SamplingParams(temperature=0.0, seed=0, max_new_tokens=20, ignore_eos=True)
    expected = target.generate(
        torch.tensor([[1, 2, 3]]), do_sample=False, max_new_tokens=20, min_new_tokens=20, pad_token_id=0
    )[0, 3:].tolist()
    assert (
        speculative_generate(TargetEngine(target), DraftEngine(draft.float()), [1, 2, 3], greedy, 3).token_ids
        == expected
    )

    # --init-from: a run starts from a saved draft's weights (here the one just exported), so with no
    # training steps its starting KL is that draft's, not an untrained student's
    start = [SPECDEC, "distill", "--target", str(tmp_path / "target"), "--out", str(out), *SMALL, "--restart"]
    again = subprocess.run(
        [*start, "--init-from", str(out), "--steps", "0"], capture_output=True, text=True, timeout=600, check=False
    )
    assert again.returncode == 0 and "starting from the weights of" in again.stderr, again.stderr[-2000:]
    started = json.loads((out / "distill.json").read_text())
    assert started["kl_start"] == pytest.approx(report["kl_end"], rel=0.05) and started["kl_start"] < report["kl_start"]
    wrong = subprocess.run(
        [*start, "--init-from", str(out), "--steps", "0", "--layers", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert wrong.returncode != 0 and "has another shape" in wrong.stderr and "model.layers.1" in wrong.stderr


def test_distill_self_prompts_and_time_budget(tmp_path):
    """--self-prompts: the target writes prompts (a fourth corpus, reused by a second run);
    --time-budget-minutes ends a run that could never reach its step count, and the export is
    the best evaluation seen."""
    target = tiny_llama(32, seed=12, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    target.save_pretrained(tmp_path / "target")
    word_tokenizer(32).save_pretrained(tmp_path / "target")
    out = tmp_path / "draft"
    args = [
        SPECDEC,
        "distill",
        "--target",
        str(tmp_path / "target"),
        "--out",
        str(out),
        *SMALL,
        "--self-prompts",
        "5",
        "--self-prompt-tokens",
        "10",
        "--eval-every",
        "10",
    ]
    first = subprocess.run([*args, "--steps", "30"], capture_output=True, text=True, timeout=600, check=False)
    assert first.returncode == 0, first.stderr[-2000:]
    written = [json.loads(line) for line in (out / "corpus" / "self_prompts.jsonl").read_text().splitlines()]
    assert len(written) == 5 and len({p["text"] for p in written}) == 5
    assert all(p["text"].split()[0].startswith("w") for p in written)  # text in the target's own vocabulary
    assert (out / "corpus" / "self_prompts").is_dir()  # and the target answered them
    report = json.loads((out / "distill.json").read_text())
    assert report["settings"]["self_prompts"] == 5 and report["stopped_by"] == "steps"
    assert report["exported_step"] in (10, 20, 30)
    # the export is scored on the held-out bench prompts, as the agreement module scores any draft
    assert report["bench_split"] == "heldout" and report["bench_positions"] > 0
    assert 0.0 <= report["bench_top1"] <= 1.0 and f"{report['bench_top1']:.3f}" in (out / "README.md").read_text()
    first = tmp_path / "first"
    shutil.copytree(out, first, ignore=shutil.ignore_patterns("corpus", "checkpoint.pt"))
    scored = subprocess.run(
        [sys.executable, "-m", "specdec.training.agreement", "--target", str(tmp_path / "target"), str(first)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    assert json.loads(scored.stdout)["top1"][str(first)] == report["bench_top1"]

    budget = subprocess.run(
        [*args, "--steps", "1000000", "--time-budget-minutes", "0.1", "--compare-draft", str(first)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert budget.returncode == 0, budget.stderr[-2000:]
    assert "reusing 5 self-written prompts" in budget.stderr and "time budget reached" in budget.stderr
    report = json.loads((out / "distill.json").read_text())
    assert report["stopped_by"] == "time budget" and 30 <= report["steps"] < 1_000_000
    assert report["compare_draft"] == str(first)
    assert report["compare_draft_bench_top1"] == json.loads(scored.stdout)["top1"][str(first)]
    assert load_model(str(out), "cpu", quiet=True).config.vocab_size == 32


FEATURE = [
    "--kind",
    "feature",
    "--num-prompts",
    "6",
    "--samples-per-prompt",
    "2",
    "--gen-tokens",
    "24",
    "--gen-batch-size",
    "4",
    "--head-vocab",
    "24",
    "--embed-size",
    "8",
    "--batch-size",
    "4",
    "--seq-len",
    "64",
    "--lr",
    "1e-2",
    "--eval-every",
    "20",
    "--checkpoint-every",
    "20",
    "--eval-sequences",
    "3",
]


def test_distill_feature_draft_tiny_target(tmp_path):
    """--kind feature: a corpus of answers with the target's hidden states (greedy + sampled), a
    one-layer draft whose held-out agreement rises at every drafting step, resumable, loadable,
    same tokenizer, bf16 weights, and a working draft: greedy output is the target's, and it is
    accepted far more often than the untrained draft."""
    from specdec.engine.draft import FeatureDraftEngine
    from specdec.modeling.feature_draft import FeatureDraft
    from specdec.training.distill_features import build_feature_draft

    target = tiny_llama(32, seed=12, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    target.save_pretrained(tmp_path / "target")
    word_tokenizer(32).save_pretrained(tmp_path / "target")
    out = tmp_path / "draft"
    base = [SPECDEC, "distill", "--target", str(tmp_path / "target"), "--out", str(out), *FEATURE]
    first = subprocess.run([*base, "--steps", "40"], capture_output=True, text=True, timeout=600, check=False)
    assert first.returncode == 0, first.stderr[-2000:]
    second = subprocess.run([*base, "--steps", "80"], capture_output=True, text=True, timeout=600, check=False)
    assert second.returncode == 0 and "resuming from" in second.stderr and "at step 40" in second.stderr
    assert "reusing" in second.stderr  # the corpus shards were not generated again
    # another held-out split of the same corpus: resuming would score (and pick weights) on
    # sequences the checkpoint trained on, so it is refused
    split = list(FEATURE)
    split[split.index("--eval-sequences") + 1] = "2"
    third = subprocess.run(
        [SPECDEC, "distill", "--target", str(tmp_path / "target"), "--out", str(out), *split, "--steps", "100"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert third.returncode != 0 and "was trained on other data" in third.stderr
    assert "held_out_sequences: 6 then, 4 now" in third.stderr  # 3 then 2 from each of its two corpora
    assert sorted(p.name for p in (out / "corpus").iterdir()) == ["features-greedy", "features-sampled-1"]
    report = json.loads((out / "distill.json").read_text())
    assert report["kind"] == "feature" and report["steps"] == 80 and len(report["top1_by_step_end"]) == 3
    assert all(
        end > start + 0.2 for start, end in zip(report["top1_by_step_start"], report["top1_by_step_end"], strict=True)
    )
    assert "Feature draft" in (out / "README.md").read_text()
    draft = load_model(str(out), "cpu", quiet=True)
    assert isinstance(draft, FeatureDraft) and draft.config.hidden_size == 32 and len(draft.head_token_ids) == 24
    assert tokenizer_fingerprint(load_tokenizer(str(out))) == tokenizer_fingerprint(
        load_tokenizer(str(tmp_path / "target"))
    )
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        names = [k for k in weights.keys() if k != "head_token_ids"]  # noqa: SIM118 - safe_open is not iterable
        assert {weights.get_tensor(k).dtype for k in names} == {torch.bfloat16}
    greedy = SamplingParams(temperature=0.0, seed=0, max_new_tokens=30, ignore_eos=True)
    from specdec.modeling.loading import encode_prompt
    from specdec.training.prompts import DEFAULT_DISTILL_PROMPTS

    text = json.loads(Path(DEFAULT_DISTILL_PROMPTS.split(",")[0]).read_text().splitlines()[-1])["text"]
    prompt = encode_prompt(load_tokenizer(str(out)), text, chat=True)  # like the corpus's (unseen) prompts
    ids = torch.tensor([prompt])  # (token 0 is in the prompt: the mask must not treat it as padding)
    expected = target.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=30, min_new_tokens=30, pad_token_id=0
    )[0, len(prompt) :].tolist()
    trained = speculative_generate(TargetEngine(target), FeatureDraftEngine(draft.float()), prompt, greedy, 3)
    assert trained.token_ids == expected
    fresh = build_feature_draft(target, draft.head_token_ids.tolist(), 8, 4, 2, 64, seed=0).eval()
    untrained = speculative_generate(TargetEngine(target), FeatureDraftEngine(fresh), prompt, greedy, 3)
    assert untrained.token_ids == expected
    assert trained.stats.acceptance_rate > untrained.stats.acceptance_rate + 0.3
