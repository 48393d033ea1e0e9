"""Which draft and target replicas a session uses: the registry's live replicas (plus any static
addresses), least-loaded first, tokenizer-compatible drafts only, and replacements on failure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence

from coordinator.affinity import PrefixAffinity, choose_near_prefix, prefix_keys
from coordinator.peers import GrpcDraft, GrpcTarget
from coordinator.replica_choice import choose_target, draft_candidates, least_loaded, target_candidates
from specdec.errors import PeerError
from specdec.runtime.placement import computes_apart
from specdec.runtime.registry import HEARTBEAT_S, Registry, Replica, same_model

log = logging.getLogger("specdec.routing")


class PeerPool:
    def __init__(
        self,
        registry: Registry | None,
        static_targets=(),
        static_drafts=(),
        draft_timeout: float = 5.0,
        target_timeout: float = 60.0,
        prefix_routing: bool = True,
    ):
        self.registry = registry
        self.static_target_addresses = [a for a in static_targets if a]
        self.static_draft_addresses = [a for a in static_drafts if a]
        self.static: dict[str, Replica] = {}
        self.draft_timeout, self.target_timeout = draft_timeout, target_timeout
        self._targets: dict[str, GrpcTarget] = {}
        self._drafts: dict[str, GrpcDraft] = {}
        self._recent: deque[tuple[float, str]] = deque()  # picks not yet visible in heartbeats
        # where this coordinator sent each prompt prefix, per replica kind (None: least-loaded only)
        self.affinity = {"target": PrefixAffinity(), "draft": PrefixAffinity()} if prefix_routing else None
        self.context_length = 0
        # the model every target must serve (pinned by the coordinator at start: see same_model)
        self.expected: Replica | None = None
        self._foreign: set[str] = set()  # targets of another model already logged
        self._labels: dict[str, str] = {}  # address -> registry id: what metrics name a replica by

    # -- peers (one channel per address, shared by all sessions) -------------------------------
    def target_peer(self, address: str) -> GrpcTarget:
        if address not in self._targets:
            self._targets[address] = GrpcTarget(address, timeout=self.target_timeout)
            self._targets[address].context_length = self.context_length
        return self._targets[address]

    def draft_peer(self, address: str, draft_kind: str = "model") -> GrpcDraft:
        if address not in self._drafts:
            self._drafts[address] = GrpcDraft(address, timeout=self.draft_timeout)
        peer = self._drafts[address]
        peer.wants_features = draft_kind == "feature"  # as the registry describes the replica now
        return peer

    async def discover_static(self) -> None:
        """Describe statically configured replicas (no registry) from their Info."""
        for kind, addresses in (("target", self.static_target_addresses), ("draft", self.static_draft_addresses)):
            for address in addresses:
                peer = self.target_peer(address) if kind == "target" else self.draft_peer(address)
                try:
                    info = await peer.info()
                except PeerError as exc:
                    log.warning("%s %s is not answering (%s)", kind, address, exc)
                    if kind == "target":
                        continue
                    info = None
                self.static[address] = Replica(
                    kind,
                    f"static-{address}",
                    address,
                    info.model_id if info else "",
                    info.tokenizer_fingerprint if info else "",
                    info.draft_kind if info else "model",
                    info.vocab_size if info else 0,
                    feature_size=info.feature_size if info else 0,
                    node=info.node if info else "",
                    devices=",".join(info.devices) if info else "",
                )

    async def replicas(self, kind: str) -> list[Replica]:
        found: list[Replica] = []
        if self.registry is not None:
            try:
                found = await self.registry.replicas(kind)
            except Exception as exc:  # noqa: BLE001 - Redis down: fall back to static replicas
                log.warning("registry unavailable (%s)", exc)
            if len(self._labels) > 10_000:  # bounded under churn
                self._labels.clear()
            self._labels.update((r.address, r.replica_id) for r in found)
        found += [r for r in self.static.values() if r.kind == kind]
        if kind == "target" and self.expected is not None:
            foreign = [r for r in found if not same_model(r, self.expected)]
            for r in foreign:
                if r.replica_id not in self._foreign and len(self._foreign) < 10_000:
                    self._foreign.add(r.replica_id)
                    log.warning(
                        "ignoring target %s at %s: it serves %r (tokenizer %s, vocab %d), this coordinator %r",
                        r.replica_id,
                        r.address,
                        r.model_id,
                        r.fingerprint[:12],
                        r.vocab_size,
                        self.expected.model_id,
                    )
            found = [r for r in found if same_model(r, self.expected)]
        return found

    def _pending(self) -> dict[str, int]:
        """Our own picks of the last two heartbeats, which the replicas' loads do not show yet."""
        now = time.monotonic()
        while self._recent and now - self._recent[0][0] > 2 * HEARTBEAT_S:
            self._recent.popleft()
        pending: dict[str, int] = {}
        for _, rid in self._recent:
            pending[rid] = pending.get(rid, 0) + 1
        return pending

    def _picked(self, replica: Replica | None) -> Replica | None:
        if replica is not None:
            self._recent.append((time.monotonic(), replica.replica_id))
        return replica

    def _pick(self, kind: str, candidates: list[Replica], prompt: Sequence[int], salt: str = "") -> Replica | None:
        """The least-loaded candidate, or the one this coordinator last sent the prompt's prefix
        (in the prefix cache's scope ``salt``) to while that one is not much busier
        (coordinator.affinity)."""
        if self.affinity is None or not prompt:
            return self._picked(least_loaded(candidates, self._pending()))
        keys = prefix_keys(prompt, salt=salt)
        memory = self.affinity[kind]
        replica, shared = choose_near_prefix(candidates, memory.holders(keys), len(prompt), self._pending())
        if replica is not None:
            if shared:
                log.debug("%s %s holds %d of %d prompt tokens: sent there", kind, replica.address, shared, len(prompt))
            memory.remember(keys, replica.replica_id)
        return self._picked(replica)

    async def pick_target(self, exclude=(), prompt: Sequence[int] = (), salt: str = "") -> Replica | None:
        return self._pick("target", target_candidates(await self.replicas("target"), exclude), prompt, salt)

    async def pick_draft(
        self, target: Replica, exclude=(), prompt: Sequence[int] = (), salt: str = ""
    ) -> Replica | None:
        return self._pick("draft", draft_candidates(await self.replicas("draft"), target, exclude), prompt, salt)

    async def wait_for_target(self, timeout: float) -> Replica:
        deadline = time.monotonic() + timeout
        while True:
            target = choose_target(await self.replicas("target"))
            if target is not None:
                return target
            if time.monotonic() > deadline:
                raise PeerError("UNAVAILABLE", f"no target replica available after {timeout:.0f}s")
            await asyncio.sleep(0.5)

    def cost_model(self) -> list[tuple[str, str, list[tuple[int, float]]]]:
        """(kind, replica, points) of every replica whose pass cost is known here; a replica is
        named by its registry id ("static" for a configured address), never by its address:
        metrics may be scraped from the public HTTP port."""
        peers: list = list(self._targets.values()) + list(self._drafts.values())
        return [
            (p.kind, self._labels.get(p.address, "static"), p.current_curve.points)
            for p in peers
            if p.current_curve is not None
        ]

    async def close(self) -> None:
        # together: each waits (bounded) for its releases in flight before closing its channel
        await asyncio.gather(*(peer.close() for peer in list(self._targets.values()) + list(self._drafts.values())))


