"""``shared.gc_heap.freeze_startup_heap``: start-up's garbage is collected, not frozen; what is alive
is moved where the collector's passes no longer walk it; what serving allocates later is still
collected."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from shared.gc_heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture
def thawed() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the test session runs with a normal heap


def test_garbage_is_collected_first_and_the_live_heap_frozen(thawed: None) -> None:
    kept = _Node()
    dropped = weakref.ref(_Node())  # unreachable cycle: start-up garbage
    assert dropped() is not None
    assert gc.get_freeze_count() == 0
    frozen = freeze_startup_heap()
    assert dropped() is None  # freed, not frozen
    # the test process's modules and objects; a frozen object can still be freed by its reference
    # count (another thread of the test session may drop one meanwhile), none is added without a
    # freeze: the count only falls from what the call returned (a fresh clone's run saw 2 fewer)
    assert 1_000 < gc.get_freeze_count() <= frozen
    assert not any(o is kept for o in gc.get_objects())  # the passes no longer visit it
    # what is allocated after the freeze is tracked and collected as before
    later = weakref.ref(_Node())
    assert any(o is later() for o in gc.get_objects())
    gc.collect()
    assert later() is None
