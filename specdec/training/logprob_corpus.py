"""The corpus a standalone draft learns from: the target's answers to the prompts, each generated
token stored with the target's top-K next-token log-probabilities (the distillation teacher), so
training never runs the target again. Batches follow a fixed plan and are saved as shards
(``specdec.training.corpus``), so an interrupted build resumes at the first missing one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.training.corpus import left_pad, open_corpus_dir, padding_id, sharded_records


@dataclass
class Record:
    """One target-generated sequence: ``ids`` = prompt + generated tokens; row t of the teacher
    arrays is the target's distribution for ``ids[start + t]`` given ``ids[:start + t]``."""

    ids: list[int]
    start: int
    top_ids: torch.Tensor  # [G, K] int32
    top_logp: torch.Tensor  # [G, K] float16, log-probabilities under the full vocabulary

    def as_dict(self) -> dict:
        return {"ids": self.ids, "start": self.start, "top_ids": self.top_ids, "top_logp": self.top_logp}


@dataclass(frozen=True)
class Job:
    prompt_index: int
    sample: int  # 0 = greedy


def plan_batches(prompt_lengths: list[int], samples: int, batch_size: int) -> list[list[Job]]:
    """Deterministic batches: greedy jobs first, then sampled ones, each sorted by prompt length
    (less left padding). The plan depends only on the inputs, so shard b means the same batch
    in every run and a resumed run skips exactly the finished ones."""
    jobs = [Job(i, j) for j in range(samples) for i in range(len(prompt_lengths))]
    jobs.sort(key=lambda job: (job.sample > 0, prompt_lengths[job.prompt_index], job.prompt_index, job.sample))
    out: list[list[Job]] = []
    current: list[Job] = []
    for job in jobs:
        if current and (current[0].sample > 0) != (job.sample > 0):
            out.append(current)
            current = []
        current.append(job)
        if len(current) == batch_size:
            out.append(current)
            current = []
    if current:
        out.append(current)
    return out


@torch.inference_mode()
def generate_batch(
    target,
    prompts: list[list[int]],
    greedy: bool,
    new_tokens: int,
    teacher_top: int,
    eos_ids: set[int],
    pad_id: int,
    temperature: float,
    seed: int,
) -> list[Record]:
    ids, mask = left_pad(prompts, pad_id)
    ids, mask = ids.to(target.device), mask.to(target.device)
    sampling = (
        {"do_sample": False} if greedy else {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    )
    torch.manual_seed(seed)
    out = target.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=1,
        pad_token_id=pad_id,
        eos_token_id=sorted(eos_ids) or None,
        output_logits=True,
        return_dict_in_generate=True,
        **sampling,
    )
    generated = out.sequences[:, ids.shape[1] :]
    # raw logits, step by step -> the teacher's top-K log-probabilities per row
    tops = [torch.log_softmax(step.float(), dim=-1).topk(teacher_top, dim=-1) for step in out.logits]
    top_logp = torch.stack([t.values for t in tops], dim=1).cpu()  # [B, G, K]
    top_ids = torch.stack([t.indices for t in tops], dim=1).cpu()
    generated = generated.cpu()
    records = []
    for row, prompt in enumerate(prompts):
        tokens = generated[row].tolist()
        length = len(tokens)
        for t, token in enumerate(tokens):
            if token in eos_ids:
                length = t + 1  # keep the end-of-turn token: the draft should learn to propose it
                break
        records.append(
            Record(
                list(prompt) + tokens[:length],
                len(prompt),
                top_ids[row, :length].to(torch.int32),
                top_logp[row, :length].to(torch.float16),
            )
        )
    return records


def corpus_settings(prompt_file: Path, args) -> dict:
    """What a corpus depends on; stored as ``plan.json`` beside its shards so a changed setting can
    never silently mix with shards generated under another."""
    import hashlib

    return {
        "prompts_sha256": hashlib.sha256(prompt_file.read_bytes()).hexdigest(),
        "split": args.split,
        "num_prompts": args.num_prompts,
        "samples_per_prompt": args.samples_per_prompt,
        "gen_tokens": args.gen_tokens,
        "gen_batch_size": args.gen_batch_size,
        "gen_temperature": args.gen_temperature,
        "teacher_top": args.teacher_top,
        "seed": args.seed,
    }


def build_corpus(
    target, tokenizer, prompts: list[dict], args, corpus_dir: Path, settings: dict, deadline: float | None = None
) -> list[Record]:
    from specdec.modeling.loading import encode_prompt, eos_token_ids

    open_corpus_dir(corpus_dir, settings)
    encoded = [encode_prompt(tokenizer, p["text"], chat=True) for p in prompts]
    plan = plan_batches([len(e) for e in encoded], args.samples_per_prompt, args.gen_batch_size)
    eos_ids = eos_token_ids(target, tokenizer)
    pad_id = padding_id(tokenizer, eos_ids)

    def make_batch(b: int) -> list[Record]:
        batch = plan[b]
        return generate_batch(
            target,
            [encoded[job.prompt_index] for job in batch],
            batch[0].sample == 0,
            args.gen_tokens,
            args.teacher_top,
            eos_ids,
            pad_id,
            args.gen_temperature,
            args.seed * 100_003 + b,
        )

    return sharded_records(corpus_dir, len(plan), make_batch, Record, lambda r: len(r.top_ids), deadline)
