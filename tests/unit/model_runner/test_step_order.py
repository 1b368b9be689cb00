"""``StepOrder``: a step sent ahead runs right after the step it follows, or is refused."""

from __future__ import annotations

import threading
import time

import pytest

from services.model_runner.step_order import StepOrder
from shared.errors import FailedPrecondition


def test_a_step_waits_for_the_one_it_follows_then_runs() -> None:
    lock = threading.Lock()
    order = StepOrder(lock)
    ran: list[str] = []

    def ahead() -> None:
        with lock:
            order.wait_turn(7, timeout=10)
            ran.append("8")
            order.done(8, True)

    t = threading.Thread(target=ahead)
    t.start()
    time.sleep(0.1)
    assert ran == []  # waiting: step 7 has not run
    with lock:
        ran.append("7")
        order.done(7, True)
    t.join(10)
    assert ran == ["7", "8"]


def test_a_step_after_a_failed_step_is_refused() -> None:
    lock = threading.Lock()
    order = StepOrder(lock)
    with lock:
        order.done(3, False)
        with pytest.raises(FailedPrecondition, match="step 3, which this step follows, failed"):
            order.wait_turn(3, timeout=1)


def test_a_step_whose_predecessor_never_arrives_is_refused_at_its_deadline() -> None:
    lock = threading.Lock()
    order = StepOrder(lock)
    with lock:
        order.done(4, True)
        start = time.monotonic()
        with pytest.raises(FailedPrecondition, match="step 5, which this step follows, did not run in time"):
            order.wait_turn(5, timeout=0.05)
        assert time.monotonic() - start < 5
