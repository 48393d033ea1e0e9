"""The versioned prompt sets (``benchmarks/*.jsonl``): the bench prompts with their held-out
split, and the distillation prompt sets, which never contain a bench prompt."""

from __future__ import annotations

import json
from pathlib import Path

from specdec.paths import BENCHMARKS_DIR

BENCH_PROMPTS = BENCHMARKS_DIR / "prompts.jsonl"
STRUCTURED_WORKLOAD = BENCHMARKS_DIR / "structured.jsonl"  # prompts with JSON schemas (bench --structured)
DISTILL_PROMPT_FILES = ("distill_prompts.v1.jsonl", "distill_prompts_extra.v1.jsonl", "distill_prompts_more.v1.jsonl")
DEFAULT_DISTILL_PROMPTS = ",".join(str(BENCHMARKS_DIR / name) for name in DISTILL_PROMPT_FILES)


def load_prompts(path: Path, limit: int | None = None, split: str | None = None) -> list[dict]:
    """The rows of a JSONL prompt file ({id, category, text, split?}), optionally one split, the first ``limit``."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if split:
        rows = [r for r in rows if r.get("split") == split]
    return rows[:limit] if limit else rows
