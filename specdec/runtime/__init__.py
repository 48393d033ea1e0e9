"""What the services share: protobuf wire conversions, gRPC server scaffolding and the
exception-to-status mapping, the model thread, the session servicer base and its batcher, the
Redis client and the replica registry, security, and the flags. The coordinator's own machinery
(its request path, routing, peers, the session log) is in the ``coordinator`` package."""
