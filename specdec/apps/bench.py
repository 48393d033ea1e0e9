"""``specdec bench``: does speculation pay on these models, by how much, and where does time go?

One run, one stack, the same prompts, models and sampling settings for every mode, interleaved
(each prompt runs every mode, in an order rotated per prompt) so machine drift hits all alike:

- ``target-only``        through the full stack with num_speculative_tokens = 0
- ``speculative``        through the full stack with the draft model, for each k of the sweep
- ``speculative-adaptive`` the same with the adaptive policy (blocks of k while they pay,
                         target-only steps while they do not: specdec/loop/adaptive_k.py), for each k
                         of ``--adaptive-ks``; the fixed-k modes above say adaptive = false
- ``speculative-default`` the server's defaults (the request says nothing of speculation): the
                         draft model, ``--default-k``, and the load-aware policy choosing each
                         step's k in 0..k from the batch it shares (docs/goodput.md)
- ``speculative-ngram``  through the full stack with n-gram (prompt lookup) drafts, for each k
- ``hf-generate``        transformers ``generate()`` of the target alone, in this process
- ``hf-assisted``        transformers assisted generation (the same draft model as
                         ``assistant_model``, or prompt lookup for an n-gram draft): the peer.
                         A feature draft cannot run there (transformers has no way to hand it
                         the target's hidden states), so its peer is assisted generation with a
                         standalone draft (``--assistant-model``; for the default target the
                         shipped distilled one)

Plus a concurrency sweep (``--concurrency``: for target-only, each fixed k of the sweep and the
server's default policy, at each temperature, that many streams at once, each level ``--repeats``
times: aggregate tokens/s, time to first token and inter-token latency p50/p99, and whether every
stream's tokens equal those of the same request run alone) and Leviathan et al.'s predicted
speedup from the measured acceptance and step times, next to the achieved one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specdec.apps.bench_burst import DEFAULT_BURST
from specdec.apps.bench_stream import Sample, drain, percentile, replica_flags, stream_one
from specdec.apps.cli import SERVE_DEFAULT_K, add_cpu_flags
from specdec.loop.reproducible import SEEDED_SAMPLING
from specdec.runtime.flags import positive_int
from specdec.runtime.grpc_server import client_channel
from specdec.training.prompts import BENCH_PROMPTS, STRUCTURED_WORKLOAD, load_prompts


@dataclass(frozen=True)
class Mode:
    mode: str
    k: int = 0
    method: str = ""
    adaptive: bool = False
    server_default: bool = False  # the request leaves speculation to the server
    pipeline: bool = False  # the draft drafts the next block while the target verifies (docs/pipelining.md)


# -- running one request -------------------------------------------------------------------
def hf_one(model, prompt_ids, max_new_tokens, temperature, seed, assistant=None, k=0) -> Sample:
    """transformers generate(); with ``assistant`` assisted generation drafting ``k`` tokens per
    round (as the stack's k; transformers' own default is adaptive), else with ``k`` prompt lookup."""
    import torch

    kwargs = {"max_new_tokens": max_new_tokens, "pad_token_id": 0}
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_k=0)
        torch.manual_seed(seed)
    else:
        kwargs.update(do_sample=False)
    if assistant is not None:
        kwargs["assistant_model"] = assistant
        if k:
            kwargs.update(num_assistant_tokens=k, num_assistant_tokens_schedule="constant")
    elif k:
        kwargs["prompt_lookup_num_tokens"] = k
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), **kwargs)
    return Sample(int(out.shape[1]) - len(prompt_ids), time.perf_counter() - started)


# -- aggregation ---------------------------------------------------------------------------
def summarize(mode: Mode, temperature: float, runs: list[list[Sample]]) -> dict:
    """``runs``: one list of samples (all prompts) per repeat."""
    rates = [sum(s.tokens for s in rep) / sum(s.seconds for s in rep) for rep in runs if rep]
    samples = [s for rep in runs for s in rep]
    tokens = sum(s.tokens for s in samples)
    passes = sum(s.passes for s in samples)
    proposed, accepted = sum(s.proposed for s in samples), sum(s.accepted for s in samples)
    drafts = sum(s.drafts for s in samples)
    positions = max((len(s.per_position) for s in samples), default=0)
    per_position = [sum(s.per_position[i] for s in samples if len(s.per_position) > i) for i in range(positions)]
    server = sum(s.server_s for s in samples)
    itl = [x for s in samples for x in s.itl]
    out = {
        "mode": mode.mode,
        "k": mode.k,
        "temperature": temperature,
        "tokens_per_s": statistics.median(rates) if rates else 0.0,
        "tokens_per_s_min": min(rates) if rates else 0.0,
        "tokens_per_s_max": max(rates) if rates else 0.0,
        "repeats": len(rates),
        "tokens": tokens,
        "ttft_s_median": statistics.median([s.ttft for s in samples if s.ttft is not None])
        if any(s.ttft is not None for s in samples)
        else None,
        "itl_s_p50": percentile(itl, 50),
        "itl_s_p90": percentile(itl, 90),
        "itl_s_p99": percentile(itl, 99),
    }
    if passes:
        out.update(
            {
                "target_passes_per_token": passes / tokens if tokens else None,
                "acceptance_rate": accepted / proposed if proposed else None,
                # vLLM's count: accepted proposals + the recovered/bonus token, per verified draft block
                "mean_accepted_length": (accepted + drafts) / drafts if drafts else None,
                "acceptance_per_position": [c / drafts for c in per_position] if drafts else [],
                "time_split": {
                    "draft": sum(s.draft_s for s in samples) / server,
                    "verify": sum(s.verify_s for s in samples) / server,
                    "coordination_network": max(0.0, 1 - (sum(s.draft_s + s.verify_s for s in samples)) / server),
                }
                if server
                else None,
                "draft_s_per_proposed_token": sum(s.draft_s for s in samples) / proposed if proposed else None,
                "verify_s_per_pass": sum(s.verify_s for s in samples) / passes,
            }
        )
    predrafts = sum(s.predrafts for s in samples)
    if predrafts:
        out["predraft_hit_rate"] = sum(s.predraft_hits for s in samples) / predrafts
    return out


def unlike_serial(results: dict[tuple, list[list[Sample]]]) -> dict[tuple[int, float], int]:
    """Per (k, temperature) of a pipelined mode: its requests whose tokens are not those of the
    same request (same prompt, seed and repeat) drafted serially -- 0 by construction
    (docs/pipelining.md); only where the serial mode of that k ran too."""
    out = {}
    for (mode, temperature), runs in results.items():
        serial = results.get((Mode("speculative", mode.k, "draft_model"), temperature))
        if mode.pipeline and serial is not None:
            pairs = zip((s for rep in runs for s in rep), (s for rep in serial for s in rep), strict=True)
            out[mode.k, temperature] = sum(a.token_ids != b.token_ids for a, b in pairs)
    return out


def predicted_speedup(spec: dict, baseline: dict) -> float | None:
    """Leviathan et al. (2023): with acceptance a and k proposals, a pass yields
    (1 - a^(k+1)) / (1 - a) tokens and costs k draft steps plus one verify; the target alone
    yields 1 token per pass."""
    a, k = spec.get("acceptance_rate"), spec["k"]
    d, v, t0 = spec.get("draft_s_per_proposed_token"), spec.get("verify_s_per_pass"), baseline.get("verify_s_per_pass")
    if a is None or d is None or not v or not t0:
        return None
    tokens_per_pass = k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
    return tokens_per_pass / ((k * d + v) / t0)


# -- the run -------------------------------------------------------------------------------
def build_request(
    prompt: dict, mode: Mode, temperature: float, max_new_tokens: int, seed: int, ignore_eos: bool = True
):
    """``ignore_eos`` (default): every mode generates the same number of tokens."""
    from specdec.v1 import coordinator_pb2 as pb

    req = pb.GenerateRequest(prompt=prompt["text"], apply_chat_template=True)
    req.sampling.temperature = temperature
    req.sampling.max_new_tokens = max_new_tokens
    req.sampling.ignore_eos = ignore_eos
    req.sampling.seed = seed
    if mode.server_default:
        return req
    req.speculation.num_speculative_tokens = mode.k
    req.speculation.method = mode.method
    req.speculation.adaptive = mode.adaptive  # explicit: a fixed-k mode is fixed whatever the server default
    req.speculation.pipeline = mode.pipeline  # explicit: serial unless the mode pipelines
    return req


def run(args) -> dict:

    from replica.model_thread import call_on_model_thread, on_model_thread
    from specdec.apps.launcher import local_stack
    from specdec.modeling.loading import default_draft_for, encode_prompt, load_model, load_tokenizer
    from specdec.v1 import coordinator_pb2_grpc

    say = lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    prompts = load_prompts(Path(args.prompts), args.num_prompts, args.split)
    ks = _ks(args.ks)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    concurrency = [int(c) for c in args.concurrency.split(",")] if args.concurrency else []
    if args.peer == "vllm":  # refused before the run, not after it
        if not concurrency or temperatures[0] != 0:
            raise SystemExit("specdec bench --peer vllm compares greedy concurrency sweeps: --concurrency, T = 0 first")
        if args.sustained:
            raise SystemExit("specdec bench --peer vllm runs one wave per level: leave --sustained at 0")
        if not Path(args.peer_python).is_file():
            raise SystemExit(
                f"specdec bench --peer vllm: no Python at {args.peer_python} (make bench-peer sets up .venv-peer, "
                "or pass --peer-python)"
            )
    if args.draft_model == "auto":
        args.draft_model = default_draft_for(args.target_model)
    draft_is_model = args.draft_model not in ("ngram", "none")
    args.assistant_model = assistant_for(args)
    modes = [Mode("target-only", 0, "none")]
    if draft_is_model:
        modes += [Mode("speculative", k, "draft_model") for k in ks]
        modes += [Mode("speculative-adaptive", k, "draft_model", True) for k in _ks(args.adaptive_ks)]
        modes += pipelined_modes(args)
        modes.append(DEFAULT_MODE(args.default_k))
    ngram_ks = ks if args.ngram_ks is None else _ks(args.ngram_ks)
    modes += [Mode("speculative-ngram", k, "ngram") for k in ngram_ks]
    hf_modes = [] if args.no_hf else [Mode("hf-generate")]
    if not args.no_hf and (args.assistant_model or not draft_is_model):  # else nothing can assist
        hf_modes += [Mode("hf-assisted", k) for k in ks]
    say(
        f"{len(prompts)} prompts x {len(temperatures)} settings x {len(modes) + len(hf_modes)} modes x "
        f"{args.repeats} repeats, {args.max_new_tokens} new tokens each"
    )

    tokenizer = load_tokenizer(args.target_model)
    hf_target = hf_draft = None
    if hf_modes:
        say("loading the target (and draft) in process for the transformers baselines...")
        # loaded on the thread that runs them (replica/model_thread.py)
        hf_target = call_on_model_thread(load_model, args.target_model, "cpu", quiet=True)
        if args.assistant_model:
            say(f"transformers assisted generation drafts with {args.assistant_model}")
            hf_draft = call_on_model_thread(load_model, args.assistant_model, "cpu", quiet=True)
    prompt_ids = {p["id"]: encode_prompt(tokenizer, p["text"], chat=True) for p in prompts}
    results: dict[tuple, list[list[Sample]]] = {}
    largest = max(ks + ngram_ks + _ks(args.adaptive_ks) + _ks(args.pipelined_ks) + [args.default_k])
    # the adaptive modes ask for the replayable schedule's policy by name only through the
    # server: the stack runs the default (load-aware) policy, which speculative-default shows
    with local_stack(
        args.target_model,
        args.draft_model if draft_is_model else "ngram",
        num_speculative_tokens=args.default_k,
        extra_coordinator=["--max-speculative-tokens", str(largest)]
        + (["--invariant-sampling"] if args.invariant else [])
        + (["--seeded-sampling", args.seeded_sampling] if getattr(args, "seeded_sampling", None) else []),
        log_dir=Path(args.log_dir) if args.log_dir else None,
        extra_target=replica_flags(args, "target") + _tp_flags(args),
        extra_draft=replica_flags(args, "draft"),
        coordinator_cpus=getattr(args, "coordinator_cpus", None),
    ) as stack:

        async def measure():
            async with client_channel(stack.coordinator_address) as channel:
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                await stream_one(stub, build_request(prompts[0], modes[0], 0.0, 4, 0))  # warm-up
                if args.sweep_only:
                    return stub
                total = args.repeats * len(prompts) * len(temperatures) * (len(modes) + len(hf_modes))
                done = 0
                for rep in range(args.repeats):
                    for pi, prompt in enumerate(prompts):
                        for temperature in temperatures:
                            ordered = (modes + hf_modes)[pi % 3 :] + (modes + hf_modes)[: pi % 3]  # interleave
                            for mode in ordered:
                                seed = 1000 * rep + pi
                                if mode.mode.startswith("hf"):
                                    assistant = hf_draft if mode.mode == "hf-assisted" else None
                                    lookup = mode.k if mode.mode == "hf-assisted" else 0
                                    # The model thread, as in the services: passes spread over a pool's
                                    # threads run slower on CPU (replica/model_thread.py).
                                    sample = await on_model_thread(
                                        hf_one,
                                        hf_target,
                                        prompt_ids[prompt["id"]],
                                        args.max_new_tokens,
                                        temperature,
                                        seed,
                                        assistant,
                                        lookup,
                                    )
                                else:
                                    sample = await stream_one(
                                        stub, build_request(prompt, mode, temperature, args.max_new_tokens, seed)
                                    )
                                runs = results.setdefault((mode, temperature), [])
                                while len(runs) <= rep:
                                    runs.append([])
                                runs[rep].append(sample)
                                done += 1
                                if done % max(1, total // 20) == 0 or done == total:
                                    say(f"{done}/{total} requests")
                return stub

        asyncio.run(measure())
        summaries = [summarize(mode, t, runs) for (mode, t), runs in results.items()]
        differing = unlike_serial(results)
        for summary in summaries:
            differ = differing.get((summary["k"], summary["temperature"]))
            if summary["mode"] == "speculative-pipelined" and differ is not None:
                summary["requests_unlike_serial"] = differ
        sweep: list[dict] = []
        alone: dict[str, dict[int, list[int]]] = {}
        if concurrency:
            swept = [Mode("target-only", 0, "none")]
            if draft_is_model:
                swept += [Mode("speculative", k, "draft_model") for k in ks] + [DEFAULT_MODE(args.default_k)]
                swept += pipelined_modes(args)
            else:
                swept += [Mode("speculative-ngram", k, "ngram") for k in ngram_ks]
            for temperature in temperatures:
                part, alone_at = asyncio.run(
                    _concurrency(
                        stack.coordinator_address,
                        prompts,
                        swept,
                        temperature,
                        args.max_new_tokens,
                        concurrency,
                        args.repeats,
                        say,
                        args.sustained,
                    )
                )
                sweep += part
                if temperature == temperatures[0]:
                    alone = alone_at
    rep = report(summaries, sweep, args)
    if args.peer == "vllm":
        rep["peer"] = run_peer(args, prompts, concurrency, alone.get("target-only", {}), say)
    return rep


def assistant_for(args) -> str | None:
    """The draft model transformers' assisted generation uses (None: prompt lookup for an n-gram
    draft, or no assisted mode). 'auto': the stack's draft itself when it is a standalone model;
    for a feature draft, which transformers cannot run, the standalone draft shipped for the
    default target (if the target is that one)."""
    from specdec.modeling.feature_draft import is_feature_draft_dir
    from specdec.modeling.loading import default_standalone_draft_for, resolve

    if args.assistant_model not in (None, "auto"):
        return None if args.assistant_model == "none" else args.assistant_model
    if args.draft_model in ("ngram", "none"):
        return None
    location = resolve(args.draft_model).location
    if not is_feature_draft_dir(location):
        return args.draft_model
    return default_standalone_draft_for(args.target_model)


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _ks(text: str) -> list[int]:
    """A comma-separated list of k >= 1 ('' = none), or a usage error naming the bad entry."""
    ks = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise SystemExit(f"specdec bench: a k list takes integers >= 1 separated by commas, got {part!r}")
        ks.append(int(part))
    return ks


def pipelined_modes(args) -> list[Mode]:
    return [Mode("speculative-pipelined", k, "draft_model", pipeline=True) for k in _ks(args.pipelined_ks)]


def DEFAULT_MODE(k: int) -> Mode:
    return Mode("speculative-default", k, "draft_model", True, server_default=True)


def level_requests(level: int, sustained: int) -> int:
    """How many requests a sweep level runs: one wave of ``level`` streams, or with
    ``sustained`` > 0 that many (at least ``level``) drained by ``level`` workers, so the level's
    load holds for the whole measurement instead of falling as the wave's streams finish."""
    return level if sustained <= 0 else max(level, sustained)


