"""One way to open a Redis client: short timeouts, and retries with backoff on connection errors,
so a Redis restart costs in-flight calls a few retries instead of failing every pooled connection
once (a stale pooled connection fails its first command after a restart). A command that times
out is retried once only -- once, because a process woken from a pause (SIGSTOP, a long GC) finds
its in-flight reads timed out although Redis answered -- so a hung Redis (stopped, swapping, a
stuck fsync) fails a call within a few seconds, as UNAVAILABLE, instead of stalling it through
every retry. The password comes from the URL or REDIS_PASSWORD (a Secret), never from a flag,
and the ACL user from the URL or REDIS_USERNAME (none: Redis's default user)."""

from __future__ import annotations

import asyncio
import os

from redis.asyncio.retry import Retry
from redis.exceptions import TimeoutError

MAX_CONNECTIONS = 256  # per client; nothing holds one while it waits (resumed streams poll)
SOCKET_TIMEOUT_S = 2.0  # below the 3 s lease: a refresh that times out still leaves time for the next
CONNECTION_RETRIES = 5
TIMEOUT_RETRIES = 1


class _Retry(Retry):
    """redis-py's retry loop with its own, smaller budget for timeouts (see the module doc)."""

    async def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        self._backoff.reset()
        failures = timeouts = 0
        while True:
            try:
                return await do()
            except self._supported_errors as error:
                if is_retryable and not is_retryable(error):
                    raise
                failures += 1
                timeouts += isinstance(error, TimeoutError)
                # the failure handler drops the connection: a late reply must not answer the next command
                await (fail(error, failures) if with_failure_count else fail(error))
                if failures > self._retries or timeouts > TIMEOUT_RETRIES:
                    raise error
                backoff = self._backoff.compute(failures)
                if backoff > 0:
                    await asyncio.sleep(backoff)


def connect(url: str):
    import redis.asyncio as aioredis
    from redis.backoff import ExponentialBackoff

    return aioredis.Redis.from_url(
        url,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=2,
        health_check_interval=2,
        retry=_Retry(ExponentialBackoff(cap=1.0, base=0.05), CONNECTION_RETRIES),
        max_connections=MAX_CONNECTIONS,
        username=os.environ.get("REDIS_USERNAME") or None,  # a user in the URL wins
        password=os.environ.get("REDIS_PASSWORD") or None,  # a password in the URL wins
    )
