"""What both distillation trainers share: mixed precision for the student, the learning-rate
schedule, the held-out split, and checkpoints that refuse to resume on other data."""

from __future__ import annotations

import contextlib
import math
import warnings
from pathlib import Path
from typing import TypeVar

import torch

R = TypeVar("R")


@contextlib.contextmanager
def quiet_mixed_norm():
    """Under CPU autocast torch warns on every RMSNorm that a bf16 input with an fp32 weight skips
    its fused kernel: expected there (the weights stay fp32 for the optimizer), so not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
        yield


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` does bf16 matrix products in hardware: CUDA, or a CPU with AVX512-BF16 /
    AMX (about 2x fp32 on such a CPU; emulated bf16 elsewhere is slower than fp32)."""
    if device.type == "cuda":
        return True
    if device.type == "cpu":
        check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        return bool(check and check())
    return False


def student_bf16(precision: str, device: torch.device, native=native_bf16) -> bool:
    """``--precision``: 'bf16' / 'fp32' as asked; 'auto' = bf16 where the device has it natively."""
    if precision == "auto":
        return native(device)
    return precision == "bf16"


def student_autocast(device: torch.device, bf16: bool):
    """The student's matrix products in bf16 (its weights, softmaxes and losses stay fp32)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)


def warmup_cosine(step: int, steps: int, lr: float, warmup: int, floor: float, budget_fraction: float = 0.0) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay from ``lr`` to ``floor * lr`` over
    the run; ``budget_fraction`` (the part of the time budget spent) moves the schedule on when
    time, not steps, will end the run."""
    progress = min(1.0, max(step / max(1, steps), budget_fraction))
    return lr * min(1.0, (step + 1) / max(1, warmup)) * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def split_records(records: list[R], eval_sequences: int) -> tuple[list[R], list[R]]:
    """Held-out sequences (never trained on) measure generalisation; chosen by a fixed stride within
    each corpus, so adding a prompt file never moves a sequence between training and held-out."""
    stride = max(2, len(records) // max(1, eval_sequences))
    held = set(range(0, len(records), stride)[:eval_sequences])
    return [r for i, r in enumerate(records) if i not in held], [records[i] for i in sorted(held)]


def training_data(head_ids: list[int], train: list, held_out: list) -> dict:
    """What a checkpoint's weights were trained against: its head vocabulary and its split. A
    corpus that grew (more batches generated since) or other --head-vocab / --eval-sequences
    settings change these, and resuming would then train head rows that stood for other tokens
    and score against another held-out set."""
    import hashlib

    digest = hashlib.sha256(torch.tensor(head_ids, dtype=torch.int64).numpy().tobytes()).hexdigest()[:16]
    return {
        "head_vocab": f"{len(head_ids)} tokens, sha256 {digest}",
        "train_sequences": len(train),
        "held_out_sequences": len(held_out),
    }


def check_resumable(checkpoint: Path, saved: dict | None, now: dict) -> None:
    """Refuses to resume a checkpoint written for other data (``training_data``); a checkpoint
    from before this check (``saved`` None) resumes as it always did."""
    if saved is None or saved == now:
        return
    changed = "; ".join(f"{k}: {saved.get(k)} then, {v} now" for k, v in now.items() if saved.get(k) != v)
    raise SystemExit(
        f"specdec distill: {checkpoint} was trained on other data ({changed}); pass --restart "
        f"to train from scratch, or --out another folder"
    )


def load_checkpoint(path: Path, device: torch.device | str = "cpu") -> dict:
    """A training checkpoint (weights, optimizer, step, RNG state: plain tensors and Python values,
    so the safe ``weights_only`` loader reads it)."""
    return torch.load(path, weights_only=True, map_location=device)
