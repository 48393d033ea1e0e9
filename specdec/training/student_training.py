"""Training the standalone draft: batches of corpus records, the distillation loss (KL to the
teacher over the head vocabulary), the held-out evaluation, and the loop that ties them together
(checkpoints, resuming, the time budget, keeping the best evaluation's weights)."""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.training.corpus import say
from specdec.training.logprob_corpus import Record
from specdec.training.trainer import (
    check_resumable,
    load_checkpoint,
    quiet_mixed_norm,
    student_autocast,
    warmup_cosine,
)

# The cosine schedule's floor (a fraction of --lr) that the standalone drafts were trained with.
LR_FLOOR = 0.1


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


# -- the loop --------------------------------------------------------------------------------------
@dataclass
class Training:
    """How a training run ended; the student then holds the weights of ``exported_step``."""

    steps: int  # steps taken, counting those of the run it resumed
    exported_step: int  # the last step, or an earlier one whose evaluation was better
    stopped_by: str  # "steps" or "time budget"
    before: tuple[float, float]  # held-out (KL, top-1 agreement) before the first step
    after: tuple[float, float]  # the same for the weights the student holds
    started: float  # time.monotonic() at the first step of this run


def training_seconds(deadline: float | None, budget_minutes: float, started: float) -> float | None:
    """How long the steps may run from ``started``: until the deadline less a tenth of the budget (at
    most a minute), kept for the final evaluation and the export; None without a time budget."""
    return (deadline - min(60.0, 6.0 * budget_minutes) - started) if deadline else None


def resume(checkpoint: Path, data: dict, student, optimizer, rng: random.Random, device):
    """(step, evaluation before training, best evaluation) of the run saved in ``checkpoint``, whose
    weights, optimizer state and batch sampling go on in ``student``, ``optimizer`` and ``rng``."""
    state = load_checkpoint(checkpoint, device)
    check_resumable(checkpoint, state.get("data"), data)
    student.load_state_dict(state["student"])
    optimizer.load_state_dict(state["optimizer"])
    rng.setstate(state["rng"])
    say(f"resuming from {checkpoint} at step {state['step']}")
    return state["step"], state["before"], state.get("best")


def save_checkpoint(checkpoint: Path, student, optimizer, step: int, before, best, rng, data: dict) -> None:
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
        checkpoint,
    )


def snapshot(step: int, kl: float, top1: float, student) -> dict:
    """An evaluation with the weights it scored, copied to the CPU (a copy on the device would hold
    a second student in its memory)."""
    return {
        "step": step,
        "kl": kl,
        "top1": top1,
        "student": {k: v.detach().cpu().clone() for k, v in student.state_dict().items()},
    }


def train_step(student, optimizer, batch: Batch, head, slot, lr: float, args):
    """One optimizer step at learning rate ``lr``; returns ``distill_loss``'s (loss, agreement, positions)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss, agree, n = distill_loss(student, batch, head, slot, args.kd_temperature, args.student_bf16)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
    optimizer.step()
    return loss, agree, n


def keep_best(student, best: dict | None, last: tuple[float, float], step: int) -> tuple[tuple[float, float], int]:
    """(evaluation, step) of the weights to export: the last ones, or the best evaluation's (loaded
    into ``student``) when it agreed more often -- later steps overfit."""
    if best is not None and best["top1"] > last[1]:
        student.load_state_dict(best["student"])
        say(f"exporting the step-{best['step']} weights (best held-out agreement)")
        return (best["kl"], best["top1"]), best["step"]
    return last, step


def train_student(
    student,
    train: list[Record],
    held_out: list[Record],
    head,
    slot,
    args,
    device,
    checkpoint: Path,
    data: dict,
    deadline: float | None,
) -> Training:
    """AdamW on random batches of ``train`` (warm-up + cosine, compressed to fit the time budget),
    checkpointed every ``--checkpoint-every`` steps and resumed from ``checkpoint`` unless
    ``--restart``; ``held_out`` is evaluated every ``--eval-every`` steps and at the end."""
    from tqdm import tqdm

    rng = random.Random(args.seed)
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.0)
    step, before, best = 0, None, None
    if checkpoint.exists() and not args.restart:
        step, before, best = resume(checkpoint, data, student, optimizer, rng, device)
    if before is None:  # a resumed run keeps the evaluation made before its first step
        before = evaluate(student, held_out, head, slot, args.kd_temperature, args.seq_len)
    student.train()
    progress = tqdm(total=args.steps, initial=step, desc="distilling", file=sys.stderr)
    started = time.monotonic()
    train_seconds = training_seconds(deadline, args.time_budget_minutes, started)
    stopped_by = "steps"
    while step < args.steps:
        if train_seconds is not None and time.monotonic() - started >= train_seconds:
            stopped_by = "time budget"
            say(f"time budget reached at step {step} of {args.steps}")
            break
        batch = make_batch([train[rng.randrange(len(train))] for _ in range(args.batch_size)], args.seq_len).to(device)
        spent = (time.monotonic() - started) / train_seconds if train_seconds else 0.0
        lr = warmup_cosine(step, args.steps, args.lr, args.warmup, LR_FLOOR, spent)
        loss, agree, n = train_step(student, optimizer, batch, head, slot, lr, args)
        step += 1
        progress.update(1)
        progress.set_postfix(kl=f"{loss.item():.3f}", top1=f"{agree / max(1, n):.2f}", lr=f"{lr:.1e}")
        if args.eval_every and step % args.eval_every == 0:
            kl, top1 = evaluate(student, held_out, head, slot, args.kd_temperature, args.seq_len)
            say(f"step {step}: held-out KL {kl:.3f}, top-1 agreement {top1:.3f}")
            if best is None or top1 > best["top1"]:
                best = snapshot(step, kl, top1, student)
        if step % args.checkpoint_every == 0 or step == args.steps:
            save_checkpoint(checkpoint, student, optimizer, step, before, best, rng, data)
    progress.close()
    last = evaluate(student, held_out, head, slot, args.kd_temperature, args.seq_len)
    after, exported_step = keep_best(student, best, last, step)
    return Training(step, exported_step, stopped_by, before, after, started)
