"""``specdec distill``: build a small draft for any HF causal-LM target, sharing its tokenizer.

1. Corpus: the target answers every prompt of a versioned prompt set (chat template when it has
   one), once greedily and ``--samples-per-prompt - 1`` times by seeded sampling, in batches. For
   each generated token we keep the target's own next-token distribution (its top ``--teacher-top``
   log-probabilities), so training never runs the target again. Batches are written as shards to
   ``OUT/corpus/`` as they finish; an interrupted run picks up at the first missing shard.
   With ``--self-prompts N`` the target also writes N user messages itself (seeded sampling from
   the opening of a user turn in its chat format) and answers those too: varied data beyond the
   templated prompt files, in the target's own idea of what users ask.
2. Head vocabulary: the ``--head-vocab`` tokens carrying the most teacher probability mass. The
   draft computes output logits over those only (``head_vocab.json``, see ``specdec.modeling.heads``);
   every other token has q = 0, which is exact because the verifier's residual supplies it.
3. Student: a compact Llama (a few layers, small width) over the target's full vocabulary with
   tied embeddings, initialised from the target's embeddings projected onto their top principal
   directions (so token identities start out meaningful).
4. Knowledge distillation: minimise KL(p_target || q_student) over the head vocabulary (the
   teacher's top tokens, renormalised, softened by ``--kd-temperature``) at every generated position.
5. Output: a normal Hugging Face directory (config, safetensors in bf16/fp16, tokenizer files,
   ``head_vocab.json``) that ``specdec draft --model OUT`` loads, and ``distill.json`` with the
   settings and the held-out KL / top-1 agreement (the greedy acceptance rate's proxy) before and after.

Seeded and reproducible; progress bars; checkpoints every ``--checkpoint-every`` steps to
``OUT/checkpoint.pt`` and resumes from it. Runs on the CPU or a GPU (``--device``; the student
trains in bf16 autocast where the device has native bf16, ``--precision``);
``--time-budget-minutes`` makes a run end on time (training stops early with its learning-rate
schedule compressed to fit), and the draft exported is the one with the best held-out agreement
seen at an evaluation.

This module is the command (its flags, their checks) and the order of the steps; each step lives
in a module of its own: the corpus in ``logprob_corpus`` (the prompts the target writes in
``self_prompts``), the head vocabulary, the student model and its export in ``student``, batches,
loss and evaluation in ``student_training``, the bench yardstick in ``agreement``; ``--kind
feature`` goes to ``distill_features``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdec.training.agreement import bench_agreements, bench_records, saved_draft_missing
from specdec.training.corpus import say
from specdec.training.distill_features import distill_feature_draft
from specdec.training.logprob_corpus import Record, build_corpus, corpus_settings
from specdec.training.prompts import BENCH_PROMPTS, DEFAULT_DISTILL_PROMPTS, load_prompts
from specdec.training.self_prompts import write_self_prompts
from specdec.training.student import (
    build_student,
    choose_head_vocab,
    export,
    head_coverage,
    head_slots,
    start_from_draft,
    write_model_card,
)
from specdec.training.student_training import Training, train_student
from specdec.training.trainer import split_records, student_bf16, training_data


def prompt_files(spec: str, self_prompts: int = 0) -> list[Path]:
    """The prompt files of ``--prompts``; none (``''``) only when the target writes its own."""
    files = [Path(p).expanduser() for p in spec.split(",") if p.strip()]
    missing = [str(f) for f in files if not f.is_file()]
    if (not files and not self_prompts) or missing:
        raise SystemExit(f"prompt file(s) not found: {', '.join(missing) or spec!r} (and no --self-prompts)")
    return files


def check_arguments(args) -> torch.device:
    """Refuse settings that cannot work before the target is loaded; returns the device to use."""
    from specdec.modeling.loading import default_device

    problems = []
    if args.self_prompts < 0:
        problems.append(f"--self-prompts must be >= 0 (got {args.self_prompts})")
    if args.self_prompt_tokens < 1:
        problems.append(f"--self-prompt-tokens must be >= 1 (got {args.self_prompt_tokens})")
    if not args.self_prompt_temperature > 0:
        problems.append(f"--self-prompt-temperature must be > 0 (got {args.self_prompt_temperature})")
    if args.time_budget_minutes < 0:
        problems.append(f"--time-budget-minutes must be >= 0 (got {args.time_budget_minutes})")
    if args.corpus_minutes < 0:
        problems.append(f"--corpus-minutes must be >= 0 (got {args.corpus_minutes})")
    if args.time_budget_minutes and args.corpus_minutes >= args.time_budget_minutes:
        problems.append(
            f"--corpus-minutes {args.corpus_minutes} leaves no training time in --time-budget-minutes "
            f"{args.time_budget_minutes}"
        )
    if args.bench_tokens < 1:
        problems.append(f"--bench-tokens must be >= 1 (got {args.bench_tokens})")
    if args.init_from and args.kind == "feature":
        problems.append("--init-from is for the standalone kind")
    for flag, directory in (("--compare-draft", args.compare_draft), ("--init-from", args.init_from)):
        missing = saved_draft_missing(directory) if directory else None
        if missing:
            problems.append(f"{flag} {directory}: {missing}")
    try:
        device = torch.device(default_device() if args.device == "auto" else args.device)
    except RuntimeError:
        problems.append(f"--device {args.device!r} is not a device (cpu, cuda, cuda:N or auto)")
        device = None
    if device is not None and device.type == "cuda" and not torch.cuda.is_available():
        problems.append(f"--device {args.device}: this torch build or machine has no CUDA GPU (use --device cpu)")
    if args.kind == "feature":
        if args.unroll < 1:
            problems.append(f"--unroll must be >= 1 (got {args.unroll})")
        if args.embed_size < 1:
            problems.append(f"--embed-size must be >= 1 (got {args.embed_size})")
        if args.corpus_batches < 0:
            problems.append(f"--corpus-batches must be >= 0 (got {args.corpus_batches})")
    else:  # the standalone draft's shape defaults (a feature draft takes the target's)
        args.heads = 4 if args.heads is None else args.heads
        args.kv_heads = 2 if args.kv_heads is None else args.kv_heads
        args.intermediate = 768 if args.intermediate is None else args.intermediate
    if problems or device is None:
        raise SystemExit("specdec distill: " + "; ".join(problems))
    args.student_bf16 = student_bf16(args.precision, device)
    say(
        f"training the student in {'bf16 autocast' if args.student_bf16 else 'fp32'} on {device} "
        f"(--precision {args.precision})"
    )
    return device


def load_target(spec: str, device: torch.device):
    """(target model in float32 on ``device``, its tokenizer): the corpus is made of text prompts,
    so a target without a tokenizer is refused."""
    from specdec.modeling.loading import load_model, try_load_tokenizer

    target = load_model(spec, str(device), torch.float32)
    tokenizer = try_load_tokenizer(spec)
    if tokenizer is None:
        raise SystemExit("the target has no tokenizer: cannot build a corpus from text prompts")
    return target, tokenizer


def prompts_to_avoid(sources: list[tuple[Path, list[dict]]]) -> set[str]:
    """What a self-written prompt must not repeat: the prompt files' prompts, and every bench prompt
    (the bench yardstick is only honest on prompts never trained on)."""
    exclude = {p["text"] for _, prompts in sources for p in prompts}
    if BENCH_PROMPTS.is_file():
        exclude |= {p["text"] for p in load_prompts(BENCH_PROMPTS)}  # never a bench prompt
    return exclude


def prompt_sources(args, target, tokenizer, out: Path) -> list[tuple[Path, list[dict]]]:
    """(prompt file, its prompts) for every ``--prompts`` file, then for the prompts the target writes
    itself (``--self-prompts``, kept in ``OUT/corpus/self_prompts.jsonl``)."""
    sources = []
    for prompt_file in prompt_files(args.prompts, args.self_prompts):
        prompts = load_prompts(prompt_file, args.num_prompts, args.split)
        if not prompts:
            raise SystemExit(f"no prompts in {prompt_file} (split {args.split!r})")
        say(f"{len(prompts)} prompts from {prompt_file}")
        sources.append((prompt_file, prompts))
    if args.self_prompts:
        exclude = prompts_to_avoid(sources)
        self_file = out / "corpus" / "self_prompts.jsonl"
        sources.append((self_file, write_self_prompts(target, tokenizer, args, self_file, exclude)))
    return sources


def split_corpora(
    target, tokenizer, sources: list[tuple[Path, list[dict]]], args, corpus_root: Path, deadline: float | None
) -> tuple[list[Record], list[Record]]:
    """(training, held-out) records of every source's corpus, each split on its own."""
    train, held_out = [], []
    for prompt_file, prompts in sources:
        # one corpus per prompt file: adding a file generates answers for that file only
        records = build_corpus(
            target,
            tokenizer,
            prompts,
            args,
            corpus_root / prompt_file.stem,
            corpus_settings(prompt_file, args),
            deadline,
        )
        if not records:
            continue  # the corpus time cap came before this file's first batch
        file_train, file_held = split_records(records, args.eval_sequences)
        train += file_train
        held_out += file_held
    if not train or not held_out:
        raise SystemExit("specdec distill: the corpus is empty (is --corpus-minutes too short for one batch?)")
    return train, held_out