async def _concurrency(
    address, prompts, modes: list[Mode], temperature, max_new_tokens, levels, repeats, say, sustained: int = 0
) -> tuple[list[dict], dict[str, dict[int, list[int]]]]:
    """Per level and mode: ``level`` streams at once (prompt i mod the prompts, seed i, natural
    EOS) -- one wave, or ``sustained`` requests drained by ``level`` workers (level_requests) --,
    ``repeats`` times, the modes of a level interleaved; the median aggregate tokens/s, latency
    percentiles over every stream, and how many streams' tokens differ from the same request run
    alone (measured once per request, one at a time)."""

    from specdec.v1 import coordinator_pb2_grpc

    out = []
    alone_by_mode: dict[str, dict[int, list[int]]] = {}
    async with client_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)

        def make(i: int, mode: Mode):
            return build_request(prompts[i % len(prompts)], mode, temperature, max_new_tokens, i, False)

        for mode in modes:
            alone: dict[int, list[int]] = {}
            for i in range(max(level_requests(level, sustained) for level in levels)):
                alone[i] = (await stream_one(stub, make(i, mode))).token_ids
            alone_by_mode[mode.mode if mode.mode != "speculative" else f"speculative-{mode.k}"] = alone
        for level in levels:
            runs: dict[Mode, list] = {mode: [] for mode in modes}
            for rep in range(repeats):
                for mode in modes[rep % len(modes) :] + modes[: rep % len(modes)]:  # rotated per repeat
                    started = time.perf_counter()
                    samples = await drain(
                        level_requests(level, sustained), level, lambda i, mode=mode: stream_one(stub, make(i, mode))
                    )
                    runs[mode].append((time.perf_counter() - started, samples))
            for mode in modes:
                alone = alone_by_mode[mode.mode if mode.mode != "speculative" else f"speculative-{mode.k}"]
                rates = [sum(s.tokens for s in samples) / wall for wall, samples in runs[mode]]
                ttfts = [s.ttft for _, samples in runs[mode] for s in samples if s.ttft is not None]
                itls = [v for _, samples in runs[mode] for s in samples for v in s.itl]
                changed = sum(s.token_ids != alone[i] for _, samples in runs[mode] for i, s in enumerate(samples))
                # greedy: every mode's tokens are the target's own, so target-only's alone are the reference
                reference = alone_by_mode.get("target-only") if temperature == 0 else None
                unlike_target = (
                    sum(s.token_ids != reference[i] for _, samples in runs[mode] for i, s in enumerate(samples))
                    if reference is not None
                    else None
                )
                speculating = [s for _, samples in runs[mode] for s in samples]
                out.append(
                    {
                        "concurrency": level,
                        "mode": mode.mode,
                        "k": mode.k,
                        "temperature": temperature,
                        "aggregate_tokens_per_s": statistics.median(rates),
                        "aggregate_tokens_per_s_min": min(rates),
                        "aggregate_tokens_per_s_max": max(rates),
                        "ttft_s_p50": percentile(ttfts, 50),
                        "ttft_s_p99": percentile(ttfts, 99),
                        "itl_s_p50": percentile(itls, 50),
                        "itl_s_p99": percentile(itls, 99),
                        "streams_changed_vs_alone": changed,
                        "streams_unlike_target_only": unlike_target,
                        "streams": len(speculating),
                        "steps_speculating": _share(
                            sum(s.drafts for s in speculating), sum(s.passes for s in speculating)
                        ),
                    }
                )
                say(
                    f"T={temperature} concurrency {level} {mode.mode} k={mode.k}: "
                    f"{out[-1]['aggregate_tokens_per_s']:.1f} tokens/s, {changed} of {out[-1]['streams']} streams "
                    "differ from alone"
                    + (f", {unlike_target} from target-only's greedy" if unlike_target is not None else "")
                )
    return out, alone_by_mode


