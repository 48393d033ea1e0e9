"""Issue 43's GPU check: the batched pass and the speculative loop on one device, in one process.

Made to run where only torch, transformers and numpy are installed (a lent GPU machine: no Ray, no
Redis, no gRPC stack needed): the target and draft engines each behind their own iteration loop
and batch runner -- what the services run -- driven by the coordinator's loop
(``specdec.loop.generate``). ``tools/gpu-check.sh`` runs it; ``--device cpu`` rehearses it here.

Prints: the backend each engine chose; greedy tokens against transformers' ``generate`` on 8
prompts; aggregate tokens/s target-only and speculative at each level of ``--levels``, and how many
streams differ from the same request alone; the batched pass's time per session count; and with
``--tp N`` (default 2 on a machine with two GPUs) the lean pass split over N ranks, one device each
(NCCL; gloo on the CPU): the backend the ranks agreed on, whether rows are the same bits alone and
together, the logits against the whole model's, the pass time per session count.

The target is ``--target`` (a model spec, e.g. ``smollm2`` where its package is installed), or by
default ``shapes``: SmolLM2-135M's shapes with random weights (nothing to download or carry;
greedy identity and throughput mean the same, acceptance does not -- a draft proposes for another
model). The draft is ``--draft`` (default: the shipped ``models/smollm2-draft``; ``none``: no
speculative levels).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from replica.batcher import IterationLoop
from replica.model_thread import on_model_thread
from specdec.engine.batching import BatchRunner
from specdec.engine.draft import DraftEngine
from specdec.engine.target import TargetEngine
from specdec.exact.sampling import SamplingParams
from specdec.loop.generate import DraftPeer, TargetPeer, generate_async
from specdec.modeling.lean_llama import Pass
from specdec.modeling.tiny import smollm2_shaped

ROOT = Path(__file__).resolve().parents[1]


def load(spec: str, device: str, dtype: torch.dtype):
    if spec == "shapes":
        return smollm2_shaped().to(device=device, dtype=dtype)
    from specdec.modeling.loading import load_model

    return load_model(spec, device, dtype, quiet=True)


class Batched(TargetPeer, DraftPeer):
    """An engine behind its iteration loop, as a service runs it, for the coordinator's loop."""

    def __init__(self, engine):
        self.engine = engine
        self.context_length = engine.context_length
        self.loop = IterationLoop(BatchRunner(engine.store), gather_seconds=0.002)

    async def start(self, session_id, prompt, params, *extra):
        return await self.loop.run(self.engine.prefill_work(session_id, prompt, params), session_id, len(prompt))

    async def verify(self, session_id, step, proposal, commit, return_features=False):
        work = self.engine.verify_work(session_id, step, proposal.tokens, proposal.q, commit, return_features)
        return await self.loop.run(work, session_id)

    async def propose(self, session_id, step, k, commit):
        return await self.loop.run(self.engine.propose_work(session_id, step, k, commit), session_id)

    async def release(self, session_id):
        await on_model_thread(self.engine.release, session_id)


async def streams(target, draft, prompts, tokens: int, k: int) -> tuple[float, list[list[int]]]:
    """All prompts at once, greedy, ``tokens`` each: (aggregate tokens/s, each stream's tokens)."""
    started = time.perf_counter()
    results = await asyncio.gather(
        *(
            generate_async(
                target,
                draft,
                prompt,
                SamplingParams(temperature=0.0, seed=i, max_new_tokens=tokens, ignore_eos=True),
                num_speculative_tokens=k if draft is not None else 0,
                session_id=f"s{time.monotonic_ns()}-{i}",
            )
            for i, prompt in enumerate(prompts)
        )
    )
    wall = time.perf_counter() - started
    return sum(len(r.token_ids) for r in results) / wall, [r.token_ids for r in results]


def pass_times(lean, device: str, sessions_list, context: int = 200) -> dict[int, float]:
    """Seconds of one batched pass of one decode row per session, over ``context``-long caches
    (``lean``: a LeanLlama; None: nothing to time)."""
    if lean is None:
        return {}
    generator = torch.Generator().manual_seed(0)
    caches = [lean.new_cache() for _ in range(max(sessions_list))]
    for cache in caches:
        ids = torch.randint(0, lean.vocab_size, (context,), generator=generator).to(device)
        lean.forward_batch([Pass(ids, cache)])
    out = {}
    for sessions in sessions_list:
        times = []
        for _ in range(6):
            passes = [Pass(torch.tensor([7], device=device), caches[i]) for i in range(sessions)]
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            started = time.perf_counter()
            lean.forward_batch(passes)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
            for cache in caches[:sessions]:
                cache.crop(-1)
        out[sessions] = statistics.median(times[1:])
    return out


def tp_model(world: int, dtype: torch.dtype):
    """SmolLM2's shapes where they split ``world`` ways (9 heads over 3 KV heads: 3 ways), else the
    same with 8 heads over 4 KV heads (2 or 4 ways); random weights, 16 layers."""
    if 3 % world == 0:
        return smollm2_shaped(layers=16).to(dtype)
    return smollm2_shaped(layers=16, heads=8, kv_heads=4).to(dtype)


