"""Training a feature draft (``specdec distill --kind feature``); see ``specdec.modeling.feature_draft``.

Data: the feature corpus (``specdec.training.feature_corpus``): the target's answers with its final hidden
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

import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.modeling.feature_draft import FeatureDraft, FeatureDraftConfig
from specdec.training.corpus import say
from specdec.training.feature_corpus import FeatureRecord
from specdec.training.trainer import (
    check_resumable,
    load_checkpoint,
    quiet_mixed_norm,
    split_records,
    student_autocast,
    training_data,
    warmup_cosine,
)

# The cosine schedule's floor (a fraction of --lr) that the feature drafts were trained with.
LR_FLOOR = 0.05


def choose_feature_head_vocab(records: list[FeatureRecord], size: int, vocab_size: int, always: set[int]) -> list[int]:
    """The ``size`` tokens the target emits most often in its answers (plus ``always``, e.g. its
    end tokens): the tokens a draft must be able to propose."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for r in records:
        counts.index_add_(
            0, torch.tensor(r.ids[r.start :], dtype=torch.long), torch.ones(len(r.ids) - r.start, dtype=torch.float64)
        )
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
    hits = sum(int(inside[torch.tensor(r.ids[r.start :])].sum()) for r in records)
    return hits / max(1, sum(len(r.ids) - r.start for r in records))


def build_feature_draft(
    target,
    head_ids: list[int],
    embed_size: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    seed: int,
    target_spec: str = "",
    fingerprint: str = "",
) -> FeatureDraft:
    """A fresh draft for ``target``: width = the target's hidden size; token embeddings from the
    target's, projected on their principal directions; the head = the target's output rows."""
    tc = target.config
    hidden = int(tc.hidden_size)
    rope = getattr(tc, "rope_parameters", None) or {}
    config = FeatureDraftConfig(
        vocab_size=int(tc.vocab_size),
        hidden_size=hidden,
        embed_size=embed_size,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        intermediate_size=intermediate,
        head_vocab_size=len(head_ids),
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-5)),
        rope_theta=float(getattr(tc, "rope_theta", None) or rope.get("rope_theta", 10000.0)),
        max_position_embeddings=int(tc.max_position_embeddings),
        target=target_spec,
        target_fingerprint=fingerprint,
        bos_token_id=tc.bos_token_id,
        eos_token_id=tc.eos_token_id,
    )
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
    tokens: torch.Tensor  # [B, T]
    preceding: torch.Tensor  # [B, T, H]: the target's feature before each token (zeros at t = 0)
    target: torch.Tensor  # [B, T, H]: the target's feature at each position
    weight: torch.Tensor  # [B, T]: 1 where position t predicts an answer token

    def to(self, device) -> FeatureBatch:
        return FeatureBatch(
            *(t.to(device, non_blocking=True) for t in (self.tokens, self.preceding, self.target, self.weight))
        )


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
        feats = r.features[:n].float()  # features[t] for t < len(ids) - 1
        preceding[i, 1:n] = feats[: n - 1]
        target[i, : len(feats)] = feats
        # position t predicts token t + 1: answer tokens are ids[start:], so t in [start - 1, len - 2]
        weight[i, max(0, r.start - 1) : min(n, len(r.ids) - 1)] = 1.0
    return FeatureBatch(tokens, preceding, target, weight)


