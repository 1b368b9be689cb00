"""The engine: the step loop thread around the :class:`Scheduler`, and per-request output queues.

Producers (gRPC handler threads, or an in-process caller) call :meth:`Engine.add_request` and
:meth:`Engine.abort`; those only enqueue commands. One loop thread owns the scheduler and runs
steps back to back while there is work::

    commands ─▶ [ apply adds/aborts, expire deadlines ─▶ schedule (1 kv call)
                  ─▶ execute (1 runner call) ─▶ update ─▶ push outputs ] ─▶ per-request queues

A failure of a step ends the requests in it with an error and frees their blocks; the loop goes
on serving the others.

Binding (docs/reliability.md): the engine *binds* the suite before serving and again whenever it
finds the other side is not the one it bound — a new runner incarnation (its pool id, checked on
every step and by a periodic keep-alive), a kv-cache-manager that restarted (``FAILED_PRECONDITION
not initialized``) — : every live request goes back to waiting, the kv-cache-manager is
re-initialized with the runner's geometry, the scheduler's hash seed and the runner's pool id
(dropping every cached hash of a dead pool), and the offload-store is attached to the current pool.
Requests then recompute, so answers are those of a cold run.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from services.offload_store.client import OffloadBackend
from services.scheduler.backends import KVCacheBackend, RunnerBackend, RunnerInfo, RunnerRestarted
from services.scheduler.config import SchedulerConfig
from services.scheduler.metrics import RequestMetrics
from services.scheduler.offload import OffloadConnector
from services.scheduler.request import FinishReason, Request, RequestSpec
from services.scheduler.scheduler import ScheduledStep, Scheduler
from services.scheduler.tracing import record_queue_span, step_span
from shared.config import CacheConfig
from shared.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KVMeshError,
    ResourceExhausted,
    Unavailable,
)
from shared.hashing import hash_seed
from shared.metrics import SchedulerMetrics

log = logging.getLogger(__name__)
# Re-binds allowed in a row without a successful step before the live requests are failed instead
# (a peer that refuses every binding must not spin the loop).
_MAX_REBINDS_IN_A_ROW = 2


@dataclass(frozen=True)
class EngineOutput:
    """What one step produced for one request (or its end)."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[Any, ...] = ()
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str = ""
    metrics: RequestMetrics | None = None
    error: KVMeshError | None = None


@dataclass(frozen=True)
class _Add:
    request: Request


@dataclass(frozen=True)
class _Finish:
    request_id: str
    reason: FinishReason
    stop_reason: str


