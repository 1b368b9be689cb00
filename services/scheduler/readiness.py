"""Readiness that tells the truth: the scheduler is SERVING only while its dependencies are.

A request needs the kv-cache-manager and the model-runner (and the offload-store when one is
configured) on every step, so while one of them is down every request fails within milliseconds;
reporting SERVING then would keep load balancers sending traffic here. A watcher thread probes
each dependency and flips the scheduler's health both ways. See docs/lifecycle.md.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)


class DependencyWatcher:
    """Probes dependencies every ``interval`` seconds and reports readiness on change.

    Args:
        probes: dependency name -> a call returning whether it answers healthy (bounded in time).
        set_serving: receives the new readiness (called once at start, then on every change).
        interval: seconds between rounds of probes.
    """

    def __init__(self, probes: Mapping[str, Callable[[], bool]], set_serving: Callable[[bool], None],
                 interval: float) -> None:
        self._probes = dict(probes)
        self._set_serving = set_serving
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
        if down:
            log.warning("dependencies down: %s; health NOT_SERVING", ", ".join(down))
        elif not first:
            log.warning("dependencies back; health SERVING")
        self.down = down
        self._set_serving(not down)

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
