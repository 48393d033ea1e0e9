"""Generated protobuf/gRPC modules (python -m specdec.protogen). Do not edit."""