def run_peer(args, prompts, levels: list[int], ours_alone: dict[int, list[int]], say) -> dict:
    """vLLM's offline engine (``specdec/apps/vllm_peer.py``, run by ``--peer-python``) on the same
    weights (the float32 copy, loaded in the bench's ``--dtype``) and chat prompts: aggregate
    tokens/s per level, and how many prompts' greedy tokens equal ours (checked before its timings
    mean anything)."""
    import os
    import subprocess
    import tempfile

    from specdec.modeling.gguf_cache import find_converted
    from specdec.modeling.loading import encode_prompt, load_tokenizer, resolve

    source = resolve(args.target_model)
    model_dir = find_converted(Path(source.location) / source.gguf_file) if source.gguf_file else Path(source.location)
    if model_dir is None:
        raise SystemExit("specdec bench --peer vllm: the float32 copy of the target is missing (load it once first)")
    tokenizer = load_tokenizer(args.target_model)
    ids = [encode_prompt(tokenizer, p["text"], chat=True) for p in prompts]
    n = min(len(prompts), max(levels))
    with tempfile.TemporaryDirectory() as tmp:
        job = os.path.join(tmp, "job.json")
        with open(job, "w") as f:
            json.dump(
                {
                    "model": str(model_dir),
                    "prompts": ids[:n],
                    "levels": levels,
                    "max_tokens": args.max_new_tokens,
                    "repeats": args.repeats,
                    "dtype": getattr(args, "dtype", None) or "float32",  # the same dtype as our replicas
                },
                f,
            )
        script = Path(__file__).with_name("vllm_peer.py")
        say(f"peer: vLLM ({args.peer_python}) on {model_dir}")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        proc = subprocess.run(
            [args.peer_python, str(script), job], capture_output=True, text=True, env=env, check=False, timeout=3600
        )
        if proc.returncode != 0:
            raise SystemExit(f"specdec bench --peer vllm failed:\n{proc.stderr[-3000:]}")
        result = json.loads(Path(job + ".out").read_text())
    matches = sum(result["alone_token_ids"][i] == ours_alone.get(i) for i in range(n))
    for level in result["levels"]:
        say(f"peer vLLM concurrency {level['concurrency']}: {level['aggregate_tokens_per_s']:.1f} tokens/s")
    say(f"peer vLLM greedy tokens equal ours on {matches} of {n} prompts")
    return {"name": "vllm", "levels": result["levels"], "greedy_prompts_equal": matches, "greedy_prompts": n}


