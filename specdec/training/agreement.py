"""``python -m specdec.training.agreement --target T DRAFT [DRAFT ...]``: the teacher-forced top-1
agreement of saved drafts with the target's greedy answers to the bench prompts of a split -- the
yardstick ``specdec distill`` scores its export by, computed for any draft on any machine, so a
draft trained elsewhere (on a GPU) is checked on the CPU it will serve on before it is shipped."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdec.training.corpus import padding_id, say
from specdec.training.logprob_corpus import Record, generate_batch
from specdec.training.prompts import BENCH_PROMPTS, load_prompts
from specdec.training.student import head_slots
from specdec.training.student_training import evaluate


# -- the yardstick (``specdec distill`` reports it too) --------------------------------------------
def bench_records(target, tokenizer, split: str, tokens: int, teacher_top: int) -> list[Record]:
    """The target's greedy answers (at most ``tokens`` new tokens, chat template) to the bench
    prompts of ``split`` ('' = none), one prompt at a time (no padding), with its distribution at
    every answer position: teacher-forced top-1 agreement on these is the greedy acceptance a
    draft will show at a block's first position in ``specdec bench --split SPLIT``. None of the
    bench prompts is ever distilled on (write_self_prompts excludes them)."""
    from specdec.modeling.loading import encode_prompt, eos_token_ids

    if not split:
        return []
    prompts = load_prompts(BENCH_PROMPTS, split=split)
    if not prompts:
        raise SystemExit(f"specdec distill: no bench prompts with split {split!r} in {BENCH_PROMPTS}")
    eos_ids = eos_token_ids(target, tokenizer)
    pad_id = padding_id(tokenizer, eos_ids)
    records: list[Record] = []
    for p in prompts:
        ids = encode_prompt(tokenizer, p["text"], chat=True)
        records += generate_batch(target, [ids], True, tokens, teacher_top, eos_ids, pad_id, 1.0, 0)
    return records


def saved_draft_missing(directory: str) -> str | None:
    """What keeps ``directory`` from being a draft saved by ``specdec distill``, or None: checked before
    a run spends its corpus and training time, not when the draft is first read."""
    folder = Path(directory)
    if not folder.is_dir():
        return "no such model directory"
    absent = [name for name in ("config.json", "model.safetensors") if not (folder / name).is_file()]
    return f"no {' or '.join(absent)} there" if absent else None


def saved_draft_agreement(directory: str, records: list[Record], device) -> float:
    """Teacher-forced top-1 agreement on ``records`` (whole, never cut to a training length) of a
    draft saved by ``specdec distill`` (its own head vocabulary applied, weights in float32 as the
    services run them)."""
    from transformers import AutoModelForCausalLM

    from specdec.modeling.heads import read_head_vocab

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to(device)
    vocab_size = model.config.vocab_size
    head, slot = head_slots(read_head_vocab(directory) or list(range(vocab_size)), vocab_size, device)
    return evaluate(model, records, head, slot, 1.0, max(len(r.ids) for r in records))[1]


def bench_agreements(student, head, slot, bench: list[Record], args, device) -> dict:
    """The report's bench yardstick: the exported student's agreement, and ``--compare-draft``'s on
    the same answers (so "better than the shipped draft" is one run's comparison)."""
    if not bench:
        return {}
    report = {
        "bench_split": args.bench_split,
        "bench_positions": sum(len(r.top_ids) for r in bench),
        "bench_top1": evaluate(student, bench, head, slot, 1.0, max(len(r.ids) for r in bench))[1],
    }
    if args.compare_draft:
        report["compare_draft"] = args.compare_draft
        report["compare_draft_bench_top1"] = saved_draft_agreement(args.compare_draft, bench, device)
    say(
        f"teacher-forced top-1 agreement on the {args.bench_split} bench prompts: {report['bench_top1']:.3f}"
        + (f" (--compare-draft: {report['compare_draft_bench_top1']:.3f})" if args.compare_draft else "")
    )
    return report


# -- the command -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.training.agreement", description=__doc__)
    p.add_argument("--target", required=True, help="target model spec")
    p.add_argument("--split", default="heldout", help="bench prompt split ('heldout', 'dev', ...)")
    p.add_argument("--tokens", type=int, default=64, help="greedy answer length")
    p.add_argument("drafts", nargs="+", help="draft directories")
    args = p.parse_args(argv)
    if args.tokens < 1:
        p.error(f"--tokens must be >= 1 (got {args.tokens})")
    for draft in args.drafts:
        missing = saved_draft_missing(draft)
        if missing:
            p.error(f"{draft}: {missing}")

    from specdec.modeling.loading import load_model, try_load_tokenizer

    target = load_model(args.target, "cpu", torch.float32)
    tokenizer = try_load_tokenizer(args.target)
    if tokenizer is None:
        raise SystemExit("the target has no tokenizer: the bench prompts are text")
    records = bench_records(target, tokenizer, args.split, args.tokens, 32)
    result = {
        "split": args.split,
        "positions": sum(len(r.top_ids) for r in records),
        "top1": {d: saved_draft_agreement(d, records, "cpu") for d in args.drafts},
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
