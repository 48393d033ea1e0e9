"""What ``specdec bench`` measures of one streamed request (shared by its workloads)."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field


@dataclass
class Sample:
    tokens: int
    seconds: float
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    passes: int = 0
    drafts: int = 0
    proposed: int = 0
    accepted: int = 0
    per_position: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    server_s: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    forced: int = 0  # tokens a structured-output constraint forced (committed without a pass)
    predrafts: int = 0  # blocks drafted while the previous one was verified (docs/pipelining.md) ...
    predraft_hits: int = 0  # ... and those a step used
    text: str = ""
    finish_reason: str = ""


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


async def stream_one(stub, request) -> Sample:
    started = time.perf_counter()
    last, tokens, sample = None, 0, Sample(0, 0.0)
    async for chunk in stub.GenerateStream(request, timeout=600):
        now = time.perf_counter()
        n = len(chunk.token_ids)
        if n:
            if last is None:
                sample.ttft = now - started
            else:
                sample.itl.extend([(now - last) / n] * n)
            last = now
            tokens += n
            sample.token_ids.extend(chunk.token_ids)
        sample.text += chunk.text
        if chunk.finish_reason:
            sample.finish_reason, sample.forced = chunk.finish_reason, chunk.stats.forced_tokens
            s = chunk.stats
            sample.passes, sample.drafts, sample.proposed, sample.accepted = (
                s.target_passes,
                s.drafts,
                s.proposed_tokens,
                s.accepted_tokens,
            )
            sample.per_position = list(s.accepted_per_position)
            sample.predrafts, sample.predraft_hits = s.predrafts, s.predraft_hits
            sample.draft_s, sample.verify_s, sample.server_s = s.draft_seconds, s.verify_seconds, s.total_seconds
    sample.tokens, sample.seconds = tokens, time.perf_counter() - started
    return sample


def replica_flags(args, role: str) -> list[str]:
    """The ``role`` ("target" / "draft") replicas' pass flags of this bench (their dtype, batch
    invariance, CPUs)."""
    flags = ["--dtype", args.dtype] if getattr(args, "dtype", None) else []
    flags += ["--cpus", getattr(args, f"{role}_cpus")] if getattr(args, f"{role}_cpus", None) else []
    return flags + (["--no-batch-invariant"] if getattr(args, "no_batch_invariant", False) else [])


async def drain(count: int, workers: int, run_one) -> list:
    """``run_one(i)`` for i in 0..count-1, at most ``workers`` at a time (each worker takes the
    next request as its last one ends); results in request order."""
    results: list = [None] * count
    queue = iter(range(count))

    async def worker():
        for i in queue:  # one shared iterator: each request is taken once
            results[i] = await run_one(i)

    await asyncio.gather(*(worker() for _ in range(min(workers, count))))
    return results


def draft_model_of(args, workload: str) -> str:
    """The draft a workload that compares a draft model's speculation runs (``--draft-model``;
    'auto': the target's default draft); an n-gram or no draft is a usage error naming it."""
    from specdec.modeling.loading import default_draft_for

    draft = default_draft_for(args.target_model) if args.draft_model == "auto" else args.draft_model
    if draft in ("ngram", "none"):
        raise SystemExit(f"specdec bench {workload} compares a draft model's speculation: give --draft-model")
    return draft


def workload_stack(args, draft: str):
    """The local stack a workload runs on: the target, ``draft``, the bench's default k, its
    replicas' pass flags and CPUs, and the log folder (a context manager: local_stack)."""
    from pathlib import Path

    from specdec.apps.launcher import local_stack

    return local_stack(
        args.target_model,
        draft,
        num_speculative_tokens=args.default_k,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        extra_target=replica_flags(args, "target"),
        extra_draft=replica_flags(args, "draft"),
        coordinator_cpus=getattr(args, "coordinator_cpus", None),
    )
