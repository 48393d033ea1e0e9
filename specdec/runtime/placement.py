"""Where a replica computes: the node it runs on and the devices its passes use.

Replicas report it (EngineInfo, the registry) so the coordinator can tell whether a draft's work
would slow the target's: pipelined drafting (docs/pipelining.md) pays only where the draft
computes on hardware of its own.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass

# The node a replica runs on, where a hostname does not name it: on Kubernetes every pod has a
# hostname of its own, and two pods on one node share its CPUs and memory (deploy/ sets this
# from the pod's spec.nodeName).
NODE_ENV = "SPECDEC_NODE_NAME"
CPU = "cpu"
MAX_DEVICES = 64  # a replica's devices as the registry keeps them (a TP group: one per rank)


def this_node(flag: str | None = None) -> str:
    """The node name a replica reports: its ``--node-name``, else SPECDEC_NODE_NAME, else the hostname."""
    return (flag or os.environ.get(NODE_ENV) or socket.gethostname()).strip()


@dataclass(frozen=True)
class Placement:
    node: str = ""  # "" = unknown (a replica older than this report)
    devices: tuple[str, ...] = ()  # device_identity of each device its passes use

    @classmethod
    def of(cls, node: str, devices: Iterable[str]) -> Placement:
        return cls(node, tuple(dict.fromkeys(d for d in devices if d))[:MAX_DEVICES])

    @property
    def known(self) -> bool:
        return bool(self.node and self.devices)


def computes_apart(a: Placement, b: Placement) -> bool:
    """Whether work on one replica leaves the other's passes alone: different nodes, or GPUs of
    their own on one node. CPU work on one node shares its caches and memory bandwidth with
    everything else there (a draft pinned to other cores still slowed the target's verify:
    docs/pipelining.md), so it never counts as apart; nor does an unknown placement."""
    if not (a.known and b.known):
        return False
    if a.node != b.node:
        return True
    if CPU in a.devices or CPU in b.devices:
        return False
    return not set(a.devices) & set(b.devices)