def tp_rank(rank: int, world: int, port: int, device: str, dtype_name: str, levels: list[int]) -> None:
    """One rank of the TP check: its shard of :func:`tp_model`, the backend the ranks agreed on,
    whether 8 sequences' rows are the same bits alone and together, the sharded logits against
    the whole model's (rank 0 prints), and the pass time per session count."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from specdec.modeling.lean_llama import LeanLlama
    from specdec.modeling.sharding import Shard, shard_in_place

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        dtype = getattr(torch, dtype_name)
        model = tp_model(world, dtype)
        whole = tp_model(world, dtype).to(device) if rank == 0 else None
        shard = Shard(rank, world)
        shard_in_place(model, shard)
        lean = LeanLlama(model.to(device), shard=shard)
        generator = torch.Generator().manual_seed(3)
        sequences = [torch.randint(0, lean.vocab_size, (5 + 7 * i,), generator=generator).to(device) for i in range(8)]

        def logits(indices):
            passes = [Pass(sequences[i], lean.new_cache(), len(sequences[i])) for i in indices]
            return [out for out, _ in lean.forward_batch(passes)]

        alone = [logits([i])[0] for i in range(8)]
        together = logits(range(8))
        same = sum(torch.equal(a, b) for a, b in zip(alone, together, strict=True))
        times = pass_times(lean, device, levels)
        if whole is not None:
            error = max(
                float((whole(seq.unsqueeze(0)).logits[0].float() - out.float()).abs().max())
                for seq, out in zip(sequences, alone, strict=True)
            )
            print(
                f"gpu-check: TP={world} pass backend {lean.backend} ({lean.backend_reason}); {same} of 8 sequences "
                f"the same bits alone and together; largest logit difference from the whole model {error:.3g}",
                flush=True,
            )
            for sessions, seconds in times.items():
                print(f"gpu-check: TP={world} pass of {sessions:>3} decode rows {seconds * 1e3:8.2f} ms", flush=True)
        # the ranks leave together: a rank that tore its group down while rank 0 was still
        # comparing with the whole model was seen to abort in gloo's teardown on a busy machine
        dist.barrier()
    finally:
        dist.destroy_process_group()


def tp_check(world: int, device: str, dtype_name: str, levels: list[int]) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(tp_rank, args=(world, port, device, dtype_name, levels), nprocs=world, start_method="spawn")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--target", default="shapes", help="model spec, or 'shapes' (SmolLM2's, random weights)")
    p.add_argument("--draft", default=str(ROOT / "models" / "smollm2-draft"), help="model spec, or 'none'")
    p.add_argument("--levels", default="1,8,32,64", help="concurrent streams per level")
    p.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    p.add_argument("-k", type=int, default=4, help="speculative block size")
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument(
        "--tp",
        type=int,
        default=2 if torch.cuda.device_count() >= 2 else 0,
        help="also check the lean pass split over this many ranks, one device each (default: 2 where "
        "the machine has two GPUs; 0 = skip)",
    )
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    levels = [int(n) for n in args.levels.split(",")]
    print(f"gpu-check: torch {torch.__version__}, device {args.device}, {args.dtype}", flush=True)
    if args.device.startswith("cuda"):
        print(f"gpu-check: {torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} device(s)", flush=True)
    if args.tp > 1:
        tp_check(args.tp, args.device, args.dtype, levels)

    target_engine = TargetEngine(load(args.target, args.device, dtype))
    draft_engine = None if args.draft == "none" else DraftEngine(load(args.draft, args.device, dtype))
    for name, engine in (("target", target_engine), ("draft", draft_engine)):
        if engine is not None:
            store = engine.store
            reason = store.runner.backend_reason if store.runner is not None else "transformers' forward"
            print(f"gpu-check: {name} pass backend {store.pass_backend} ({reason})", flush=True)

    vocab = target_engine.vocab_size
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (args.prompt_tokens,), generator=generator).tolist() for _ in range(max(levels))]

    async def run() -> None:
        target = Batched(target_engine)
        draft = Batched(draft_engine) if draft_engine is not None else None
        model = target_engine.store.model
        reference = [
            model.generate(
                torch.tensor([prompt], device=args.device),
                do_sample=False,
                max_new_tokens=args.tokens,
                min_new_tokens=args.tokens,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
            for prompt in prompts[:8]
        ]
        _, ours = await streams(target, None, prompts[:8], args.tokens, 0)
        equal = sum(a == b for a, b in zip(ours, reference, strict=True))
        print(f"gpu-check: greedy target-only equals transformers' generate on {equal} of 8 prompts", flush=True)
        modes = [("target-only", None)] + ([("speculative", draft)] if draft is not None else [])
        alone: dict[str, list[list[int]]] = {}
        for mode, peer in modes:
            alone[mode] = [(await streams(target, peer, [prompt], args.tokens, args.k))[1][0] for prompt in prompts]
        for level in levels:
            for mode, peer in modes:
                rate, tokens = await streams(target, peer, prompts[:level], args.tokens, args.k)
                changed = sum(t != a for t, a in zip(tokens, alone[mode], strict=False))
                unlike = sum(t != a for t, a in zip(tokens, alone["target-only"], strict=False))
                print(
                    f"gpu-check: {level:>3} streams {mode:<12} {rate:8.1f} tokens/s, {changed} of {level} differ "
                    f"from alone, {unlike} from target-only's greedy",
                    flush=True,
                )
        await target.loop.stop()
        if draft is not None:
            await draft.loop.stop()

    asyncio.run(run())
    for sessions, seconds in pass_times(target_engine.store.runner, args.device, levels).items():
        print(f"gpu-check: target pass of {sessions:>3} decode rows {seconds * 1e3:8.2f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