def feature_loss(
    draft: FeatureDraft,
    batch: FeatureBatch,
    teacher_head: torch.Tensor,
    steps: int,
    decay: float,
    feature_weight: float,
    bf16: bool = False,
):
    """(loss, top-1 agreements per step, positions). ``teacher_head``: [S, H] the target's head rows
    over the draft's head vocabulary (frozen). With ``bf16`` the draft's matrix products run in
    bf16 autocast; the teacher, the softmaxes and the losses stay fp32."""
    batch = batch.to(teacher_head.device)
    mask = batch.weight > 0
    target = batch.target[mask]  # [N, H]
    with torch.no_grad():
        logp = torch.log_softmax(target @ teacher_head.T, dim=-1)  # [N, S]
        p = logp.exp()
        teacher_top = logp.argmax(-1)
    loss = torch.zeros((), device=teacher_head.device)
    agree = []
    with student_autocast(teacher_head.device, bf16), quiet_mixed_norm():
        drafted = [
            (h, draft.head_logits(h))
            for h in (predicted[mask] for predicted in draft.unrolled(batch.tokens, batch.preceding, steps))
        ]
    for s, (h, logits) in enumerate(drafted):
        logq = torch.log_softmax(logits.float(), dim=-1)
        kl = (p * (logp - logq)).sum(-1).mean()
        reg = F.smooth_l1_loss(h.float(), target) if feature_weight else 0.0
        loss = loss + decay**s * (kl + feature_weight * reg)
        agree.append(int((logq.argmax(-1) == teacher_top).sum()))
    return loss, agree, int(mask.sum())


@torch.no_grad()
def evaluate_features(
    draft: FeatureDraft, records: list[FeatureRecord], teacher_head, steps: int, seq_len: int
) -> dict:
    """Held-out KL-free summary: top-1 agreement with the target per drafting step (greedy
    acceptance of the s-th proposal given the earlier ones were accepted)."""
    was = draft.training
    draft.eval()
    agree = [0] * steps
    total = 0
    for i in range(0, len(records), 16):
        batch = make_feature_batch(records[i : i + 16], seq_len)
        _, a, n = feature_loss(draft, batch, teacher_head, steps, 1.0, 0.0)
        agree = [x + y for x, y in zip(agree, a, strict=True)]
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


def train_feature_draft(
    draft: FeatureDraft,
    teacher_head: torch.Tensor,
    train: list[FeatureRecord],
    held_out: list[FeatureRecord],
    args,
    checkpoint: Path,
    train_seconds: float | None = None,
) -> dict:
    """The training loop: AdamW, warm-up + cosine, checkpoint/resume, held-out evaluation; the
    weights of the best evaluation (mean tokens per pass at k = unroll) are kept in the result."""
    from tqdm import tqdm

    rng = random.Random(args.seed)
    frozen = set(getattr(args, "freeze", "").split(",")) - {""}
    for name, p in draft.named_parameters():
        p.requires_grad_(name.split(".")[0] not in frozen)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    step, best, history = 0, None, []
    data = training_data(draft.head_token_ids.tolist(), train, held_out)
    if checkpoint.exists() and not args.restart:
        state = load_checkpoint(checkpoint)
        check_resumable(checkpoint, state.get("data"), data)
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
        lr = warmup_cosine(step, args.steps, args.lr, args.warmup, LR_FLOOR, spent)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if getattr(args, "feature_noise", 0.0):  # EAGLE's feature noise: robustness to imperfect inputs
            batch.preceding += torch.randn_like(batch.preceding) * args.feature_noise * batch.preceding.std()
        loss, agree, n = feature_loss(
            draft,
            batch,
            teacher_head,
            args.unroll,
            args.unroll_decay,
            args.feature_loss,
            getattr(args, "student_bf16", False),
        )
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", top1="/".join(f"{a / max(1, n):.2f}" for a in agree), lr=f"{lr:.1e}")
        last = step == args.steps
        if args.eval_every and (step % args.eval_every == 0 or last):
            ev = evaluate_features(draft, held_out, teacher_head, args.unroll, args.seq_len)
            history.append({"step": step, **ev})
            say(
                f"step {step}: held-out top-1 by drafting step "
                + " / ".join(f"{a:.3f}" for a in ev["top1_by_step"])
                + f"; tokens per pass at k={args.unroll}: {score(ev):.2f}"
            )
            if best is None or score(ev) > score(best):
                best = {"step": step, **ev, "state": {k: v.detach().clone() for k, v in draft.state_dict().items()}}
        if step % args.checkpoint_every == 0 or last:
            torch.save(
                {
                    "draft": draft.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                    "best": best,
                    "history": history,
                    "rng": rng.getstate(),
                    "data": data,
                },
                checkpoint,
            )
    bar.close()
    return {
        "steps": step,
        "best": best,
        "history": history,
        "stopped_by": stopped_by,
        "train_seconds": time.monotonic() - started,
    }


