"""``python -m specdec.training.agreement --target T DRAFT [DRAFT ...]``: the teacher-forced top-1
agreement of saved drafts with the target's greedy answers to the bench prompts of a split -- the
yardstick ``specdec distill`` scores its export by, computed for any draft on any machine, so a
draft trained elsewhere (on a GPU) is checked on the CPU it will serve on before it is shipped."""

from __future__ import annotations

import argparse
import json

import torch

from specdec.training.distill import bench_records, saved_draft_agreement, saved_draft_missing


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