def new_student(target, args, device: torch.device):
    """The student of the shape the flags ask for, on ``device``: started from the target's
    embeddings, or from ``--init-from``'s weights. Moves the target to the CPU."""
    student = build_student(
        target.cpu(), args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate, args.seed
    )
    if args.init_from:
        start_from_draft(student, args.init_from)
    return student.to(device)


def run_report(
    args,
    run: Training,
    device: torch.device,
    train: list[Record],
    held_out: list[Record],
    parameters: int,
    head_ids: list[int],
    coverage: float,
    bench_report: dict,
    command_started: float,
) -> dict:
    """What ``distill.json`` and the model card say about the run."""
    return {
        "target": args.target,
        "steps": run.steps,
        "exported_step": run.exported_step,
        "stopped_by": run.stopped_by,
        "device": str(device),
        "train_sequences": len(train),
        "held_out_sequences": len(held_out),
        "supervised_tokens": sum(len(r.top_ids) for r in train),
        "parameters": parameters,
        "head_vocab": len(head_ids),
        "head_coverage_held_out": coverage,
        "kl_start": run.before[0],
        "kl_end": run.after[0],
        "top1_start": run.before[1],
        "top1_end": run.after[1],
        "train_seconds": time.monotonic() - run.started,
        "total_seconds": time.monotonic() - command_started,
        **bench_report,
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
    }


