"""Domain errors raised by core logic and mapped to gRPC status codes at the edge.

Core modules stay free of grpc imports; each error names the status it should become, and
``shared.grpc_server``'s interceptor does the mapping. Raising one of these from a core method
promises that the method changed nothing.
"""

from __future__ import annotations


class KVMeshError(Exception):
    """Base class; ``status`` is the name of a ``grpc.StatusCode`` member."""

    status = "INTERNAL"


class InvalidArgument(KVMeshError):
    """The caller sent something malformed or out of range."""

    status = "INVALID_ARGUMENT"


class NotFound(KVMeshError):
    """The named object (request id, block hash, ...) does not exist."""

    status = "NOT_FOUND"


class AlreadyExists(KVMeshError):
    """An id that must be unique is already in use."""

    status = "ALREADY_EXISTS"


class FailedPrecondition(KVMeshError):
    """The system is not in a state that allows the operation (e.g. blocks still in use)."""

    status = "FAILED_PRECONDITION"


class ResourceExhausted(KVMeshError):
    """A bounded resource (queue, pool) is full; retry later."""

    status = "RESOURCE_EXHAUSTED"


class DeadlineExceeded(KVMeshError):
    """The request's deadline passed before it finished; it was aborted and its resources freed."""

    status = "DEADLINE_EXCEEDED"


class Unavailable(KVMeshError):
    """A dependency cannot be reached right now."""

    status = "UNAVAILABLE"


class IntegrityError(KVMeshError):
    """Internal accounting is inconsistent: a bug, never the caller's fault."""

    status = "INTERNAL"


class PortInUseError(OSError):
    """The configured port is taken: a server never shares a port (no ``SO_REUSEPORT``).

    NOTE: here rather than in grpc_server.py so entry points can name it without importing gRPC.
    """
