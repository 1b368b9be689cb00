"""The scheduler's binding of the suite: which runner incarnation, kv-cache-manager and offload-store
its steps are planned against, and the ownership leases that keep them its own.

Binding (docs/reliability.md): the engine *binds* the suite before serving and again whenever it
finds the other side is not the one it bound — a new runner incarnation (its pool id, checked on
every step and by the keep-alive), a kv-cache-manager that restarted (``FAILED_PRECONDITION not
initialized``) — : every live request goes back to waiting, the kv-cache-manager is re-initialized
with the runner's geometry and the runner's pool id (dropping every cached hash of a dead pool; the
hash seed stays the scheduler's, which sends hashes with every allocation), and the offload-store
is attached to the current pool. Requests then
recompute, so answers are those of a cold run.

Keep-alive: every successful step already renews the kv-cache-manager's lease (``AllocateSlots``
is an owner call) and proves the runner's incarnation (``Execute`` checks the pool id), so the
keep-alive calls a peer only when nothing renewed its lease for a third of the lease: an idle
engine, or an offload-store no step saved to or loaded from. After a peer failed, the same check
(:meth:`SuiteBinding.check_peers`) runs before the next step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from services.kv_cache_manager.client import KVCacheBackend
from services.kv_cache_manager.config import CacheConfig
from services.model_runner.client import RunnerBackend, RunnerInfo, RunnerRestarted
from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from shared.errors import FailedPrecondition, Unavailable
from shared.hashing import hash_seed

log = logging.getLogger(__name__)
# Re-binds allowed in a row without a successful step before the live requests are failed instead
# (a peer that refuses every binding must not spin the loop).
MAX_REBINDS_IN_A_ROW = 2


def prefix_hash_seed(config: SchedulerConfig, info: RunnerInfo) -> bytes:
    """The prefix-hash root: the scheduler is its one owner (deployment key + model id)."""
    return hash_seed(config.deployment_key.encode(), info.model_id)


class SuiteBinding:
    """Binds, re-binds and keeps alive; called from the engine's loop thread only.

    Args:
        fail_all: ends every live request with the given error (the engine's).
        clock: monotonic seconds for the keep-alive schedule (injected by tests).
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheBackend, runner: RunnerBackend,
                 scheduler: Scheduler, fail_all: Callable[[Exception], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.kv = kv
        self.runner = runner
        self.scheduler = scheduler
        self.info: RunnerInfo = scheduler.info
        self._fail_all = fail_all
        self._clock = clock
        self.bound = False
        self.suspect = False  # a peer call failed: check the peers before the next step
        self._rebinds_in_a_row = 0
        self._period = config.owner_lease_seconds / 3
        self._kv_renewed = 0.0  # when the kv-cache-manager's lease (and the runner) were last confirmed
        self._offload_renewed = 0.0
        self._offload_mark = (0, 0, 0)

    def bind(self) -> None:
        """Binds runner incarnation, kv-cache-manager and offload-store (see the module docstring).

        Raises:
            FailedPrecondition: another scheduler owns the kv-cache-manager.
            Exception: a peer is unreachable (the engine stays unbound and tries again).
        """
        self.bound = False
        info = self.runner.info()
        seed = prefix_hash_seed(self.config, info)
        cache = CacheConfig(num_blocks=info.num_blocks, block_size=info.block_size,
                            max_model_len=info.max_model_len, model_id=info.model_id,
                            group_windows=info.kv_group_windows, group_sink_tokens=info.kv_group_sink_tokens)
        self.runner.bind(info.pool_id)
        kept = self.kv.initialize(cache, info.pool_id)
        sched = self.scheduler
        sched.bind_runner(info)
        if sched.offload is not None:  # None too for a model the offload tier cannot serve
            sched.offload.attach(self.runner.pool_handle())
        self.info = info
        sched.hash_seed = seed
        self.bound = True
        self._kv_renewed = self._offload_renewed = self._clock()
        log.info("bound to runner pool %s (%d blocks of %d tokens), kv-cache-manager cache %s",
                 info.pool_id or "(in-process)", info.num_blocks, info.block_size, "kept" if kept else "fresh")

    def bind_at_start(self) -> None:
        """The first bind; waits out a predecessor's lease (it died without releasing it)."""
        deadline = time.monotonic() + self.config.owner_lease_seconds + 5.0
        while True:
            try:
                self.bind()
                return
            except FailedPrecondition as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("waiting for the previous scheduler's lease to lapse: %s", exc)
                time.sleep(0.25)

    def rebind(self, cause: Exception) -> None:
        """A peer is not the one bound: requeue everything and bind again (or fail the requests)."""
        self._rebinds_in_a_row += 1
        if self._rebinds_in_a_row > MAX_REBINDS_IN_A_ROW:
            self._rebinds_in_a_row = 0
            self.bound = False
            self._fail_all(cause)
            return
        log.warning("re-binding the suite: %s", cause)
        requeued = self.scheduler.requeue_all()
        try:
            self.bind()
        except Exception as exc:
            self._fail_all(exc)
            return
        log.warning("re-bound; %d running requests requeued to recompute", requeued)

    def step_succeeded(self, allocated: bool = True) -> None:
        """A step ran: the runner is the one bound, and the kv-cache-manager's lease is renewed
        when the step allocated (a step sent ahead asks it nothing); so is the offload-store's
        lease if the step saved or loaded blocks without an error."""
        self._rebinds_in_a_row = 0
        now = self._clock()
        if allocated:
            self._kv_renewed = now
        offload = self.scheduler.offload
        if offload is not None:
            c = offload.counters
            mark = (c.saved_blocks, c.loaded_blocks, c.errors)
            if mark[:2] != self._offload_mark[:2] and mark[2] == self._offload_mark[2]:
                self._offload_renewed = now
            self._offload_mark = mark

    def _kv_due(self, now: float) -> bool:
        return now - self._kv_renewed >= self._period

    def _offload_due(self, now: float) -> bool:
        # NOTE: offload is None while the bound model cannot use the tier: no lease to renew.
        return self.scheduler.offload is not None and now - self._offload_renewed >= self._period

    def renewal_due(self) -> bool:
        """Whether a lease needs renewing (so the next step should be a synchronous one: the
        keep-alive does not run while a step is in flight)."""
        now = self._clock()
        return self._kv_due(now) or self._offload_due(now)

    def keepalive(self) -> None:
        """Renews whichever lease nothing renewed for a third of the lease (also while idle)."""
        now = self._clock()
        if self._kv_due(now) and not self.check_peers(after_failure=False):
            return
        offload = self.scheduler.offload
        if offload is not None and self._offload_due(now):
            self._offload_renewed = now
            offload.keepalive()

    def check_peers(self, after_failure: bool) -> bool:
        """Asks the runner for its incarnation and renews the kv-cache-manager's lease; re-binds when
        either is not the one bound.

        Args:
            after_failure: a peer call failed and requests wait: an unreachable peer fails them
                (else, for the keep-alive, it is only logged: the next step finds out).

        Returns:
            Whether the engine is bound and may step; when not, the live requests were failed.
        """
        self._kv_renewed = self._clock()  # also when it fails: retried a period later, not every loop
        try:
            pool_id = self.runner.info().pool_id
            if pool_id == self.info.pool_id:
                self.kv.keepalive()
        except FailedPrecondition as exc:
            self.rebind(exc)
            return self.bound
        except Exception as exc:
            if after_failure:
                self._fail_all(Unavailable(f"a backend is unreachable: {exc}"))
                return False
            log.debug("keep-alive failed: %s", exc)
            return True
        self.suspect = False
        if pool_id != self.info.pool_id:
            self.rebind(RunnerRestarted(f"model-runner pool is now {pool_id}, was {self.info.pool_id}"))
            return self.bound
        return True
