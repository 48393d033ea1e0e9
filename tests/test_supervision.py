"""`specdec serve` supervises its processes (issue 62, item 9): SIGKILL one of two drafts, the
target or the embedded Redis under the real command, while clients stream long greedy requests.
The launcher restarts the dead process (same address, same model, said on its stderr), the
others keep serving, and every stream ends with exactly the tokens of an undisturbed run
(resuming with ``resume_from_index`` after a retryable status where there was one); a request
after the restart succeeds. A process that keeps exiting is given up on: a draft's loss leaves
the stack serving, the last target's stops it. SIGTERM stops everything, restarted processes
included, and leaves no process behind.

The unit tests of the restart policy itself are in tests/test_restart_policy.py."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from stack_util import info, long_greedy, save_fault_pair, stream_resuming, stub

from specdec.apps.launcher import Child, Stack, free_port, serving

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LONG = 800  # tokens: seconds of steps, so the kill lands mid-stream
# Restarts of one process within the window before the launcher gives up on it: the kills of the
# shared stack stay below it (one of each process).
MAX_RESTARTS = 2


@dataclass
class Serve:
    """A `specdec serve` process, its public address and its stderr (a file)."""

    process: subprocess.Popen
    address: str
    log: Path

    def running(self) -> bool:
        return self.process.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def descendants(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.NoSuchProcess):
            return psutil.Process(self.process.pid).children(recursive=True)
        return []


def start_serve(target: str, draft: str, log: Path, *flags: str) -> Serve:
    port = free_port()
    argv = [sys.executable, "-m", "specdec", "serve", "--target-model", target, "--draft-model", draft]
    argv += ["-k", "2", "--port", str(port), "--http-port", "0", *flags]
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    serve = Serve(process, f"127.0.0.1:{port}", log)
    try:
        Stack().wait_healthy(Child("specdec serve", serve.address, process), 300, log)
    except BaseException:
        stop_serve(serve)
        raise
    return serve


def stop_serve(serve: Serve) -> int:
    """SIGTERM, as a service manager stops it; -> its exit code."""
    if serve.running():
        serve.process.send_signal(signal.SIGTERM)
    try:
        return serve.process.wait(120)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            serve.process.kill()
        return serve.process.wait()


def replica(serve: Serve, name: str) -> psutil.Process:
    """The live replica process ``name`` (its --replica-id) of the stack."""
    found = [p for p in serve.descendants() if _flag(p, "--replica-id") == [name]]
    assert len(found) == 1, (name, [_cmdline(p) for p in found])
    return found[0]


def redis_server(serve: Serve) -> psutil.Process:
    found = [p for p in serve.descendants() if "redis-server" in " ".join(_cmdline(p)[:1])]
    assert len(found) == 1, [_cmdline(p) for p in found]
    return found[0]


def _cmdline(process: psutil.Process) -> list[str]:
    with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
        return process.cmdline()
    return []


def _flag(process: psutil.Process, flag: str) -> list[str]:
    argv = _cmdline(process)
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]


def listening_port(process: psutil.Process) -> int:
    ports = {c.laddr.port for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    assert len(ports) == 1, ports
    return ports.pop()


def address_of(process: psutil.Process) -> str:
    return f"{_flag(process, '--host')[0]}:{_flag(process, '--port')[0]}"


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def restarted_replica(serve: Serve, name: str, old: psutil.Process, address: str) -> psutil.Process:
    """Wait until a new process of replica ``name`` is SERVING on its old ``address``."""

    def back():
        assert serve.running(), serve.output()[-3000:]
        with contextlib.suppress(AssertionError):
            new = replica(serve, name)
            if new.pid != old.pid and address_of(new) == address and serving(address):
                return new
        return None

    return wait_for(back, 180, f"{name} restarted on {address}")


def concurrent_streams(
    serve: Serve, label: str, streams: int, fault, tokens_wanted: int = LONG
) -> list[tuple[list[int], list[str]]]:
    """``streams`` streams at once; ``fault`` runs once every one of them has its first tokens."""
    started = [threading.Event() for _ in range(streams)]
    results: dict[int, tuple[list[int], list[str]]] = {}
    rid = f"{label}-{time.monotonic_ns()}"

    def one(i: int) -> None:
        results[i] = stream_resuming(
            serve.address, f"{rid}-{i}", tokens_wanted, on_first=started[i].set, keep_trying=serve.running
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    try:
        for event in started:
            assert event.wait(180), "a stream did not start"
        fault()
    finally:
        for thread in threads:
            thread.join(400)
    return [results[i] for i in range(streams)]


def one_restart_line(serve: Serve, name: str) -> str:
    lines = [line for line in serve.output().splitlines() if line.startswith(f"[specdec] {name} exited")]
    assert len(lines) == 1, (name, lines)
    return lines[0]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return save_fault_pair(tmp_path_factory.mktemp("supervision-models"))


@pytest.fixture(scope="module")
def serve(models, tmp_path_factory):
    target, draft = models
    log = tmp_path_factory.mktemp("supervision-logs") / "serve.log"
    running = start_serve(target, draft, log, "--draft-replicas", "2", "--max-restarts", str(MAX_RESTARTS))
    try:
        yield running
    finally:
        stop_serve(running)


@pytest.fixture(scope="module")
def undisturbed(serve):
    return list(stub(serve.address).Generate(long_greedy(LONG), timeout=300).token_ids)


def a_new_request_succeeds(serve: Serve, undisturbed: list[int]) -> None:
    answer = stub(serve.address).Generate(long_greedy(64), timeout=120)
    assert list(answer.token_ids) == undisturbed[:64]


def test_a_killed_draft_is_restarted_and_no_stream_loses_a_token(serve, undisturbed):
    victim = replica(serve, "draft-1")
    address = address_of(victim)

    def kill():
        # the two streams went to the two least-loaded drafts: one of them is on the victim
        assert info(address, "draft").live_sessions == 1
        victim.send_signal(signal.SIGKILL)

    results = concurrent_streams(serve, "draft-killed", 2, kill)
    for tokens, errors in results:
        assert errors == [], errors  # the loop rides a lost draft out: the session moves or goes target-only
        assert tokens == undisturbed, (len(tokens), serve.output()[-3000:])
    assert serve.running(), serve.output()[-3000:]
    back = restarted_replica(serve, "draft-1", victim, address)
    assert "killed by SIGKILL" in one_restart_line(serve, "draft-1")
    # new requests succeed, and it serves again: two at once go to the two drafts, one of them to it
    pair = concurrent_streams(serve, "draft-back", 2, lambda: None, tokens_wanted=64)
    assert [tokens for tokens, _ in pair] == [undisturbed[:64]] * 2, [errors for _, errors in pair]
    assert info(address, "draft").sessions_started >= 1
    assert back.is_running()


def test_a_killed_target_is_restarted_and_the_streams_resume_exactly(serve, undisturbed):
    victim = replica(serve, "target-0")
    address = address_of(victim)
    results = concurrent_streams(serve, "target-killed", 2, lambda: victim.send_signal(signal.SIGKILL))
    print("target killed: statuses before the streams completed", [errors for _, errors in results])
    for tokens, errors in results:
        assert tokens == undisturbed, (len(tokens), errors, serve.output()[-3000:])
    assert serve.running(), serve.output()[-3000:]
    restarted_replica(serve, "target-0", victim, address)
    assert "killed by SIGKILL" in one_restart_line(serve, "target-0")
    a_new_request_succeeds(serve, undisturbed)


def test_a_killed_redis_is_restarted_with_its_data_and_the_streams_resume_exactly(serve, undisturbed):
    victim = redis_server(serve)
    port = listening_port(victim)
    results = concurrent_streams(serve, "redis-killed", 2, lambda: victim.send_signal(signal.SIGKILL))
    print("redis killed: statuses before the streams completed", [errors for _, errors in results])
    for tokens, errors in results:
        assert tokens == undisturbed, (len(tokens), errors, serve.output()[-3000:])
    assert serve.running(), serve.output()[-3000:]
    back = wait_for(lambda: _new_redis(serve, victim), 60, "a new redis-server")
    assert listening_port(back) == port  # the same address: every service's --redis still points at it
    assert "killed by SIGKILL" in one_restart_line(serve, "redis")
    a_new_request_succeeds(serve, undisturbed)


def _new_redis(serve: Serve, old: psutil.Process) -> psutil.Process | None:
    with contextlib.suppress(AssertionError):
        new = redis_server(serve)
        return new if new.pid != old.pid else None
    return None


def test_sigterm_stops_every_process_restarted_ones_included(serve):
    processes = serve.descendants()
    assert len(processes) >= 5  # redis-server, a target, two drafts, the coordinator (and its Ray)
    assert stop_serve(serve) == 0, serve.output()[-3000:]
    _gone, alive = psutil.wait_procs(processes, timeout=60)
    assert alive == [], [(p.pid, _cmdline(p)) for p in alive]


def test_one_that_keeps_exiting_is_given_up_on_and_only_the_last_target_stops_the_stack(models, tmp_path):
    import shutil

    # copies whose weights are then removed: a restart exits at once, as a broken volume would make it
    target, draft = (str(shutil.copytree(path, tmp_path / Path(path).name)) for path in models)
    serve = start_serve(target, draft, tmp_path / "serve.log", "--max-restarts", "1", "--restart-window", "600")
    try:
        processes = serve.descendants()
        Path(draft, "model.safetensors").unlink()
        replica(serve, "draft-0").send_signal(signal.SIGKILL)
        wait_for(lambda: "giving up on draft-0" in serve.output(), 180, "the launcher to give up on draft-0")
        assert serve.running(), serve.output()[-3000:]  # a draft is an optimization: the stack serves on
        undisturbed = list(stub(serve.address).Generate(long_greedy(64), timeout=120).token_ids)
        assert len(undisturbed) == 64

        Path(target, "model.safetensors").unlink()
        replica(serve, "target-0").send_signal(signal.SIGKILL)
        code = serve.process.wait(300)
        output = serve.output()
        assert code == 1, output[-3000:]
        assert "giving up on target-0" in output and "no target left" in output, output[-3000:]
        _gone, alive = psutil.wait_procs(processes, timeout=60)
        assert alive == [], [(p.pid, _cmdline(p)) for p in alive]
    finally:
        stop_serve(serve)
