"""The scheduler's side of the offload-store: look up, load and save blocks by hash, never failing a request.

Policy (docs/design.md, "Offload policy"):

* **save on evict** — the kv-cache-manager reports every cached block whose slot a step reuses;
  the scheduler saves those blocks to the store *before* the step runs, so a prefix that falls out
  of the pool is still one copy away;
* **load instead of recompute** — for a new request, the store's longest run of the prompt's block
  hashes is offered to the kv-cache-manager as ``num_external_blocks``; blocks past the pool hit
  are allocated, filled by the store through shared memory, and only the rest is prefilled;
* **swap preemption** (``preemption_mode=swap``) — a preempted request's full blocks are saved
  eagerly before they are freed;
* **publish after prefill** (``publish_prefill``, on for a ``prefill`` replica) — as soon as a
  request's first token is sampled, its full prompt blocks are saved (and so written through to
  the shared remote tier), *before* that token is handed to the client: a decode replica the
  router sends the rest to finds them (docs/mesh.md, "Prefill/decode"); without it blocks reach
  the store only when the pool evicts or swaps them;
* **faults** — store down, a load error, a checksum mismatch: the affected blocks are recomputed
  (the request's answer never changes) and a counter records it;
* **re-attach** — a restarted store has no pool mapped and no owner: its remote adapter
  (``services/offload_store/client.py``) attaches the runner's current pool again and retries the
  call once, so saves resume instead of silently stopping (docs/reliability.md).

Only the policy lives here: the transport is the offload-store's own ``client.py``, behind its
``OffloadBackend`` Protocol, so this module imports no gRPC.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.offload_store.client import OffloadBackend
    from services.scheduler.request import Request

log = logging.getLogger(__name__)


@dataclass
class OffloadCounters:
    """What the connector did, for metrics and the benchmark."""

    lookups: int = 0
    hit_blocks: int = 0
    loaded_blocks: int = 0
    saved_blocks: int = 0
    load_failures: int = 0  # blocks that had to be recomputed after a failed load
    errors: int = 0  # calls that raised (store down, timeouts)
    attach_failures: int = 0  # AttachPool calls that failed (the store then saves nothing)
    published_blocks: int = 0  # prompt blocks offered by publish-after-prefill (saved or already held)


class OffloadConnector:
    """Wraps a backend so that any failure degrades to a miss, and counts everything."""

    def __init__(self, backend: OffloadBackend, publish_prefill: bool = False) -> None:
        """Args:
            publish_prefill: save every request's full prompt blocks right after its prefill.
        """
        self.backend = backend
        self.publish_prefill = publish_prefill
        self.counters = OffloadCounters()

    def publish_prompts(self, requests: Sequence[Request], block_size: int) -> None:
        """With ``publish_prefill``: saves the full prompt blocks of the requests whose first token
        this step sampled (their blocks are computed and not yet freed: frees go with the next step).

        One save call for the whole step; a resumed request (more than one output token) is skipped,
        its blocks were published the first time.
        """
        if not self.publish_prefill:
            return
        blocks: list[tuple[bytes, int]] = []
        for req in requests:
            if len(req.output_token_ids) != 1:
                continue
            table = req.block_tables[0]  # the only one: the offload tier is off for several groups
            n = min(req.num_prompt_tokens // block_size, len(req.block_hashes), len(table))
            blocks += zip(req.block_hashes[:n], table[:n], strict=True)
        if blocks:
            self.counters.published_blocks += len(blocks)
            self.save(blocks)

    def lookup(self, chains: Sequence[Sequence[bytes]]) -> list[int]:
        """Per chain, the leading blocks available; all 0 on any error."""
        if not any(chains):
            return [0] * len(chains)
        self.counters.lookups += 1
        try:
            found = self.backend.lookup(chains)
        except Exception as exc:
            self._error("lookup", exc)
            return [0] * len(chains)
        self.counters.hit_blocks += sum(found)
        return found

    def save(self, blocks: Sequence[tuple[bytes, int]]) -> None:
        """Best effort: a failed save only loses a future hit."""
        if not blocks:
            return
        try:
            self.counters.saved_blocks += self.backend.save(blocks)
        except Exception as exc:
            self._error("save", exc)

    def load(self, blocks: Sequence[tuple[bytes, int]]) -> int:
        """Leading blocks loaded; the rest must be recomputed."""
        if not blocks:
            return 0
        try:
            n = self.backend.load(blocks)
        except Exception as exc:
            self._error("load", exc)
            n = 0
        self.counters.loaded_blocks += n
        self.counters.load_failures += len(blocks) - n
        return n

    def attach(self, handle: Any) -> bool:
        """Attaches the store to the runner's pool; False (logged, counted) when it cannot."""
        try:
            self.backend.attach(handle)
        except Exception as exc:
            self.counters.attach_failures += 1
            log.error("offload-store cannot attach the KV pool, offload is off until it can: %s", exc)
            return False
        return True

    def keepalive(self) -> None:
        """Best effort: a lost store ownership is re-taken on the next call's re-attach."""
        try:
            self.backend.keepalive()
        except Exception as exc:
            self._error("keepalive", exc)

    def _error(self, what: str, exc: Exception) -> None:
        self.counters.errors += 1
        log.warning("offload %s failed, treating as a miss: %s", what, exc)
