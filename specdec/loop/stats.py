"""The running statistics of one request's speculative steps, as the public API reports them."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.exact.verify import StepDecision


@dataclass
class StepStats:
    """Running speculation statistics of one request (names as in the public API)."""

    target_passes: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    draft_fallbacks: int = 0
    draft_failovers: int = 0
    target_failovers: int = 0
    drafts: int = 0
    policy: str = "fixed"  # fixed / adaptive / load_aware: how each step's k was chosen
    steps_by_k: list[int] = field(default_factory=list)  # [k] = steps whose policy chose k
    cached_prompt_tokens: int = 0  # prompt positions the target copied from its prefix cache
    # tokens a constraint forced, committed by the loop without a pass (not the draft's proposals)
    forced_tokens: int = 0
    # pipelined drafting (specdec.loop.pipelining): drafts made while a block was verified, those
    # a step used, and their seconds (off the critical path; draft_seconds counts what is on it)
    predrafts: int = 0
    predraft_hits: int = 0
    predraft_seconds: float = 0.0
    predraft_rejection_hits: int = 0  # of predraft_hits: a rejection branch's

    def record_choice(self, k: int) -> None:
        if len(self.steps_by_k) <= k:
            self.steps_by_k.extend([0] * (k + 1 - len(self.steps_by_k)))
        self.steps_by_k[k] += 1

    def record(self, decision: StepDecision, num_proposed: int) -> None:
        self.target_passes += 1
        self.drafts += 1 if num_proposed else 0
        self.proposed_tokens += num_proposed
        self.accepted_tokens += decision.num_accepted
        if len(self.accepted_per_position) < num_proposed:
            self.accepted_per_position.extend([0] * (num_proposed - len(self.accepted_per_position)))
        for i in range(decision.num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0
