"""Training a feature draft (``specdec distill --kind feature``); see ``specdec.feature_draft``.

Data: the feature corpus (``specdec.feature_corpus``): the target's answers with its final hidden
state at every position. The teacher's next-token distribution at t is the target's own head
applied to f_t, so the loss needs nothing else.

Loss at every answer position t and drafting step s = 1..``--unroll`` (the draft's inputs at step
s are its own step-(s-1) predictions, as when it drafts the s-th token of a block):
- KL(p_t || q_t^(s)) over the head vocabulary, p_t = softmax(head(f_t)) renormalised over it;
- ``--feature-loss`` x smooth-L1(prediction, f_t): keeps the fed-back predictions near the
  feature space the next step expects (EAGLE's regression term).
Step s is weighted ``--unroll-decay`` ** (s - 1).
"""
from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .feature_corpus import FeatureRecord
from .feature_draft import FeatureDraft, FeatureDraftConfig


def say(message: str) -> None:
    print(f"[distill] {message}", file=sys.stderr, flush=True)


def choose_feature_head_vocab(records: list[FeatureRecord], size: int, vocab_size: int, always: set[int]) -> list[int]:
    """The ``size`` tokens the target emits most often in its answers (plus ``always``, e.g. its
    end tokens): the tokens a draft must be able to propose."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for r in records:
        counts.index_add_(0, torch.tensor(r.ids[r.start:], dtype=torch.long), torch.ones(len(r.ids) - r.start,
                                                                                       dtype=torch.float64))
    chosen = {int(t) for t in always if 0 <= t < vocab_size}
    for t in torch.argsort(counts, descending=True, stable=True).tolist():
        if len(chosen) >= size:
            break
        chosen.add(t)
    return sorted(chosen)


def answer_coverage(records: list[FeatureRecord], head: list[int], vocab_size: int) -> float:
    """Fraction of answer tokens inside the head vocabulary (a ceiling on greedy acceptance)."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[head] = True
    hits = sum(int(inside[torch.tensor(r.ids[r.start:])].sum()) for r in records)
    return hits / max(1, sum(len(r.ids) - r.start for r in records))


def build_feature_draft(target, head_ids: list[int], embed_size: int, heads: int, kv_heads: int,
                        intermediate: int, seed: int, target_spec: str = "", fingerprint: str = "") -> FeatureDraft:
    """A fresh draft for ``target``: width = the target's hidden size; token embeddings from the
    target's, projected on their principal directions; the head = the target's output rows."""
    tc = target.config
    hidden = int(tc.hidden_size)
    rope = getattr(tc, "rope_parameters", None) or {}
    config = FeatureDraftConfig(
        vocab_size=int(tc.vocab_size), hidden_size=hidden, embed_size=embed_size, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=hidden // heads, intermediate_size=intermediate,
        head_vocab_size=len(head_ids), rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-5)),
        rope_theta=float(getattr(tc, "rope_theta", None) or rope.get("rope_theta", 10000.0)),
        max_position_embeddings=int(tc.max_position_embeddings), target=target_spec,
        target_fingerprint=fingerprint, bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id)
    torch.manual_seed(seed)
    ids = torch.tensor(head_ids, dtype=torch.long)
    draft = FeatureDraft(config, ids)
    with torch.no_grad():
        emb = target.get_input_embeddings().weight.detach().float().cpu()
        centered = emb - emb.mean(0, keepdim=True)
        _, _, v = torch.linalg.svd(centered[: min(len(centered), 8192)], full_matrices=False)
        projected = centered @ v[:embed_size].T
        draft.embed.weight.copy_(projected / projected.std() * 0.2)
        draft.head.weight.copy_(target.get_output_embeddings().weight.detach().float().cpu()[ids])
    return draft


@dataclass
class FeatureBatch:
    tokens: torch.Tensor     # [B, T]
    preceding: torch.Tensor  # [B, T, H]: the target's feature before each token (zeros at t = 0)
    target: torch.Tensor     # [B, T, H]: the target's feature at each position
    weight: torch.Tensor     # [B, T]: 1 where position t predicts an answer token


def make_feature_batch(records: list[FeatureRecord], seq_len: int) -> FeatureBatch:
    width = min(seq_len, max(len(r.ids) for r in records))
    hidden = records[0].features.shape[1]
    tokens = torch.zeros(len(records), width, dtype=torch.long)
    preceding = torch.zeros(len(records), width, hidden)
    target = torch.zeros(len(records), width, hidden)
    weight = torch.zeros(len(records), width)
    for i, r in enumerate(records):
        n = min(width, len(r.ids))
        tokens[i, :n] = torch.tensor(r.ids[:n])
        feats = r.features[: n].float()  # features[t] for t < len(ids) - 1
        preceding[i, 1:n] = feats[: n - 1]
        target[i, : len(feats)] = feats
        # position t predicts token t + 1: answer tokens are ids[start:], so t in [start - 1, len - 2]
        weight[i, max(0, r.start - 1): min(n, len(r.ids) - 1)] = 1.0
    return FeatureBatch(tokens, preceding, target, weight)


