"""The startup profile of a replica's batched pass: seconds against size, what the load-aware
policy's cost model starts from (specdec.loop.goodput; docs/goodput.md).

Measured on the loaded model, on the device and thread count it serves with, through the same
batched path the sessions use (scratch sessions, each advancing one row per pass), and kept in
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

from specdec.engine.sessions import PassRequest, SessionStore
from specdec.exact.sampling import SamplingParams
from specdec.paths import cache_dir

log = logging.getLogger("specdec.engine.profile")

SIZES = (1, 2, 4, 8, 16, 32, 64)
CONTEXT = 32  # cached tokens per scratch session: decode passes, not prefill
REPEATS = 3
FORMAT = 1


def profile_sizes(max_size: int) -> list[int]:
    """The grid up to ``max_size`` (which is included when it falls between grid points)."""
    sizes = [s for s in SIZES if s <= max_size]
    if max_size < SIZES[-1] and max_size not in sizes:
        sizes.append(max_size)
    return sizes or [1]


def _key(store: SessionStore, sizes: list[int]) -> str:
    param = next(store.model.parameters())
    identity = {
        "model": store.model.config.to_json_string(use_diff=False),
        "weights": float(param.detach().reshape(-1)[:64].double().sum()),  # tells apart same-config models
        "device": str(param.device),
        "dtype": str(param.dtype),
        "threads": torch.get_num_threads(),
        "batched": store.batches,
        "sizes": sizes,
        "context": CONTEXT,
        "format": FORMAT,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]


def _cache_file(key: str) -> Path:
    return cache_dir() / "profiles" / f"{key}.json"


def measure(store: SessionStore, sizes: list[int], repeats: int = REPEATS) -> list[tuple[int, float]]:
    """Median seconds of one pass with ``n`` sessions advancing a row each, for n in ``sizes``
    (stopping early where the store's caps refuse more scratch sessions)."""
    started = store.sessions_started
    scratch = []
    points: list[tuple[int, float]] = []
    try:
        vocab = store.vocab_size
        for i in range(max(sizes)):
            prompt = [(7 * i + j) % vocab for j in range(CONTEXT + 1)]
            try:
                session = store.create(f"__profile-{i}", prompt, SamplingParams(seed=i))
            except Exception:  # noqa: BLE001 - a capped store: profile the sizes that fit
                break
            store.warm(session)
            scratch.append(session)
        for n in sizes:
            if n > len(scratch):
                break
            times = []
            for _ in range(repeats + 1):  # the first pass of a size warms it
                begin = time.perf_counter()
                store.run_requests([(PassRequest(s), None) for s in scratch[:n]])
                times.append(time.perf_counter() - begin)
            points.append((n, statistics.median(times[1:])))
    finally:
        for session in scratch:
            store.release(session.session_id)
        store.sessions_started = started  # scratch sessions are not served ones
    return points


def pass_costs(store: SessionStore, max_size: int) -> list[tuple[int, float]]:
    """The profile for ``store`` (from the cache where it was measured before)."""
    sizes = profile_sizes(max_size)
    key = _key(store, sizes)
    path = _cache_file(key)
    try:
        cached = json.loads(path.read_text())
        return [(int(s), float(t)) for s, t in cached["points"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    begin = time.perf_counter()
    points = measure(store, sizes)
    log.info(
        "%s: profiled its batched pass in %.1fs: %s",
        store.name,
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
