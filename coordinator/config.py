"""The coordinator's configuration: what ``specdec coordinator``'s flags and the Ray Serve
application's args set (coordinator.settings reads both into it)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.exact.proposal import MAX_BLOCK
from specdec.loop.adaptive_k import StepCost
from specdec.loop.load_aware_k import MAX_CONTENTION
from specdec.loop.reproducible import SEEDED_SAMPLING

METHODS = ("draft_model", "ngram", "none")
# pipelined drafting for requests that do not say: where the draft and target compute apart
# (coordinator.routing.pipelines), always, never
PIPELINING = ("auto", "on", "off")


@dataclass(frozen=True)
class CoordinatorConfig:
    target_address: str | None = None  # static replicas (optional when a registry is used)
    draft_address: str | None = None
    redis_url: str | None = None  # registry + session log
    tokenizer: str | None = None  # model spec to load the tokenizer from (default: the target's)
    default_k: int = 4
    max_k: int = 16
    default_adaptive: bool = True  # draft-model requests that do not say: pause blocks that do not pay
    step_cost: StepCost = StepCost()  # the replayable adaptive policy's cost model (specdec.loop.adaptive_k)
    # Adaptive requests choose k from their own past only (specdec.loop.adaptive_k), not from the
    # load (specdec.loop.load_aware_k): seeded sampled output then reproduces under any load.
    replayable_schedule: bool = False
    default_max_new_tokens: int = 128
    max_new_tokens_limit: int = 4096
    max_concurrent_requests: int = 64
    max_resume_readers: int = 64  # resumed streams reading the log at once (past it: RESOURCE_EXHAUSTED)
    invariant_sampling: bool = False  # requests that do not say sample invariantly (docs/exactness.md)
    # how a request that sends a seed and samples gets its reproducible tokens when it does not say:
    # "invariant" sampling, or rejection sampling on a "replayable" schedule (resolve_reproducibility)
    seeded_sampling: str = "invariant"
    draft_timeout_s: float = 5.0
    target_timeout_s: float = 60.0
    default_method: str = "draft_model"
    output_ttl_s: float = 600.0  # a request's session log lives this long after its last write
    max_output_bytes: int = 4 << 20  # ... and holds at most this many bytes of chunks
    # what one API key's logged requests may hold of the session log: their reservations while
    # they run, their outputs until they expire (coordinator.output_log)
    max_output_bytes_per_key: int = 64 << 20
    startup_timeout_s: float = 120.0
    # a new session goes to the replica this coordinator last sent its prompt's prefix to, while
    # that one is not much busier than the least loaded (coordinator.affinity)
    prefix_routing: bool = True
    # whether requests that do not say draft their next block while the target verifies (loop.pipelining)
    pipeline_drafts: str = "auto"
    # what the load-aware regime assumes of the machine before it has measured it (None: from the
    # replicas' placement; 0: the draft's work leaves the target's alone, 1: they take turns)
    contention: float | None = None
    # whether requests with no prefix-cache scope of their own (no API key, no cache_salt) are told
    # their cached prompt tokens: those show what other such clients sent (docs/http-api.md)
    report_unscoped_cached_tokens: bool = False

    def __post_init__(self):
        if not 0 <= self.max_k <= MAX_BLOCK:
            raise ValueError(f"max_k must be in [0, {MAX_BLOCK}] (the longest block a replica takes), got {self.max_k}")
        if self.contention is not None and not 0.0 <= self.contention <= MAX_CONTENTION:
            raise ValueError(f"contention must be in [0, {MAX_CONTENTION}] or unset, got {self.contention}")
        if self.pipeline_drafts not in PIPELINING:
            raise ValueError(f"pipeline_drafts must be one of {PIPELINING}, got {self.pipeline_drafts!r}")
        if self.seeded_sampling not in SEEDED_SAMPLING:
            raise ValueError(f"seeded_sampling must be one of {SEEDED_SAMPLING}, got {self.seeded_sampling!r}")
        if isinstance(self.step_cost, dict):  # back from dataclasses.asdict (how it travels to a Ray actor)
            object.__setattr__(self, "step_cost", StepCost(**self.step_cost))
