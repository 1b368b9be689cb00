"""How the scheduler ends its streams on SIGTERM (the server has already gone NOT_SERVING and
refuses new calls): in-flight requests get the grace period to finish, the rest end with a final
``ABORT`` chunk, and the engine's stop then frees all of them in the kv-cache-manager.
See docs/lifecycle.md."""

from __future__ import annotations

import logging
import time

from services.scheduler.engine import Engine

log = logging.getLogger(__name__)

SHUTDOWN_STOP_REASON = "server shutting down"
# After the final chunks are queued, how long their streams get to deliver them.
_FINAL_CHUNK_SECONDS = 2.0


def _wait_until_idle(engine: Engine, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while engine.num_live() and time.monotonic() < deadline:
        time.sleep(0.02)
    return engine.num_live() == 0


def drain_engine(engine: Engine, grace: float) -> int:
    """Lets live requests run for ``grace`` seconds, then ends the rest; returns how many it ended."""
    if _wait_until_idle(engine, grace):
        return 0
    ended = engine.abort_all(SHUTDOWN_STOP_REASON)
    log.warning("grace period over: ended %d requests with a final chunk", ended)
    _wait_until_idle(engine, _FINAL_CHUNK_SECONDS)
    return ended
