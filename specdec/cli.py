"""The ``specdec`` command line."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--seed", type=int, default=None, help="default: a fresh random seed (reported)")
    group.add_argument("--max-new-tokens", type=int, default=96)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")


def sampling_from_args(args):
    from .sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, max_new_tokens=args.max_new_tokens,
        stop=tuple(args.stop), ignore_eos=args.ignore_eos,
    )


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """Chat models get their chat template (as a user message); others the raw text."""
    if chat and getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(prompt)["input_ids"]]


def cmd_run(args) -> int:
    """In-process demo: target + draft engines in this process, answer streamed as committed."""
    from draft_service.engine import DraftEngine
    from draft_service.ngram import NgramDraft
    from target_service.engine import TargetEngine

    from .generate import LocalDraft, LocalTarget, SpeculativeRun, TextStream
    from .models import eos_token_ids, load_model, load_tokenizer, parse_dtype

    device = args.device or ("cuda" if _cuda() else "cpu")
    dtype = parse_dtype(args.dtype, device)
    tokenizer = load_tokenizer(args.target_model)
    target_model = load_model(args.target_model, device, dtype)
    target = TargetEngine(target_model)
    if args.draft_model == "ngram":
        draft = NgramDraft(target.vocab_size)
    else:
        draft = DraftEngine(load_model(args.draft_model, device, dtype))
    params = sampling_from_args(args)
    prompt_ids = encode_prompt(tokenizer, args.prompt)
    run = SpeculativeRun(LocalTarget(target), LocalDraft(draft), prompt_ids, params, args.num_speculative_tokens,
                         eos_token_ids(target_model, tokenizer), tokenizer)
    print(f"\n> {args.prompt}\n", flush=True)
    stream = TextStream()
    started = time.perf_counter()
    first_token_at = None

    async def consume():
        nonlocal first_token_at
        async for _ in run.steps():
            if first_token_at is None:
                first_token_at = time.perf_counter() - started
            sys.stdout.write(stream.delta(run.stopper.text(), final=run.stopper.finished))
            sys.stdout.flush()

    asyncio.run(consume())
    result = run.result()
    elapsed = time.perf_counter() - started
    s = result.stats
    print(f"\n\n[{len(result.token_ids)} tokens, finish={result.finish_reason}, seed={result.seed}] "
          f"draft={draft.model_id} k={args.num_speculative_tokens}")
    print(f"acceptance rate {s.acceptance_rate:.2f}, mean accepted length {s.mean_accepted_length:.2f}, "
          f"{len(result.token_ids) / elapsed:.1f} tokens/s, {s.target_passes} target passes, "
          f"time to first token {first_token_at or 0:.2f}s")
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Exact, distributed speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("selftest", help="the statistical exactness certificate on tiny random models",
                       add_help=False)
    p.set_defaults(func=None)

    p = sub.add_parser("run", help="answer one prompt with speculative decoding, streamed, with stats")
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    p.add_argument("--target-model", default="smollm2", help="target model spec (default: SmolLM2-135M-Instruct)")
    p.add_argument("--draft-model", default="ngram", help="draft model spec, or 'ngram' (default)")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) / bfloat16 (GPU default) / float16")
    add_sampling_flags(p)
    p.set_defaults(func=cmd_run)

    from coordinator import server as coordinator_server
    from draft_service import server as draft_server
    from target_service import server as target_server

    p = sub.add_parser("draft", help="run the draft gRPC service")
    draft_server.add_arguments(p)
    p.set_defaults(func=draft_server.main)

    p = sub.add_parser("target", help="run the target gRPC service")
    target_server.add_arguments(p)
    p.set_defaults(func=target_server.main)

    p = sub.add_parser("coordinator", help="run the coordinator (public gRPC API) on Ray")
    coordinator_server.add_arguments(p)
    p.set_defaults(func=coordinator_server.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a model hub
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if argv[:1] == ["selftest"]:
        from .selftest import main as selftest_main

        return selftest_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    from .errors import SpecdecError

    try:
        return args.func(args)
    except SpecdecError as exc:
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
