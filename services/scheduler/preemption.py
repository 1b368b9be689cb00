"""Who gives way when a running request cannot get its slots: the newest request first.

The policy alone (vLLM v1's): requests admitted in this very step go first (nothing of them is
computed yet), then running requests from the newest; the refused request may end up preempting
itself. What giving way *does* (free or roll back, requeue, swap out) is the scheduler's
``_preempt``; whether the retried allocation fits is the kv-cache-manager's answer.
"""

from __future__ import annotations

from collections.abc import Callable

from services.kv_cache_manager.types import AllocationResult, AllocationStatus
from services.scheduler.request import Request

Preempt = Callable[..., None]  # (victim, *, was_admitting=False, rollback=False)


def preempt_until_fits(
    req: Request,
    running: list[Request],
    scheduled: list[tuple[Request, AllocationResult]],
    admitted: list[tuple[Request, AllocationResult]],
    preempted: list[str],
    granted: set[str],
    preempt: Preempt,
    retry: Callable[[], AllocationResult],
) -> AllocationResult | None:
    """Preempts the newest requests until ``req`` gets its slots, or preempts ``req`` itself.

    Args:
        running: the running queue (admission order); ``preempt`` removes each victim from it.
        scheduled: running requests granted slots so far this step; a victim is taken out.
        admitted: requests admitted this step, newest last; victims are popped from it.
        preempted: ids preempted this step, appended to.
        granted: running requests whose allocation in this step's call succeeded; one of them
            preempted now is rolled back, since the slots it was granted will never be computed.
        retry: ``req``'s allocation sent again (one kv-cache-manager call).

    Returns:
        ``req``'s allocation once it fits, or None when ``req`` itself was preempted.
    """
    while True:
        if admitted:
            victim, _ = admitted.pop()  # admitted this step: newest of all, nothing computed yet
            preempt(victim, was_admitting=True)
        else:
            victim = running[-1]
            preempt(victim, rollback=victim.request_id in granted)
            scheduled[:] = [(r, a) for r, a in scheduled if r is not victim]
            if victim is req:
                preempted.append(req.request_id)
                return None
        preempted.append(victim.request_id)
        result = retry()
        if result.status is AllocationStatus.OK:
            return result
