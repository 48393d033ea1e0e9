"""One thread for every model call a service process makes.

Why not ``asyncio.to_thread``: PyTorch runs its CPU kernels on an OpenMP team that belongs to the
calling thread, so spreading forward passes over a thread pool gives the process one team per pool
thread, and on a small CPU those teams fight for the same cores: a pass got about twice as slow
(docs/performance.md). Running every engine call on one dedicated thread keeps a single team, and
also serialises the passes, which is what a CPU (or one GPU stream) does anyway.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from specdec.telemetry import metrics

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None


def model_executor() -> ThreadPoolExecutor:
    """The process's model thread (created on first use)."""
    global _executor  # noqa: PLW0603 - one model thread per process, made on first use
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-model")
        return _executor


def call_on_model_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on the model thread, waiting for it: for loading models, which must
    happen on the thread that runs them. A model loaded on the main thread and run on this one was
    as slow as passes spread over two threads, since loading already starts the main thread's
    OpenMP team."""
    return model_executor().submit(contextvars.copy_context().run, fn, *args, **kwargs).result()


async def on_model_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``await fn(*args, **kwargs)`` on the model thread, with the caller's context (trace span)."""
    context = contextvars.copy_context()
    call = functools.partial(context.run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(model_executor(), functools.partial(_timed, call))


def _timed(call: Callable[[], Any]) -> Any:
    """``call()``, its time added to the model thread's busy seconds (the autoscaling signal)."""
    started = time.perf_counter()
    try:
        return call()
    finally:
        metrics.MODEL_BUSY.inc(time.perf_counter() - started)