def report(summaries: list[dict], sweep: list[dict], args) -> dict:
    by = {(s["mode"], s["k"], s["temperature"]): s for s in summaries}
    headline_t = float(args.temperatures.split(",")[0])
    base = by.get(("target-only", 0, headline_t))
    for s in summaries:
        b = by.get(("target-only", 0, s["temperature"]))
        s["speedup_vs_target_only"] = s["tokens_per_s"] / b["tokens_per_s"] if b and b["tokens_per_s"] else None
        # Leviathan's model is for a fixed k: an adaptive run mixes blocks and target-only steps.
        fixed = s["mode"] in ("speculative", "speculative-ngram")
        s["predicted_speedup"] = predicted_speedup(s, b) if b and fixed else None
    spec = [s for s in summaries if s["mode"].startswith("speculative") and s["temperature"] == headline_t]
    best = max(spec, key=lambda s: s["tokens_per_s"]) if spec else None
    assisted = [s for s in summaries if s["mode"] == "hf-assisted" and s["temperature"] == headline_t]
    best_assisted = max(assisted, key=lambda s: s["tokens_per_s"]) if assisted else None
    split = (best or {}).get("time_split") or {}
    return {
        "settings": {
            "target_model": args.target_model,
            "draft_model": args.draft_model,
            "assistant_model": getattr(args, "assistant_model", None),
            "ks": args.ks,
            "temperatures": args.temperatures,
            "max_new_tokens": args.max_new_tokens,
            "invariant": getattr(args, "invariant", False),
            "seeded_sampling": getattr(args, "seeded_sampling", None) or "invariant",
            "sustained": getattr(args, "sustained", 0),
            "repeats": args.repeats,
            "prompts": args.prompts,
            "num_prompts": args.num_prompts,
            "headline_temperature": headline_t,
        },
        "modes": summaries,
        "best": {"mode": best["mode"], "k": best["k"]} if best else None,
        "speedup_vs_target_only": best["speedup_vs_target_only"] if best else None,
        "speedup_vs_hf_assisted": best["tokens_per_s"] / best_assisted["tokens_per_s"]
        if best and best_assisted
        else None,
        "speedup_vs_hf_generate": best["tokens_per_s"] / by[("hf-generate", 0, headline_t)]["tokens_per_s"]
        if best and ("hf-generate", 0, headline_t) in by
        else None,
        "acceptance_rate": best.get("acceptance_rate") if best else None,
        "mean_accepted_length": best.get("mean_accepted_length") if best else None,
        "predicted_speedup": best.get("predicted_speedup") if best else None,
        "overhead_fraction": split.get("coordination_network"),
        "target_only_tokens_per_s": base["tokens_per_s"] if base else None,
        "concurrency": sweep,
    }


