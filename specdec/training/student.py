"""The standalone draft (``specdec distill --kind model``) from its start to its saved folder: the
head vocabulary it computes logits over, the compact Llama it is, the weights it starts from, and
the Hugging Face directory (with ``head_vocab.json`` and a README) it is exported as."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch

from specdec.modeling.heads import write_head_vocab
from specdec.training.corpus import say
from specdec.training.logprob_corpus import Record


# -- head vocabulary -------------------------------------------------------------------------------
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


def head_slots(head_ids: list[int], vocab_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(head token ids, slot of every vocabulary id in the head or -1) on ``device``."""
    head = torch.tensor(head_ids, dtype=torch.long, device=device)
    slot = torch.full((vocab_size,), -1, dtype=torch.long, device=device)
    slot[head] = torch.arange(len(head), device=device)
    return head, slot


# -- the model -------------------------------------------------------------------------------------
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
    """Start ``student`` from the weights of a draft saved by ``specdec distill`` (instead of the
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


# -- the saved draft -------------------------------------------------------------------------------
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
