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
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F

from specdec.modeling.heads import write_head_vocab
from specdec.training.corpus import left_pad, open_corpus_dir, padding_id, say, sharded_records
from specdec.training.distill_features import distill_feature_draft
from specdec.training.prompts import BENCH_PROMPTS, DEFAULT_DISTILL_PROMPTS, load_prompts
from specdec.training.trainer import (
    check_resumable,
    load_checkpoint,
    quiet_mixed_norm,
    split_records,
    student_autocast,
    student_bf16,
    training_data,
    warmup_cosine,
)

# The cosine schedule's floor (a fraction of --lr) that the standalone drafts were trained with.
LR_FLOOR = 0.1


# -- corpus ------------------------------------------------------------------------------------
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


# -- prompts the target writes itself ----------------------------------------------------------------
def user_turn_opening(tokenizer) -> list[int]:
    """The tokens that open a user message in the target's chat format (its default system prompt
    included), so that what the target generates next *is* a user message. Without a chat template:
    the BOS token (or, lacking one, token 0), i.e. plain text."""
    if getattr(tokenizer, "chat_template", None):
        mark = "\u2063specdec-user-message\u2063"
        text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
        if mark in text:
            return [int(t) for t in tokenizer(text[: text.index(mark)], add_special_tokens=False)["input_ids"]]
    for special in (getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(special, int):
            return [special]
    return [0]


def finished_messages(rows: list[list[int]], eos_ids: set[int], need_end: bool) -> list[list[int]]:
    """The generated rows that form a whole message: cut at the first end token; rows that never
    ended are dropped when the target has end tokens (``need_end``) -- half a message is not a prompt."""
    out = []
    for row in rows:
        ends = [i for i, t in enumerate(row) if t in eos_ids]
        if ends:
            out.append(row[: ends[0]])
        elif not need_end:
            out.append(row)
    return out


@torch.inference_mode()
def write_self_prompts(target, tokenizer, args, path: Path, exclude: set[str]) -> list[dict]:
    """``args.self_prompts`` user messages written by the target (seeded sampling at
    ``--self-prompt-temperature``, at most ``--self-prompt-tokens`` tokens each), deduplicated and
    never equal to a prompt in ``exclude`` (the prompt files and the bench prompts). Written to
    ``path`` as a prompt file; reused when its settings (``path``.plan.json) match."""
    from tqdm import tqdm

    from specdec.modeling.loading import eos_token_ids

    settings = {
        "count": args.self_prompts,
        "tokens": args.self_prompt_tokens,
        "temperature": args.self_prompt_temperature,
        "batch": args.gen_batch_size,
        "seed": args.seed,
    }
    plan = path.with_suffix(".plan.json")
    if path.exists() and plan.exists() and json.loads(plan.read_text()) == settings:
        rows = load_prompts(path)
        say(f"reusing {len(rows)} self-written prompts from {path}")
        return rows
    path.parent.mkdir(parents=True, exist_ok=True)
    opening = user_turn_opening(tokenizer)
    eos_ids = eos_token_ids(target, tokenizer)
    pad_id = padding_id(tokenizer, eos_ids)
    texts: list[str] = []
    seen = set(exclude)
    bar = tqdm(total=args.self_prompts, desc="target writes prompts", file=sys.stderr)
    attempts, batch_index = 0, 0
    while len(texts) < args.self_prompts and attempts < 4 * args.self_prompts:
        n = min(args.gen_batch_size, 2 * (args.self_prompts - len(texts)) + 8)
        ids = torch.tensor([opening] * n, device=target.device)
        torch.manual_seed(args.seed * 7919 + batch_index)
        out = target.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=args.self_prompt_temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=args.self_prompt_tokens,
            pad_token_id=pad_id,
            eos_token_id=sorted(eos_ids) or None,
        )
        rows = out[:, len(opening) :].cpu().tolist()
        for message in finished_messages(rows, eos_ids, need_end=bool(eos_ids)):
            text = tokenizer.decode(message, skip_special_tokens=True).strip()
            if len(text.split()) >= 3 and text not in seen and len(texts) < args.self_prompts:
                seen.add(text)
                texts.append(text)
                bar.update(1)
        attempts += n
        batch_index += 1
    bar.close()
    if len(texts) < args.self_prompts:
        say(f"the target wrote only {len(texts)} usable prompts in {attempts} attempts (asked for {args.self_prompts})")
    rows = [{"id": f"s{i:05d}", "category": "self", "split": "distill", "text": t} for i, t in enumerate(texts)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plan.write_text(json.dumps(settings, indent=2))
    return rows


# -- head vocabulary -----------------------------------------------------------------------------
def choose_head_vocab(records: list[Record], size: int, vocab_size: int, always: set[int]) -> list[int]:
    """The ``size`` tokens with the most teacher probability mass over the corpus (plus ``always``)."""
    mass = torch.zeros(vocab_size, dtype=torch.float64)
    for r in records:
        mass.index_add_(0, r.top_ids.reshape(-1).long(), r.top_logp.reshape(-1).double().exp())
    chosen = {int(t) for t in always if 0 <= t < vocab_size}
    for t in torch.argsort(mass, descending=True, stable=True).tolist():
        if len(chosen) >= size:
            break
        chosen.add(t)
    return sorted(chosen)


def head_coverage(records: list[Record], head: list[int], vocab_size: int) -> float:
    """Fraction of generated positions whose teacher top-1 token is in the head vocabulary (an
    upper bound on greedy acceptance)."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[head] = True
    hits = total = 0
    for r in records:
        hits += int(inside[r.top_ids[:, 0].long()].sum())
        total += len(r.top_ids)
    return hits / max(1, total)


# -- student ---------------------------------------------------------------------------------------
def build_student(target, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    tc = target.config
    config = LlamaConfig(
        vocab_size=tc.vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=tc.max_position_embeddings,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": getattr(tc, "rope_theta", None)
            or (getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 10000.0),
        },
        tie_word_embeddings=True,
        bos_token_id=tc.bos_token_id,
        eos_token_id=tc.eos_token_id,
        pad_token_id=getattr(tc, "pad_token_id", None),
    )
    torch.manual_seed(seed)
    student = LlamaForCausalLM(config)
    with torch.no_grad():
        emb = target.get_input_embeddings().weight.float()
        centered = emb - emb.mean(0, keepdim=True)
        # top principal directions of the target's embeddings, rescaled to the student's init scale
        _, _, v = torch.linalg.svd(centered[: min(len(centered), 8192)], full_matrices=False)
        projected = centered @ v[: min(hidden, v.shape[0])].T
        if projected.shape[1] < hidden:
            projected = torch.cat([projected, torch.zeros(len(projected), hidden - projected.shape[1])], dim=1)
        projected = projected / projected.std() * config.initializer_range * 10
        cast(torch.Tensor, student.get_input_embeddings().weight).copy_(projected)
    return student


def start_from_draft(student, directory: str) -> None:
    """Start ``student`` from the weights of a draft saved by this command (instead of the
    projected target embeddings): new data then refines a trained draft rather than paying
    again for what it already learnt. The shapes must be the same; the head vocabulary may
    differ (the embeddings cover the whole vocabulary, the head is a choice of their rows)."""
    from safetensors.torch import load_file

    saved = load_file(str(Path(directory) / "model.safetensors"))  # there: check_arguments looked
    own = student.state_dict()
    if "lm_head.weight" not in saved and "lm_head.weight" in own:  # tied: saved once, as the embeddings
        saved["lm_head.weight"] = saved["model.embed_tokens.weight"]
    wrong = sorted(
        f"{k} {tuple(saved[k].shape) if k in saved else 'missing'} (needs {tuple(v.shape)})"
        for k, v in own.items()
        if k not in saved or saved[k].shape != v.shape
    )
    if wrong:
        raise SystemExit(
            f"specdec distill: --init-from {directory} has another shape than --layers/--hidden/--heads/"
            f"--kv-heads/--intermediate ask for: {'; '.join(wrong[:4])}"
        )
    student.load_state_dict({k: saved[k].float() for k in own})
    say(f"starting from the weights of {directory}")


@dataclass
class Batch:
    ids: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] attention mask
    rows: torch.Tensor  # [N] batch row of each supervised position
    cols: torch.Tensor  # [N] position whose hidden state predicts the next token
    top_ids: torch.Tensor  # [N, K]
    top_logp: torch.Tensor  # [N, K]

    def to(self, device) -> Batch:
        return Batch(
            *(
                t.to(device, non_blocking=True)
                for t in (self.ids, self.mask, self.rows, self.cols, self.top_ids, self.top_logp)
            )
        )


def make_batch(records: list[Record], seq_len: int) -> Batch:
    width = min(seq_len, max(len(r.ids) for r in records))
    ids = torch.zeros(len(records), width, dtype=torch.long)
    mask = torch.zeros(len(records), width, dtype=torch.long)
    rows, cols, tids, tlogp = [], [], [], []
    for i, r in enumerate(records):
        seq = r.ids[:width]
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        g = max(0, min(len(r.top_ids), width - r.start))  # generated tokens that fit
        rows.append(torch.full((g,), i, dtype=torch.long))
        cols.append(torch.arange(r.start - 1, r.start - 1 + g))
        tids.append(r.top_ids[:g].long())
        tlogp.append(r.top_logp[:g].float())
    return Batch(ids, mask, torch.cat(rows), torch.cat(cols), torch.cat(tids), torch.cat(tlogp))


def distill_loss(student, batch: Batch, head: torch.Tensor, slot: torch.Tensor, temperature: float, bf16: bool = False):
    """(KL over the head vocabulary, top-1 agreement count, positions). The teacher's top tokens
    outside the head are dropped and the rest renormalised: the draft cannot propose them anyway.
    With ``bf16`` the student's matrix products run in bf16 (autocast); the softmax and KL in fp32."""
    device = batch.ids.device
    with student_autocast(device, bf16), quiet_mixed_norm():
        hidden = student.model(input_ids=batch.ids, attention_mask=batch.mask).last_hidden_state
        h = hidden[batch.rows, batch.cols]  # [N, H]
        weight = student.get_output_embeddings().weight
        logits = h @ weight[head].T
    logq = F.log_softmax(logits.float() / temperature, dim=-1)  # [N, S]
    where = slot[batch.top_ids]  # [N, K], -1 = outside the head
    inside = where >= 0
    logp = torch.where(inside, batch.top_logp / temperature, float("-inf"))
    keep = inside.any(-1)
    logp = torch.log_softmax(logp[keep], dim=-1)
    p = logp.exp()
    logq_at = logq[keep].gather(-1, where[keep].clamp(min=0))
    kl = (p * (torch.where(inside[keep], logp, 0.0) - logq_at)).sum(-1)
    agree = (head[logq.argmax(-1)] == batch.top_ids[:, 0]).sum()
    return kl.mean() * temperature**2, int(agree), len(batch.rows)


@torch.no_grad()
def evaluate(student, records: list[Record], head, slot, temperature: float, seq_len: int) -> tuple[float, float]:
    """(mean KL, top-1 agreement) over ``records``."""
    was_training = student.training
    student.eval()
    device = head.device
    kl_sum = agree = total = 0.0
    for i in range(0, len(records), 32):
        batch = make_batch(records[i : i + 32], seq_len).to(device)
        kl, a, n = distill_loss(student, batch, head, slot, temperature)
        kl_sum += float(kl) * n
        agree += a
        total += n
    student.train(was_training)
    return kl_sum / max(1, total), agree / max(1, total)


# -- the bench yardstick -----------------------------------------------------------------------------
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


def head_slots(head_ids: list[int], vocab_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(head token ids, slot of every vocabulary id in the head or -1) on ``device``."""
    head = torch.tensor(head_ids, dtype=torch.long, device=device)
    slot = torch.full((vocab_size,), -1, dtype=torch.long, device=device)
    slot[head] = torch.arange(len(head), device=device)
    return head, slot


def saved_draft_missing(directory: str) -> str | None:
    """What keeps ``directory`` from being a draft saved by this command, or None: checked before
    a run spends its corpus and training time, not when the draft is first read."""
    folder = Path(directory)
    if not folder.is_dir():
        return "no such model directory"
    absent = [name for name in ("config.json", "model.safetensors") if not (folder / name).is_file()]
    return f"no {' or '.join(absent)} there" if absent else None


def saved_draft_agreement(directory: str, records: list[Record], device) -> float:
    """Teacher-forced top-1 agreement on ``records`` (whole, never cut to a training length) of a
    draft saved by this command (its own head vocabulary applied, weights in float32 as the
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


# -- the command -------------------------------------------------------------------------------------
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


def distill(args) -> dict:
    from tqdm import tqdm

    from specdec.modeling.loading import eos_token_ids, load_model, try_load_tokenizer

    command_started = time.monotonic()
    device = check_arguments(args)
    deadline = command_started + args.time_budget_minutes * 60 if args.time_budget_minutes else None
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # the teacher's fp32 forward passes
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    target = load_model(args.target, str(device), torch.float32)
    tokenizer = try_load_tokenizer(args.target)
    if tokenizer is None:
        raise SystemExit("the target has no tokenizer: cannot build a corpus from text prompts")
    sources = []
    for prompt_file in prompt_files(args.prompts, args.self_prompts):
        prompts = load_prompts(prompt_file, args.num_prompts, args.split)
        if not prompts:
            raise SystemExit(f"no prompts in {prompt_file} (split {args.split!r})")
        say(f"{len(prompts)} prompts from {prompt_file}")
        sources.append((prompt_file, prompts))
    if args.self_prompts:
        exclude = {p["text"] for _, prompts in sources for p in prompts}
        if BENCH_PROMPTS.is_file():
            exclude |= {p["text"] for p in load_prompts(BENCH_PROMPTS)}  # never a bench prompt
        self_file = out / "corpus" / "self_prompts.jsonl"
        sources.append((self_file, write_self_prompts(target, tokenizer, args, self_file, exclude)))
    if args.kind == "feature":
        return distill_feature_draft(
            args, target, tokenizer, [p for _, prompts in sources for p in prompts], out, command_started, deadline
        )
    train, held_out = [], []
    corpus_deadline = command_started + args.corpus_minutes * 60 if args.corpus_minutes else None
    for prompt_file, prompts in sources:
        # one corpus per prompt file: adding a file generates answers for that file only
        records = build_corpus(
            target,
            tokenizer,
            prompts,
            args,
            out / "corpus" / prompt_file.stem,
            corpus_settings(prompt_file, args),
            corpus_deadline,
        )
        if not records:
            continue  # the corpus time cap came before this file's first batch
        file_train, file_held = split_records(records, args.eval_sequences)
        train += file_train
        held_out += file_held
    if not train or not held_out:
        raise SystemExit("specdec distill: the corpus is empty (is --corpus-minutes too short for one batch?)")
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

    student = build_student(
        target.cpu(), args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate, args.seed
    )
    if args.init_from:
        start_from_draft(student, args.init_from)
    student = student.to(device)
    del target  # the corpus holds everything training needs from the target
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.0)
    step, before, best = 0, None, None
    ckpt = out / "checkpoint.pt"
    data = training_data(head_ids, train, held_out)
    if ckpt.exists() and not args.restart:
        state = load_checkpoint(ckpt, device)
        check_resumable(ckpt, state.get("data"), data)
        student.load_state_dict(state["student"])
        optimizer.load_state_dict(state["optimizer"])
        step, before, best = state["step"], state["before"], state.get("best")
        rng.setstate(state["rng"])
        say(f"resuming from {ckpt} at step {step}")
    if before is None:
        before = evaluate(student, held_out, head, slot, args.kd_temperature, args.seq_len)
    student.train()
    progress = tqdm(total=args.steps, initial=step, desc="distilling", file=sys.stderr)
    started = time.monotonic()
    # training stops early when the time budget would be overrun; a tenth of the budget (at most a
    # minute) is kept for the final evaluation and the export
    train_seconds = (deadline - min(60.0, 6.0 * args.time_budget_minutes) - started) if deadline else None
    stopped_by = "steps"
    while step < args.steps:
        if train_seconds is not None and time.monotonic() - started >= train_seconds:
            stopped_by = "time budget"
            say(f"time budget reached at step {step} of {args.steps}")
            break
        batch = make_batch([train[rng.randrange(len(train))] for _ in range(args.batch_size)], args.seq_len).to(device)
        spent = (time.monotonic() - started) / train_seconds if train_seconds else 0.0
        lr = warmup_cosine(step, args.steps, args.lr, args.warmup, LR_FLOOR, spent)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, agree, n = distill_loss(student, batch, head, slot, args.kd_temperature, args.student_bf16)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        step += 1
        progress.update(1)
        progress.set_postfix(kl=f"{loss.item():.3f}", top1=f"{agree / max(1, n):.2f}", lr=f"{lr:.1e}")
        if args.eval_every and step % args.eval_every == 0:
            kl, top1 = evaluate(student, held_out, head, slot, args.kd_temperature, args.seq_len)
            say(f"step {step}: held-out KL {kl:.3f}, top-1 agreement {top1:.3f}")
            if best is None or top1 > best["top1"]:
                best = {
                    "step": step,
                    "kl": kl,
                    "top1": top1,
                    "student": {k: v.detach().cpu().clone() for k, v in student.state_dict().items()},
                }
        if step % args.checkpoint_every == 0 or step == args.steps:
            torch.save(
                {
                    "student": student.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                    "before": before,
                    "best": best,
                    "rng": rng.getstate(),
                    "data": data,
                },
                ckpt,
            )
    progress.close()
    after = evaluate(student, held_out, head, slot, args.kd_temperature, args.seq_len)
    exported_step = step
    if best is not None and best["top1"] > after[1]:
        # later steps overfit: export the evaluation with the best held-out agreement
        student.load_state_dict(best["student"])
        after, exported_step = (best["kl"], best["top1"]), best["step"]
        say(f"exporting the step-{exported_step} weights (best held-out agreement)")
    export(student, tokenizer, out, head_ids, args.save_dtype, note=f"distilled from {args.target}")
    params = sum(p.numel() for p in student.parameters())
    bench_report = bench_agreements(student, head, slot, bench, args, device)
    report = {
        "target": args.target,
        "steps": step,
        "exported_step": exported_step,
        "stopped_by": stopped_by,
        "device": str(device),
        "train_sequences": len(train),
        "held_out_sequences": len(held_out),
        "supervised_tokens": sum(len(r.top_ids) for r in train),
        "parameters": params,
        "head_vocab": len(head_ids),
        "head_coverage_held_out": coverage,
        "kl_start": before[0],
        "kl_end": after[0],
        "top1_start": before[1],
        "top1_end": after[1],
        "train_seconds": time.monotonic() - started,
        "total_seconds": time.monotonic() - command_started,
        **bench_report,
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
    }
    (out / "distill.json").write_text(json.dumps(report, indent=2))
    write_model_card(out, report)
    say(
        f"held-out KL(target || draft) {before[0]:.3f} -> {after[0]:.3f}, top-1 agreement "
        f"{before[1]:.3f} -> {after[1]:.3f}; {params / 1e6:.1f}M parameters saved to {out}"
    )
    return report


def export(student, tokenizer, out: Path, head_ids: list[int], save_dtype: str, note: str) -> None:
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[save_dtype]
    student.to(dtype).save_pretrained(out, safe_serialization=True)
    student.float()
    tokenizer.save_pretrained(out)
    write_head_vocab(out, head_ids, note=note)


def write_model_card(out: Path, report: dict) -> None:
    """README.md of the draft directory: what it is, how it was made, what it measured."""
    st = report["settings"]
    self_written = (
        (
            f" and {st['self_prompts']} user messages the target wrote itself (sampled at temperature "
            f"{st['self_prompt_temperature']}, seed {st['seed']})"
        )
        if st.get("self_prompts")
        else ""
    )
    prompt_files_md = ", ".join("`" + Path(f).name + "`" for f in st["prompts"].split(",") if f.strip()) or "no file"
    exported = ""
    if report.get("exported_step", report["steps"]) != report["steps"]:
        exported = f"; exported the step-{report['exported_step']} weights (best held-out agreement)"
    if report.get("stopped_by") == "time budget":
        exported += f" (stopped by the {st['time_budget_minutes']}-minute time budget)"
    size_mb = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 1e6
    bench = ""
    if "bench_top1" in report:
        bench = (
            f"\n- **Bench prompts** (split {report['bench_split']!r}, never distilled on): teacher-forced top-1 "
            f"agreement with the target's greedy answers {report['bench_top1']:.3f} over "
            f"{report['bench_positions']} positions"
        )
        if "compare_draft_bench_top1" in report:
            bench += f" (`{report['compare_draft']}` on the same answers: {report['compare_draft_bench_top1']:.3f})"
        bench += "."
    (out / "README.md").write_text(f"""# Draft model for `{report["target"]}` (made by `specdec distill`)

A speculative-decoding draft sharing the target's tokenizer. Not a general-purpose model: it is
trained only to predict the target's next-token distribution on the target's own answers.

- **Architecture**: Llama, {st["layers"]} layers, hidden {st["hidden"]}, {st["heads"]} heads
  ({st["kv_heads"]} KV heads), MLP {st["intermediate"]}; input embeddings over the target's full vocabulary,
  tied output head
  restricted to {report["head_vocab"]} tokens (`head_vocab.json`, applied by `specdec.modeling.loading.load_model`;
  other tokens get q = 0, which keeps speculative decoding exact).
- **Size**: {report["parameters"] / 1e6:.1f}M parameters, {size_mb:.1f} MB of {st["save_dtype"]} safetensors.
- **Data**: the target's answers ({st["samples_per_prompt"]} per prompt: one greedy, the rest sampled at
  temperature {st["gen_temperature"]}, up to {st["gen_tokens"]} new tokens) to the prompts of
  {prompt_files_md} (split {st["split"] or "all"!r}){self_written}:
  {report["train_sequences"]} training sequences,
  {report["supervised_tokens"]} supervised positions, {report["held_out_sequences"]} held-out sequences.
- **Training**: forward KL to the target's top-{st["teacher_top"]} next-token distribution (temperature
  {st["kd_temperature"]}), {report["steps"]} steps of batch {st["batch_size"]}, AdamW lr {st["lr"]} (cosine),
  seed {st["seed"]};
  {report["train_seconds"] / 60:.0f} min of training on {report.get("device", "cpu")}{exported}.
- **Held-out**: KL(target || draft) {report["kl_start"]:.3f} -> {report["kl_end"]:.3f}; top-1 agreement with the
  target (how often the draft's first choice is the target's: greedy acceptance at one position)
  {report["top1_start"]:.3f} -> {report["top1_end"]:.3f};
  the head vocabulary covers {report["head_coverage_held_out"]:.1%} of the target's held-out greedy choices.{bench}

Reproduce: `specdec distill --target {report["target"]} --out DIR` with the settings in `distill.json`.
""")


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