def table(rep: dict) -> str:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines = [
        f"{'mode':<20} {'k':>2} {'T':>4} {'tok/s':>7} {'(min-max)':>13} {'x base':>6} {'pred':>5} "
        f"{'accept':>6} {'len':>5} {'pass/tok':>8} {'ttft':>6} {'itl p50/p99':>13} {'draft/verify/other':>20}"
    ]
    for s in sorted(rep["modes"], key=lambda s: (s["temperature"], s["mode"], s["k"])):
        split = s.get("time_split")
        parts = ("draft", "verify", "coordination_network")
        time_split = " / ".join(f"{split[k]:.0%}" for k in parts) if split else "-"
        lines.append(
            f"{s['mode']:<20} {s['k']:>2} {s['temperature']:>4.1f} {s['tokens_per_s']:>7.1f} "
            f"{fmt(s['tokens_per_s_min'], '.1f') + '-' + fmt(s['tokens_per_s_max'], '.1f'):>13} "
            f"{fmt(s.get('speedup_vs_target_only'), '.2f'):>6} {fmt(s.get('predicted_speedup'), '.2f'):>5} "
            f"{fmt(s.get('acceptance_rate'), '.2f'):>6} {fmt(s.get('mean_accepted_length'), '.2f'):>5} "
            f"{fmt(s.get('target_passes_per_token'), '.2f'):>8} {fmt(s.get('ttft_s_median'), '.3f'):>6} "
            f"{fmt(s.get('itl_s_p50'), '.3f') + '/' + fmt(s.get('itl_s_p99'), '.3f'):>13} "
            f"{time_split:>20}"
        )
    for s in rep["modes"]:
        if s.get("predraft_hit_rate") is not None:
            lines.append(
                f"{s['mode']} k={s['k']} T={s['temperature']:.1f}: {s['predraft_hit_rate']:.0%} of the blocks drafted "
                f"ahead were used; {s.get('requests_unlike_serial', '-')} requests unlike the serial run"
            )
    for c in rep["concurrency"]:
        lines.append(
            f"T={c.get('temperature', 0):.1f} concurrency {c['concurrency']:>2}: {c['mode']:<20} k={c['k']}: "
            f"{c['aggregate_tokens_per_s']:>6.1f} tokens/s aggregate, ttft p50/p99 "
            f"{fmt(c.get('ttft_s_p50'), '.3f')}/{fmt(c.get('ttft_s_p99'), '.3f')} s, itl p50/p99 "
            f"{fmt(c.get('itl_s_p50'), '.3f')}/{fmt(c.get('itl_s_p99'), '.3f')} s, "
            f"{c.get('streams_changed_vs_alone', 0)} of {c.get('streams', 0)} streams differ from alone"
            + (
                f" ({c['streams_unlike_target_only']} from target-only's greedy)"
                if c.get("streams_unlike_target_only") is not None
                else ""
            )
            + f", {fmt(c.get('steps_speculating'), '.0%')} of steps speculating"
        )
    lines.append(
        f"best: {rep['best']}, speedup vs target-only {fmt(rep['speedup_vs_target_only'], '.2f')}x "
        f"(predicted {fmt(rep['predicted_speedup'], '.2f')}x), vs transformers assisted "
        f"{fmt(rep['speedup_vs_hf_assisted'], '.2f')}x, acceptance {fmt(rep['acceptance_rate'], '.2f')}, "
        f"mean accepted length {fmt(rep['mean_accepted_length'], '.2f')}"
    )
    return "\n".join(lines)


