"""Takeover on the default topology (one target, one draft), for real: coordinators in their own
processes on one Redis. A coordinator that dies is resumed on the first retry; one that is
paused past its lease (a blocked loop, a GC pause, a slow fsync) is fenced when it wakes: the
session log holds every token once, whoever wrote it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from stack_util import request, stub

from specdec.apps.launcher import Child, free_port, local_stack
from specdec.modeling.tiny import perturbed, tiny_llama, word_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LONG = 3000  # tokens: seconds of steps, so a pause lands mid-generation
GREEDY = {"k": 2, "adaptive": False, "temperature": 0.0, "max_new_tokens": LONG, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("takeover-models")
    target = tiny_llama(32, seed=21, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_positions=4096)
    target.save_pretrained(root / "target")
    perturbed(target, scale=0.04, seed=2).save_pretrained(root / "draft")
    for name in ("target", "draft"):
        word_tokenizer(32).save_pretrained(root / name)
    with local_stack(
        str(root / "target"),
        str(root / "draft"),
        num_speculative_tokens=2,
        log_dir=tmp_path_factory.mktemp("takeover-logs"),
        extra_coordinator=["--max-new-tokens-limit", str(LONG)],
        # sessions outlive the pause below: the woken coordinator could go on generating
        extra_target=["--threads", "1", "--session-ttl", "60"],
        extra_draft=["--threads", "1", "--session-ttl", "60"],
    ) as s:
        yield s


@contextlib.contextmanager
def coordinator(stack, log_dir, name: str, extra=()):
    """Another coordinator process (its own Ray) on the stack's Redis."""
    port = free_port()
    args = [sys.executable, "-m", "specdec", "coordinator", "--redis", stack.redis_url, "--host", "127.0.0.1"]
    args += ["--port", str(port), "--num-speculative-tokens", "2", "--max-new-tokens-limit", str(LONG), *extra]
    with open(log_dir / f"{name}.log", "wb") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    child = Child(name, f"127.0.0.1:{port}", process)
    try:
        stack.wait_healthy(child, 180)
        yield child
    finally:
        if process.poll() is None:
            signal_all(process.pid, signal.SIGCONT)
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)


def signal_all(pid: int, sig: int) -> None:
    """``sig`` to a coordinator and every process under it: its Ray instance's raylet and
    workers, among them the actor running the request path (not in its process group)."""
    import psutil

    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(sig)


def read(address, req, on_first=None):
    """(tokens, error code or None) of a stream; ``on_first`` runs after the first chunk."""
    tokens: list[int] = []
    try:
        for chunk in stub(address).GenerateStream(req, timeout=300):
            tokens.extend(chunk.token_ids)
            if on_first is not None and len(tokens) == len(chunk.token_ids):
                on_first()
    except grpc.RpcError as exc:
        return tokens, exc.code().name
    return tokens, None


def test_a_dead_coordinators_request_resumes_on_the_first_retry(stack, tmp_path):
    undisturbed = list(stub(stack.coordinator_address).Generate(request([9, 9, 8], **GREEDY), timeout=300).token_ids)
    rid = f"dead-{time.monotonic_ns()}"
    with coordinator(stack, tmp_path, "doomed") as doomed:
        kill = lambda: os.killpg(doomed.process.pid, signal.SIGKILL)  # noqa: E731 - front and its Ray
        first, error = read(doomed.address, request([9, 9, 8], **GREEDY, request_id=rid), on_first=kill)
        assert error is not None and 0 < len(first) < LONG
    # one retry, at once: the dead run's sessions (same request id) still live on the one target
    # and draft until their TTL, and must not collide with the taker's
    rest, error = read(
        stack.coordinator_address, request([9, 9, 8], **GREEDY, request_id=rid, resume_from_index=len(first))
    )
    assert error is None, error
    assert first + rest == undisturbed


def test_a_paused_coordinator_is_fenced_when_it_wakes_and_the_log_holds_each_token_once(stack, tmp_path):
    undisturbed = list(stub(stack.coordinator_address).Generate(request([2, 7, 1], **GREEDY), timeout=300).token_ids)
    rid = f"paused-{time.monotonic_ns()}"
    with coordinator(stack, tmp_path, "sleepy") as sleepy:
        paused = threading.Event()

        def pause():  # the front and its Ray (the actor generating the request) alike
            signal_all(sleepy.process.pid, signal.SIGSTOP)  # past the 3 s lease: another takes over
            paused.set()

        outcome: dict = {}
        client1 = threading.Thread(
            target=lambda: outcome.update(
                one=read(sleepy.address, request([2, 7, 1], **GREEDY, request_id=rid), on_first=pause)
            )
        )
        client1.start()
        assert paused.wait(120)
        time.sleep(4.0)  # the lease lapses
        # client 2 attaches to the same request through the stack's coordinator, which takes over
        taken, error = read(
            stack.coordinator_address, request([2, 7, 1], **GREEDY, request_id=rid, resume_from_index=0)
        )
        assert error is None, error
        signal_all(sleepy.process.pid, signal.SIGCONT)  # the paused one wakes up mid-generation
        client1.join(120)
        first, first_error = outcome["one"]
    assert taken == undisturbed  # the taker's client got every token, once
    assert first_error == "ABORTED", (first_error, len(first), len(taken))  # the woken one stopped: fenced
    assert first == undisturbed[: len(first)]
    replay, error = read(stack.coordinator_address, request([2, 7, 1], **GREEDY, request_id=rid, resume_from_index=0))
    assert error is None and replay == undisturbed  # the log: LONG tokens, none twice


