"""The ``specdec`` command line."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import time

from coordinator.config import PIPELINING
from specdec.apps.supervision import RestartPolicy
from specdec.loop.reproducible import SEEDED_SAMPLING
from specdec.runtime.flags import cpu_list, cpu_set, non_negative_int, positive_float, positive_int

# `specdec serve` / `run`'s default k: the best k of the held-out CPU bench with the shipped draft
# (docs/performance.md); the load-aware policy chooses each step's k in 0..k.
SERVE_DEFAULT_K = 2

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
    group.add_argument("--raw", action="store_true", help="send the prompt as is (default: as a chat user message)")
    structured = parser.add_argument_group("structured output (one of)").add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="FILE|JSON", help="the output is a JSON document of this schema")
    structured.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    structured.add_argument("--regex", help="the output matches this regular expression")
    structured.add_argument("--choice", action="append", help="the output is one of these strings (repeatable)")
    structured.add_argument("--grammar", metavar="FILE|TEXT", help="the output follows this Lark or GBNF grammar")
    parser.add_argument(
        "--no-forced-tokens",
        dest="forced_tokens",
        action="store_false",
        help="with structured output: let the draft propose what the constraint forces (measuring)",
    )


def _text_or_file(value: str) -> str:
    """A flag that takes inline text or a file of it."""
    from pathlib import Path

    path = Path(value)
    return path.read_text() if len(value) < 4096 and path.is_file() else value


def constraint_from_args(args):
    """The structured-output constraint the flags ask for (None: none)."""
    import json

    from specdec.exact.constraint import Constraint

    if args.json_schema:
        return Constraint("json_schema", _text_or_file(args.json_schema))
    if args.json_object:
        return Constraint("json_object")
    if args.regex:
        return Constraint("regex", args.regex)
    if args.choice:
        return Constraint("choice", json.dumps(args.choice))
    if args.grammar:
        return Constraint("grammar", _text_or_file(args.grammar))
    return None


def sampling_from_args(args):
    from specdec.exact.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        constraint=constraint_from_args(args),
    )


def cmd_run(args) -> int:
    """Bring the local stack up, stream one answer through the public API, print stats, tear down."""
    from specdec.apps.client import build_request, stream_to, summary
    from specdec.apps.launcher import local_stack
    from specdec.errors import InvalidArgumentError

    try:
        sampling_from_args(args)  # a bad flag (a constraint that is not valid) before the stack starts
    except InvalidArgumentError as exc:
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 2
    with local_stack(
        args.target_model,
        None if args.draft_model == "none" else args.draft_model,
        num_speculative_tokens=args.num_speculative_tokens,
        extra_coordinator=_policy_flags(args),
        extra_target=_device_flags(args, "target"),
        extra_draft=_device_flags(args, "draft"),
        coordinator_cpus=getattr(args, "coordinator_cpus", None),
        restarts=restart_policy(args),
    ) as stack:
        if args.seed is None:  # one seeded request throughout: every run and stream of it has the same tokens
            args.seed = secrets.randbits(63)
        request = build_request(
            prompt=args.prompt, params=sampling_from_args(args), k=args.num_speculative_tokens, chat=not args.raw
        )
        request.speculation.forced_tokens = args.forced_tokens
        if args.compare:  # neither measured request should pay the stack's first-request costs
            warm_up(stack.coordinator_address, args)
        print(f"\n> {args.prompt}\n", flush=True)
        answer = stream_to(stack.coordinator_address, request)
        print("\n\n" + summary(answer), flush=True)
        if args.compare:
            print(compare_without_speculation(stack.coordinator_address, args, answer), flush=True)
            if args.compare_streams > 1:
                print(concurrent_streams(stack.coordinator_address, args, answer), flush=True)
    return 0


def concurrent_streams(address: str, args, answer) -> str:
    """The same request as ``args.compare_streams`` concurrent streams (same seed): their
    aggregate tokens/s beside one stream's, and whether every stream got the one stream's tokens
    (each replica batches the streams' passes: docs/batching.md)."""
    from concurrent.futures import ThreadPoolExecutor

    from specdec.apps.client import build_request, stream_to

    params = sampling_from_args(args).with_seed(answer.seed)
    request = build_request(prompt=args.prompt, params=params, k=args.num_speculative_tokens, chat=not args.raw)
    streams = args.compare_streams
    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        answers = list(pool.map(lambda _: stream_to(address, request, out=None), range(streams)))
    wall = time.perf_counter() - started
    one = len(answer.token_ids) / answer.seconds if answer.seconds else 0.0
    together = sum(len(a.token_ids) for a in answers) / wall
    same = sum(a.token_ids == answer.token_ids for a in answers)
    return (
        f"{streams} concurrent streams of the same request: {together:.1f} tokens/s in all, one stream alone "
        f"{one:.1f} ({together / one if one else float('nan'):.1f}x); streams with the lone stream's tokens: "
        f"{same} of {streams}" + ("" if same == streams else " (a bug: please report)")
    )


def warm_up(address: str, args) -> None:
    from dataclasses import replace

    from specdec.apps.client import build_request, stream_to

    params = replace(sampling_from_args(args), max_new_tokens=8)
    for k, method in ((args.num_speculative_tokens, ""), (0, "none")):
        stream_to(
            address, build_request(prompt=args.prompt, params=params, k=k, method=method, chat=not args.raw), out=None
        )


def compare_without_speculation(address: str, args, answer) -> str:
    """The same request (same seed) without speculation, through the same stack, alternated with
    the speculative one ``args.compare_runs`` times each (the answer is the first speculative run;
    medians, since one run on a busy machine says little): how much faster speculation was, and,
    for greedy decoding, that the tokens are identical."""
    import statistics

    from specdec.apps.client import build_request, stream_to

    params = sampling_from_args(args).with_seed(answer.seed)
    with_spec = build_request(prompt=args.prompt, params=params, k=args.num_speculative_tokens, chat=not args.raw)
    without = build_request(prompt=args.prompt, params=params, k=0, method="none", chat=not args.raw)
    rate = lambda a: len(a.token_ids) / a.seconds if a.seconds else 0.0  # noqa: E731
    plains, fast = [], [rate(answer)]
    for i in range(args.compare_runs):
        plains.append(stream_to(address, without, out=None))
        if i + 1 < args.compare_runs:  # the answer was the first speculative run
            fast.append(rate(stream_to(address, with_spec, out=None)))
    plain, slow = plains[0], [rate(p) for p in plains]
    fast_m, slow_m = statistics.median(fast), statistics.median(slow)
    line = (
        f"without speculation (target only, same stack): {slow_m:.1f} tokens/s, with: {fast_m:.1f} "
        f"(medians of {len(slow)} runs each) -> speculation is {fast_m / slow_m if slow_m else float('nan'):.2f}x"
    )
    # greedy, or seeded sampling made invariant (the server's default for a seed): the same tokens
    if params.greedy or getattr(args, "seeded_sampling", None) != "replayable":
        line += "; identical tokens: " + ("yes" if plain.token_ids == answer.token_ids else "NO (a bug: please report)")
    return line


def cmd_serve(args) -> int:
    """The local stack, up until Ctrl-C / SIGTERM."""
    import signal
    import threading

    from specdec.apps.launcher import local_stack

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with local_stack(
        args.target_model,
        None if args.draft_model == "none" else args.draft_model,
        port=args.port,
        num_speculative_tokens=args.num_speculative_tokens,
        host=args.host,
        extra_target=[*_device_flags(args, "target"), "--tp", str(args.target_tp)],
        extra_draft=_device_flags(args, "draft"),
        coordinator_cpus=getattr(args, "coordinator_cpus", None),
        extra_coordinator=_policy_flags(args),
        draft_replicas=args.draft_replicas,
        target_replicas=args.target_replicas,
        http_port=args.http_port,
        restarts=restart_policy(args),
    ) as stack:
        from specdec.runtime.security import redacted  # here: `specdec distill` must not import grpc

        http = f"  OpenAI-compatible HTTP API: {stack.http_url}/v1\n" if stack.http_url else ""
        print(
            f"specdec is serving specdec.v1.Coordinator on {stack.coordinator_address} (Ctrl-C to stop)\n"
            f"{http}"
            f"  registry and session log: {redacted(stack.redis_url)}"
            f"{' (embedded redis-server)' if stack.embedded_redis else ''}\n"
            f"  add a draft replica: specdec draft --model {stack.draft_model} --port PORT "
            f"--redis {redacted(stack.redis_url)}",
            flush=True,
        )
        try:
            while not stop.wait(1.0):
                failure = stack.failure()  # the supervisor restarts what it can; this it could not
                if failure is not None:
                    print(f"specdec: {failure}; stopping", file=sys.stderr)
                    return 1
        except KeyboardInterrupt:
            pass
    return 0


def cmd_generate(args) -> int:
    import grpc

    from specdec.apps.client import build_request, stream_to, summary
    from specdec.errors import InvalidArgumentError

    try:
        params = sampling_from_args(args)
    except InvalidArgumentError as exc:  # a bad constraint, named before anything is sent
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 2
    request = build_request(
        prompt=args.prompt,
        params=params,
        k=args.num_speculative_tokens,
        method=args.method,
        request_id=args.request_id,
        chat=not args.raw,
        adaptive=args.adaptive,
    )
    request.speculation.forced_tokens = args.forced_tokens
    try:
        answer = stream_to(args.addr, request, timeout=args.timeout, api_key=args.api_key)
    except grpc.RpcError as exc:  # print the status, not a traceback
        print(f"specdec: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2
    print("\n\n" + summary(answer), file=sys.stderr)
    return 0


def _device_flags(args, role: str = "") -> list[str]:
    device = getattr(args, f"{role}_device", None) if role else None
    device = device or getattr(args, "device", None)
    flags = ["--device", device] if device else []
    if getattr(args, "dtype", None):
        flags += ["--dtype", args.dtype]
    if getattr(args, "no_batch_invariant", False):
        flags.append("--no-batch-invariant")
    cpus = getattr(args, f"{role}_cpus", None) if role else None
    return flags + (["--cpus", cpus] if cpus else [])


def add_cpu_flags(p: argparse.ArgumentParser) -> None:
    """Each process of the stack on CPUs of its own (the replicas' --cpus), as separate devices
    would be."""
    for role in ("target", "draft"):
        p.add_argument(
            f"--{role}-cpus",
            type=cpu_list,
            default=None,
            help=f"run the {role} replicas on these CPUs only (0-3, 0,2), a thread each (default: every CPU)",
        )
    p.add_argument(
        "--coordinator-cpus",
        type=cpu_set,
        default=None,
        help="run the coordinator and its Ray processes on these CPUs only (default: every CPU)",
    )


def restart_policy(args) -> RestartPolicy:
    return RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window)


def add_restart_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group(
        "supervision",
        "A draft or target replica, or the embedded redis-server, that exits is started again (same address, "
        f"same model) after a backoff of {RestartPolicy.first_delay_s:g} s, doubling with each exit within the "
        f"window up to {RestartPolicy.max_delay_s:g} s; one that exits more than --max-restarts times within "
        "--restart-window is given up on. The stack serves on "
        "without a draft or one of several targets; without its last target, Redis or the coordinator it "
        "stops (docs/operations.md, 'Supervision').",
    )
    group.add_argument(
        "--max-restarts",
        type=non_negative_int,
        metavar="N",
        default=RestartPolicy.max_restarts,
        help=f"restarts of one process within --restart-window before giving up on it (default "
        f"{RestartPolicy.max_restarts}; 0 = never restart)",
    )
    group.add_argument(
        "--restart-window",
        type=positive_float,
        default=RestartPolicy.window_s,
        metavar="SECONDS",
        help=f"how far back exits count (default {RestartPolicy.window_s:g})",
    )


def _policy_flags(args) -> list[str]:
    flags = ["--fixed-k"] if args.fixed_k else []
    flags += ["--pipeline-drafts", args.pipeline_drafts] if getattr(args, "pipeline_drafts", None) else []
    flags += ["--seeded-sampling", args.seeded_sampling] if args.seeded_sampling else []
    return flags + (["--replayable-schedule"] if args.replayable_schedule else [])


def _stack_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target-model", default="smollm2", help="target model spec (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--draft-model",
        default="auto",
        help="draft model spec, 'ngram', 'none' (no speculation), or 'auto' (default: the shipped "
        "distilled draft 'smollm2-draft' for the default target, 'ngram' for any other)",
    )
    p.add_argument(
        "-k",
        "--num-speculative-tokens",
        type=int,
        default=SERVE_DEFAULT_K,
        help=f"tokens a draft block proposes at most (default {SERVE_DEFAULT_K})",
    )
    p.add_argument(
        "--fixed-k",
        action="store_true",
        help="a block of k every step (default: adaptive, each step's k in 0..k chosen from the batch's "
        "load and the request's acceptance; docs/goodput.md)",
    )
    p.add_argument(
        "--seeded-sampling",
        choices=SEEDED_SAMPLING,
        default=None,
        help="how a seeded sampled request gets the same tokens every time: 'invariant' sampling (default: "
        "its tokens depend on the seed alone, at any load) or a 'replayable' schedule (k from its own past "
        "only); docs/exactness.md, 'What a seed fixes'",
    )
    p.add_argument(
        "--replayable-schedule",
        action="store_true",
        help="every adaptive request that does not sample invariantly, seeded or not, chooses k from its own "
        "past only, never the load (invariant-sampling requests, whose tokens no schedule changes, still "
        "follow the load; docs/goodput.md)",
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) / bfloat16 (GPU default) / float16")
    p.add_argument(
        "--no-batch-invariant",
        action="store_true",
        help="replicas batch with torch's fastest operations where the float32 layer kernel does not run "
        "(greedy output under load may then differ from one stream's; docs/batching.md, 'Backends')",
    )
    add_cpu_flags(p)
    add_restart_flags(p)
    p.add_argument(
        "--pipeline-drafts",
        nargs="?",
        const="on",
        choices=PIPELINING,
        default=None,
        help="whether the draft drafts the next block while the target verifies this one (the same tokens): "
        "'auto' (default) where the draft and target compute apart -- other nodes or GPUs of their own, not "
        "one machine's CPUs, where it did not pay --, 'on' (the flag alone) or 'off'; docs/pipelining.md",
    )


# Commands whose flags live in their own module: name -> (help, module). The module provides
# add_arguments(parser) and main(args).
MODULE_COMMANDS = {
    "bench": ("measure speculative vs target-only vs transformers, in one run", "specdec.apps.bench"),
    "distill": ("train a small draft for a target by knowledge distillation", "specdec.training.distill"),
    "draft": ("run the draft gRPC service", "replica.draft"),
    "target": ("run the target gRPC service", "replica.target"),
    "coordinator": ("run the coordinator (public gRPC API) on Ray", "coordinator.main"),
    "health": ("probe a specdec port's health (with this process's TLS settings)", "specdec.apps.ops:health"),
    "secrets": (
        "print a Kubernetes Secret of fresh token, passwords, API keys and certificates",
        "specdec.apps.ops:secrets",
    ),
}


def _module_command(name: str):
    import importlib

    path, _, prefix = MODULE_COMMANDS[name][1].partition(":")
    module = importlib.import_module(path)
    if prefix:  # a module of several commands: add_<prefix>_arguments and <prefix>_main
        return getattr(module, f"add_{prefix}_arguments"), getattr(module, f"{prefix}_main")
    return module.add_arguments, module.main


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI parser. With ``command`` (what main() passes), only that command's module is imported,
    so `specdec distill` needs neither grpc nor ray and a service process imports only its own
    server; without it, every command is complete."""
    parser = argparse.ArgumentParser(prog="specdec", description="Exact, distributed speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("selftest", help="the statistical exactness certificate on tiny random models", add_help=False)
    p.set_defaults(func=None)

    p = sub.add_parser("run", help="bring the local stack up, stream one answer with its stats, shut down")
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    p.add_argument(
        "--compare", action="store_true", help="then run the same request without speculation and print the speed-up"
    )
    p.add_argument(
        "--compare-runs",
        type=positive_int,
        default=3,
        help="with --compare: runs of each, alternated (medians are compared)",
    )
    p.add_argument(
        "--compare-streams",
        type=non_negative_int,
        default=8,
        help="with --compare: then the same request as this many concurrent streams (0 = skip)",
    )
    _stack_flags(p)
    add_sampling_flags(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("serve", help="run the whole local stack (target, draft, coordinator on Ray) until stopped")
    _stack_flags(p)
    p.add_argument("--port", type=int, default=50051, help="public (coordinator) port")
    p.add_argument("--http-port", type=int, default=8000, help="the OpenAI-compatible HTTP API's port (0 = off)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--target-device", default=None, help="device of the target (e.g. cuda:0)")
    p.add_argument("--draft-device", default=None, help="device of the draft (e.g. cuda:1)")
    p.add_argument("--draft-replicas", type=int, default=1, help="draft service processes")
    p.add_argument("--target-replicas", type=int, default=1, help="target service processes")
    p.add_argument("--target-tp", type=int, default=1, help="tensor-parallel ranks per target replica")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="call a running coordinator and stream the answer")
    p.add_argument("prompt")
    p.add_argument("--addr", default="127.0.0.1:50051", help="coordinator HOST:PORT")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=None, help="default: the server's")
    p.add_argument("--method", default="", choices=["", "draft_model", "ngram", "none"])
    policy = p.add_mutually_exclusive_group()
    policy.add_argument(
        "--adaptive",
        dest="adaptive",
        action="store_const",
        const=True,
        default=None,
        help="target-only steps while draft blocks do not pay (default: the server's choice)",
    )
    policy.add_argument(
        "--fixed-k", dest="adaptive", action="store_const", const=False, help="a draft block every step"
    )
    p.add_argument("--request-id", default="")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument(
        "--api-key",
        default=os.environ.get("SPECDEC_API_KEY"),
        help="the key a server with API keys requires (default: SPECDEC_API_KEY)",
    )
    add_sampling_flags(p)
    p.set_defaults(func=cmd_generate)

    for name, (help_text, _) in MODULE_COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if command is None or name == command:  # a named command imports only its own module
            add_arguments, run = _module_command(name)
            add_arguments(p)
            p.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a model hub
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if argv[:1] == ["selftest"]:
        from specdec.apps.selftest import main as selftest_main

        return selftest_main(argv[1:])
    parser = build_parser(next((a for a in argv if not a.startswith("-")), None))
    args = parser.parse_args(argv)
    from specdec.errors import SpecdecError

    # SIGTERM unwinds like Ctrl-C, so `run`, `bench` and `distill` stop the processes they started
    # (local_stack's finally) instead of dying and leaving them behind. Commands that serve install
    # their own handler (drain first) after this one.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return args.func(args)
    except SpecdecError as exc:
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdec: interrupted", file=sys.stderr)
        return 130


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
