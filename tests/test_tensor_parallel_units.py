"""worker_loop, the loop of tensor-parallel ranks > 0, with rank 0's broadcasts replayed (the
group itself is exercised in test_tp.py)."""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist

from specdec.engine import tensor_parallel
from specdec.errors import SessionNotFoundError


class Engine:
    """Records what the rank performed; ``verify`` fails as told."""

    def __init__(self, failure: BaseException | None):
        self.failure = failure
        self.done: list[str] = []

    def commit(self, *args):
        self.done.append("commit")

    def verify(self, *args):
        if self.failure is not None:
            raise self.failure
        self.done.append("verify")


@pytest.fixture
def broadcasts(monkeypatch):
    """Makes the rank receive the given operations, in order, as rank 0's broadcasts."""

    def install(operations):
        queue = list(operations)

        def broadcast_object_list(box, src):
            assert src == 0
            box[0] = queue.pop(0)

        monkeypatch.setattr(dist, "broadcast_object_list", broadcast_object_list)
        monkeypatch.setattr(dist, "get_rank", lambda: 1)
        return queue

    return install


def test_a_request_error_is_rank_0s_to_report_and_the_rank_goes_on(broadcasts):
    engine = Engine(SessionNotFoundError("target: unknown session 's'"))
    broadcasts([("verify", ("s",)), ("commit", ("s",)), (tensor_parallel.SHUTDOWN, ())])
    assert tensor_parallel.worker_loop(engine) == 0
    assert engine.done == ["commit"]  # it kept serving after the refused verify


def test_any_other_failure_is_reported_and_fails_the_group(broadcasts, caplog):
    engine = Engine(RuntimeError("out of memory on this rank"))
    left = broadcasts([("verify", ("s",)), ("commit", ("s",)), (tensor_parallel.SHUTDOWN, ())])
    with caplog.at_level(logging.ERROR, logger="specdec.tp"):
        assert tensor_parallel.worker_loop(engine) == 1
    assert engine.done == [] and len(left) == 2  # it stopped at once: nothing after the failure ran
    assert "verify failed" in caplog.text and "out of memory on this rank" in caplog.text  # with the traceback


def test_a_tensor_parallel_target_keeps_one_call_at_a_time():
    """Its calls must be mirrored on every rank, so its replica does not batch them as works
    (which would run on rank 0 alone); a plain target's replica does."""
    import argparse

    from specdec.engine.target import TargetEngine
    from specdec.engine.tensor_parallel import DistributedTargetEngine
    from specdec.modeling.tiny import tiny_llama
    from specdec.runtime.servicer import batch_runner_for

    args = argparse.Namespace(max_batch_tokens=256, max_batch_sessions=64, max_waiting_sessions=64)
    plain = TargetEngine(tiny_llama(32, seed=1, hidden_size=32, num_heads=4, num_kv_heads=2))
    assert batch_runner_for(plain, args) is not None
    assert batch_runner_for(DistributedTargetEngine(plain, 2), args) is None
