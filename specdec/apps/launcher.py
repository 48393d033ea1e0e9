"""``specdec serve`` / ``specdec run``: the whole local stack as separate processes.

Starts the target service, the draft service and the coordinator (which starts or joins Ray),
each as its own process running the same ``specdec`` CLI, waits until each answers the standard
gRPC health check, and stops them all (SIGTERM, then SIGKILL after a grace period) on exit.
Given a restart policy, it supervises them meanwhile (specdec.apps.supervision): a replica or
the embedded Redis that exits is started again the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from specdec.apps.supervision import RestartPolicy, Supervised, Supervisor, describe_exit
from specdec.engine.memory import DEFAULT_KV_FRACTION
from specdec.errors import SpecdecError
from specdec.modeling.loading import default_draft_for, resolve
from specdec.runtime import security
from specdec.runtime.grpc_server import sync_channel, wait_for_health
from specdec.runtime.redis_embedded import EmbeddedRedis


class StackError(SpecdecError):
    """A service of the local stack failed to start."""

    code = "UNAVAILABLE"


DEFAULT_TARGET = "smollm2"
DEFAULT_DRAFT = "auto"  # the shipped distilled draft for the default target, else n-gram
# The local stack puts the target and the draft on one machine's cores. A draft of a few layers
# gains little from a second CPU thread, but its OpenMP team then competes with the target's for
# the same cores: through the stack, one thread was faster (docs/performance.md). A caller's own
# --threads wins.
DRAFT_THREADS = "1"


def draft_flags(extra: list[str] | None) -> list[str]:
    """The draft service's flags in the local stack: the caller's, with one CPU thread unless
    they chose a thread count (see DRAFT_THREADS)."""
    flags = list(extra or [])
    return flags if "--threads" in flags else [*flags, "--threads", DRAFT_THREADS]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def specdec_command() -> list[str]:
    return [sys.executable, "-m", "specdec"]


def spawn(argv: list[str], env: dict | None, log: Path | None, cpus: set[int] | None) -> subprocess.Popen:
    """Start ``argv`` in a process group of its own (so it and whatever it starts can be stopped
    together), its output appended to ``log`` (None: this process's); ``cpus``: it, and every
    process it starts, runs on those CPUs."""
    out = None
    if log:
        log.parent.mkdir(parents=True, exist_ok=True)  # --log-dir names a folder that may not exist yet
        out = open(log, "ab")  # noqa: SIM115 - closed below, once the child holds its own copy
    try:
        process = subprocess.Popen(
            argv,
            stdout=out or None,
            stderr=subprocess.STDOUT if out else None,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    finally:
        if out:
            out.close()
    if cpus:  # before it starts a thread or a process (Ray's): they inherit it
        os.sched_setaffinity(process.pid, cpus)
    return process


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL ``process`` and everything left in its group (a dead target's ranks, say)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def serving(address: str, timeout: float = 1.0) -> bool:
    """One health check of ``address`` (blocking, at most ``timeout`` s): SERVING or not."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with sync_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@dataclass
class Child:
    """A process of the stack, and how to start it again (the supervisor's restarts)."""

    name: str
    address: str
    process: subprocess.Popen
    argv: list[str] = field(default_factory=list)
    env: dict | None = None
    log: Path | None = None
    cpus: set[int] | None = None

    @property
    def kind(self) -> str:
        """draft / target / coordinator: what the name says (draft-1, target-spare2)."""
        return self.name.split("-", 1)[0]

    def exit_code(self) -> int | None:
        return self.process.poll()

    def relaunch(self) -> None:
        self.process = spawn(self.argv, self.env, self.log, self.cpus)

    def ready(self) -> bool:
        return serving(self.address)

    def kill(self) -> None:
        kill_group(self.process)


@dataclass
class RedisChild:
    """The embedded redis-server as a supervised process (same port, same append-only data)."""

    redis: EmbeddedRedis
    name: str = "redis"
    kind: str = "redis"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.redis.port}"

    def exit_code(self) -> int | None:
        return self.redis.process.poll() if self.redis.process else None  # None: stopped by the stack

    def relaunch(self) -> None:
        self.redis.launch()

    def ready(self) -> bool:
        return self.redis.answers()

    def kill(self) -> None:
        if self.redis.process:
            kill_group(self.redis.process)


