"""The draft gRPC service: its servicer and entry point (``specdec draft``)."""
