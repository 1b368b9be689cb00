"""``StepOrder``: a step sent ahead is queued right behind the step it follows, and runs only if
that one ran and succeeded; otherwise it is refused."""

from __future__ import annotations

import threading
import time

import pytest

from services.model_runner.step_order import StepOrder
from shared.errors import FailedPrecondition


def test_a_step_is_queued_once_the_one_it_follows_is_queued() -> None:
    lock = threading.Lock()
    order = StepOrder(lock)
    queued: list[int] = []

    def ahead() -> None:
        with lock:
            order.wait_queued(7, timeout=10)
            queued.append(8)
            order.queued(8)

    t = threading.Thread(target=ahead)
    t.start()
    time.sleep(0.1)
    assert queued == [] and order.last_queued == 0  # waiting: step 7 is not queued yet
    with lock:
        queued.append(7)
        order.queued(7)  # queued, not run: enough for 8 to be queued behind it
    t.join(10)
    assert queued == [7, 8] and order.last_queued == 8


def test_a_step_runs_only_after_the_one_it_follows_succeeded() -> None:
    order = StepOrder(threading.Lock())
    later = time.monotonic() + 60
    order.ran(3, True)
    order.check_turn(3, later)  # its turn: no error
    order.ran(4, False)
    with pytest.raises(FailedPrecondition, match="step 4, which this step follows, failed"):
        order.check_turn(4, later)
    with pytest.raises(FailedPrecondition, match="step 3, which this step follows, did not run in time"):
        order.check_turn(3, later)  # 3 is not the step that ran last
    order.ran(5, True)
    with pytest.raises(FailedPrecondition, match="step 5, which this step follows, did not run in time"):
        order.check_turn(5, time.monotonic() - 1)  # its caller's deadline passed while it was queued


def test_a_step_whose_predecessor_never_arrives_is_refused_at_its_deadline() -> None:
    lock = threading.Lock()
    order = StepOrder(lock)
    with lock:
        order.queued(4)
        start = time.monotonic()
        with pytest.raises(FailedPrecondition, match="step 5, which this step follows, did not run in time"):
            order.wait_queued(5, timeout=0.05)
        assert time.monotonic() - start < 5
