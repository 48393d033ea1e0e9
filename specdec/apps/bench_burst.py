"""``specdec bench --burst``: the load-aware default through bursts of load (issue 50).

Real traffic arrives in bursts, and a burst after a light load is where a policy that learns the
load loses: its first seconds run on what the light load taught it. One stack, started fresh,
then ``--repeats`` sequences of levels (``--burst``, default 1, 16, 1, 32, 4 streams); at each
level a wave of 2 x level requests drained by ``level`` workers, once with the server's default
(``speculative-default``: the load-aware policy) and once target-only, the two interleaved (which
goes first alternates, level by level and sequence by sequence, so neither always follows the
other's load), after an unmeasured target-only warm-up wave (:func:`warm_up`). Reported per
level: both modes' aggregate tokens/s (median over the sequences, and each sequence's own, the
first being the fresh server's), the default's ratio to target-only, its share of steps
speculating, and at temperature 0 how many of its streams differ from target-only's (none may:
greedy output is the target's own).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

from specdec.apps.bench_stream import draft_model_of, drain, stream_one, workload_stack

DEFAULT_BURST = "1,16,1,32,4"
WAVE_PER_STREAM = 2  # a level's wave: this many requests per stream in flight


def burst_levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(
            f"specdec bench --burst: levels are stream counts like {DEFAULT_BURST}, got {text!r}"
        ) from None
    if not levels or any(level < 1 for level in levels):
        raise SystemExit(f"specdec bench --burst: levels are stream counts >= 1, got {text!r}")
    return levels


def first_mode(sequence: int, position: int) -> str:
    """Which mode runs first at a level: alternating along a sequence, and between sequences."""
    return "speculative-default" if (sequence + position) % 2 == 0 else "target-only"


WARM_UP_TOKENS = 8


async def warm_up(stub, prompts: list, streams: int, target_only, build_request) -> None:
    """One unmeasured wave before the sequences, target-only (the default's regime learns
    nothing from it): every prompt once, at the largest level's concurrency. Without it the
    first measured wave pays for what any server pays once -- the prompts' first prefills (later
    waves find them in the prefix cache) and the batched pass's first large batches -- and
    whichever mode runs first there came out ~4% slower (docs/performance.md, "Bursts")."""
    count = max(streams, len(prompts))

    def one(i: int):
        return stream_one(stub, build_request(prompts[i % len(prompts)], target_only, 0.0, WARM_UP_TOKENS, i, True))

    await drain(count, streams, one)


def run_burst(args, modes: dict, build_request, say) -> dict:
    """``modes``: {"speculative-default": Mode, "target-only": Mode}; ``build_request(prompt, mode,
    temperature, max_new_tokens, seed, ignore_eos)``."""
    from specdec.runtime.grpc_server import client_channel
    from specdec.training.prompts import load_prompts
    from specdec.v1 import coordinator_pb2_grpc

    levels = burst_levels(args.burst)
    temperature = float(args.temperatures.split(",")[0])
    prompts = load_prompts(Path(args.prompts), args.num_prompts, args.split)
    draft = draft_model_of(args, "--burst")
    say(
        f"burst: {args.repeats} sequences of levels {levels} streams (waves of {WAVE_PER_STREAM} x level requests), "
        f"default vs target-only, T={temperature}, {args.max_new_tokens} tokens"
    )
    # (sequence, level index, mode) -> (seconds, samples)
    runs: dict[tuple[int, int, str], tuple[float, list]] = {}
    with workload_stack(args, draft) as stack:

        async def measure():
            async with client_channel(stack.coordinator_address) as channel:
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                await warm_up(stub, prompts, max(levels), modes["target-only"], build_request)
                for sequence in range(args.repeats):
                    for position, level in enumerate(levels):
                        first = first_mode(sequence, position)
                        for name in (first, *(m for m in modes if m != first)):
                            count = WAVE_PER_STREAM * level

                            def one(i: int, name=name, position=position):
                                # the same prompts at every level: a level's ratio must not hang on
                                # how well the draft knows its prompts (docs/performance.md, "Bursts")
                                prompt = prompts[i % len(prompts)]
                                request = build_request(prompt, modes[name], temperature, args.max_new_tokens, i, False)
                                return stream_one(stub, request)

                            started = time.perf_counter()
                            samples = await drain(count, level, one)
                            runs[(sequence, position, name)] = (time.perf_counter() - started, samples)
                            rate = sum(s.tokens for s in samples) / runs[(sequence, position, name)][0]
                            say(f"sequence {sequence + 1}, {level} streams, {name}: {rate:.1f} tokens/s")

        asyncio.run(measure())
    return burst_report(levels, runs, args, temperature)


def burst_report(levels: list[int], runs: dict, args, temperature: float) -> dict:
    sequences = sorted({s for s, _, _ in runs})
    rows = []
    for position, level in enumerate(levels):
        rates = {
            name: [
                sum(x.tokens for x in runs[(s, position, name)][1]) / runs[(s, position, name)][0] for s in sequences
            ]
            for name in ("speculative-default", "target-only")
        }
        default = [s for seq in sequences for s in runs[(seq, position, "speculative-default")][1]]
        alone = [s for seq in sequences for s in runs[(seq, position, "target-only")][1]]
        median = {name: statistics.median(r) for name, r in rates.items()}
        rows.append(
            {
                "level": level,
                "default_tokens_per_s": median["speculative-default"],
                "target_only_tokens_per_s": median["target-only"],
                "ratio": median["speculative-default"] / median["target-only"],
                "ratio_per_sequence": [
                    d / t for d, t in zip(rates["speculative-default"], rates["target-only"], strict=True)
                ],
                "default_per_sequence": rates["speculative-default"],
                "target_only_per_sequence": rates["target-only"],
                "steps_speculating": sum(s.drafts for s in default) / max(1, sum(s.passes for s in default)),
                # the same request (prompt, seed) in both modes: greedy, the same tokens
                "streams_unlike_target_only": sum(
                    d.token_ids != t.token_ids for d, t in zip(default, alone, strict=True)
                )
                if temperature == 0
                else None,
                "streams": len(default),
            }
        )
    return {
        "levels": levels,
        "sequences": len(sequences),
        "temperature": temperature,
        "max_new_tokens": args.max_new_tokens,
        "wave_per_stream": WAVE_PER_STREAM,
        "rows": rows,
    }


def burst_table(rep: dict) -> str:
    lines = [
        f"burst: levels {rep['levels']} streams, {rep['sequences']} sequences on one server (the first: fresh), "
        f"T={rep['temperature']}, {rep['max_new_tokens']} tokens, waves of {rep['wave_per_stream']} x level requests",
        f"{'streams':>7} {'target-only':>12} {'default':>8} {'x':>6} {'per sequence':>22} {'speculating':>12} "
        f"{'unlike target-only':>19}",
    ]
    for row in rep["rows"]:
        unlike = (
            "-"
            if row["streams_unlike_target_only"] is None
            else f"{row['streams_unlike_target_only']}/{row['streams']}"
        )
        per = " ".join(f"{r:.2f}" for r in row["ratio_per_sequence"])
        lines.append(
            f"{row['level']:>7} {row['target_only_tokens_per_s']:>12.1f} {row['default_tokens_per_s']:>8.1f} "
            f"{row['ratio']:>5.2f}x {per:>22} {row['steps_speculating']:>11.0%} {unlike:>19}"
        )
    return "\n".join(lines)
