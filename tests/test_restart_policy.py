"""The local stack's restart policy (specdec.apps.supervision): the backoff, the give-up rule,
when a loss stops the stack, and the supervisor applying them to real (trivial) processes. The
stack under `specdec serve`, killed for real: tests/test_supervision.py."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

from specdec.apps.supervision import (
    RestartPolicy,
    Supervisor,
    cannot_serve_without,
    describe_exit,
    gives_up,
    recent_exits,
    restart_delay,
)


def test_the_backoff_doubles_with_each_exit_in_the_window_up_to_its_bound():
    policy = RestartPolicy(first_delay_s=1.0, max_delay_s=30.0)
    assert [restart_delay(policy, n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def test_only_exits_within_the_window_count_and_one_past_max_restarts_gives_up():
    policy = RestartPolicy(max_restarts=2, window_s=60.0)
    assert recent_exits([0.0, 50.0, 100.0], now=100.0, window_s=60.0) == [50.0, 100.0]
    assert not gives_up(policy, 2)
    assert gives_up(policy, 3)
    assert gives_up(RestartPolicy(max_restarts=0), 1)  # 0: the first exit is the last


def test_an_exit_is_described_as_a_person_reads_it():
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(2) == "code 2"
    assert describe_exit(-200) == "killed by signal 200"


def test_only_the_last_target_redis_or_the_coordinator_is_one_the_stack_cannot_serve_without():
    assert cannot_serve_without("draft", []) is None
    assert cannot_serve_without("target", ["draft", "target"]) is None
    assert cannot_serve_without("target", ["draft", "redis"]) == "no target left to serve"
    assert "Redis" in cannot_serve_without("redis", ["target"])
    assert cannot_serve_without("coordinator", ["target"]) is not None


class Clock:
    """The supervisor's clock, advanced by the test: the backoff is checked in its time."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Command:
    """A real process started from ``argv``, as the supervisor sees a replica; ``serves``: what
    its health check answers while it runs (a replica that dies while loading never serves)."""

    name: str
    argv: list[str]
    clock: Clock
    serves: bool = True
    starts: list[float] = field(default_factory=list)
    process: subprocess.Popen | None = None

    def __post_init__(self):
        self.relaunch()

    @property
    def kind(self) -> str:
        return self.name.split("-", 1)[0]

    @property
    def address(self) -> str:
        return "-"

    def exit_code(self) -> int | None:
        assert self.process is not None
        return self.process.poll()

    def relaunch(self) -> None:
        self.starts.append(self.clock())
        self.process = subprocess.Popen(self.argv)

    def ready(self) -> bool:
        return self.serves

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()


def run_until(supervisor: Supervisor, clock: Clock, done, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        supervisor.step()
        clock.now += 0.01
        time.sleep(0.01)
    assert done(), "timed out"


EXITS_AT_ONCE = [sys.executable, "-c", "raise SystemExit(3)"]
RUNS = [sys.executable, "-c", "import time; time.sleep(120)"]


@pytest.mark.parametrize("survivor", ["target-1", None])
def test_a_target_that_keeps_exiting_is_restarted_with_backoff_then_given_up_on(survivor):
    policy = RestartPolicy(max_restarts=2, window_s=60.0, first_delay_s=0.1, max_delay_s=10.0)
    lines: list[str] = []
    clock = Clock()
    dying = Command("target-0", EXITS_AT_ONCE, clock, serves=False)
    units = [dying, *([Command(survivor, RUNS, clock)] if survivor else [])]
    supervisor = Supervisor(lambda: units, policy, lines.append, clock=clock)
    try:
        run_until(supervisor, clock, lambda: any("giving up" in line for line in lines))
        assert len(dying.starts) == 3  # the first start and max_restarts restarts
        first, second = (b - a for a, b in zip(dying.starts, dying.starts[1:], strict=False))
        assert first >= 0.1 and second >= 0.2  # never sooner than the backoff, which doubled
        assert lines[0] == "target-0 exited (code 3); restarting it in 0.1s (restart 1 of at most 2 in 60s)"
        assert "exited (code 3) before it was SERVING again; restarting it in 0.2s" in lines[1]
        if survivor:
            assert lines[-1].endswith("giving up on target-0; the stack serves on without it")
            assert supervisor.failure is None
        else:
            assert lines[-1].endswith("giving up on target-0; no target left to serve: stopping the stack")
            assert supervisor.failure == "gave up on target-0 (no target left to serve)"
    finally:
        for unit in units:
            unit.kill()


def test_after_stop_nothing_is_started_again():
    policy = RestartPolicy(max_restarts=10_000, first_delay_s=0.0)  # never gives up by itself
    dying = Command("draft-0", EXITS_AT_ONCE, Clock(), serves=False)
    supervisor = Supervisor(lambda: [dying], policy, lambda _line: None, interval=0.01).start()
    try:
        deadline = time.monotonic() + 30
        while len(dying.starts) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        supervisor.stop()
        starts = len(dying.starts)
        assert starts >= 2  # it was restarting
        time.sleep(0.3)
        assert len(dying.starts) == starts
    finally:
        dying.kill()