# -- the command ---------------------------------------------------------------------------------
def distill_feature_draft(
    args, target, tokenizer, prompts: list[dict], out: Path, command_started: float, deadline: float | None
) -> dict:
    """``specdec distill --kind feature``: corpus -> head vocabulary -> training -> export."""
    import json

    from specdec.modeling.loading import eos_token_ids, tokenizer_fingerprint
    from specdec.training.feature_corpus import build_feature_corpus, corpus_plan

    train, held_out = [], []
    for sample in range(max(1, args.samples_per_prompt)):
        greedy = sample == 0
        plan = corpus_plan(
            prompts, args.target, args.gen_tokens, args.gen_batch_size, greedy, args.gen_temperature, args.seed + sample
        )
        name = "features-greedy" if greedy else f"features-sampled-{sample}"
        records = build_feature_corpus(
            target, tokenizer, prompts, out / "corpus" / name, plan, args.corpus_batches or None
        )
        part_train, part_held = split_records(records, args.eval_sequences)
        train += part_train
        held_out += part_held
    answer_tokens = sum(len(r.ids) - r.start for r in train)
    say(
        f"corpus ready after {(time.monotonic() - command_started) / 60:.1f} min: {len(train)} training + "
        f"{len(held_out)} held-out sequences, {answer_tokens} answer tokens"
    )
    vocab_size = int(target.config.vocab_size)
    head_ids = choose_feature_head_vocab(
        train, args.head_vocab or vocab_size, vocab_size, eos_token_ids(target, tokenizer)
    )
    coverage = answer_coverage(held_out, head_ids, vocab_size)
    say(f"head vocabulary: {len(head_ids)} tokens, covering {coverage:.1%} of held-out answer tokens")
    tc = target.config
    heads = args.heads or int(tc.num_attention_heads)
    kv_heads = args.kv_heads or int(getattr(tc, "num_key_value_heads", None) or heads)
    intermediate = args.intermediate or int(tc.intermediate_size)
    if int(tc.hidden_size) % heads:
        raise SystemExit(f"specdec distill: --heads {heads} does not divide the target's hidden size {tc.hidden_size}")
    draft = build_feature_draft(
        target.cpu(),
        head_ids,
        args.embed_size,
        heads,
        kv_heads,
        intermediate,
        args.seed,
        args.target,
        tokenizer_fingerprint(tokenizer),
    )
    teacher_head = target.get_output_embeddings().weight.detach().float().cpu()[torch.tensor(head_ids)].clone()
    del target  # the corpus holds everything training needs from the target
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    draft, teacher_head = draft.to(device), teacher_head.to(device)
    before = evaluate_features(draft, held_out, teacher_head, args.unroll, args.seq_len)
    train_seconds = None
    if deadline:  # a tenth of the budget (at most a minute) stays for the final evaluation and export
        train_seconds = deadline - min(60.0, 6.0 * args.time_budget_minutes) - time.monotonic()
    result = train_feature_draft(draft, teacher_head, train, held_out, args, out / "checkpoint.pt", train_seconds)
    after = evaluate_features(draft, held_out, teacher_head, args.unroll, args.seq_len)
    exported_step = result["steps"]
    best = result["best"]
    if best is not None and expected_tokens_per_step(best["top1_by_step"], args.unroll) > expected_tokens_per_step(
        after["top1_by_step"], args.unroll
    ):
        draft.load_state_dict(best["state"])
        after, exported_step = {k: best[k] for k in ("top1_by_step", "positions")}, best["step"]
        say(f"exporting the step-{exported_step} weights (best held-out evaluation)")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.save_dtype]
    draft.save(out, dtype)
    tokenizer.save_pretrained(out)
    report = {
        "kind": "feature",
        "target": args.target,
        "steps": result["steps"],
        "exported_step": exported_step,
        "stopped_by": result["stopped_by"],
        "device": str(device),
        "train_sequences": len(train),
        "held_out_sequences": len(held_out),
        "answer_tokens": answer_tokens,
        "parameters": sum(p.numel() for p in draft.parameters()),
        "head_vocab": len(head_ids),
        "head_coverage_held_out": coverage,
        "top1_by_step_start": before["top1_by_step"],
        "top1_by_step_end": after["top1_by_step"],
        "tokens_per_pass_end": {k: expected_tokens_per_step(after["top1_by_step"], k) for k in (1, 2, 3, 4)},
        "history": [{k: h[k] for k in ("step", "top1_by_step")} for h in result["history"]],
        "train_seconds": result["train_seconds"],
        "total_seconds": time.monotonic() - command_started,
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
    }
    (out / "distill.json").write_text(json.dumps(report, indent=2))
    write_feature_model_card(out, report)
    say(
        "held-out top-1 agreement by drafting step: "
        + " / ".join(f"{a:.3f}" for a in before["top1_by_step"])
        + " -> "
        + " / ".join(f"{a:.3f}" for a in after["top1_by_step"])
        + f"; {report['parameters'] / 1e6:.1f}M parameters saved to {out}"
    )
    return report


