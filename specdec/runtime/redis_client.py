"""One way to open a Redis client: short timeouts, and retries with backoff on connection errors,
so a Redis restart costs in-flight calls a few retries instead of failing every pooled connection
once (a stale pooled connection fails its first command after a restart)."""

from __future__ import annotations

MAX_CONNECTIONS = 256  # per client; nothing holds one while it waits (resumed streams poll)


def connect(url: str):
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError, TimeoutError

    return aioredis.Redis.from_url(
        url,
        socket_timeout=5,
        socket_connect_timeout=2,
        health_check_interval=2,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 5),
        retry_on_error=[ConnectionError, TimeoutError],
        max_connections=MAX_CONNECTIONS,
    )
