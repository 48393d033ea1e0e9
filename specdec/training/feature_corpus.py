"""The corpus a feature draft learns from: the target's own answers with its hidden states.

A feature draft (``specdec.modeling.feature_draft``) predicts the target's next *hidden state* from the
previous one and the token just chosen, then reads tokens off it with the target's own output
head. It therefore trains on (tokens, target features) pairs: for every position t of a sequence,
the target's final hidden state (after the last norm, i.e. what the LM head reads) when it has seen
tokens [0, t]. The target's next-token distribution at t is ``head(features[t])``, so the features
are also the distillation teacher -- nothing else needs storing.

Answers are generated in batches (left-padded ``generate``), and the features come from the same
pass (``output_hidden_states``), so the target runs once per token. Each batch is one shard,
written atomically to ``DIR/shard-NNNNN.pt`` when complete; an interrupted run resumes at the
first missing shard, and ``plan.json`` refuses to mix shards made under other settings.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.training.corpus import left_pad, open_corpus_dir, padding_id, sharded_records


@dataclass
class FeatureRecord:
    """One sequence: ``ids`` = prompt + answer; ``features[t]`` is the target's final hidden state
    after reading ``ids[: t + 1]`` (so it predicts ``ids[t + 1]``), for t < len(ids) - 1."""

    ids: list[int]
    start: int  # where the answer begins
    features: torch.Tensor  # [len(ids) - 1, H] float16

    def as_dict(self) -> dict:
        return {"ids": self.ids, "start": self.start, "features": self.features}


def plan_feature_batches(prompt_lengths: list[int], batch_size: int, seed: int, window: int = 1024) -> list[list[int]]:
    """Batches of prompt indices: a seeded shuffle (so any prefix of the run is a fair sample of
    the prompts), then sorted by length inside windows (less left padding per batch)."""
    order = list(range(len(prompt_lengths)))
    random.Random(seed).shuffle(order)
    batches = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w : w + window], key=lambda i: (prompt_lengths[i], i))
        batches += [chunk[b : b + batch_size] for b in range(0, len(chunk), batch_size)]
    return batches


@torch.inference_mode()
def answer_with_features(
    target,
    prompts: list[list[int]],
    new_tokens: int,
    eos_ids: set[int],
    pad_id: int,
    greedy: bool = True,
    temperature: float = 0.7,
    seed: int = 0,
) -> list[FeatureRecord]:
    """The target answers ``prompts`` (one batch); every answer is cut after its first end token."""
    ids, mask = left_pad(prompts, pad_id)
    width = ids.shape[1]
    sampling = (
        {"do_sample": False} if greedy else {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    )
    torch.manual_seed(seed)
    out = target.generate(
        input_ids=ids.to(target.device),
        attention_mask=mask.to(target.device),
        max_new_tokens=new_tokens,
        min_new_tokens=1,
        pad_token_id=pad_id,
        eos_token_id=sorted(eos_ids) or None,
        output_hidden_states=True,
        return_dict_in_generate=True,
        **sampling,
    )
    generated = out.sequences[:, width:].cpu()
    # hidden_states[step][-1]: the last layer after the final norm; step 0 covers the prompt
    steps = [layers[-1].to(device="cpu", dtype=torch.float16) for layers in out.hidden_states]
    features = torch.cat(steps, dim=1)  # [B, width + G - 1, H]: position c of the padded row
    records = []
    for row, prompt in enumerate(prompts):
        answer = generated[row].tolist()
        length = len(answer)
        for t, token in enumerate(answer):
            if token in eos_ids:
                length = t + 1  # keep the end token: the draft should learn to propose it
                break
        sequence = list(prompt) + answer[:length]
        first = width - len(prompt)
        records.append(FeatureRecord(sequence, len(prompt), features[row, first : first + len(sequence) - 1].clone()))
    return records


def corpus_plan(
    prompts: list[dict], target_spec: str, new_tokens: int, batch_size: int, greedy: bool, temperature: float, seed: int
) -> dict:
    blob = json.dumps([p["text"] for p in prompts], ensure_ascii=False).encode()
    return {
        "prompts_sha256": hashlib.sha256(blob).hexdigest(),
        "prompts": len(prompts),
        "target": target_spec,
        "new_tokens": new_tokens,
        "batch_size": batch_size,
        "greedy": greedy,
        "temperature": None if greedy else temperature,
        "seed": seed,
        "format": "features-v1",
    }


def build_feature_corpus(
    target, tokenizer, prompts: list[dict], corpus_dir: Path, plan: dict, max_batches: int | None = None
) -> list[FeatureRecord]:
    """Every batch of the plan, generated or read back from its shard (see the module docstring).
    ``max_batches``: stop after that many batches (a partial corpus is still a valid prefix)."""
    from specdec.modeling.loading import encode_prompt, eos_token_ids

    open_corpus_dir(corpus_dir, plan)
    encoded = [encode_prompt(tokenizer, p["text"], chat=True) for p in prompts]
    batches = plan_feature_batches([len(e) for e in encoded], plan["batch_size"], plan["seed"])
    if max_batches is not None:
        batches = batches[:max_batches]
    eos_ids = eos_token_ids(target, tokenizer)
    pad_id = padding_id(tokenizer, eos_ids)

    def make_batch(b: int) -> list[FeatureRecord]:
        return answer_with_features(
            target,
            [encoded[i] for i in batches[b]],
            plan["new_tokens"],
            eos_ids,
            pad_id,
            plan["greedy"],
            plan["temperature"] or 1.0,
            plan["seed"] * 100_003 + b,
        )

    return sharded_records(corpus_dir, len(batches), make_batch, FeatureRecord, lambda r: len(r.ids))