def feature_loss(draft: FeatureDraft, batch: FeatureBatch, teacher_head: torch.Tensor, steps: int,
                 decay: float, feature_weight: float):
    """(loss, top-1 agreements per step, positions). ``teacher_head``: [S, H] the target's head rows
    over the draft's head vocabulary (frozen)."""
    mask = batch.weight > 0
    target = batch.target[mask]                                              # [N, H]
    with torch.no_grad():
        logp = torch.log_softmax(target @ teacher_head.T, dim=-1)            # [N, S]
        p = logp.exp()
        teacher_top = logp.argmax(-1)
    loss = torch.zeros(())
    agree = []
    for s, predicted in enumerate(draft.unrolled(batch.tokens, batch.preceding, steps)):
        h = predicted[mask]
        logq = torch.log_softmax(draft.head_logits(h).float(), dim=-1)
        kl = (p * (logp - logq)).sum(-1).mean()
        reg = F.smooth_l1_loss(h.float(), target) if feature_weight else torch.zeros(())
        loss = loss + decay ** s * (kl + feature_weight * reg)
        agree.append(int((logq.argmax(-1) == teacher_top).sum()))
    return loss, agree, int(mask.sum())


@torch.no_grad()
def evaluate_features(draft: FeatureDraft, records: list[FeatureRecord], teacher_head, steps: int,
                      seq_len: int) -> dict:
    """Held-out KL-free summary: top-1 agreement with the target per drafting step (greedy
    acceptance of the s-th proposal given the earlier ones were accepted)."""
    was = draft.training
    draft.eval()
    agree = [0] * steps
    total = 0
    for i in range(0, len(records), 16):
        batch = make_feature_batch(records[i:i + 16], seq_len)
        _, a, n = feature_loss(draft, batch, teacher_head, steps, 1.0, 0.0)
        agree = [x + y for x, y in zip(agree, a)]
        total += n
    draft.train(was)
    return {"top1_by_step": [a / max(1, total) for a in agree], "positions": total}


def expected_tokens_per_step(top1_by_step: list[float], k: int) -> float:
    """Greedy tokens per target pass at block size k from per-step agreements (a conditional
    acceptance chain): 1 + a1 + a1 a2 + ... (the last step's rate reused beyond ``len``)."""
    total, chain = 1.0, 1.0
    for s in range(k):
        chain *= top1_by_step[min(s, len(top1_by_step) - 1)]
        total += chain
    return total


def lr_at(step: int, steps: int, lr: float, warmup: int, budget_fraction: float = 0.0) -> float:
    progress = min(1.0, max(step / max(1, steps), budget_fraction))
    return lr * min(1.0, (step + 1) / max(1, warmup)) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_feature_draft(draft: FeatureDraft, teacher_head: torch.Tensor, train: list[FeatureRecord],
                        held_out: list[FeatureRecord], args, checkpoint: Path,
                        train_seconds: float | None = None) -> dict:
    """The training loop: AdamW, warm-up + cosine, checkpoint/resume, held-out evaluation; the
    weights of the best evaluation (mean tokens per pass at k = unroll) are kept in the result."""
    from tqdm import tqdm

    rng = random.Random(args.seed)
    params = [p for n, p in draft.named_parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    step, best, history = 0, None, []
    if checkpoint.exists() and not args.restart:
        state = torch.load(checkpoint, weights_only=False)
        draft.load_state_dict(state["draft"])
        optimizer.load_state_dict(state["optimizer"])
        step, best, history = state["step"], state["best"], state["history"]
        rng.setstate(state["rng"])
        say(f"resuming from {checkpoint} at step {step}")
    draft.train()
    bar = tqdm(total=args.steps, initial=step, desc="distilling (feature draft)", file=sys.stderr)
    started = time.monotonic()
    stopped_by = "steps"

    def score(ev: dict) -> float:
        return expected_tokens_per_step(ev["top1_by_step"], args.unroll)

    while step < args.steps:
        if train_seconds is not None and time.monotonic() - started >= train_seconds:
            stopped_by = "time budget"
            say(f"time budget reached at step {step} of {args.steps}")
            break
        batch = make_feature_batch([train[rng.randrange(len(train))] for _ in range(args.batch_size)], args.seq_len)
        spent = (time.monotonic() - started) / train_seconds if train_seconds else 0.0
        lr = lr_at(step, args.steps, args.lr, args.warmup, spent)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, agree, n = feature_loss(draft, batch, teacher_head, args.unroll, args.unroll_decay, args.feature_loss)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", top1="/".join(f"{a / max(1, n):.2f}" for a in agree),
                        lr=f"{lr:.1e}")
        last = step == args.steps
        if args.eval_every and (step % args.eval_every == 0 or last):
            ev = evaluate_features(draft, held_out, teacher_head, args.unroll, args.seq_len)
            history.append({"step": step, **ev})
            say(f"step {step}: held-out top-1 by drafting step "
                + " / ".join(f"{a:.3f}" for a in ev["top1_by_step"])
                + f"; tokens per pass at k={args.unroll}: {score(ev):.2f}")
            if best is None or score(ev) > score(best):
                best = {"step": step, **ev, "state": {k: v.detach().clone() for k, v in draft.state_dict().items()}}
        if step % args.checkpoint_every == 0 or last:
            torch.save({"draft": draft.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                        "best": best, "history": history, "rng": rng.getstate()}, checkpoint)
    bar.close()
    return {"steps": step, "best": best, "history": history, "stopped_by": stopped_by,
            "train_seconds": time.monotonic() - started}