def plot(rep: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = rep.get("concurrency") or []
    fig, axes = plt.subplots(1, 3 if sweep else 2, figsize=(16 if sweep else 11, 4))
    ax1, ax2 = axes[0], axes[1]
    for s_mode in ("speculative", "speculative-adaptive", "speculative-ngram", "hf-assisted"):
        for t in sorted({s["temperature"] for s in rep["modes"]}):
            pts = sorted((s["k"], s) for s in rep["modes"] if s["mode"] == s_mode and s["temperature"] == t)
            if not pts:
                continue
            ax1.plot([k for k, _ in pts], [s["tokens_per_s"] for _, s in pts], marker="o", label=f"{s_mode} T={t}")
            if s_mode != "hf-assisted":
                ax2.plot(
                    [k for k, _ in pts],
                    [s.get("acceptance_rate") or 0 for _, s in pts],
                    marker="o",
                    label=f"{s_mode} T={t}",
                )
        base = [s for s in rep["modes"] if s["mode"] == "target-only"]
    for s in base:
        ax1.axhline(s["tokens_per_s"], linestyle="--", color="grey")
    ax1.set_xlabel("k (speculative tokens)")
    ax1.set_ylabel("tokens/s (median)")
    ax1.set_title("throughput vs k (dashed: target-only)")
    ax1.legend(fontsize=7)
    ax2.set_xlabel("k")
    ax2.set_ylabel("acceptance rate")
    ax2.set_title("acceptance vs k")
    ax2.legend(fontsize=7)
    if sweep:
        ax3 = axes[2]
        for key in sorted({(c["mode"], c["k"], c.get("temperature", 0)) for c in sweep}):
            pts = sorted(
                (c["concurrency"], c["aggregate_tokens_per_s"])
                for c in sweep
                if (c["mode"], c["k"], c.get("temperature", 0)) == key
            )
            mode, k, t = key
            label = f"{mode} T={t}" if mode in ("target-only", "speculative-default") else f"{mode} k={k} T={t}"
            style = "--" if mode == "target-only" else "-"
            ax3.plot([x for x, _ in pts], [y for _, y in pts], style, marker="o", label=label)
        ax3.set_xscale("log", base=2)
        ax3.set_xlabel("concurrent streams")
        ax3.set_ylabel("aggregate tokens/s (median)")
        ax3.set_title("throughput vs load")
        ax3.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _tp_flags(args) -> list[str]:
    """The target's tensor-parallel flag of this bench (none for one rank)."""
    tp = getattr(args, "target_tp", 1)
    return ["--tp", str(tp)] if tp > 1 else []


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target-model", default="smollm2")
    p.add_argument(
        "--draft-model",
        default="auto",
        help="draft model spec, 'ngram', or 'auto' (the stack's default: the shipped distilled draft "
        "for the default target, else n-gram)",
    )
    p.add_argument(
        "--assistant-model",
        default="auto",
        help="the draft of transformers' assisted generation (the peer): 'auto' = the stack's draft, or "
        "for a feature draft the standalone distilled draft of the default target; 'none' = skip",
    )
    p.add_argument("--ngram-ks", default=None, help="k sweep of the n-gram draft (default: --ks; '' = skip)")
    p.add_argument("--prompts", default=str(BENCH_PROMPTS), help="JSONL file of {id, category, text}")
    p.add_argument("--split", default=None, help="only prompts with this split (e.g. heldout)")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="k sweep of the fixed-k modes ('' = none)")
    p.add_argument("--adaptive-ks", default="2", help="k of the adaptive-policy modes ('' = skip)")
    p.add_argument(
        "--pipelined-ks",
        default="",
        help="k of fixed-k modes with pipelined drafting, beside the serial ones (default '' = none; "
        "docs/pipelining.md); with --target-cpus / --draft-cpus each replica has cores of its own",
    )
    add_cpu_flags(p)
    p.add_argument(
        "--default-k",
        type=int,
        default=SERVE_DEFAULT_K,
        help="the stack's default k (as `specdec serve`'s): what speculative-default requests, which leave "
        "speculation to the server, use at most",
    )
    p.add_argument("--temperatures", default="0,0.7", help="sampling settings; the first is the headline")
    p.add_argument("--dtype", default=None, help="the stack's replicas' dtype (default: theirs, float32 on the CPU)")
    p.add_argument("--target-tp", type=positive_int, default=1, help="tensor-parallel ranks of the stack's target")
    p.add_argument(
        "--no-batch-invariant",
        action="store_true",
        help="the replicas batch with torch's fastest operations where the layer kernel does not run",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--invariant",
        action="store_true",
        help="every request samples invariantly (the coordinator's --invariant-sampling; docs/exactness.md)",
    )
    p.add_argument(
        "--seeded-sampling",
        choices=SEEDED_SAMPLING,
        default=None,
        help="how the stack makes seeded sampled requests (every request here is seeded) reproducible: the "
        "coordinator's --seeded-sampling (default: its default, invariant)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", default="1,4,16", help="concurrency sweep ('' = skip)")
    p.add_argument(
        "--sweep-only",
        action="store_true",
        help="only the concurrency sweep: skip the per-prompt comparison of modes (and transformers')",
    )
    p.add_argument(
        "--sustained",
        type=int,
        default=0,
        help="each sweep level drains this many requests (at least the level) with as many workers as "
        "the level, so the load holds throughout (as a serving benchmark's max concurrency); 0 = one wave "
        "of level streams at once",
    )
    p.add_argument(
        "--peer", choices=["none", "vllm"], default="none", help="also run vLLM's CPU build (make bench-peer)"
    )
    p.add_argument("--peer-python", default=".venv-peer/bin/python", help="the Python of the peer's venv")
    p.add_argument("--no-hf", action="store_true", help="skip the in-process transformers baselines")
    p.add_argument("--quick", action="store_true", help="a few minutes: 4 prompts, k in 2,4, 2 repeats, 24 tokens")
    p.add_argument(
        "--structured",
        nargs="?",
        const=str(STRUCTURED_WORKLOAD),
        default=None,
        metavar="FILE",
        help="structured output instead: target-only vs speculation with and without forced runs over prompts "
        "with JSON schemas (a JSONL of {id, text, schema}, or a schema file for every prompt of --prompts; "
        "no FILE: the bundled workload)",
    )
    p.add_argument(
        "--burst",
        nargs="?",
        const=DEFAULT_BURST,
        default=None,
        metavar="LEVELS",
        help="bursts instead: on one fresh stack, --repeats sequences of these stream counts (no LEVELS: "
        f"{DEFAULT_BURST}), each a wave of 2 x level requests with the server's default and target-only "
        "interleaved, at the first --temperatures (docs/goodput.md, 'Bursts')",
    )
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--plot", default=None, help="write tokens/s and acceptance vs k here (PNG)")
    p.add_argument("--log-dir", default=None, help="service logs (default: inherited output)")