@dataclass
class Stack:
    children: list[Child] = field(default_factory=list)
    coordinator_address: str = ""
    http_url: str = ""  # the OpenAI-compatible HTTP API, http://HOST:PORT (empty: off)
    redis_url: str = ""
    embedded_redis: EmbeddedRedis | None = None
    host: str = "127.0.0.1"
    log_dir: Path | None = None
    env: dict = field(default_factory=dict)
    draft_model: str | None = None
    extra_draft: list = field(default_factory=list)
    target_model: str | None = None
    extra_target: list = field(default_factory=list)
    kv_sharers: int = 1  # replicas with a KV pool on this host: they split the default share of memory
    supervisor: Supervisor | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # the supervisor's: see Supervisor
    _redis_children: list[RedisChild] = field(default_factory=list)

    def start_replica(self, kind: str, model: str, extra: list[str], name: str) -> Child:
        """Start one draft/target replica registered in the stack's Redis (not waited for)."""
        address = f"{self.host}:{free_port()}"
        args = [
            kind,
            "--model",
            model,
            "--host",
            self.host,
            "--port",
            address.rsplit(":", 1)[1],
            "--redis",
            self.redis_url,
            "--replica-id",
            name,
            *extra,
        ]
        if not {"--max-kv-bytes", "--kv-memory-fraction"} & set(extra):
            # every replica here measures the same host's free memory: the default share is theirs together
            args += ["--kv-memory-fraction", f"{DEFAULT_KV_FRACTION / max(1, self.kv_sharers):g}"]
        return self.start(name, args, address, self.log_dir, {"OTEL_SERVICE_NAME": f"specdec-{kind}", **self.env})

    def add_replica(self, kind: str, name: str, timeout: float = 120.0) -> Child:
        """Scale a pool out at run time (a new replica registers itself; no restart needed)."""
        model, extra = (
            (self.draft_model, self.extra_draft) if kind == "draft" else (self.target_model, self.extra_target)
        )
        if model is None:
            raise StackError(f"this stack runs no {kind} model to start another replica of")
        child = self.start_replica(kind, model, extra, name)
        self.wait_healthy(child, timeout)
        return child

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def start(
        self,
        name: str,
        args: list[str],
        address: str,
        log_dir: Path | None,
        env: dict | None = None,
        cpus: set[int] | None = None,
    ) -> Child:
        """Start a child process; ``cpus``: run it, and every process it starts, on those CPUs."""
        log = Path(log_dir) / f"{name}.log" if log_dir else None
        argv = specdec_command() + args
        with _signals_deferred():  # a child started but not recorded could never be stopped
            child = Child(name, address, spawn(argv, env, log, cpus), argv, env, log, cpus)
            self.children.append(child)
        return child

    def wait_healthy(self, child: Child, timeout: float, log: Path | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if child.process.poll() is not None:
                raise StackError(
                    f"the {child.name} service exited with code {child.process.returncode} before "
                    f"it was ready (see its output above{' or in ' + str(log) if log else ''})"
                )
            # One probe at a time with SIGTERM/SIGINT held until it returns (at most ~2 s): the
            # KeyboardInterrupt they become must not land inside grpc.aio's event loop, which can
            # abort the interpreter at exit (seen once in CI: `specdec run` exited -6 on SIGTERM).
            with _signals_deferred():
                ready = asyncio.run(_probe_health(child.address))
            if ready:
                return
        raise StackError(f"the {child.name} service at {child.address} is not SERVING after {timeout:.0f}s")

    def supervise(self, policy: RestartPolicy) -> None:
        """Restart what exits, as ``policy`` says, until stop() (specdec.apps.supervision)."""
        self._redis_children = [RedisChild(self.embedded_redis)] if self.embedded_redis else []
        self.supervisor = Supervisor(self._supervised, policy, _say, self.lock).start()

    def _supervised(self) -> list[Supervised]:
        return [*self._redis_children, *self.children]

    def failure(self) -> str | None:
        """Why the stack can no longer serve (None: it can). Supervised: what the supervisor gave
        up on; otherwise the first process that exited."""
        if self.supervisor is not None:
            return self.supervisor.failure
        dead = self.any_exited()
        return f"{dead.name} exited ({describe_exit(dead.process.returncode)})" if dead else None

    def stop(self, grace: float = 15.0) -> None:
        if self.supervisor is not None:  # first: nothing is restarted while it stops
            self.supervisor.stop()
        for child in reversed(self.children):
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in reversed(self.children):
            remaining = max(0.1, deadline - time.monotonic())
            try:
                child.process.wait(remaining)
            except subprocess.TimeoutExpired:
                kill_group(child.process)

    def any_exited(self) -> Child | None:
        return next((c for c in self.children if c.process.poll() is not None), None)


async def _probe_health(address: str) -> bool:
    """One health check of ``address`` (up to 2 s): SERVING or not yet."""
    try:
        await wait_for_health(address, timeout=2.0)
        return True
    except TimeoutError:
        return False


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGTERM / SIGINT (which `specdec` turns into KeyboardInterrupt) until the block is done,
    then raise. Only the main thread can set handlers; elsewhere this is a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda signum, _frame: pending.append(signum))
        for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    if pending:
        raise KeyboardInterrupt(f"signal {pending[0]} during a child's start")


def _say(message: str) -> None:
    print(f"[specdec] {message}", file=sys.stderr, flush=True)


