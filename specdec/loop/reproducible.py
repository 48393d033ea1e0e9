"""What a seed fixes: whether a request samples invariantly and whether its schedule of k may
follow the load, resolved once when the request arrives (docs/exactness.md, "What a seed fixes").

Pure, and free of heavy imports: the command line offers its choices too."""

from __future__ import annotations

SEEDED_SAMPLING = ("invariant", "replayable")  # how a seed fixes a sampled request's tokens


def resolve_reproducibility(
    *,
    seeded: bool,
    sampled: bool,
    invariant: bool | None,
    replayable: bool | None,
    seeded_sampling: str = "invariant",
    invariant_default: bool = False,
    replayable_default: bool = False,
) -> tuple[bool, bool]:
    """(invariant, replayable) of one request: what it asked (None: unset), else the server's
    choice. A seed the client sent must fix a sampled request's tokens (design rule 3), so such a
    request either samples invariantly -- its tokens are a function of the seed alone, and any
    schedule of k, the load-aware one included, leaves them alone -- or, under ``seeded_sampling
    = "replayable"`` or when it refuses invariance, runs a schedule that depends on its own past
    only. Greedy output is the target's whatever the schedule, and an unseeded request has no
    tokens to reproduce: both keep the server's defaults (load-aware unless
    ``--replayable-schedule``)."""
    if seeded_sampling not in SEEDED_SAMPLING:
        raise ValueError(f"seeded_sampling must be one of {SEEDED_SAMPLING}, got {seeded_sampling!r}")
    fix_tokens = seeded and sampled
    if invariant is None:
        invariant = invariant_default or (fix_tokens and seeded_sampling == "invariant")
    if replayable is None:
        replayable = not invariant and (replayable_default or fix_tokens)
    return invariant, replayable
