"""The local stack's supervisor (``specdec serve`` / ``specdec run``): a replica (draft, target) or
the embedded redis-server that exits unexpectedly is started again with its own command line --
the same address, model and replica id, so it re-registers where the coordinator looks -- after
an exponential backoff; one that keeps exiting is given up on. The stack serves on without a
draft (an optimization: requests fall back to another draft or to target-only steps) and without
one of several targets; losing the last target, Redis or the coordinator stops it, which is what
``failure`` then says. docs/operations.md, "Supervision".

The policy is pure functions of a process's recent exits; :class:`Supervisor` is the one thread
that applies them, one pass every ``interval`` seconds.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

# Kinds of processes the supervisor starts again; any other (the coordinator) ends the stack.
RESTARTABLE = ("draft", "target", "redis")


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5  # restarts of one process within window_s; one more exit and it is given up on
    window_s: float = 300.0
    first_delay_s: float = 1.0  # the backoff: this after the first exit in the window, doubling after each
    max_delay_s: float = 30.0
    start_timeout_s: float = 300.0  # a restarted process not SERVING by then is killed: an exit


def recent_exits(exits: Sequence[float], now: float, window_s: float) -> list[float]:
    """The exits (monotonic times) that count against a process now."""
    return [t for t in exits if now - t <= window_s]


def gives_up(policy: RestartPolicy, exits_in_window: int) -> bool:
    return exits_in_window > policy.max_restarts


def restart_delay(policy: RestartPolicy, exits_in_window: int) -> float:
    """Seconds to wait before the next start: a process that keeps exiting is not started in a
    tight loop, and one that exits once in a long while is back after first_delay_s."""
    return min(policy.max_delay_s, policy.first_delay_s * 2.0 ** max(0, exits_in_window - 1))


def describe_exit(code: int) -> str:
    """A Popen return code as a person reads it: ``killed by SIGKILL``, ``code 1``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"code {code}"


def cannot_serve_without(kind: str, others: Iterable[str]) -> str | None:
    """Why the stack cannot serve once a process of ``kind`` is gone for good, ``others`` being
    the kinds of the processes still running or being restarted (None: it serves on)."""
    if kind == "draft":
        return None
    if kind == "target":
        return None if "target" in others else "no target left to serve"
    if kind == "redis":
        return "the registry and session log (Redis) are gone"
    return f"the {kind} is gone"


class Supervised(Protocol):
    """A process of the stack as the supervisor sees it."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...  # "draft" / "target" / "redis" / "coordinator"
    @property
    def address(self) -> str: ...
    def exit_code(self) -> int | None: ...  # None while it runs
    def relaunch(self) -> None: ...  # start it again, the same way; do not wait
    def ready(self) -> bool: ...  # one probe (a couple of seconds at most): does it serve?
    def kill(self) -> None: ...  # it and everything it started, at once


RUNNING, WAITING, STARTING, GIVEN_UP = "running", "waiting", "starting", "given up"


@dataclass
class _Watch:
    unit: Supervised
    state: str = RUNNING
    exits: list[float] = field(default_factory=list)
    due: float = 0.0  # WAITING: when to start it again; STARTING: when to stop waiting for it
    restarts: int = 0


class Supervisor:
    """Watches ``units()`` (asked again every pass: replicas added at run time are watched too)
    and restarts or gives up on those that exit. ``lock`` is held while a process is started, so
    :meth:`stop` never races a restart: after it returns, nothing starts any more."""

    def __init__(
        self,
        units: Callable[[], Sequence[Supervised]],
        policy: RestartPolicy,
        say: Callable[[str], None],
        lock: threading.Lock | None = None,
        interval: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.units, self.policy, self.say, self.interval, self.clock = units, policy, say, interval, clock
        self.lock = lock or threading.Lock()
        self.failure: str | None = None  # set once the stack cannot serve; it is then to be stopped
        self._watches: dict[int, _Watch] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specdec-supervisor", daemon=True)

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        with self.lock:
            self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while self.failure is None and not self._stopping.wait(self.interval):
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - an unsupervised stack must not look supervised
                self.failure = f"the supervisor failed ({exc!r})"

    def step(self) -> None:
        """One pass over every process."""
        for unit in self.units():
            watch = self._watches.setdefault(id(unit), _Watch(unit))
            if self.failure is not None or self._stopping.is_set():
                return
            if watch.state == RUNNING:
                self._check_running(watch)
            elif watch.state == WAITING:
                self._start_if_due(watch)
            elif watch.state == STARTING:
                self._check_starting(watch)

    def _check_running(self, watch: _Watch) -> None:
        code = watch.unit.exit_code()
        if code is not None:
            self._exited(watch, f"exited ({describe_exit(code)})")

    def _start_if_due(self, watch: _Watch) -> None:
        if self.clock() < watch.due:
            return
        with self.lock:
            if self._stopping.is_set():
                return
            watch.unit.relaunch()
        watch.state, watch.due = STARTING, self.clock() + self.policy.start_timeout_s
        watch.restarts += 1

    def _check_starting(self, watch: _Watch) -> None:
        code = watch.unit.exit_code()
        if code is not None:
            self._exited(watch, f"exited ({describe_exit(code)}) before it was SERVING again")
        elif watch.unit.ready():
            watch.state = RUNNING
            self.say(f"{watch.unit.name} is SERVING again on {watch.unit.address} (restart {watch.restarts})")
        elif self.clock() > watch.due:
            self._exited(watch, f"was not SERVING {self.policy.start_timeout_s:.0f}s after its restart")

    def _exited(self, watch: _Watch, why: str) -> None:
        unit, now = watch.unit, self.clock()
        unit.kill()  # what it started must not outlive it (nor hold the port its restart binds)
        if unit.kind not in RESTARTABLE:
            self.failure = f"{unit.name} {why}"
            return
        watch.exits = [*recent_exits(watch.exits, now, self.policy.window_s), now]
        count, window = len(watch.exits), f"{self.policy.window_s:g}s"
        if not gives_up(self.policy, count):
            delay = restart_delay(self.policy, count)
            watch.state, watch.due = WAITING, now + delay
            self.say(
                f"{unit.name} {why}; restarting it in {delay:g}s "
                f"(restart {count} of at most {self.policy.max_restarts} in {window})"
            )
            return
        watch.state = GIVEN_UP
        others = [w.unit.kind for w in self._watches.values() if w is not watch and w.state != GIVEN_UP]
        reason = cannot_serve_without(unit.kind, others)
        self.say(
            f"{unit.name} {why}, {count} exits in {window}: giving up on {unit.name}; "
            + (f"{reason}: stopping the stack" if reason else "the stack serves on without it")
        )
        if reason:
            self.failure = f"gave up on {unit.name} ({reason})"
