"""The speculative loop of one request: propose, verify, decide, stop, commit -- against peers
given as small async interfaces (engines in process, gRPC clients in the coordinator) -- with the
adaptive speculation policy, stop handling and incremental detokenization, and step statistics."""