def distill(args) -> dict:
    """``specdec distill``: prompts -> corpus -> head vocabulary -> student -> training -> export
    (``--kind feature``: the same first step, then ``distill_feature_draft``)."""
    from specdec.modeling.loading import eos_token_ids

    command_started = time.monotonic()
    device = check_arguments(args)
    deadline = command_started + args.time_budget_minutes * 60 if args.time_budget_minutes else None
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # the teacher's fp32 forward passes
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    target, tokenizer = load_target(args.target, device)
    sources = prompt_sources(args, target, tokenizer, out)
    if args.kind == "feature":
        return distill_feature_draft(
            args, target, tokenizer, [p for _, prompts in sources for p in prompts], out, command_started, deadline
        )
    corpus_deadline = command_started + args.corpus_minutes * 60 if args.corpus_minutes else None
    train, held_out = split_corpora(target, tokenizer, sources, args, out / "corpus", corpus_deadline)
    say(f"corpus ready after {(time.monotonic() - command_started) / 60:.1f} min")
    # the yardstick the bench will see: the target's greedy answers to prompts never trained on
    bench = bench_records(target, tokenizer, args.bench_split, args.bench_tokens, args.teacher_top)
    vocab_size = target.config.vocab_size
    head_ids = choose_head_vocab(train, args.head_vocab or vocab_size, vocab_size, eos_token_ids(target, tokenizer))
    head, slot = head_slots(head_ids, vocab_size, device)
    coverage = head_coverage(held_out, head_ids, vocab_size)
    say(
        f"corpus: {len(train)} training + {len(held_out)} held-out sequences, "
        f"{sum(len(r.top_ids) for r in train)} supervised tokens; head vocabulary {len(head_ids)} tokens "
        f"covers {coverage:.1%} of held-out greedy choices"
    )
    student = new_student(target, args, device)
    del target  # the corpus holds everything training needs from the target
    data = training_data(head_ids, train, held_out)
    run = train_student(student, train, held_out, head, slot, args, device, out / "checkpoint.pt", data, deadline)
    export(student, tokenizer, out, head_ids, args.save_dtype, note=f"distilled from {args.target}")
    parameters = sum(p.numel() for p in student.parameters())
    bench_report = bench_agreements(student, head, slot, bench, args, device)
    report = run_report(
        args, run, device, train, held_out, parameters, head_ids, coverage, bench_report, command_started
    )
    (out / "distill.json").write_text(json.dumps(report, indent=2))
    write_model_card(out, report)
    before, after = run.before, run.after
    say(
        f"held-out KL(target || draft) {before[0]:.3f} -> {after[0]:.3f}, top-1 agreement "
        f"{before[1]:.3f} -> {after[1]:.3f}; {parameters / 1e6:.1f}M parameters saved to {out}"
    )
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model spec")
    p.add_argument("--out", required=True, help="output directory (HF format)")
    p.add_argument(
        "--prompts",
        default=DEFAULT_DISTILL_PROMPTS,
        help="comma-separated JSONL prompt files {id, text, split}; one corpus each ('' with --self-prompts: "
        "only the prompts the target writes)",
    )
    p.add_argument("--split", default="", help="only prompts with this split ('' = all)")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--samples-per-prompt", type=int, default=2, help="1 greedy + seeded samples")
    p.add_argument("--gen-tokens", type=int, default=128, help="new tokens the target generates per sample")
    p.add_argument("--gen-batch-size", type=int, default=16, help="sequences the target generates at once")
    p.add_argument("--gen-temperature", type=float, default=0.7, help="temperature of the sampled answers")
    p.add_argument("--teacher-top", type=int, default=32, help="teacher log-probabilities kept per position")
    p.add_argument("--head-vocab", type=int, default=8192, help="output-head tokens (0 = full vocabulary)")
    p.add_argument(
        "--kind",
        choices=["model", "feature"],
        default="model",
        help="model: a standalone small LM; feature: a one-layer draft that reads the target's hidden "
        "states (EAGLE-style; needs the stack's feature support, far higher acceptance)",
    )
    p.add_argument("--layers", type=int, default=2, help="model kind: decoder layers")
    p.add_argument("--hidden", type=int, default=256, help="model kind: width (a feature draft has the target's)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default: 4; feature kind: the target's)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: 2; feature kind: the target's)")
    p.add_argument(
        "--intermediate", type=int, default=None, help="MLP width (default: 768; feature kind: the target's)"
    )
    p.add_argument("--embed-size", type=int, default=128, help="feature kind: width of the draft's token embedding")
    p.add_argument(
        "--unroll",
        type=int,
        default=3,
        help="feature kind: drafting steps trained per position (its own predictions fed back)",
    )
    p.add_argument("--unroll-decay", type=float, default=0.8, help="feature kind: loss weight ratio of step s+1 to s")
    p.add_argument(
        "--feature-loss",
        type=float,
        default=0.1,
        help="feature kind: weight of the smooth-L1 loss between predicted and target features",
    )
    p.add_argument(
        "--corpus-batches",
        type=int,
        default=0,
        help="feature kind: answer only the first N batches of the (shuffled) prompts (0 = all)",
    )
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=320)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--kd-temperature", type=float, default=1.0)
    p.add_argument("--eval-sequences", type=int, default=32)
    p.add_argument("--checkpoint-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=100, help="held-out evaluation every N steps (0 = off)")
    p.add_argument("--restart", action="store_true", help="ignore an existing checkpoint")
    p.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--self-prompts",
        type=int,
        default=0,
        help="user messages the target writes itself and then answers (0 = prompt files only)",
    )
    p.add_argument("--self-prompt-tokens", type=int, default=64, help="longest self-written user message")
    p.add_argument("--self-prompt-temperature", type=float, default=1.0)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N ('auto': a GPU when there is one)")
    p.add_argument(
        "--corpus-minutes",
        type=float,
        default=0.0,
        help="start no corpus batch after this many minutes from the command's start (self-written "
        "prompts included); train on what is finished (0 = the whole corpus)",
    )
    p.add_argument(
        "--bench-split",
        default="heldout",
        help="score the export by teacher-forced top-1 agreement with the target's greedy answers to "
        "the bench prompts of this split ('' = off)",
    )
    p.add_argument("--bench-tokens", type=int, default=64, help="answer length of that yardstick")
    p.add_argument("--compare-draft", default="", help="a saved draft directory scored on the same answers")
    p.add_argument(
        "--init-from",
        default="",
        help="start the student from this saved draft's weights (same shape) instead of from the target's embeddings",
    )
    p.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="the student's matrix products in training: bf16 autocast or fp32 ('auto': bf16 where the "
        "device does it natively -- a GPU, or a CPU with AVX512-BF16/AMX, ~1.5x faster there; the "
        "teacher, losses and evaluations stay fp32)",
    )
    p.add_argument(
        "--time-budget-minutes",
        type=float,
        default=0.0,
        help="end the whole run within this many minutes: training stops early, schedule compressed (0 = no limit)",
    )


def main(args) -> int:
    distill(args)
    return 0
