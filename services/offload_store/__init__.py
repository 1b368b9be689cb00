"""kvmesh offload_store service."""
