"""The engine: the step loop thread around the :class:`Scheduler`.

Producers (gRPC handler threads, or an in-process caller) call :meth:`Engine.add_request` and
:meth:`Engine.abort`; those only enqueue commands. One loop thread owns the scheduler and runs
steps back to back while there is work::

    commands ─▶ [ apply adds/aborts, expire deadlines ─▶ schedule (1 kv call)
                  ─▶ execute (1 runner call) ─▶ update ─▶ push outputs ] ─▶ per-request queues

With async scheduling (``SchedulerConfig.async_scheduling``) the step after the one in flight is
planned and sent before the one in flight returns, whenever it needs no allocation
(:mod:`services.scheduler.lookahead`): the runner starts it the moment the other ends, and
updating, streaming and the RPC round trips overlap the forward pass. At most one step waits
behind the running one; anything that needs the kv-cache-manager (or a re-bind, a failure, the
keep-alive, stopping) first waits for every step in flight.

A failure of a step ends the requests in it with an error and frees their blocks; the loop goes
on serving the others. Binding the suite, re-binding it and the keep-alive are in
:mod:`services.scheduler.binding`; the per-request queues in :mod:`services.scheduler.outputs`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.kv_cache_manager.client import KVCacheBackend
from services.model_runner.client import RunnerBackend, RunnerInfo, RunnerRestarted
from services.model_runner.types import StepOutput
from services.offload_store.client import OffloadBackend
from services.scheduler.binding import SuiteBinding, prefix_hash_seed
from services.scheduler.config import SchedulerConfig
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.offload import OffloadConnector
from services.scheduler.outputs import EngineOutput, OutputQueues
from services.scheduler.request import FinishReason, Request, RequestSpec
from services.scheduler.scheduler import ScheduledStep, Scheduler
from services.scheduler.tracing import record_queue_span, step_span
from shared.errors import DeadlineExceeded, FailedPrecondition, KVMeshError, Unavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Add:
    request: Request


@dataclass(frozen=True)
class _Finish:
    request_id: str
    reason: FinishReason
    stop_reason: str


@dataclass(frozen=True)
class _InFlight:
    """A step sent to the runner and not yet collected."""

    step: ScheduledStep
    wait: Callable[[], StepOutput]


class Engine:
    """Runs the step loop in a thread; safe to call from many threads.

    Args:
        clock: monotonic seconds for the keep-alive schedule (injected by tests).
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheBackend, runner: RunnerBackend,
                 offload: OffloadBackend | None = None, metrics: SchedulerMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.metrics = metrics
        self.kv = kv
        self.runner = runner
        info = runner.info()
        self.offload = (OffloadConnector(offload, publish_prefill=config.role == "prefill")
                        if offload is not None else None)
        self.scheduler = Scheduler(config, kv, info, self.offload, prefix_hash_seed(config, info))
        self.outputs = OutputQueues(config, metrics)
        self.binding = SuiteBinding(config, kv, runner, self.scheduler, self._fail_all, clock)
        self.binding.bind_at_start()
        self._commands: queue.SimpleQueue[_Add | _Finish] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._in_flight: _InFlight | None = None
        self.num_steps = 0
        self.num_steps_ahead = 0  # steps sent while the one before them ran

    @property
    def info(self) -> RunnerInfo:
        """The model and pool of the runner incarnation last bound."""
        return self.binding.info

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
            self.outputs.on_dequeued(req)
            if self.scheduler.finish(req.request_id, FinishReason.ABORT, "shutdown"):
                self.outputs.emit_final(req, Unavailable("the scheduler stopped; retry"))
        self._flush_frees()

    def num_live(self) -> int:
        """Requests added and not yet ended (their streams are still open)."""
        return len(self.outputs.live_ids())

    def abort_all(self, stop_reason: str) -> int:
        """Ends every live request at the next step boundary with an ``ABORT`` final; returns how many."""
        ids = self.outputs.live_ids()
        for rid in ids:
            self.abort(rid, FinishReason.ABORT, stop_reason)
        return len(ids)

    def add_request(self, spec: RequestSpec) -> queue.SimpleQueue[EngineOutput]:
        """Queues a validated request; returns the queue its outputs arrive on.

        Raises:
            ResourceExhausted: the waiting queue is full (requests or tokens).
            InvalidArgument: the request id is already in use.
        """
        q = self.outputs.register(spec)
        self._commands.put(_Add(Request(spec=spec, seq=0)))
        self._wake.set()
        return q

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT, stop_reason: str = "") -> None:
        """Ends a request at the next step boundary (cancel, stop string, deadline)."""
        self._commands.put(_Finish(request_id, reason, stop_reason))
        self._wake.set()

    # ----------------------------------------------------------------- loop
    def _loop(self) -> None:
        binding = self.binding
        while not self._stop.is_set():
            try:
                self._apply_commands()
                self._expire()
                if self._in_flight is not None:
                    self._run_one_step()  # collects it first: the checks below need nothing in flight
                    continue
                binding.keepalive()
                if not binding.bound and self.scheduler.has_work:
                    binding.rebind(Unavailable("the suite is not bound"))
                    continue
                if binding.suspect and self.scheduler.has_work and not binding.check_peers(after_failure=True):
                    continue
                if not self.scheduler.has_work:
                    self._flush_frees()
                    self.outputs.publish_queues(self.scheduler)  # an abort or expiry may have emptied them
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self._run_one_step()
            except Exception:  # pragma: no cover - a bug: keep serving, but say so loudly
                log.exception("engine loop error")
                time.sleep(0.01)
        self._drain(self._in_flight)  # stop() frees the live requests: nothing may still write their blocks
        self._in_flight = None

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
                    self.outputs.on_dequeued(req)
                    self.outputs.emit_final(req)

    def _expire(self) -> None:
        for req in self.scheduler.expire(time.monotonic()):
            self.outputs.on_dequeued(req)
            # NOTE: an error, not an ABORT final chunk: the stream then ends with DEADLINE_EXCEEDED
            # whether the server's expiry or the client's own timer fires first.
            self.outputs.emit_final(req, DeadlineExceeded("deadline exceeded"))

    def _flush_frees(self) -> None:
        frees, rollbacks = self.scheduler.take_pending_frees()
        if frees or rollbacks:
            try:
                self.scheduler.last_kv_stats = self.kv.free(frees, rollbacks)
            except FailedPrecondition as exc:  # restarted or taken over: re-bind on the next step
                log.warning("freeing %d requests refused: %s", len(frees) + len(rollbacks), exc)
                self.binding.bound = False
            except Exception:
                log.exception("freeing %d requests failed", len(frees) + len(rollbacks))

    def _run_one_step(self) -> None:
        """Plans and sends a step unless one is in flight, sends the one after it when it can be
        planned ahead, then collects the first and applies its tokens."""
        sched = self.scheduler
        current = self._in_flight
        candidates = [*sched.running] if current is not None else [
            *sched.running, *sched.waiting[: max(self.config.max_num_seqs - len(sched.running), 0)]]
        with step_span(self.num_steps, candidates, self.config.trace_steps, self.config.trace_step_every):
            if current is None:
                current = self._schedule_and_send()
                if current is None:
                    return
            self._in_flight = None
            ahead = None
            if self.config.sends_ahead and not self.binding.renewal_due():
                step = sched.plan_ahead(current.step)
                if step is not None:
                    ahead = self._send(step)
                    self.num_steps_ahead += 1
            try:
                output = current.wait()
            except RunnerRestarted as exc:  # refused before it ran: nothing was computed
                self._drain(ahead)
                self.binding.rebind(exc)
                return
            except Exception as exc:
                self._drain(ahead)
                self._fail_step(current.step, exc)
                return
            self._in_flight = ahead
        step = current.step
        self.num_steps += 1
        self.binding.step_succeeded(step.allocated)
        for rid in step.num_scheduled:
            stepped = sched.requests.get(rid)
            if stepped is not None:
                stepped.num_steps += 1
        events = sched.update(step, output)
        self.outputs.record_step(sched, step, len(events))
        if sched.offload is not None:  # a prefill replica's prompts, before their first token leaves
            sched.offload.publish_prompts([ev.request for ev in events], sched.block_size)
        pushed = False

        def push() -> None:
            nonlocal pushed
            if not pushed:
                pushed = True
                self.outputs.push(events)
                self.outputs.publish_queues(sched)

        try:
            if self._in_flight is None:
                self._send_next_synchronous(before_failure=push)
        finally:
            push()  # the step's tokens go out whatever the planning of the next one met

    def _send_next_synchronous(self, before_failure: Callable[[], None]) -> None:
        """With nothing in flight after a step, plans and sends the next one (a synchronous step)
        before the step's tokens are streamed, where the loop's checks would let it run at once.

        Why: pushing the tokens wakes every stream's handler thread, and while they serialize and
        send, the engine thread waited for the GIL through its kv-cache-manager call and the
        runner's send, with the runner idle (docs/design.md, "Async scheduling"). Sent first, the
        step runs while they stream. The order of events is the loop's: commands, expiry, plan.
        ``before_failure`` (the tokens' push) runs before a failed planning is handled, so a
        re-bind or a failure of every request comes after the tokens already computed, as before.
        """
        binding = self.binding
        if self._stop.is_set() or not binding.bound or binding.suspect or binding.renewal_due():
            return  # stopping, or the loop's checks first (re-bind, peer check, keep-alive)
        self._apply_commands()
        self._expire()
        if self.scheduler.has_work:
            self._in_flight = self._schedule_and_send(idle_wait=False, before_failure=before_failure)

    def _schedule_and_send(self, idle_wait: bool = True,
                           before_failure: Callable[[], None] | None = None) -> _InFlight | None:
        """A synchronous step (nothing in flight): allocates it and sends it; None when nothing runs
        or the planning failed (handled here, after ``before_failure``). ``idle_wait``: when nothing
        can run, wait a moment for a command before returning (the loop's pace while requests wait
        for blocks)."""
        sched = self.scheduler
        waiting_before = [r for r in sched.waiting if r.in_admission_queue]
        try:
            step = sched.schedule()
        except FailedPrecondition as exc:  # the kv-cache-manager restarted or was taken over
            if before_failure is not None:
                before_failure()
            self.binding.rebind(exc)
            return None
        except Exception as exc:
            if before_failure is not None:
                before_failure()
            self._fail_all(exc)
            return None
        for req in waiting_before:
            if req.times.first_scheduled is not None:
                self.outputs.on_dequeued(req)
                record_queue_span(req)
        if step is None:
            if idle_wait:
                self._wake.wait(0.005)
                self._wake.clear()
            return None
        return self._send(step)

    def _send(self, step: ScheduledStep) -> _InFlight:
        """Sends a step; a send that fails at once fails where a step's failure is handled: when
        it is collected."""
        try:
            return _InFlight(step, self.runner.submit(step.step_input))
        except Exception as exc:
            error = exc

            def fail() -> StepOutput:
                raise error
            return _InFlight(step, fail)

    @staticmethod
    def _drain(in_flight: _InFlight | None) -> None:
        """Waits for a step whose output nobody will apply (the step it followed failed, or the
        engine stops), so no block is freed while it may still write it."""
        if in_flight is None:
            return
        try:
            in_flight.wait()
        except Exception as exc:  # expected: it followed a step that failed
            log.debug("step %d sent ahead ended with %s", in_flight.step.step_input.step_id, exc)

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
        self.binding.suspect = True
        for req in reqs:
            err = exc if isinstance(exc, KVMeshError) else Unavailable(
                f"{component} unavailable; request {req.request_id} failed, retry")
            self.outputs.on_dequeued(req)
            # NOTE: rollback: the failed step's allocations may have registered blocks it never filled.
            if self.scheduler.finish(req.request_id, FinishReason.ABORT, "error", rollback=True):
                self.outputs.emit_final(req, err)
