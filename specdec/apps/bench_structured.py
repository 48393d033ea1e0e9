"""``specdec bench --structured``: what speculation does for structured output (issue 45).

One stack, one stream at a time, every prompt with its JSON schema (``response_format``'s
json_schema through the gRPC ``sampling.structured_output``), three modes interleaved per prompt
(rotated, so machine drift hits all alike):

- ``target-only``             num_speculative_tokens = 0
- ``speculative``             the draft model at fixed k, forced runs off: the draft proposes
                              every token, the schema's keys and punctuation included
- ``speculative+forced``      the same with forced runs: where the schema admits one token (a run
                              of them), the coordinator commits it without a draft call or a pass

Reported per mode and temperature: tokens/s (median over repeats of all prompts' tokens / their
seconds), target passes per token, the draft's acceptance, the forced share of the tokens, and
how many outputs are complete documents that parse. At temperature 0 every mode's tokens must be
target-only's (``identical``).

The workload is a JSONL file of {id, text, schema} (``benchmarks/structured.jsonl`` by default),
or a JSON schema file applied to every prompt of ``--prompts``.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from specdec.apps.bench_stream import Sample, draft_model_of, stream_one, workload_stack
from specdec.training.prompts import load_prompts


@dataclass(frozen=True)
class StructuredMode:
    mode: str
    k: int
    forced: bool = False


def structured_modes(k: int) -> list[StructuredMode]:
    return [
        StructuredMode("target-only", 0),
        StructuredMode("speculative", k, forced=False),
        StructuredMode("speculative+forced", k, forced=True),
    ]


def load_workload(path: str, prompts_path: str, limit: int | None, split: str | None) -> list[dict]:
    """[{id, text, schema}]: a JSONL workload, or a schema file applied to ``prompts_path``'s prompts."""
    source = Path(path)
    if not source.is_file():
        raise SystemExit(f"specdec bench --structured: no file {path}")
    if source.suffix == ".jsonl":
        rows = load_prompts(source, limit, split)
        missing = [r.get("id", i) for i, r in enumerate(rows) if not isinstance(r.get("schema"), dict)]
        if missing:
            raise SystemExit(f"specdec bench --structured: rows {missing[:5]} of {path} have no schema object")
        return rows
    try:
        schema = json.loads(source.read_text())
    except json.JSONDecodeError as error:
        raise SystemExit(f"specdec bench --structured: {path} is not JSON ({error.msg})") from None
    if not isinstance(schema, dict):
        raise SystemExit(f"specdec bench --structured: {path} is not a JSON schema (an object)")
    return [dict(row, schema=schema) for row in load_prompts(Path(prompts_path), limit, split)]


def structured_request(row: dict, mode: StructuredMode, temperature: float, max_new_tokens: int, seed: int):
    from specdec.v1 import coordinator_pb2 as pb

    req = pb.GenerateRequest(prompt=row["text"], apply_chat_template=True)
    req.sampling.temperature = temperature
    req.sampling.max_new_tokens = max_new_tokens
    req.sampling.seed = seed
    req.sampling.structured_output.json_schema = json.dumps(row["schema"])
    req.speculation.num_speculative_tokens = mode.k
    req.speculation.method = "draft_model" if mode.k else "none"
    req.speculation.adaptive = False  # fixed k: the modes differ in forced runs alone
    req.speculation.forced_tokens = mode.forced
    return req


def parses(sample: Sample) -> bool:
    """A complete document: the constraint ended it (EOS) and it is JSON."""
    if sample.finish_reason != "eos":
        return False
    try:
        json.loads(sample.text)
    except json.JSONDecodeError:
        return False
    return True


def summarize_structured(mode: StructuredMode, temperature: float, runs: list[list[Sample]]) -> dict:
    rates = [sum(s.tokens for s in rep) / sum(s.seconds for s in rep) for rep in runs if rep]
    samples = [s for rep in runs for s in rep]
    tokens = sum(s.tokens for s in samples)
    proposed, accepted = sum(s.proposed for s in samples), sum(s.accepted for s in samples)
    return {
        "mode": mode.mode,
        "k": mode.k,
        "temperature": temperature,
        "tokens_per_s": statistics.median(rates) if rates else 0.0,
        "tokens_per_s_min": min(rates, default=0.0),
        "tokens_per_s_max": max(rates, default=0.0),
        "tokens": tokens,
        "target_passes_per_token": sum(s.passes for s in samples) / tokens if tokens else None,
        "acceptance_rate": accepted / proposed if proposed else None,
        "forced_share": sum(s.forced for s in samples) / tokens if tokens else 0.0,
        "complete_documents": sum(parses(s) for s in samples),
        "outputs": len(samples),
    }