class Engine:
    """Runs the step loop in a thread; safe to call from many threads."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheBackend, runner: RunnerBackend,
                 offload: OffloadBackend | None = None, metrics: SchedulerMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.kv = kv
        self.runner = runner
        self.info: RunnerInfo = runner.info()
        self.offload = (OffloadConnector(offload, publish_prefill=config.role == "prefill")
                        if offload is not None else None)
        self.scheduler = Scheduler(config, kv, self.info, self.offload, self._seed(self.info))
        self._bound = False
        self._rebinds_in_a_row = 0
        self._next_keepalive = 0.0
        self._suspect = False  # a peer call failed: probe the peers before the next step
        self._bind_at_start()
        self._commands: queue.SimpleQueue[_Add | _Finish] = queue.SimpleQueue()
        self._queues: dict[str, queue.SimpleQueue[EngineOutput]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._queued_requests = 0  # added but not yet first scheduled (admission control)
        self._queued_tokens = 0
        self.num_steps = 0
        self._preemptions_seen = 0

    # ----------------------------------------------------------------- binding
    def _seed(self, info: RunnerInfo) -> bytes:
        """The prefix-hash root: the scheduler is its one owner (deployment key + model id)."""
        return hash_seed(self.config.deployment_key.encode(), info.model_id)

    def _bind(self) -> None:
        """Binds runner incarnation, kv-cache-manager and offload-store (see the module docstring).

        Raises:
            FailedPrecondition: another scheduler owns the kv-cache-manager.
            Exception: a peer is unreachable (the engine stays unbound and tries again).
        """
        self._bound = False
        info = self.runner.info()
        seed = self._seed(info)
        cache = CacheConfig(num_blocks=info.num_blocks, block_size=info.block_size,
                            max_model_len=info.max_model_len, model_id=info.model_id, hash_seed=seed)
        self.runner.bind(info.pool_id)
        kept = self.kv.initialize(cache, info.pool_id)
        if self.offload is not None:
            self.offload.attach(self.runner.pool_handle())
        sched = self.scheduler
        self.info = sched.info = info
        sched.block_size = info.block_size
        sched.hash_seed = seed
        self._bound = True
        self._next_keepalive = time.monotonic() + self._keepalive_period
        log.info("bound to runner pool %s (%d blocks of %d tokens), kv-cache-manager cache %s",
                 info.pool_id or "(in-process)", info.num_blocks, info.block_size, "kept" if kept else "fresh")

    @property
    def _keepalive_period(self) -> float:
        return self.config.owner_lease_seconds / 3

    def _bind_at_start(self) -> None:
        """The first bind; waits out a predecessor's lease (it died without releasing it)."""
        deadline = time.monotonic() + self.config.owner_lease_seconds + 5.0
        while True:
            try:
                self._bind()
                return
            except FailedPrecondition as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("waiting for the previous scheduler's lease to lapse: %s", exc)
                time.sleep(0.25)

    def _rebind(self, cause: Exception) -> None:
        """A peer is not the one bound: requeue everything and bind again (or fail the requests)."""
        self._rebinds_in_a_row += 1
        if self._rebinds_in_a_row > _MAX_REBINDS_IN_A_ROW:
            self._rebinds_in_a_row = 0
            self._bound = False
            self._fail_all(cause)
            return
        log.warning("re-binding the suite: %s", cause)
        requeued = self.scheduler.requeue_all()
        try:
            self._bind()
        except Exception as exc:
            self._fail_all(exc)
            return
        log.warning("re-bound; %d running requests requeued to recompute", requeued)

    def _probe(self) -> bool:
        """After a peer failed: wait briefly for the peers, re-bind if one is a new incarnation.

        Returns:
            Whether the engine is bound and may step; when not, the live requests were failed.
        """
        try:
            pool_id = self.runner.info().pool_id
            self.kv.keepalive()
        except FailedPrecondition as exc:
            self._rebind(exc)
            return self._bound
        except Exception as exc:
            self._fail_all(Unavailable(f"a backend is unreachable: {exc}"))
            return False
        self._suspect = False
        if pool_id != self.info.pool_id:
            self._rebind(RunnerRestarted(f"model-runner pool is now {pool_id}, was {self.info.pool_id}"))
            return self._bound
        return True

    def _keepalive(self) -> None:
        """Renews the ownership leases and checks the runner incarnation (also while idle)."""
        self._next_keepalive = time.monotonic() + self._keepalive_period
        try:
            pool_id = self.runner.info().pool_id
            if pool_id != self.info.pool_id:
                self._rebind(RunnerRestarted(f"model-runner pool is now {pool_id}, was {self.info.pool_id}"))
                return
            self.kv.keepalive()
        except FailedPrecondition as exc:
            self._rebind(exc)
            return
        except Exception as exc:
            log.debug("keep-alive failed: %s", exc)
        if self.offload is not None:
            self.offload.keepalive()

    # ----------------------------------------------------------------- public API
    def start(self) -> Engine:
        """Starts the loop thread."""
        self._thread = threading.Thread(target=self._loop, name="kvmesh-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the loop after the current step, then ends every request still live and frees
        them in the kv-cache-manager, so a replacement scheduler finds nothing left behind."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("engine loop did not stop in %.1fs; its requests stay live", timeout)
                return
        # The loop has exited: this thread owns the scheduler now.
        self._apply_commands()
        for req in [*self.scheduler.running, *self.scheduler.waiting]:
            self._on_dequeued(req)
            if self.scheduler.finish(req.request_id, FinishReason.ABORT, "shutdown"):
                self._emit_final(req, Unavailable("the scheduler stopped; retry"))
        self._flush_frees()

    def num_live(self) -> int:
        """Requests added and not yet ended (their streams are still open)."""
        with self._lock:
            return len(self._queues)

    def abort_all(self, stop_reason: str) -> int:
        """Ends every live request at the next step boundary with an ``ABORT`` final; returns how many."""
        with self._lock:
            ids = list(self._queues)
        for rid in ids:
            self.abort(rid, FinishReason.ABORT, stop_reason)
        return len(ids)

    def add_request(self, spec: RequestSpec) -> queue.SimpleQueue[EngineOutput]:
        """Queues a validated request; returns the queue its outputs arrive on.

        Raises:
            ResourceExhausted: the waiting queue is full (requests or tokens).
            InvalidArgument: the request id is already in use.
        """
        n_tokens = len(spec.prompt_token_ids)
        with self._lock:
            if spec.request_id in self._queues:
                raise InvalidArgument(f"request_id: {spec.request_id!r} is already in use")
            if self._queued_requests >= self.config.max_waiting_requests:
                raise ResourceExhausted(
                    f"waiting queue is full ({self.config.max_waiting_requests} requests); retry later")
            if self._queued_tokens + n_tokens > self.config.max_waiting_tokens:
                raise ResourceExhausted(
                    f"waiting queue is full ({self.config.max_waiting_tokens} prompt tokens); retry later")
            self._queued_requests += 1
            self._queued_tokens += n_tokens
            q: queue.SimpleQueue[EngineOutput] = queue.SimpleQueue()
            self._queues[spec.request_id] = q
        self._commands.put(_Add(Request(spec=spec, seq=0)))
        self._wake.set()
        return q

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT, stop_reason: str = "") -> None:
        """Ends a request at the next step boundary (cancel, stop string, deadline)."""
        self._commands.put(_Finish(request_id, reason, stop_reason))
        self._wake.set()

    # ----------------------------------------------------------------- loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._apply_commands()
                self._expire()
                if time.monotonic() >= self._next_keepalive:
                    self._keepalive()
                if not self._bound and self.scheduler.has_work:
                    self._rebind(Unavailable("the suite is not bound"))
                    continue
                if self._suspect and self.scheduler.has_work and not self._probe():
                    continue
                if not self.scheduler.has_work:
                    self._flush_frees()
                    self._publish_queues()  # an abort or expiry may have emptied them without a step
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self._run_one_step()
            except Exception:  # pragma: no cover - a bug: keep serving, but say so loudly
                log.exception("engine loop error")
                time.sleep(0.01)

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                self.scheduler.add(cmd.request)
            else:
                req = self.scheduler.requests.get(cmd.request_id)
                if req is not None and self.scheduler.finish(cmd.request_id, cmd.reason, cmd.stop_reason):
                    self._on_dequeued(req)
                    self._emit_final(req)

    def _expire(self) -> None:
        for req in self.scheduler.expire(time.monotonic()):
            self._on_dequeued(req)
            # NOTE: an error, not an ABORT final chunk: the stream then ends with DEADLINE_EXCEEDED
            # whether the server's expiry or the client's own timer fires first.
            self._emit_final(req, DeadlineExceeded("deadline exceeded"))

    def _flush_frees(self) -> None:
        frees, rollbacks = self.scheduler.take_pending_frees()
        if frees or rollbacks:
            try:
                self.scheduler.last_kv_stats = self.kv.free(frees, rollbacks)
            except FailedPrecondition as exc:  # restarted or taken over: re-bind on the next step
                log.warning("freeing %d requests refused: %s", len(frees) + len(rollbacks), exc)
                self._bound = False
            except Exception:
                log.exception("freeing %d requests failed", len(frees) + len(rollbacks))

    def _on_dequeued(self, req: Request) -> None:
        """Admission accounting: a request leaves the bounded queue at its first scheduling."""
        if req.in_admission_queue:
            req.in_admission_queue = False
            with self._lock:
                self._queued_requests -= 1
                self._queued_tokens -= req.num_prompt_tokens

    def _run_one_step(self) -> None:
        sched = self.scheduler
        waiting_before = [r for r in sched.waiting if r.in_admission_queue]
        candidates = [*sched.running, *sched.waiting[: max(self.config.max_num_seqs - len(sched.running), 0)]]
        with step_span(self.num_steps, candidates, self.config.trace_steps, self.config.trace_step_every):
            try:
                step = sched.schedule()
            except FailedPrecondition as exc:  # the kv-cache-manager restarted or was taken over
                self._rebind(exc)
                return
            except Exception as exc:
                self._fail_all(exc)
                return
            for req in waiting_before:
                if req.times.first_scheduled is not None:
                    self._on_dequeued(req)
                    record_queue_span(req)
            if step is None:
                self._wake.wait(0.005)
                self._wake.clear()
                return
            try:
                output = self.runner.execute(step.step_input)
            except RunnerRestarted as exc:  # refused before it ran: nothing was computed
                self._rebind(exc)
                return
            except Exception as exc:
                self._fail_step(step, exc)
                return
        self.num_steps += 1
        self._rebinds_in_a_row = 0
        if self.metrics is not None:
            self._record_step(step, output)
        for rid in step.num_scheduled:
            stepped = sched.requests.get(rid)
            if stepped is not None:
                stepped.num_steps += 1
        self._dispatch(step, output)
        self._publish_queues()

    def _publish_queues(self) -> None:
        """Queue gauges as they stand after the step's finished requests left (not before)."""
        if self.metrics is not None:
            self.metrics.set_queues(len(self.scheduler.running), len(self.scheduler.waiting))

    def _record_step(self, step: ScheduledStep, output: Any) -> None:
        assert self.metrics is not None
        sched = self.scheduler
        decodes = len(step.step_input.cached_requests)
        self.metrics.add_step_tokens(max(step.total_tokens - decodes, 0), len(output.sampled))
        if sched.num_preemptions > self._preemptions_seen:
            self.metrics.num_preemptions.inc(sched.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = sched.num_preemptions

    def _observe_finished(self, out: EngineOutput) -> None:
        if self.metrics is None or out.metrics is None:
            return
        m = out.metrics
        reason = "error" if out.error is not None else (out.finish_reason or FinishReason.ABORT).value
        self.metrics.observe_finished(
            finished_reason=reason, e2e_s=m.e2e_seconds, queue_s=m.queue_seconds,
            ttft_s=m.ttft_seconds if m.completion_tokens else None, prompt_tokens=m.prompt_tokens,
            generation_tokens=m.completion_tokens)

    def _dispatch(self, step: ScheduledStep, output: Any) -> None:
        events = self.scheduler.update(step, output)
        if self.offload is not None:  # a prefill replica's prompts, before their first token leaves
            self.offload.publish_prompts([ev.request for ev in events], self.info.block_size)
        if self.metrics is not None:  # every gap between two tokens, as it happens
            self.metrics.observe_inter_token([g for ev in events if (g := ev.request.times.last_gap) is not None])
        for ev in events:
            q = self._queues.get(ev.request_id)
            if q is None:
                continue
            if ev.finished:
                req = ev.request
                self._finish_queue(ev.request_id, EngineOutput(
                    ev.request_id, (ev.token_id,), (ev.logprobs,), True, req.finish_reason,
                    req.stop_reason, RequestMetrics.of(req),
                ))
            else:
                q.put(EngineOutput(ev.request_id, (ev.token_id,), (ev.logprobs,)))

    def _emit_final(self, req: Request, error: KVMeshError | None = None) -> None:
        self._finish_queue(req.request_id, EngineOutput(
            req.request_id, finished=True, finish_reason=req.finish_reason,
            stop_reason=req.stop_reason, metrics=RequestMetrics.of(req), error=error,
        ))

    def _finish_queue(self, request_id: str, out: EngineOutput) -> None:
        self._observe_finished(out)
        with self._lock:
            q = self._queues.pop(request_id, None)
        if q is not None:
            q.put(out)

    def _fail_step(self, step: ScheduledStep, exc: Exception) -> None:
        """The model-runner call failed: end the step's requests with an error."""
        reqs = [r for rid in step.num_scheduled if (r := self.scheduler.requests.get(rid)) is not None]
        self._abort_with_error(reqs, exc, "model-runner", f"model-runner step {step.step_input.step_id}")

    def _fail_all(self, exc: Exception) -> None:
        """The kv-cache-manager call failed: end every live request with an error rather than let
        any wait forever; their blocks are freed with the next successful call."""
        self._abort_with_error([*self.scheduler.running, *self.scheduler.waiting], exc, "kv-cache-manager",
                               "kv-cache-manager step")

    def _abort_with_error(self, reqs: list[Request], exc: Exception, component: str, what: str) -> None:
        # NOTE: the exception text names internal addresses and peers: it goes to the log with the
        # request ids; clients get a clean message with their own id only.
        log.error("%s failed for requests %s: %s", what, [r.request_id for r in reqs], " ".join(str(exc).split()))
        self._suspect = True
        for req in reqs:
            err = exc if isinstance(exc, KVMeshError) else Unavailable(
                f"{component} unavailable; request {req.request_id} failed, retry")
            self._on_dequeued(req)
            # NOTE: rollback: the failed step's allocations may have registered blocks it never filled.
            if self.scheduler.finish(req.request_id, FinishReason.ABORT, "error", rollback=True):
                self._emit_final(req, err)
