"""``specdec distill``: build a small draft for any HF causal-LM target, sharing its tokenizer.

1. Data: the target answers the prompts of a versioned prompt set (chat template when it has one),
   greedily and by seeded sampling; those token sequences are the training text (cached in
   ``OUT/data.pt``).
2. Student: a compact Llama (a few layers, small width) over the target's full vocabulary with
   tied embeddings, initialised from the target's embeddings projected onto their top principal
   directions (so token identities start out meaningful).
3. Knowledge distillation: minimise KL(p_target || q_student) on the target's own softened
   next-token distributions at every position (temperature ``--kd-temperature``).
4. Output: a normal Hugging Face directory (config, safetensors in bf16/fp16, tokenizer files)
   that ``specdec draft --model OUT`` loads, plus ``distill.json`` (settings, KL before/after).

Seeded and reproducible; progress bars; checkpoints every ``--checkpoint-every`` steps to
``OUT/checkpoint.pt`` and resumes from it.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .bench import DEFAULT_PROMPTS, load_prompts


def say(message: str) -> None:
    print(f"[distill] {message}", file=sys.stderr, flush=True)


@torch.inference_mode()
def generate_corpus(target, tokenizer, prompts: list[dict], samples: int, new_tokens: int, seed: int) -> list[list[int]]:
    from tqdm import tqdm

    from .models import encode_prompt

    corpus = []
    for i, prompt in enumerate(tqdm(prompts, desc="target generates the corpus", file=sys.stderr)):
        ids = encode_prompt(tokenizer, prompt["text"], chat=True) if tokenizer is not None else prompt["ids"]
        for j in range(samples):
            kwargs = {"do_sample": False} if j == 0 else {"do_sample": True, "temperature": 0.8, "top_k": 0}
            torch.manual_seed(seed * 1000 + i * 10 + j)
            out = target.generate(torch.tensor([ids]), max_new_tokens=new_tokens, pad_token_id=0, **kwargs)
            corpus.append(out[0].tolist())
    return corpus


def build_student(target, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    tc = target.config
    config = LlamaConfig(
        vocab_size=tc.vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=tc.max_position_embeddings,
        rope_theta=getattr(tc, "rope_theta", None) or (getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 10000.0),
        tie_word_embeddings=True, bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id,
        pad_token_id=getattr(tc, "pad_token_id", None),
    )
    torch.manual_seed(seed)
    student = LlamaForCausalLM(config)
    with torch.no_grad():
        emb = target.get_input_embeddings().weight.float()
        centered = emb - emb.mean(0, keepdim=True)
        # top principal directions of the target's embeddings, rescaled to the student's init scale
        _, _, v = torch.linalg.svd(centered[: min(len(centered), 8192)], full_matrices=False)
        projected = centered @ v[:hidden].T
        projected = projected / projected.std() * config.initializer_range * 10
        student.get_input_embeddings().weight.copy_(projected)
    return student


def kl_loss(student_logits, teacher_logits, mask, temperature: float) -> torch.Tensor:
    """Mean over unmasked positions of KL(softmax(t/T) || softmax(s/T)) * T^2."""
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    kl = (t.exp() * (t - s)).sum(-1)
    return (kl * mask).sum() / mask.sum().clamp(min=1) * temperature ** 2


def batches(corpus: list[list[int]], batch_size: int, seq_len: int, rng: random.Random):
    while True:
        picks = [corpus[rng.randrange(len(corpus))] for _ in range(batch_size)]
        width = min(seq_len, max(len(p) for p in picks))
        ids = torch.zeros(batch_size, width, dtype=torch.long)
        mask = torch.zeros(batch_size, width)
        for row, seq in enumerate(picks):
            start = rng.randrange(0, max(1, len(seq) - width + 1))
            chunk = seq[start:start + width]
            ids[row, : len(chunk)] = torch.tensor(chunk)
            mask[row, : len(chunk)] = 1
        yield ids, mask


@torch.no_grad()
def evaluate(student, target, corpus, temperature: float, seq_len: int) -> float:
    total, count = 0.0, 0
    for seq in corpus:
        ids = torch.tensor([seq[:seq_len]])
        mask = torch.ones(1, ids.shape[1])
        total += float(kl_loss(student(input_ids=ids).logits, target(input_ids=ids).logits, mask, temperature))
        count += 1
    return total / max(1, count)


def distill(args) -> dict:
    from tqdm import tqdm

    from .models import load_model, try_load_tokenizer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    target = load_model(args.target, "cpu", torch.float32)
    tokenizer = try_load_tokenizer(args.target)
    data_path = out / "data.pt"
    if data_path.exists():
        corpus = torch.load(data_path)
        say(f"reusing the corpus in {data_path} ({len(corpus)} sequences)")
    else:
        prompts = load_prompts(Path(args.prompts), args.num_prompts, args.split)
        if tokenizer is None:
            raise SystemExit("the target has no tokenizer: cannot build a corpus from text prompts")
        corpus = generate_corpus(target, tokenizer, prompts, args.samples_per_prompt, args.gen_tokens, args.seed)
        torch.save(corpus, data_path)
    # Held-out sequences are never trained on: the KL reported on them measures generalisation.
    stride = max(2, len(corpus) // max(1, args.eval_sequences))
    held_out = corpus[::stride][: args.eval_sequences]
    train = [seq for i, seq in enumerate(corpus) if not (i % stride == 0 and i // stride < args.eval_sequences)]
    student = build_student(target, args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate, args.seed)
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.0)
    step = 0
    ckpt = out / "checkpoint.pt"
    kl_start = None
    if ckpt.exists() and not args.restart:
        state = torch.load(ckpt, weights_only=False)
        student.load_state_dict(state["student"])
        optimizer.load_state_dict(state["optimizer"])
        step, kl_start = state["step"], state["kl_start"]
        rng.setstate(state["rng"])
        say(f"resuming from {ckpt} at step {step}")
    if kl_start is None:
        kl_start = evaluate(student, target, held_out, args.kd_temperature, args.seq_len)
    feed = batches(train, args.batch_size, args.seq_len, rng)
    student.train()
    progress = tqdm(total=args.steps, initial=step, desc="distilling", file=sys.stderr)
    started = time.monotonic()
    while step < args.steps:
        ids, mask = next(feed)
        with torch.no_grad():
            teacher = target(input_ids=ids).logits
        lr = args.lr * min(1.0, (step + 1) / max(1, args.warmup)) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = kl_loss(student(input_ids=ids).logits, teacher, mask, args.kd_temperature)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        step += 1
        progress.update(1)
        progress.set_postfix(kl=f"{loss.item():.3f}", lr=f"{lr:.1e}")
        if step % args.checkpoint_every == 0 or step == args.steps:
            torch.save({"student": student.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                        "kl_start": kl_start, "rng": rng.getstate()}, ckpt)
    progress.close()
    student.eval()
    kl_end = evaluate(student, target, held_out, args.kd_temperature, args.seq_len)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.save_dtype]
    student.to(dtype).save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in student.parameters())
    report = {"target": args.target, "steps": step, "train_sequences": len(train), "held_out_sequences": len(held_out),
              "parameters": params,
              "kl_start": kl_start, "kl_end": kl_end, "seconds": time.monotonic() - started,
              "settings": {k: v for k, v in vars(args).items() if k != "func"}}
    (out / "distill.json").write_text(json.dumps(report, indent=2))
    say(f"KL(target || draft) on held-out text: {kl_start:.3f} -> {kl_end:.3f}; "
        f"{params / 1e6:.1f}M parameters saved to {out}")
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model spec")
    p.add_argument("--out", required=True, help="output directory (HF format)")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    p.add_argument("--split", default="train", help="prompt split to use ('' = all)")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--samples-per-prompt", type=int, default=4, help="1 greedy + seeded samples")
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--kd-temperature", type=float, default=1.0)
    p.add_argument("--eval-sequences", type=int, default=8)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--restart", action="store_true", help="ignore an existing checkpoint")
    p.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)


def main(args) -> int:
    if args.split == "":
        args.split = None
    distill(args)
    return 0
