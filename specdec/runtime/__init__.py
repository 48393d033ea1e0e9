"""How the loop runs distributed: protobuf wire conversions, gRPC server scaffolding and the
exception-to-status mapping, the model thread, the session servicer base, the Redis registry and
session log, gRPC peers and routing, and the coordinator's request path (``coordination``)."""
