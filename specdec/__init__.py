"""specdec: exact, distributed speculative decoding.

The library is in layers; a module imports only from its own layer or lower ones (checked by
import-linter, see pyproject.toml and docs/architecture.md):

    apps        the CLI, launcher, client, bench, selftest
    training    distillation of drafts, corpora, prompt sets (beside apps)
    (processes) replica (the draft and target replicas: servicers, batching, entry points) and
                coordinator (the public API, routing, the session log): packages beside specdec
    runtime     what both share: wire, gRPC scaffolding, security, the registry, placement, flags
    telemetry   tracing, metrics
    loop        the speculative run of one request, its policy, stop handling
    engine      per-session KV caches, draft / target / n-gram engines, tensor parallelism
    modeling    model loading, the lean forward pass and its kernels, heads, the feature draft
    exact       the algorithm: rng, transforms, sparse q, verifier
    errors, paths   foundation modules every layer may use
"""
