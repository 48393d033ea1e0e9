"""Tensor-parallel target: N ranks, one logical target service.

``specdec target --model M --tp N`` runs a small supervisor that starts N rank processes
(torch.distributed; NCCL when CUDA is available, one GPU per rank; gloo on CPU). Every rank loads
the model sharded with transformers' tensor parallelism (``tp_plan="auto"``) and holds its shard
of every session's KV cache. Rank 0 serves gRPC; each engine operation it performs (prefill,
verify, commit, release, expiry) is first broadcast to the other ranks, which perform the same
operation on their identical engine, so the forward passes' collectives line up and commits and
rollbacks are applied on every rank in the same order. Operations are serialized by one lock on
rank 0 (collectives must be issued in the same order everywhere).

The ranks are started and watched by ``target_service.supervisor``: if any rank dies (or fails an
operation for another reason than a bad request, see :func:`worker_loop`) the group goes down,
and the coordinator's target failover takes over.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from specdec.errors import InvalidArgumentError, SpecdecError

log = logging.getLogger("specdec.tp")

SHUTDOWN = "__shutdown__"


def check_divisible(config, tp: int) -> None:
    """A clear error when the model cannot be split ``tp`` ways."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    inter = int(getattr(config, "intermediate_size", 0) or 0)
    problems = [
        f"{name}={value}"
        for name, value in (
            ("num_attention_heads", heads),
            ("num_key_value_heads", kv_heads),
            ("intermediate_size", inter),
        )
        if value and value % tp
    ]
    if problems:
        raise InvalidArgumentError(
            "tp", f"this model cannot be split {tp} ways: {', '.join(problems)} must be divisible by {tp}"
        )


def local_param_bytes(model) -> int:
    """Bytes of the parameters this rank actually holds (DTensor shards count locally)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


class DistributedTargetEngine:
    """Rank 0's engine: mirrors every state-changing call on all ranks, in one global order."""

    # Its calls are mirrored one at a time, so they are not batched as works (the inner engine's
    # works would run on rank 0 alone); __getattr__ must not hand the inner engine's flag out.
    supports_works = False

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

    mine = {
        "rank": dist.get_rank(),
        "param_bytes": local_param_bytes(engine.store.model),
        "kv_bytes": engine.store.total_kv_bytes,
    }
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def worker_loop(engine) -> int:
    """Ranks > 0: perform whatever rank 0 broadcasts until it says shutdown; returns the exit code.

    An operation that fails with a request error (a ``SpecdecError``: bad input, an unknown
    session) fails the same way on rank 0, from the same state, and rank 0 reports it to its
    caller, so the group goes on. Any other exception means this rank's shard of the sessions may
    no longer match the others': it is logged with its traceback and the rank exits non-zero, and
    the supervisor takes the whole group down (a target that might compute wrong logits must not
    serve)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    while True:
        box: list = [None]
        dist.broadcast_object_list(box, src=0)
        name, args = box[0]
        if name == SHUTDOWN:
            return 0
        if name == "rank_stats":
            _gather_rank_stats(engine)
            continue
        try:
            getattr(engine, name)(*args)
        except SpecdecError as exc:
            log.debug("rank %d: %s refused (%s), as on rank 0", rank, name, exc)
        except Exception:
            log.exception("rank %d: %s failed; this rank may now differ from rank 0, failing the group", rank, name)
            return 1


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
