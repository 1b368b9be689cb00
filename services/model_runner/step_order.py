"""The order of steps the scheduler sends ahead (async scheduling, docs/design.md "Async scheduling").

With async scheduling the scheduler sends step N + 1 before step N has returned: N + 1 names N as
``after_step_id`` and the runner's sampled tokens of N are its inputs. Two ``Execute`` calls in
flight may reach the servicer's threads in either order, so N + 1 waits here for N to be *queued*
on the compute thread, and is queued right behind it: the compute thread goes from N to N + 1
without waking a handler thread in between (docs/model_runner.md, "Steps queued behind the one
they follow"). Once its turn comes, N + 1 runs only if N ran to completion; when N failed (or
never arrived before N + 1's deadline) it is refused, and the runner's state is still the one N
left, unchanged.

Two halves, two owners: what was queued last belongs to the handler threads (under the servicer's
lock); what ran last, and how, belongs to the compute thread, the only thread that runs steps, so
it needs no lock.
"""

from __future__ import annotations

import threading
import time

from shared.errors import FailedPrecondition

# Longest wait for the step a look-ahead step follows when its call carries no deadline.
MAX_WAIT_SECONDS = 300.0


class StepOrder:
    """The last step queued (callers hold ``lock``, the servicer's) and the last step run."""

    def __init__(self, lock: threading.Lock) -> None:
        self._queued = threading.Condition(lock)
        self._last_queued = 0
        self._last_run = 0
        self._last_ok = False

    def wait_queued(self, after_step_id: int, timeout: float | None) -> float:
        """Returns once step ``after_step_id`` is the last one queued; the caller holds the lock.

        Returns:
            The ``time.monotonic()`` by which the step must start (its call's deadline), for
            :meth:`check_turn`.

        Raises:
            FailedPrecondition: that step was not queued within ``timeout`` seconds.
        """
        wait = MAX_WAIT_SECONDS if timeout is None else max(0.0, min(timeout, MAX_WAIT_SECONDS))
        deadline = time.monotonic() + wait
        if not self._queued.wait_for(lambda: self._last_queued == after_step_id, wait):
            raise FailedPrecondition(f"step {after_step_id}, which this step follows, did not run in time")
        return deadline

    @property
    def last_queued(self) -> int:
        """The step id queued last (0: none yet)."""
        return self._last_queued

    def queued(self, step_id: int) -> None:
        """Step ``step_id`` is on the compute thread's queue; the caller holds the lock."""
        self._last_queued = step_id
        self._queued.notify_all()

    def check_turn(self, after_step_id: int, deadline: float) -> None:
        """On the compute thread, before a step sent ahead runs: the step it follows ran, and
        succeeded, and the step's own deadline has not passed (its caller has given up on it).

        Raises:
            FailedPrecondition: otherwise; the step must not run.
        """
        if self._last_run != after_step_id or time.monotonic() > deadline:
            raise FailedPrecondition(f"step {after_step_id}, which this step follows, did not run in time")
        if not self._last_ok:
            raise FailedPrecondition(f"step {after_step_id}, which this step follows, failed")

    def ran(self, step_id: int, ok: bool) -> None:
        """On the compute thread: step ``step_id`` ran (``ok``) or was refused."""
        self._last_run = step_id
        self._last_ok = ok