def test_redis_refusing_writes_is_resource_exhausted_without_a_traceback_and_then_recovers(stack):
    """A real Redis out of memory (maxmemory below its use, noeviction) under the real coordinator
    and its Ray actor: the client gets RESOURCE_EXHAUSTED naming the session log, before anything
    is written (issue 42, item 1; it was INTERNAL with the actor's traceback before issue 24), not
    a traceback; once Redis has room, the same request works."""
    import redis

    admin = redis.Redis.from_url(stack.redis_url)
    before = admin.config_get("maxmemory")["maxmemory"]
    req = request([3, 1, 4], **{**GREEDY, "max_new_tokens": 8}, request_id=f"oom-{time.monotonic_ns()}")
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)
    try:
        with pytest.raises(grpc.RpcError) as info:
            stub(stack.coordinator_address).Generate(req, timeout=60)
    finally:
        admin.config_set("maxmemory", before)
    details = info.value.details()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (info.value.code(), details)
    assert "session log (Redis)" in details and "maxmemory" in details
    assert "Traceback" not in details and ".py" not in details and "pid" not in details
    from coordinator.output_log import ROOM_CHECK_S

    time.sleep(2 * ROOM_CHECK_S)  # "retry in a while": the coordinator looks at Redis's memory again
    assert len(stub(stack.coordinator_address).Generate(req, timeout=120).token_ids) == 8