@contextmanager
def local_stack(
    target_model: str = DEFAULT_TARGET,
    draft_model: str | None = DEFAULT_DRAFT,
    port: int = 0,
    num_speculative_tokens: int = 4,
    host: str = "127.0.0.1",
    log_dir: Path | None = None,
    extra_target: list[str] | None = None,
    extra_draft: list[str] | None = None,
    extra_coordinator: list[str] | None = None,
    startup_timeout: float = 300.0,
    env: dict | None = None,
    draft_replicas: int = 1,
    target_replicas: int = 1,
    redis_url: str | None = None,
    http_port: int | None = None,
    redis_maxmemory: str | None = None,
    coordinator_cpus: set[int] | None = None,
    restarts: RestartPolicy | None = None,
) -> Iterator[Stack]:
    """Bring the stack up (yields it once the coordinator is SERVING); always tear it down.

    ``http_port``: the coordinator's OpenAI-compatible HTTP API (None: a free port; 0: off).

    Redis: ``redis_url``, else REDIS_URL, else an embedded redis-server started here, bounded by
    ``redis_maxmemory`` (default DEFAULT_MAXMEMORY). ``coordinator_cpus``: the coordinator and
    its Ray processes run on those CPUs only (the replicas' own: their ``--cpus`` flag).

    ``restarts``: supervise the stack while it is up (a replica or the embedded Redis that exits
    is started again, as the policy says; ``Stack.failure()`` says when it cannot serve any more);
    None: a process that exits stays down."""
    from specdec.runtime.flags import check_cpus_available
    from specdec.runtime.redis_embedded import DEFAULT_MAXMEMORY

    if coordinator_cpus:  # before any process starts
        check_cpus_available(coordinator_cpus, "--coordinator-cpus")

    if draft_model == "auto":
        draft_model = default_draft_for(target_model)
    # Fail fast, with the model loader's own message, before any process starts.
    for spec in (target_model, draft_model):
        if spec and spec not in ("ngram", "none"):
            resolve(spec)
    stack = Stack()
    embedded = None
    try:
        redis_url = redis_url or os.environ.get("REDIS_URL")
        if not redis_url:
            embedded = EmbeddedRedis(maxmemory=redis_maxmemory or DEFAULT_MAXMEMORY).start()
            redis_url = embedded.url
            _say(f"started an embedded redis-server at {security.redacted(redis_url)}")
        stack.redis_url, stack.embedded_redis = redis_url, embedded
        stack.host, stack.log_dir, stack.env = host, log_dir, env or {}
        stack.draft_model, stack.extra_draft = draft_model, draft_flags(extra_draft)
        stack.target_model, stack.extra_target = target_model, list(extra_target or [])
        drafts = draft_replicas if draft_model and draft_model != "none" else 0
        stack.kv_sharers = target_replicas + drafts
        for i in range(target_replicas):
            _say(f"starting target replica {i} ({target_model})...")
            stack.start_replica("target", target_model, list(extra_target or []), f"target-{i}")
        if draft_model and draft_model != "none":
            for i in range(draft_replicas):
                _say(f"starting draft replica {i} ({draft_model})...")
                stack.start_replica("draft", draft_model, stack.extra_draft, f"draft-{i}")
        for child in list(stack.children):
            stack.wait_healthy(child, startup_timeout, log_dir / f"{child.name}.log" if log_dir else None)
            _say(f"{child.name} is SERVING on {child.address}")
        coord_port = port or free_port()
        coord_addr = f"{host}:{coord_port}"
        _say(f"starting coordinator on {coord_addr} (Ray)...")
        args = [
            "coordinator",
            "--redis",
            redis_url,
            "--host",
            host,
            "--port",
            str(coord_port),
            "--num-speculative-tokens",
            str(num_speculative_tokens),
        ]
        if not draft_model or draft_model == "none":  # no draft: requests run target-only by default
            args += ["--default-method", "none"]
        http_port = free_port() if http_port is None else http_port
        if http_port:
            args += ["--http-port", str(http_port)]
        coordinator = stack.start(
            "coordinator",
            args + list(extra_coordinator or []),
            coord_addr,
            log_dir,
            {"OTEL_SERVICE_NAME": "specdec-coordinator", **(env or {})},
            coordinator_cpus,
        )
        stack.wait_healthy(coordinator, startup_timeout, log_dir / "coordinator.log" if log_dir else None)
        stack.coordinator_address = coord_addr
        stack.http_url = f"http://{host}:{http_port}" if http_port else ""
        _say(f"coordinator is SERVING on {coord_addr}" + (f", HTTP API on {stack.http_url}/v1" if http_port else ""))
        if restarts is not None:
            stack.supervise(restarts)
        yield stack
    finally:
        stack.stop()
        if embedded is not None:
            embedded.stop()