def run_structured(args, say) -> dict:
    from specdec.runtime.grpc_server import client_channel
    from specdec.v1 import coordinator_pb2_grpc

    rows = load_workload(args.structured, args.prompts, args.num_prompts, args.split)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    draft = draft_model_of(args, "--structured")
    modes = structured_modes(args.default_k)
    say(
        f"structured output: {len(rows)} prompts x {len(temperatures)} settings x {len(modes)} modes x "
        f"{args.repeats} repeats, up to {args.max_new_tokens} new tokens each (k={args.default_k})"
    )
    results: dict[tuple[StructuredMode, float], list[list[Sample]]] = {}
    greedy: dict[tuple[str, str], list[int]] = {}  # (prompt, mode) -> tokens at temperature 0
    with workload_stack(args, draft) as stack:

        async def measure():
            async with client_channel(stack.coordinator_address) as channel:
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                for row in rows:  # warm-up: every schema compiled on every service
                    await stream_one(stub, structured_request(row, modes[-1], 0.0, 4, 0))
                total, done = args.repeats * len(rows) * len(temperatures) * len(modes), 0
                for rep in range(args.repeats):
                    for pi, row in enumerate(rows):
                        for temperature in temperatures:
                            for mode in modes[pi % 3 :] + modes[: pi % 3]:  # interleaved
                                request = structured_request(
                                    row, mode, temperature, args.max_new_tokens, 1000 * rep + pi
                                )
                                sample = await stream_one(stub, request)
                                if temperature == 0:
                                    greedy.setdefault((row["id"], mode.mode), sample.token_ids)
                                runs = results.setdefault((mode, temperature), [])
                                while len(runs) <= rep:
                                    runs.append([])
                                runs[rep].append(sample)
                                done += 1
                                if done % max(1, total // 10) == 0 or done == total:
                                    say(f"{done}/{total} requests")

        asyncio.run(measure())
    summaries = [summarize_structured(mode, t, runs) for (mode, t), runs in results.items()]
    differ = sorted(
        {pid for (pid, mode), tokens in greedy.items() if tokens != greedy.get((pid, "target-only"), tokens)}
    )
    return {
        "workload": str(args.structured),
        "prompts": len(rows),
        "k": args.default_k,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "modes": summaries,
        "greedy_differs_from_target_only": differ,
    }


def structured_table(rep: dict) -> str:
    lines = [
        f"structured output: {rep['prompts']} prompts, k={rep['k']}, up to {rep['max_new_tokens']} tokens, "
        f"medians of {rep['repeats']} repeats",
        f"{'mode':<20} {'T':>4} {'tok/s':>7} {'x target':>9} {'passes/tok':>11} {'accept':>7} {'forced':>7} "
        f"{'complete':>9}",
    ]
    base = {m["temperature"]: m["tokens_per_s"] for m in rep["modes"] if m["mode"] == "target-only"}
    for m in sorted(rep["modes"], key=lambda m: (m["temperature"], m["mode"] != "target-only", m["mode"])):
        ratio = m["tokens_per_s"] / base[m["temperature"]] if base.get(m["temperature"]) else float("nan")
        accept = f"{m['acceptance_rate']:.2f}" if m["acceptance_rate"] is not None else "-"
        lines.append(
            f"{m['mode']:<20} {m['temperature']:>4} {m['tokens_per_s']:>7.1f} {ratio:>8.2f}x "
            f"{m['target_passes_per_token'] or 0:>11.3f} {accept:>7} {m['forced_share']:>6.0%} "
            f"{m['complete_documents']:>4}/{m['outputs']:<4}"
        )
    differ = rep["greedy_differs_from_target_only"]
    lines.append(
        "greedy: every mode's tokens equal target-only's"
        if not differ
        else f"greedy: tokens DIFFER from target-only on prompts {differ}"
    )
    return "\n".join(lines)
