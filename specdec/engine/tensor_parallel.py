"""Tensor-parallel target: N ranks, one logical target service.

``specdec target --model M --tp N`` runs a small supervisor that starts N rank processes
(torch.distributed; NCCL when CUDA is available, one GPU per rank; gloo on CPU). Every rank loads
the model sharded with transformers' tensor parallelism (``tp_plan="auto"``) and holds its shard
of every session's KV cache. Rank 0 serves gRPC; each engine operation it performs (prefill,
verify, commit, release, expiry) is first broadcast to the other ranks, which perform the same
operation on their identical engine, so the forward passes' collectives line up and commits and
rollbacks are applied on every rank in the same order. Operations are serialized by one lock on
rank 0 (collectives must be issued in the same order everywhere).

If any rank dies the supervisor tells rank 0 (SIGUSR1: health NOT_SERVING, deregister, stop at
once), kills the group and exits non-zero: a broken group never hangs a caller.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

log = logging.getLogger("specdec.tp")

SHUTDOWN = "__shutdown__"


def check_divisible(config, tp: int) -> None:
    """A clear error when the model cannot be split ``tp`` ways."""
    from specdec.errors import InvalidArgumentError

    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    inter = int(getattr(config, "intermediate_size", 0) or 0)
    problems = [f"{name}={value}" for name, value in
                (("num_attention_heads", heads), ("num_key_value_heads", kv_heads), ("intermediate_size", inter))
                if value and value % tp]
    if problems:
        raise InvalidArgumentError("tp", f"this model cannot be split {tp} ways: {', '.join(problems)} "
                                         f"must be divisible by {tp}")


def local_param_bytes(model) -> int:
    """Bytes of the parameters this rank actually holds (DTensor shards count locally)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


class DistributedTargetEngine:
    """Rank 0's engine: mirrors every state-changing call on all ranks, in one global order."""

    MIRRORED = ("prefill", "verify", "commit", "release", "expire_idle", "target_probs")

    def __init__(self, engine, tp: int):
        self.engine = engine
        self.tp = tp
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _mirror(self, name: str, *args):
        import torch.distributed as dist

        with self._lock:
            dist.broadcast_object_list([(name, args)], src=0)
            return getattr(self.engine, name)(*args)

    def prefill(self, *args):
        return self._mirror("prefill", *args)

    def verify(self, *args):
        return self._mirror("verify", *args)

    def commit(self, *args):
        return self._mirror("commit", *args)

    def release(self, *args):
        return self._mirror("release", *args)

    def expire_idle(self, ttl):
        # Expiry is decided once, on rank 0, and applied everywhere as releases.
        now_stale = self.engine.store.stale_sessions(ttl)
        return [sid for sid in now_stale if self.release(sid)]

    def target_probs(self, *args):
        return self._mirror("target_probs", *args)

    def rank_stats(self) -> list[dict]:
        import torch.distributed as dist

        with self._lock:
            dist.broadcast_object_list([("rank_stats", ())], src=0)
            return _gather_rank_stats(self.engine)

    def shutdown(self) -> None:
        import torch.distributed as dist

        with self._lock:
            dist.broadcast_object_list([(SHUTDOWN, ())], src=0)


def _gather_rank_stats(engine) -> list[dict]:
    import torch.distributed as dist

    mine = {"rank": dist.get_rank(), "param_bytes": local_param_bytes(engine.store.model),
            "kv_bytes": engine.store.total_kv_bytes}
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def worker_loop(engine) -> None:
    """Ranks > 0: perform whatever rank 0 broadcasts, forever (until shutdown)."""
    import torch.distributed as dist

    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        name, args = box[0]
        if name == SHUTDOWN:
            return
        if name == "rank_stats":
            _gather_rank_stats(engine)
            continue
        try:
            getattr(engine, name)(*args)
        except Exception:  # noqa: BLE001 - rank 0 gets the same (deterministic) error and reports it
            pass


def init_rank(device_arg: str | None):
    """Join the process group from the environment; return (rank, world, device)."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available() and (device_arg is None or device_arg.startswith("cuda"))
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    else:
        device = "cpu"
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    return rank, world, device


def supervise(argv: list[str], tp: int) -> int:
    """Start ``tp`` ranks of ``specdec target ... --tp N`` and watch them."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(tp):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(tp), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "SPECDEC_TP_RANK_PROCESS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-m", "specdec", *argv], env=env))
    print(f"[specdec] target: {tp} tensor-parallel ranks, pids {[p.pid for p in procs]}", file=sys.stderr, flush=True)

    stopping = {"flag": False}

    def forward(sig, _frame):
        stopping["flag"] = True
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGTERM)  # rank 0 drains, then tells the others to stop

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        while True:
            dead = [(i, p) for i, p in enumerate(procs) if p.poll() is not None]
            if dead and (not stopping["flag"] or dead[0][0] != 0):
                if stopping["flag"] and all(p.poll() is not None for p in procs):
                    return max(p.returncode or 0 for p in procs)
                if not stopping["flag"]:
                    rank, proc = dead[0]
                    print(f"[specdec] target: rank {rank} exited ({proc.returncode}); taking the group down",
                          file=sys.stderr, flush=True)
                    if procs[0].poll() is None:
                        procs[0].send_signal(signal.SIGUSR1)  # NOT_SERVING + deregister, at once
                    deadline = time.monotonic() + 3.0
                    while procs[0].poll() is None and time.monotonic() < deadline:
                        time.sleep(0.1)
                    for p in procs:
                        if p.poll() is None:
                            p.kill()
                    for p in procs:
                        p.wait()
                    return 1
            if stopping["flag"] and procs[0].poll() is not None:
                deadline = time.monotonic() + 10.0
                while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                    time.sleep(0.1)
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                return procs[0].returncode or 0
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