def pipelines(asked: bool | None, draft: Replica | None, target: Replica | None) -> bool:
    """Whether a session drafts its next block while the target verifies (docs/pipelining.md):
    as the request (or the coordinator's --pipeline-drafts on / off) says, else where its draft
    and target compute apart -- where they share hardware, the draft's pre-drafting slows the
    target's verify by about what it saves (docs/pipelining.md, "Measured")."""
    if asked is not None:
        return asked
    return draft is not None and target is not None and computes_apart(draft.placement, target.placement)


def shares_hardware(draft: Replica | None, target: Replica | None) -> bool:
    """Whether a session's draft computes on its target's hardware (unknown placements: assumed
    so); no draft replica (the n-gram draft in the coordinator): False, nothing drafts there."""
    if draft is None or target is None:
        return False
    return not computes_apart(draft.placement, target.placement)


class SessionRouting:
    """The replicas of one session: chosen at start, kept for its life (affinity), replaced
    only when one fails (the loop's Failover)."""

    def __init__(self, pool: PeerPool, prompt: Sequence[int] = (), salt: str = ""):
        self.pool = pool
        self.prompt = prompt  # the request's prompt: replicas that hold its prefix are preferred
        self.salt = salt  # ... in its prefix-cache scope
        self.target: Replica | None = None
        self.draft: Replica | None = None
        self.tried_targets: set[str] = set()
        self.tried_drafts: set[str] = set()

    async def first_target(self) -> GrpcTarget:
        self.target = await self.pool.pick_target(prompt=self.prompt, salt=self.salt)
        if self.target is None:
            raise PeerError("UNAVAILABLE", "no target replica is available")
        self.tried_targets.add(self.target.replica_id)
        return self.pool.target_peer(self.target.address)

    async def first_draft(self) -> GrpcDraft | None:
        if self.target is None:
            raise RuntimeError("a session's draft is chosen for its target: call first_target() first")
        draft = await self.pool.pick_draft(self.target, self.tried_drafts, self.prompt, self.salt)
        self.draft = draft
        if draft is None:
            return None
        self.tried_drafts.add(draft.replica_id)
        return self.pool.draft_peer(draft.address, draft.draft_kind)

    async def replace_draft(self, failed) -> GrpcDraft | None:
        return await self.first_draft()

    async def replace_target(self, failed) -> GrpcTarget | None:
        replacement = await self.pool.pick_target(self.tried_targets, self.prompt, self.salt)
        if replacement is None:
            return None
        self.target = replacement
        self.tried_targets.add(replacement.replica_id)
        return self.pool.target_peer(replacement.address)
