"""What a failed call tells its client (issue 24, item 14): a specdec error its status and
message; Redis refusing or gone, UNAVAILABLE; anything else INTERNAL with an error id and no
traceback, path, pid or address -- through the Ray hop as without it, on gRPC and HTTP alike."""

from __future__ import annotations

import grpc
import pytest
import redis.exceptions as rx
from ray.exceptions import RayTaskError

from specdec.errors import InvalidArgumentError, ResourceExhaustedError
from specdec.runtime.grpc_server import failure_status

SECRET = 'File "/home/ray/specdec/runtime/output_log.py", line 99, pid=4242, ip=10.1.2.3'


def test_a_specdec_error_keeps_its_status_and_message():
    assert failure_status(InvalidArgumentError("top_p", "must be in (0, 1]"), "Generate") == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "top_p: must be in (0, 1]",
    )
    assert failure_status(ResourceExhaustedError("full"), "Generate")[0] == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_an_unexpected_error_is_internal_with_an_error_id_and_nothing_else(caplog):
    code, details = failure_status(RuntimeError(SECRET), "Generate")
    assert code == grpc.StatusCode.INTERNAL
    assert "error id" in details and "4242" not in details and "10.1.2.3" not in details and ".py" not in details
    error_id = details.split("error id ")[1].split(";")[0]
    assert any(error_id in r.getMessage() and r.exc_info for r in caplog.records)  # the log has it all


@pytest.mark.parametrize(
    "exc",
    [
        rx.ResponseError("OOM command not allowed when used memory > 'maxmemory'."),
        rx.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),  # as redis-py raises it
        rx.ReadOnlyError("You can't write against a read only replica."),
        rx.ResponseError("MISCONF Redis is configured to save RDB snapshots"),
        rx.ConnectionError("Error 111 connecting to 10.1.2.3:6379. Connection refused."),
        rx.TimeoutError("Timeout reading from socket"),
    ],
)
def test_redis_refusing_or_gone_is_unavailable(exc):
    code, details = failure_status(exc, "Generate")
    assert code == grpc.StatusCode.UNAVAILABLE and "Redis" in details and "10.1.2.3" not in details


def test_a_redis_bug_is_not_mistaken_for_unavailability():
    assert failure_status(rx.ResponseError("WRONGTYPE Operation against a key"), "Generate")[0] == (
        grpc.StatusCode.INTERNAL
    )


def test_through_the_ray_hop_the_cause_is_classified_and_its_traceback_dropped():
    from coordinator.ray_backend import _unwrap

    oom = rx.ResponseError("OOM command not allowed when used memory > 'maxmemory'.")
    wrapped = RayTaskError("CoordinatorActor.generate", f"Traceback (most recent call last):\n  {SECRET}", oom)
    assert failure_status(_unwrap(wrapped), "Generate")[0] == grpc.StatusCode.UNAVAILABLE
    bug = RayTaskError("CoordinatorActor.generate", f"Traceback:\n  {SECRET}", KeyError("x"))
    code, details = failure_status(_unwrap(bug), "Generate")
    assert code == grpc.StatusCode.INTERNAL and "Traceback" not in details and "4242" not in details


def test_the_http_api_maps_the_same_way():
    from coordinator.http_api import error_of

    error = error_of(RuntimeError(SECRET))
    assert error.status == 500 and "error id" in error.message and "4242" not in error.message
    assert error_of(rx.ResponseError("OOM command not allowed")).status == 503
    assert error_of(InvalidArgumentError("sampling.top_p", "bad")).param == "top_p"


def test_redis_down_is_unavailable_naming_the_session_log_without_its_address(caplog):
    """Issue 62, item 12: with Redis down, the client was told redis-py's own message, "Error 111
    connecting to 127.0.0.1:PORT. Connection refused." -- an internal address and an errno. Now
    UNAVAILABLE saying the session log is unavailable; the log has the rest. A real request path
    and a real Redis client, dialing a port nobody listens on, for a logged (gRPC) request and an
    unlogged (HTTP) one (which needs Redis only for the registry: no target, then)."""
    import asyncio

    from coordinator.config import CoordinatorConfig
    from coordinator.core import CoordinatorCore
    from coordinator.http_api import error_of
    from specdec.apps.launcher import free_port
    from specdec.v1 import coordinator_pb2

    port = free_port()

    async def failure(durable: bool) -> BaseException:
        core = CoordinatorCore(CoordinatorConfig(redis_url=f"redis://127.0.0.1:{port}/0"))
        core.requests.vocab_size, core.requests.context_length = 32, 64  # what setup learns from a target
        try:
            async for _ in core.generate(coordinator_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3]), None, durable):
                pass
        except Exception as exc:  # noqa: BLE001 - the failure is the subject
            return exc
        finally:
            await core.close()
        raise AssertionError("a request with Redis down succeeded")

    for durable in (True, False):
        exc = asyncio.run(failure(durable))
        code, details = failure_status(exc, "GenerateStream")
        assert code == grpc.StatusCode.UNAVAILABLE, (durable, details)
        assert ("session log" in details) if durable else ("no target replica" in details), details
        for leak in ("127.0.0.1", str(port), "111", "refused"):
            assert leak not in details, (durable, details)
        http = error_of(exc)
        assert http.status == 503 and http.message == details
    assert any(str(port) in r.getMessage() for r in caplog.records)  # the log names it
