"""Prompts the target writes itself (``specdec distill --self-prompts N``): seeded sampling from
the opening of a user turn in its chat format gives user messages in the target's own idea of
what users ask, which it then answers like any prompt file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from specdec.training.corpus import padding_id, say
from specdec.training.prompts import load_prompts


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
