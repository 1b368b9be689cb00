"""Readiness that tells the truth: the scheduler is SERVING only while its dependencies are.

A request needs the kv-cache-manager and the model-runner on every step, so while one of them is
down every request fails within milliseconds; reporting SERVING then would keep load balancers
sending traffic here. A watcher thread probes
each dependency and flips the scheduler's health both ways. See docs/lifecycle.md.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Mapping

log = logging.getLogger(__name__)


DEPENDENCY_HEALTH_PREFIX = "kvmesh.dependency."


class DependencyWatcher:
    """Probes dependencies every ``interval`` seconds and reports readiness on change.

    NOTE: only ``required`` dependencies decide readiness. Without the offload-store the scheduler
    still answers correctly (it recomputes what it cannot load), so an offload-store outage must
    not take it out of service; it shows under its own health name instead
    (``kvmesh.dependency.<name>``, set for every dependency).

    Args:
        probes: dependency name -> a call returning whether it answers healthy (bounded in time).
        required: the names whose outage makes the scheduler NOT_SERVING.
        set_serving: receives the new readiness (called once at start, then on every change).
        set_status: receives ``(health name, serving)`` for each dependency's own health name.
        interval: seconds between rounds of probes.
    """

    def __init__(self, probes: Mapping[str, Callable[[], bool]], required: Collection[str],
                 set_serving: Callable[[bool], None], set_status: Callable[[str, bool], None],
                 interval: float) -> None:
        self._probes = dict(probes)
        self._required = frozenset(required)
        self._set_serving = set_serving
        self._set_status = set_status
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.down: tuple[str, ...] = ()

    def check_once(self) -> tuple[str, ...]:
        """Probes every dependency once; returns the names of those down."""
        down = []
        for name, probe in self._probes.items():
            try:
                ok = probe()
            except Exception:  # a probe that raises counts as down, never kills the watcher
                ok = False
            if not ok:
                down.append(name)
        return tuple(down)

    def _report(self, down: tuple[str, ...], first: bool = False) -> None:
        if down == self.down and not first:
            return
        for name in self._probes:
            self._set_status(DEPENDENCY_HEALTH_PREFIX + name, name not in down)
        required_down = [n for n in down if n in self._required]
        if required_down:
            log.warning("dependencies down: %s; health NOT_SERVING", ", ".join(down))
        elif down:
            log.warning("dependencies down: %s; still SERVING without them", ", ".join(down))
        elif not first:
            log.warning("dependencies back; health SERVING")
        self.down = down
        self._set_serving(not required_down)

    def start(self) -> DependencyWatcher:
        """Starts the watcher thread."""
        self._thread = threading.Thread(target=self._loop, name="kvmesh-readiness", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        first = True
        while not self._stop.is_set():
            self._report(self.check_once(), first)
            first = False
            self._stop.wait(self._interval)

    def stop(self) -> None:
        """Stops the thread (readiness stays as last reported)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