def write_feature_model_card(out: Path, report: dict) -> None:
    st = report["settings"]
    size_mb = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 1e6
    steps = " / ".join(f"{a:.3f}" for a in report["top1_by_step_end"])
    per_k = ", ".join(f"k={k}: {v:.2f}" for k, v in report["tokens_per_pass_end"].items())
    exported = ""
    if report["exported_step"] != report["steps"]:
        exported = f"; exported the step-{report['exported_step']} weights (best held-out evaluation)"
    (
        out / "README.md"
    ).write_text(f"""# Feature draft for `{report["target"]}` (made by `specdec distill --kind feature`)

A speculative-decoding draft that reads the target's own hidden states (EAGLE-style): at each
position it takes the token and the target's final hidden state before it, predicts the next
hidden state with one decoder layer, and reads tokens off that with the target's output head
(restricted to {report["head_vocab"]} tokens; the others get q = 0, which keeps decoding exact). To
draft more tokens it feeds its own predictions back. It only works with the target it was trained
on, served by specdec (the target sends its features to the draft through the coordinator).

- **Size**: {report["parameters"] / 1e6:.1f}M parameters, {size_mb:.1f} MB of {st["save_dtype"]} safetensors
  (token embedding {st["embed_size"]} wide, one layer of the target's width, head over {report["head_vocab"]} tokens).
- **Data**: the target's greedy answers (up to {st["gen_tokens"]} new tokens) to
  {", ".join("`" + Path(f).name + "`" for f in st["prompts"].split(","))}, with its hidden state at every position:
  {report["train_sequences"]} training sequences ({report["answer_tokens"]} answer tokens),
  {report["held_out_sequences"]} held out.
- **Training**: KL to the target's next-token distribution over the head vocabulary plus
  {st["feature_loss"]} x smooth-L1 to its features, at {st["unroll"]} unrolled drafting steps (step s reads the draft's
  own step-(s-1) predictions; weights {st["unroll_decay"]}^(s-1)); {report["steps"]} steps of batch
  {st["batch_size"]},
  AdamW lr {st["lr"]} (cosine), seed {st["seed"]}; {report["train_seconds"] / 60:.0f} min on
  {report["device"]}{exported}.
- **Held-out**: top-1 agreement with the target by drafting step {steps} (the greedy acceptance of
  the s-th proposal of a block when the earlier ones were accepted); expected tokens per target pass
  (greedy) {per_k}; the head vocabulary covers {report["head_coverage_held_out"]:.1%} of held-out answer tokens.

Reproduce: `specdec distill --kind feature --target {report["target"]} --out DIR` with the settings in `distill.json`.
""")