def main(args) -> int:
    if args.structured is not None:
        from specdec.apps.bench_structured import run_structured, structured_table

        if args.quick:
            args.num_prompts, args.repeats = args.num_prompts or 3, 1
        srep = run_structured(args, lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True))
        print(structured_table(srep))
        if args.json:
            Path(args.json).write_text(json.dumps(srep, indent=2))
        return 0 if not srep["greedy_differs_from_target_only"] else 1
    if args.burst is not None:
        from specdec.apps.bench_burst import burst_table, run_burst

        modes = {"speculative-default": DEFAULT_MODE(args.default_k), "target-only": Mode("target-only", 0, "none")}
        brep = run_burst(args, modes, build_request, lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True))
        print(burst_table(brep))
        if args.json:
            Path(args.json).write_text(json.dumps(brep, indent=2))
        return 0 if not any(row["streams_unlike_target_only"] for row in brep["rows"]) else 1
    if args.quick:
        args.num_prompts = args.num_prompts or 4
        args.ks, args.repeats, args.max_new_tokens = "2,4", 2, min(args.max_new_tokens, 24)
        args.concurrency = "1,4" if args.concurrency == "1,4,16" else args.concurrency
    rep = run(args)
    print(table(rep))
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=2))
    if args.plot:
        plot(rep, args.plot)
    return 0
