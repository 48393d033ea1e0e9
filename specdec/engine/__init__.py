"""Engines: per-session KV caches over one model (commits, rollback, caps), the draft engine, the
target engine (verification), the n-gram draft, and the tensor-parallel mirror of a target. Runs
models; knows nothing of gRPC, Redis or Ray."""
