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
