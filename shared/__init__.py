"""Code every kvmesh service imports: config, block hashing, errors, the gRPC server helper."""