def test_a_hung_redis_fails_requests_fast_and_shows_in_the_health_check(stack):
    """Redis stopped (SIGSTOP: a hung host, swapping, a stuck fsync) rather than gone: requests
    that need it fail with UNAVAILABLE in seconds, not after a minute of retries, and the
    coordinator's health check turns NOT_SERVING; when Redis wakes, both recover (issue 24, item 16)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(stack.coordinator_address))

    def status():
        try:
            return health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        except grpc.RpcError:
            return None

    def wait_for(wanted, seconds=20.0):
        deadline = time.monotonic() + seconds
        while status() != wanted and time.monotonic() < deadline:
            time.sleep(0.2)
        return status()

    SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert wait_for(SERVING) == SERVING
    redis_pid = stack.embedded_redis.process.pid
    req = request([5, 3], **{**GREEDY, "max_new_tokens": 8}, request_id=f"hung-{time.monotonic_ns()}")
    os.kill(redis_pid, signal.SIGSTOP)
    try:
        with pytest.raises(grpc.RpcError) as info:
            stub(stack.coordinator_address).Generate(req, timeout=30)  # a stall would be DEADLINE_EXCEEDED
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
        assert "Redis" in info.value.details()
        assert wait_for(NOT_SERVING) == NOT_SERVING
    finally:
        os.kill(redis_pid, signal.SIGCONT)
    assert wait_for(SERVING) == SERVING
    assert len(stub(stack.coordinator_address).Generate(req, timeout=120).token_ids) == 8


def test_redis_holds_nothing_for_refused_or_http_requests_and_stays_under_its_maxmemory(stack, tmp_path):
    """Issue 42, item 1. (a) A flood of gRPC requests over the coordinator's limit: the refused
    ones write no key, only the admitted ones do; an HTTP request (no OpenAI client can resume)
    writes none. (b) Redis near its maxmemory: new requests that would not fit are refused at
    admission naming the session log (issue 62, item 7: before, they were admitted until the log
    was full, and then refused every request) while Redis never passes its bound and the
    replicas' heartbeats go on; once finished outputs expire (--output-ttl) they are admitted
    again."""
    import asyncio

    import httpx
    import redis

    client = redis.Redis.from_url(stack.redis_url)

    def logged() -> int:  # requests with a session log (a lease may outlive its answer by a moment)
        return sum(1 for _ in client.scan_iter("specdec:req:*:meta", count=1000))

    http_port = free_port()
    extra = ["--max-concurrent-requests", "4", "--output-ttl", "10", "--http-port", str(http_port)]
    with coordinator(stack, tmp_path, "bounded", extra) as bounded:
        before = logged()

        async def flood(requests):
            async with grpc.aio.insecure_channel(bounded.address) as channel:
                from specdec.v1 import coordinator_pb2_grpc

                s = coordinator_pb2_grpc.CoordinatorStub(channel)

                async def one(r):
                    try:
                        await s.Generate(r, timeout=120)
                        return "OK", ""
                    except grpc.aio.AioRpcError as exc:
                        return exc.code().name, exc.details()

                return await asyncio.gather(*(one(r) for r in requests))

        small = {"k": 2, "temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}
        outcomes = asyncio.run(flood([request([1, 2, 3 + i % 20], **small) for i in range(24)]))
        ok = sum(code == "OK" for code, _ in outcomes)
        refused = [d for code, d in outcomes if code == "RESOURCE_EXHAUSTED"]
        assert ok >= 4 and len(refused) >= 10 and ok + len(refused) == 24, outcomes
        assert all("requests in flight" in d for d in refused)
        assert logged() - before == ok  # a session log per admitted request, none for a refused one

        answer = httpx.post(
            f"http://127.0.0.1:{http_port}/v1/completions",
            json={"prompt": "w1 w2 w3", "max_tokens": 8, "temperature": 0, "n": 3},
            timeout=120,
        )
        assert answer.status_code == 200 and logged() - before == ok

        # (b): a bound a little above what Redis holds now, filled by requests with logprobs. Each
        # reserves what it may write (docs/protocol.md, "Reservations"): one that does not fit
        # beside those running is refused before it writes anything, naming the session log;
        # those admitted run to their end, their outputs filling Redis until a wave is refused whole
        used = int(client.info("memory")["used_memory"])
        original = client.config_get("maxmemory")["maxmemory"]
        client.config_set("maxmemory", used + (5 << 18))
        try:
            heavy = {**small, "max_new_tokens": 600, "logprobs": 20}  # about 0.3 MB reserved each
            admitted, refusals = 0, []
            for wave in range(8):
                outcomes = asyncio.run(flood([request([4, 5, wave, i], **heavy) for i in range(4)]))
                info = client.info("memory")
                # Redis checks its bound before each write, so one write in flight may pass it a
                # little (its buffers count too); what it must never do is grow on
                assert int(info["used_memory"]) <= 1.1 * int(info["maxmemory"]), info["used_memory"]
                assert {code for code, _ in outcomes} <= {"OK", "RESOURCE_EXHAUSTED"}, outcomes
                admitted += sum(code == "OK" for code, _ in outcomes)
                refusals += [d for code, d in outcomes if code != "OK"]
                if all(code != "OK" for code, _ in outcomes):
                    break
            assert admitted and refusals, (admitted, refusals)
            # every refusal at admission: no running request met a full Redis
            assert all("too full for request" in d and "sent so far" not in d for d in refusals), refusals
            assert {"target", "draft"} <= {k.decode().split(":")[2] for k in client.scan_iter("specdec:replica:*")}
            reply = stub(bounded.address).Generate(request([6, 7, 8], **small), timeout=120)
            assert len(reply.token_ids) == 40  # a request that fits still gets in
            time.sleep(12)  # the finished outputs expire (--output-ttl 10)
            reply = stub(bounded.address).Generate(request([1, 2, 3], **heavy), timeout=300)
            assert len(reply.token_ids) == 600  # room again for the largest
        finally:
            client.config_set("maxmemory", original)


def test_one_api_key_cannot_lock_the_others_out_of_the_session_log(stack, tmp_path, monkeypatch):
    """Issue 62, item 7, through real processes: a key that floods requests with logprobs gets
    those past its bound on the session log (--max-output-bytes-per-key, here from the
    environment as deploy/'s ConfigMap sets it) refused at admission, naming the bound; those it
    got in run to their end; another key's request still gets in."""
    import asyncio

    from specdec.v1 import coordinator_pb2_grpc

    alpha, bravo = "sk-alpha-0123456789abcdef", "sk-bravo-0123456789abcdef"
    keys = tmp_path / "api-keys"
    keys.write_text(f"{alpha} alpha\n{bravo} bravo\n")
    monkeypatch.setenv("SPECDEC_MAX_OUTPUT_BYTES_PER_KEY", str(2 << 20))  # the coordinator inherits it
    with coordinator(stack, tmp_path, "keyed", ["--api-key-file", str(keys)]) as keyed:

        async def calls(key, requests):
            async with grpc.aio.insecure_channel(keyed.address) as channel:
                s = coordinator_pb2_grpc.CoordinatorStub(channel)

                async def one(r):
                    try:
                        reply = await s.Generate(r, timeout=300, metadata=(("authorization", f"Bearer {key}"),))
                        return "OK", len(reply.token_ids), ""
                    except grpc.aio.AioRpcError as exc:
                        return exc.code().name, 0, exc.details()

                return await asyncio.gather(*(one(r) for r in requests))

        # 1000 tokens with 20 logprobs: about 0.53 MB reserved each, so 3 fit in alpha's 2 MiB
        heavy = {"k": 2, "temperature": 0.0, "max_new_tokens": 1000, "ignore_eos": True, "logprobs": 20}
        outcomes = asyncio.run(calls(alpha, [request([4, 5, 6, i], **heavy) for i in range(8)]))
        admitted = [o for o in outcomes if o[0] == "OK"]
        refused = [o for o in outcomes if o[0] != "OK"]
        assert admitted and all(tokens == 1000 for _, tokens, _ in admitted), outcomes
        assert refused and all(
            code == "RESOURCE_EXHAUSTED" and "--max-output-bytes-per-key" in details for code, _, details in refused
        ), outcomes
        small = {"k": 2, "temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
        assert asyncio.run(calls(bravo, [request([1, 2, 3], **small)])) == [("OK", 16, "")]
