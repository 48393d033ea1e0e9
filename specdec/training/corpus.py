"""What both kinds of distillation corpus share: batching prompts for generation, and shards
written atomically under a folder whose ``plan.json`` refuses to mix corpora made with other
settings (an interrupted build resumes at the first missing shard)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def say(message: str) -> None:
    print(f"[distill] {message}", file=sys.stderr, flush=True)


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


def padding_id(tokenizer, eos_ids: set[int]) -> int:
    """The id that pads batched generation: the tokenizer's pad token, else an end token, else 0."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return min(eos_ids) if eos_ids else 0


def open_corpus_dir(corpus_dir: Path, settings: dict) -> None:
    """Create ``corpus_dir`` for a corpus made with ``settings``; refuse one made with others, since
    its shards would silently mix two corpora."""
    corpus_dir.mkdir(parents=True, exist_ok=True)
    plan_file = corpus_dir / "plan.json"
    if plan_file.exists() and json.loads(plan_file.read_text()) != settings:
        raise SystemExit(
            f"{corpus_dir} was generated with other settings ({plan_file}); use another --out "
            "or delete that folder to regenerate it"
        )
    plan_file.write_text(json.dumps(settings, indent=2))


def sharded_records(
    corpus_dir: Path, batches: int, make_batch, record_type, tokens_of, deadline: float | None = None
) -> list:
    """The records of ``batches`` batches: batch ``b`` read back from ``shard-b.pt`` when a previous
    run finished it, else made by ``make_batch(b)`` and saved (atomically: a shard exists only once it
    is complete), so an interrupted corpus build resumes where it stopped. Past ``deadline`` (a
    ``time.monotonic()`` value) no new batch is started, so a corpus can be sized by the time a
    device is lent for rather than guessed; what was finished is returned (and a later run with a
    later deadline goes on from there)."""
    import time

    from tqdm import tqdm

    done = sum(1 for b in range(batches) if (corpus_dir / f"shard-{b:05d}.pt").exists())
    if done:
        say(f"reusing {done}/{batches} finished corpus shards in {corpus_dir}")
    records: list = []
    bar = tqdm(total=batches, desc=f"target answers {corpus_dir.name} (batches)", file=sys.stderr)
    for b in range(batches):
        shard = corpus_dir / f"shard-{b:05d}.pt"
        if shard.exists():
            rows = [record_type(**r) for r in torch.load(shard)]
        elif deadline is not None and time.monotonic() >= deadline:
            say(f"corpus time cap reached: {corpus_dir.name} stops at {b} of {batches} batches")
            break
        else:
            rows = make_batch(b)
            tmp = shard.with_suffix(".tmp")
            torch.save([r.as_dict() for r in rows], tmp)
            tmp.replace(shard)
        records.extend(rows)
        bar.update(1)
        bar.set_postfix(tokens=sum(tokens_of(r) for r in records))
    bar.close()
    return records
