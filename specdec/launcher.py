"""``specdec serve`` / ``specdec run``: the whole local stack as separate processes.

Starts the target service, the draft service and the coordinator (which starts or joins Ray),
each as its own process running the same ``specdec`` CLI, waits until each answers the standard
gRPC health check, and stops them all (SIGTERM, then SIGKILL after a grace period) on exit.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .errors import SpecdecError
from .models import resolve
from .server import wait_for_health


class StackError(SpecdecError):
    """A service of the local stack failed to start."""

    code = "UNAVAILABLE"

DEFAULT_TARGET = "smollm2"
DEFAULT_DRAFT = "ngram"  # the best draft the project ships today for the default target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def specdec_command() -> list[str]:
    return [sys.executable, "-m", "specdec.cli"]


@dataclass
class Child:
    name: str
    address: str
    process: subprocess.Popen


@dataclass
class Stack:
    children: list[Child] = field(default_factory=list)
    coordinator_address: str = ""

    def start(self, name: str, args: list[str], address: str, log_dir: Path | None, env: dict | None = None) -> Child:
        out = open(log_dir / f"{name}.log", "ab") if log_dir else None
        process = subprocess.Popen(specdec_command() + args, stdout=out or None, stderr=subprocess.STDOUT if out else None,
                                   env={**os.environ, **(env or {})}, start_new_session=True)
        child = Child(name, address, process)
        self.children.append(child)
        return child

    def wait_healthy(self, child: Child, timeout: float, log: Path | None = None) -> None:
        deadline = time.monotonic() + timeout

        async def poll():
            while time.monotonic() < deadline:
                if child.process.poll() is not None:
                    raise StackError(f"the {child.name} service exited with code {child.process.returncode} before "
                                     f"it was ready (see its output above{' or in ' + str(log) if log else ''})")
                try:
                    await wait_for_health(child.address, timeout=2.0)
                    return
                except TimeoutError:
                    continue
            raise StackError(f"the {child.name} service at {child.address} is not SERVING after {timeout:.0f}s")

        asyncio.run(poll())

    def stop(self, grace: float = 15.0) -> None:
        for child in reversed(self.children):
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in reversed(self.children):
            remaining = max(0.1, deadline - time.monotonic())
            try:
                child.process.wait(remaining)
            except subprocess.TimeoutExpired:
                os.killpg(child.process.pid, signal.SIGKILL)
                child.process.wait()

    def any_exited(self) -> Child | None:
        return next((c for c in self.children if c.process.poll() is not None), None)


def _say(message: str) -> None:
    print(f"[specdec] {message}", file=sys.stderr, flush=True)


@contextmanager
def local_stack(target_model: str = DEFAULT_TARGET, draft_model: str | None = DEFAULT_DRAFT, port: int = 0,
                num_speculative_tokens: int = 4, host: str = "127.0.0.1", log_dir: Path | None = None,
                extra_target: list[str] | None = None, extra_draft: list[str] | None = None,
                extra_coordinator: list[str] | None = None, startup_timeout: float = 300.0,
                env: dict | None = None) -> Iterator[Stack]:
    """Bring the stack up (yields it once the coordinator is SERVING); always tear it down."""
    # Fail fast, with the model loader's own message, before any process starts.
    for spec in (target_model, draft_model):
        if spec and spec not in ("ngram", "none"):
            resolve(spec)
    stack = Stack()
    try:
        target_addr = f"{host}:{free_port()}"
        _say(f"starting target service ({target_model}) on {target_addr}...")
        target = stack.start("target", ["target", "--model", target_model, "--host", host, "--port",
                                        target_addr.rsplit(":", 1)[1], *(extra_target or [])], target_addr, log_dir,
                             {"OTEL_SERVICE_NAME": "specdec-target", **(env or {})})
        draft = None
        if draft_model:
            draft_addr = f"{host}:{free_port()}"
            _say(f"starting draft service ({draft_model}) on {draft_addr}...")
            draft = stack.start("draft", ["draft", "--model", draft_model, "--host", host, "--port",
                                          draft_addr.rsplit(":", 1)[1], *(extra_draft or [])], draft_addr, log_dir,
                                {"OTEL_SERVICE_NAME": "specdec-draft", **(env or {})})
        for child in [target] + ([draft] if draft else []):
            stack.wait_healthy(child, startup_timeout, log_dir / f"{child.name}.log" if log_dir else None)
            _say(f"{child.name} is SERVING")
        coord_port = port or free_port()
        coord_addr = f"{host}:{coord_port}"
        _say(f"starting coordinator on {coord_addr} (Ray)...")
        args = ["coordinator", "--target", target.address, "--host", host, "--port", str(coord_port),
                "--num-speculative-tokens", str(num_speculative_tokens)]
        if draft is not None:
            args += ["--draft", draft.address]
        else:
            args += ["--default-method", "ngram"]
        coordinator = stack.start("coordinator", args + list(extra_coordinator or []), coord_addr, log_dir,
                                  {"OTEL_SERVICE_NAME": "specdec-coordinator", **(env or {})})
        stack.wait_healthy(coordinator, startup_timeout, log_dir / "coordinator.log" if log_dir else None)
        stack.coordinator_address = coord_addr
        _say(f"coordinator is SERVING on {coord_addr}")
        yield stack
    finally:
        stack.stop()
