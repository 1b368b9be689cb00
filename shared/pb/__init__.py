"""Generated protobuf and gRPC code (see ``shared.protogen``)."""
