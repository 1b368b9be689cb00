"""The scheduler's request bookkeeping: the waiting and running queues and what peers must be told.

Every live request is in exactly one queue. Leaving a queue for good (finish) or for a while
(preemption, a re-bind) records what the peers must learn at the next step: the kv-cache-manager
frees the request (with a rollback when its latest allocation never ran) and the model-runner
forgets it. The planner (``scheduler.py``) decides *who* moves; this module only moves them.
"""

from __future__ import annotations

import bisect

from services.scheduler.request import FinishReason, Request, RequestStatus
from shared.errors import InvalidArgument


class RequestQueues:
    """Waiting (priority, arrival order) and running (admission order) requests, by id too."""

    def __init__(self) -> None:
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []  # in the order they were (re)admitted
        self.requests: dict[str, Request] = {}
        self.pending_frees: list[str] = []  # finished/preempted, not yet freed in the manager
        # Released before their latest allocation ran: the manager must unregister its blocks.
        self.pending_rollbacks: list[str] = []
        self.runner_forget: list[str] = []  # finished/preempted, not yet forgotten by the runner
        self._seq = 0

    def add(self, request: Request) -> None:
        """Queues a validated request (its id must be unique among live requests)."""
        if request.request_id in self.requests:
            raise InvalidArgument(f"request_id {request.request_id!r} is already in use")
        request.seq = self._seq
        self._seq += 1
        self.requests[request.request_id] = request
        self.enqueue(request)

    def enqueue(self, req: Request) -> None:
        """Into the waiting queue at its (priority, arrival) place; a preempted request keeps its
        arrival number, so it goes back in front of later arrivals of its priority."""
        req.status = RequestStatus.WAITING
        if req not in self.waiting:
            bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def admit(self, req: Request) -> None:
        """Waiting -> running."""
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def retire(self, req: Request, reason: FinishReason, stop_reason: str = "", rollback: bool = False) -> None:
        """Ends a request already taken out of its queue; its peers learn it at the next step."""
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        del self.requests[req.request_id]
        if req.num_tokens_sent_to_kvm:
            (self.pending_rollbacks if rollback else self.pending_frees).append(req.request_id)
        if req.known_to_runner:
            self.runner_forget.append(req.request_id)

    def finish(self, request_id: str, reason: FinishReason, stop_reason: str = "", rollback: bool = False) -> bool:
        """Takes a live request out of its queue and retires it; False if it is not live."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        (self.running if req.status is RequestStatus.RUNNING else self.waiting).remove(req)
        self.retire(req, reason, stop_reason, rollback)
        return True

    def release(self, req: Request, rollback: bool) -> None:
        """Preemption: the peers drop the request's blocks and state; it waits to be recomputed."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        (self.pending_rollbacks if rollback else self.pending_frees).append(req.request_id)
        if req.known_to_runner:
            self.runner_forget.append(req.request_id)
        req.forget_placement()
        self.enqueue(req)

    def requeue_all(self) -> int:
        """A re-bind: the peers lost (or never had) every request's state, so nothing is sent to
        them; every live request waits to be recomputed from its tokens. Returns how many ran."""
        running, self.running = self.running, []
        for req in self.requests.values():
            req.forget_placement()
            req.block_hashes = []  # the seed or block size may have changed with the runner
            req.num_cached_tokens = -1  # a hit counted against the old binding is not one
        for req in running:
            req.num_preemptions += 1
            self.enqueue(req)
        self.pending_frees.clear()
        self.pending_rollbacks.clear()
        self.runner_forget.clear()
        return len(running)

    def take_pending_frees(self) -> tuple[list[str], list[str]]:
        """Frees and rollbacks not yet sent (they go with the next kv-cache-manager call)."""
        frees, self.pending_frees = self.pending_frees, []
        rollbacks, self.pending_rollbacks = self.pending_rollbacks, []
        return frees, rollbacks

    def take_runner_forget(self) -> list[str]:
        """Requests the runner must forget, for the next step."""
        forget, self.runner_forget = self.runner_forget, []
        return forget
