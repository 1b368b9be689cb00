"""The order of steps the scheduler sends ahead (async scheduling, docs/design.md "Async scheduling").

With async scheduling the scheduler sends step N + 1 before step N has returned: N + 1 names N as
``after_step_id`` and the runner's sampled tokens of N are its inputs. Two ``Execute`` calls in
flight may reach the servicer's threads in either order, so N + 1 waits here for its turn: it runs
only right after N ran to completion; when N failed (or never arrived before N + 1's deadline) it
is refused, and the runner's state is still the one N left, unchanged.
"""

from __future__ import annotations

import threading

from shared.errors import FailedPrecondition

# Longest wait for the step a look-ahead step follows when its call carries no deadline.
MAX_WAIT_SECONDS = 300.0


class StepOrder:
    """The last step run and whether it succeeded; callers hold ``lock`` (the runner's)."""

    def __init__(self, lock: threading.Lock) -> None:
        self._turn = threading.Condition(lock)
        self._last_step_id = 0
        self._last_ok = False

    def wait_turn(self, after_step_id: int, timeout: float | None) -> None:
        """Returns once step ``after_step_id`` is the last one run, and it succeeded.

        Raises:
            FailedPrecondition: that step failed, or did not run within ``timeout`` seconds.
        """
        wait = MAX_WAIT_SECONDS if timeout is None else max(0.0, min(timeout, MAX_WAIT_SECONDS))
        if not self._turn.wait_for(lambda: self._last_step_id == after_step_id, wait):
            raise FailedPrecondition(f"step {after_step_id}, which this step follows, did not run in time")
        if not self._last_ok:
            raise FailedPrecondition(f"step {after_step_id}, which this step follows, failed")

    def done(self, step_id: int, ok: bool) -> None:
        """Step ``step_id`` ran (``ok``) or was refused; wakes the step that follows it."""
        self._last_step_id = step_id
        self._last_ok = ok
        self._turn.notify_all()
