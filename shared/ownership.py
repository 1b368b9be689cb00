"""Single-owner leases for internal services whose state belongs to one scheduler incarnation.

The kv-cache-manager's block tables and the offload-store's pool mapping are meaningful only to
the scheduler that created them. Each scheduler process picks a random owner id and sends it as
gRPC metadata (:data:`OWNER_METADATA`) on every call; the service keeps a :class:`Lease`:

* the first owner (or any owner once the lease has lapsed or was released) takes it;
* every call of the owner renews it, so a live scheduler never loses it (an idle one renews it
  with a keep-alive call);
* a call from anyone else is refused with ``FAILED_PRECONDITION``: a scheduler that was replaced
  (fenced out) cannot change what its successor now owns.

See docs/reliability.md for why a lease (and not "free everything on start") was chosen.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable

from shared.errors import FailedPrecondition, InvalidArgument

OWNER_METADATA = "kvmesh-owner"
MAX_OWNER_ID_BYTES = 128


class Acquired(enum.Enum):
    """How :meth:`Lease.acquire` got the lease."""

    NEW = "new"  # nobody held it
    RENEWED = "renewed"  # the caller already held it
    TAKEN_OVER = "taken_over"  # an earlier owner's lease had lapsed or was released


def owner_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The caller's owner id from its invocation metadata ('' when absent)."""
    for key, value in metadata or ():
        if key == OWNER_METADATA:
            owner = value.decode() if isinstance(value, bytes) else value
            if len(owner.encode()) > MAX_OWNER_ID_BYTES:
                raise InvalidArgument(f"{OWNER_METADATA}: at most {MAX_OWNER_ID_BYTES} bytes")
            return owner
    return ""


class Lease:
    """Who owns a service's state, until when. Not thread-safe: callers hold their service lock.

    Args:
        what: the owned thing, for error messages ("the kv-cache-manager").
        taken_by: the call that takes the lease, for error messages ("Initialize").
        clock: monotonic seconds (injected by tests).
    """

    def __init__(self, what: str, taken_by: str = "Initialize", clock: Callable[[], float] = time.monotonic) -> None:
        self._what = what
        self._taken_by = taken_by
        self._clock = clock
        self.owner = ""
        self._seconds = 0.0
        self._expires = 0.0

    def acquire(self, owner: str, seconds: float) -> Acquired:
        """Makes ``owner`` the owner for ``seconds`` (renewed by :meth:`check`).

        Raises:
            InvalidArgument: no owner id, or a non-positive duration.
            FailedPrecondition: another owner's lease is still running.
        """
        if not owner:
            raise InvalidArgument(f"{OWNER_METADATA} metadata is required")
        if not seconds > 0:
            raise InvalidArgument("lease_seconds must be positive")
        now = self._clock()
        if owner == self.owner:
            kind = Acquired.RENEWED
        elif self.owner and now < self._expires:
            raise FailedPrecondition(
                f"{self._what} is owned by another scheduler; its lease ends in "
                f"{self._expires - now:.1f}s unless renewed")
        else:
            kind = Acquired.TAKEN_OVER if self.owner else Acquired.NEW
        self.owner, self._seconds, self._expires = owner, seconds, now + seconds
        return kind

    def is_owner(self, owner: str) -> bool:
        """Whether ``owner`` (a non-empty id) is the one holding the lease; renews nothing."""
        return bool(owner) and owner == self.owner

    def check(self, owner: str) -> None:
        """Renews the lease if ``owner`` holds it.

        NOTE: an owner whose lease lapsed but that nobody replaced keeps it: a lapse only lets a
        *new* owner in, it does not fence an owner that was merely slow.

        Raises:
            FailedPrecondition: ``owner`` is not the owner.
        """
        if not owner or owner != self.owner:
            raise FailedPrecondition(f"not the owner of {self._what}: only the scheduler whose {self._taken_by} "
                                     f"took it may call (its id travels as {OWNER_METADATA} metadata)")
        self._expires = self._clock() + self._seconds

    def release(self, owner: str) -> None:
        """Ends the lease now (clean exit), so a successor need not wait for it to lapse."""
        self.check(owner)
        self.owner = ""
        self._expires = 0.0
