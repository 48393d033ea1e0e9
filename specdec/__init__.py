"""specdec: exact, distributed speculative decoding.

The library is in layers; a module imports only from its own layer or lower ones (checked by
import-linter, see pyproject.toml and docs/architecture.md):

    apps        the CLI, launcher, client, bench, selftest
    training    distillation of drafts, corpora, prompt sets (beside apps)
    (services)  draft_service, target_service, coordinator: servicers and entry points
    runtime     wire, gRPC scaffolding, model thread, Redis, peers, the coordinator's request path
    telemetry   tracing, metrics
    loop        the speculative run of one request, its policy, stop handling
    engine      per-session KV caches, draft / target / n-gram engines, tensor parallelism
    modeling    model loading, the lean forward pass and its kernels, heads, the feature draft
    exact       the algorithm: rng, transforms, sparse q, verifier
    errors, paths   foundation modules every layer may use
"""
