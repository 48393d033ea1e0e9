"""The startup profile of a replica's batched pass: seconds against size, what the load-aware
policy's cost model starts from (specdec.loop.load_aware_k; docs/goodput.md).

Measured on the loaded model, on the device and thread count it serves with, through the same
batched path the sessions use (scratch sessions, each taking a step per iteration: its row of the
pass and the sampling math on its logits), and kept in
the cache folder per model + device + dtype + threads + kernel so a restart does not measure
again. The coordinator refreshes the curve online from the pass times replicas report, so the
profile only has to be about right.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from specdec.engine.commits import Commit
from specdec.engine.sessions import SessionStore
from specdec.exact.sampling import SamplingParams
from specdec.paths import cache_dir

log = logging.getLogger("specdec.engine.profile")

SIZES = (1, 2, 4, 8, 16, 32, 64)
CONTEXT = 32  # cached tokens per scratch session: decode passes, not prefill
REPEATS = 3
PROFILE_TEMPERATURE = 0.7  # sampled steps: their sampling math is part of a row's cost
FORMAT = 1


def profile_sizes(max_size: int) -> list[int]:
    """The grid up to ``max_size`` (which is included when it falls between grid points)."""
    sizes = [s for s in SIZES if s <= max_size]
    if max_size < SIZES[-1] and max_size not in sizes:
        sizes.append(max_size)
    return sizes or [1]


def _key(engine, sizes: list[int]) -> str:
    store: SessionStore = engine.store
    param = next(store.model.parameters())
    identity = {
        "kind": type(engine).__name__,
        "model": store.model.config.to_json_string(use_diff=False),
        "weights": float(param.detach().reshape(-1)[:64].double().sum()),  # tells apart same-config models
        "device": str(param.device),
        "dtype": str(param.dtype),
        "threads": torch.get_num_threads(),
        "batched": store.batches,
        "backend": store.pass_backend,
        "sizes": sizes,
        "context": CONTEXT,
        "format": FORMAT,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]


def _cache_file(key: str) -> Path:
    return cache_dir() / "profiles" / f"{key}.json"


def measure(engine, sizes: list[int], repeats: int = REPEATS) -> list[tuple[int, float]]:
    """Median seconds of one batched iteration with ``n`` scratch sessions each taking a step
    (``engine.step_work``: a row and its sampling math), for n in ``sizes``, through the batch runner the service
    uses; stops early where the engine's caps refuse more scratch sessions."""
    from specdec.engine.batching import BatchRunner

    store: SessionStore = engine.store
    params = SamplingParams(temperature=PROFILE_TEMPERATURE, seed=0)
    ids: list[str] = []
    points: list[tuple[int, float]] = []
    runner = BatchRunner(store, max_batch_tokens=max(sizes) * (CONTEXT + 1), max_batch_sessions=max(sizes))
    # scratch sessions neither read nor fill the prefix cache (they would fill it with prompts
    # nobody sends and count as its lookups)
    with store.scratch_sessions():
        try:
            vocab = store.vocab_size
            for i in range(max(sizes)):
                prompt = [(7 * i + j) % vocab for j in range(CONTEXT + 1)]
                try:
                    engine.prefill(f"__profile-{i}", prompt, params.with_seed(i))
                except Exception:  # noqa: BLE001 - a capped engine: profile the sizes that fit
                    break
                ids.append(f"__profile-{i}")
            steps = dict.fromkeys(ids, 0)
            pending: dict[str, Commit | None] = dict.fromkeys(ids)
            for n in sizes:
                if n > len(ids):
                    break
                times = []
                for _ in range(repeats + 1):  # the first iteration of a size warms it
                    jobs = []
                    for sid in ids[:n]:
                        steps[sid] += 1
                        jobs.append(runner.add(engine.step_work(sid, steps[sid], pending[sid]), sid))
                    begin = time.perf_counter()
                    while not all(job.finished for job in jobs):
                        runner.iterate()
                    times.append(time.perf_counter() - begin)
                    for sid, job in zip(ids[:n], jobs, strict=True):
                        if job.error is not None:
                            raise job.error
                        length = len(store.get(sid).tokens)
                        pending[sid] = Commit(steps[sid], length, (int(job.result),))
                points.append((n, statistics.median(times[1:])))
        finally:
            for sid in ids:
                store.release(sid)
    return points


def pass_costs(engine, max_size: int) -> list[tuple[int, float]]:
    """The profile of ``engine`` (a draft or target engine whose calls are works), from the
    cache where it was measured before."""
    sizes = profile_sizes(max_size)
    key = _key(engine, sizes)
    path = _cache_file(key)
    try:
        cached = json.loads(path.read_text())
        return [(int(s), float(t)) for s, t in cached["points"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    begin = time.perf_counter()
    points = measure(engine, sizes)
    log.info(
        "%s: profiled its batched pass in %.1fs: %s",
        engine.store.name,
        time.perf_counter() - begin,
        ", ".join(f"{n}: {t * 1e3:.1f} ms" for n, t in points),
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"points": points}))
        tmp.replace(path)
    except OSError as exc:  # a read-only cache: measured again next start
        log.warning("could not keep the pass profile in %s: %s", path, exc)
    return points
