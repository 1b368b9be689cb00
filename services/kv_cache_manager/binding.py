"""The kv-cache-manager as a service: unbound until a scheduler binds it, then owned by it.

A bare process does not know the pool geometry (the model-runner's), so it serves nothing until
``Initialize`` brings it: a restarted manager never invents a pool that disagrees with the runner.
(It needs no hash seed: the scheduler hashes and sends the hashes.) The binding also records

* the **owner** (a scheduler incarnation, :class:`shared.ownership.Lease`): only it may change or
  read per-request state, and a successor takes over only once the lease lapsed or was released;
* the runner **pool incarnation** the blocks live in: the cache is kept across a re-bind only
  while it is the same, since a restarted runner's pool holds none of the cached KV.

Not thread-safe and free of grpc: the servicer calls it under its one lock.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from services.kv_cache_manager.config import CacheConfig
from services.kv_cache_manager.events import EventHub
from services.kv_cache_manager.manager import KVCacheManager
from services.kv_cache_manager.types import KVCacheStats
from shared.errors import FailedPrecondition
from shared.ownership import Acquired, Lease

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BindResult:
    """What ``Initialize`` did."""

    stats: KVCacheStats
    kept_cache: bool
    num_freed_requests: int
    acquired: Acquired


class ManagerBinding:
    """Owns the (optional) :class:`KVCacheManager` and who may use it.

    Args:
        hub: the event hub every manager incarnation publishes to.
        clock: monotonic seconds, for the lease (injected by tests).
    """

    def __init__(self, hub: EventHub | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.instance_id = uuid.uuid4().hex  # a new process never claims an old one's state
        self._hub = hub
        self._manager: KVCacheManager | None = None
        self.pool_id = ""
        self.lease = Lease("the kv-cache-manager", "Initialize", clock)

    @property
    def initialized(self) -> bool:
        """Whether a scheduler has bound the manager."""
        return self._manager is not None

    def initialize(self, owner: str, config: CacheConfig, pool_id: str, lease_seconds: float) -> BindResult:
        """Binds (or re-binds) the manager to ``owner``, ``config`` and the runner ``pool_id``.

        Raises:
            InvalidArgument: no owner id or a bad lease duration (nothing changed).
            FailedPrecondition: another owner's lease is still running (nothing changed).
        """
        acquired = self.lease.acquire(owner, lease_seconds)
        if self._manager is None:
            self._manager = KVCacheManager(config, self._hub)
            stats, kept, freed = self._manager.stats(), False, 0
        else:
            stats, kept, freed = self._manager.initialize(config, keep_cache=pool_id == self.pool_id)
        if acquired is Acquired.TAKEN_OVER:
            log.warning("kv-cache-manager taken over by a new scheduler; %d live requests of the previous "
                        "one freed, cache %s", freed, "kept" if kept else "dropped")
        self.pool_id = pool_id
        return BindResult(stats, kept, freed, acquired)

    def manager(self) -> KVCacheManager:
        """The bound manager, for calls anyone may make (stats, integrity).

        Raises:
            FailedPrecondition: not initialized yet.
        """
        if self._manager is None:
            raise FailedPrecondition("not initialized: the scheduler sends Initialize with the runner's "
                                     "geometry first")
        return self._manager

    def owned(self, owner: str) -> KVCacheManager:
        """The bound manager for a call only the owner may make; renews the owner's lease.

        Raises:
            FailedPrecondition: not initialized, or ``owner`` is not the owner.
        """
        manager = self.manager()
        self.lease.check(owner)
        return manager

    def release(self, owner: str) -> int:
        """The owner's clean exit: frees its live requests (cache kept) and ends the lease."""
        manager = self.owned(owner)
        _, _, freed = manager.initialize(manager.config, keep_cache=True)
        self.lease.release(owner)
        return freed
