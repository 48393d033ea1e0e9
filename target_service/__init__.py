"""The target gRPC service: its servicer and entry point (``specdec target``, ``--tp N``)."""
