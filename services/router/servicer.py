"""The public ``kvmesh.v1.Scheduler`` API in front of the replicas, and the ``kvmesh.v1.Router`` view.

Generate is scored by :class:`~services.router.routing.Router` and forwarded, unchanged and with
the caller's metadata (``authorization`` included: the replica authenticates again), as a stream
to the best replica. Fault rules (docs/mesh.md): a replica that is unreachable before the first
response is marked down and the request retried once on the next candidate; a replica that
refuses (``RESOURCE_EXHAUSTED``: its admission control) hands the request to the next one, and
only when every candidate refuses does the caller see ``RESOURCE_EXHAUSTED``; after the first
response nothing is replayed: the stream ends with the replica's status. Any other status (bad
input, deadline, auth) is the caller's answer as the replica gave it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TypeVar

import grpc

from services.router import convert, disagg
from services.router.client import Metadata, Replica, ReplicaSet
from services.router.disagg import refusal, split_roles, uncached_tokens
from services.router.routing import Router
from services.router.types import Decision
from services.scheduler.auth import current_tenant
from services.scheduler.tokenizer import Tokenizer
from shared.errors import InvalidArgument, Unavailable
from shared.grpc_server import ServiceName
from shared.pb.kvmesh.v1 import router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

T = TypeVar("T")
# One label, two proto services: the public API (unchanged from a replica's) and the operators' view.
SERVICE = ServiceName.of("router", router_pb2, "Router")
PUBLIC_API = ServiceName.of("router", scheduler_pb2, "Scheduler")
# Caller metadata not passed on: transport headers, and the trace context (the router's client
# instrumentation injects its own span as the parent instead).
_NOT_FORWARDED = frozenset({"user-agent", "traceparent", "tracestate"})
TRAILER_REPLICA = "kvmesh-replica"
TRAILER_MATCHED = "kvmesh-matched-blocks"
TRAILER_PREFILL = "kvmesh-prefill-replica"  # set when the request was disaggregated (docs/mesh.md)
log = logging.getLogger(__name__)


def forwarded_metadata(context: grpc.ServicerContext) -> Metadata:
    """The caller's metadata minus transport and trace headers."""
    return tuple((k, v) for k, v in context.invocation_metadata() or ()
                 if not k.startswith((":", "grpc-")) and k not in _NOT_FORWARDED)


def _timeout(context: grpc.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return remaining if remaining is not None and remaining < 1e8 else None


class RouterFront:
    """What both servicers share: the replicas, the router core, the tokenizer."""

    def __init__(self, replicas: ReplicaSet, router: Router, tokenizer: Tokenizer | None) -> None:
        self.replicas = replicas
        self.router = router
        self.tokenizer = tokenizer

    def candidates(self) -> list[Replica]:
        """The healthy replicas, or UNAVAILABLE."""
        healthy = self.replicas.healthy()
        if not healthy:
            raise Unavailable("no healthy replica; retry later")
        return healthy

    def unary(self, call: Callable[[Replica], T]) -> T:
        """A unary forward to the first healthy replica that is reachable (its other statuses pass)."""
        last: grpc.RpcError | None = None
        for replica in self.candidates():
            try:
                return call(replica)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                replica.mark_failed()
                last = exc
        raise Unavailable(f"no replica reachable: {last.details() if last else ''}")

    def prompt_ids(self, request: scheduler_pb2.GenerateRequest, metadata: Metadata) -> list[int]:
        """The prompt's token ids as the replica will see them (local tokenizer, else a replica's)."""
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind not in ("text", "chat"):
            raise InvalidArgument("prompt: one of text, chat or token_ids is required")
        if kind == "chat" and not request.chat.messages:
            raise InvalidArgument("prompt: chat.messages must not be empty")
        if self.tokenizer is not None:
            if kind == "text":
                return self.tokenizer.encode(request.text)
            return self.tokenizer.apply_chat_template([(m.role, m.content) for m in request.chat.messages])
        tok = (scheduler_pb2.TokenizeRequest(text=request.text, add_special_tokens=True) if kind == "text"
               else scheduler_pb2.TokenizeRequest(chat=request.chat))
        resp = self.unary(lambda r: r.stub.Tokenize(tok, metadata=metadata,
                                                    timeout=self.router.config.rpc_timeout_seconds))
        return list(resp.token_ids)

    def decide(self, request: scheduler_pb2.GenerateRequest, context: grpc.ServicerContext,
               record: bool) -> tuple[Decision, list[Replica]]:
        decision, order, _, _ = self.plan(request, context, record)
        return decision, order

    def plan(self, request: scheduler_pb2.GenerateRequest, context: grpc.ServicerContext, record: bool
             ) -> tuple[Decision, list[Replica], list[int], scheduler_pb2.SchedulerModelInfo]:
        """The decision over the replicas that serve whole requests (prefill replicas only when no
        other is healthy), its candidates in order, the prompt's ids and the model info."""
        healthy = self.candidates()
        candidates = split_roles(healthy)[1] or healthy
        metadata = forwarded_metadata(context)
        try:
            info = self.replicas.model_info(candidates, metadata)
        except grpc.RpcError as exc:  # e.g. UNAUTHENTICATED: the replica's answer is the caller's
            context.abort(exc.code(), exc.details() or "")
        ids = self.prompt_ids(request, metadata)
        decision = self.router.decide(candidates, ids, current_tenant().id, request.cache_salt, info.model_id,
                                      info.block_size, record=record)
        by_id = {r.id: r for r in candidates}  # not replicas.by_id: discovery may have dropped one since
        return decision, [by_id[s.replica_id] for s in decision.scores], ids, info

    def prefill_replica(self, request: scheduler_pb2.GenerateRequest, decision: Decision, ids: list[int],
                        info: scheduler_pb2.SchedulerModelInfo) -> Replica | None:
        """The prefill replica for leg 1 when this request is to be disaggregated, else None."""
        cfg = self.router.config
        prefill = [r for r in split_roles(self.replicas.healthy())[0]
                   if not cfg.pd_max_prefill_in_flight or r.in_flight < cfg.pd_max_prefill_in_flight]
        if not prefill or uncached_tokens(decision, info.block_size, len(ids)) <= cfg.pd_threshold_tokens:
            return None
        why = refusal(request)
        metrics = self.router.metrics
        if why:
            log.info("not disaggregated (%s): the request goes whole", why)
            if metrics is not None:
                metrics.pd.labels("refused").inc()
            return None
        if metrics is not None:
            metrics.pd.labels("split").inc()
        best = self.router.decide(prefill, ids, current_tenant().id, request.cache_salt, info.model_id,
                                  info.block_size, record=False)
        return next(r for r in prefill if r.id == best.replica_id)


class RouterSchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """``kvmesh.v1.Scheduler`` served by routing: a client cannot tell one replica from many."""

    def __init__(self, front: RouterFront) -> None:
        self.front = front

    def Generate(self, request: scheduler_pb2.GenerateRequest, context: grpc.ServicerContext
                 ) -> Iterator[scheduler_pb2.GenerateResponse]:
        decision, order, ids, info = self.front.plan(request, context, record=True)
        prefill = self.front.prefill_replica(request, decision, ids, info)
        if prefill is None:
            yield from self._forward(request, decision, order, context)
            return
        metadata = forwarded_metadata(context)

        def leg1(req: scheduler_pb2.GenerateRequest) -> Iterator[scheduler_pb2.GenerateResponse]:
            with prefill.track():
                call = prefill.stub.Generate(req, metadata=metadata, timeout=_timeout(context))
                context.add_callback(call.cancel)
                yield from call

        def failed(exc: Exception) -> bool:
            code = exc.code() if isinstance(exc, grpc.RpcError) else None
            if code == grpc.StatusCode.UNAVAILABLE:
                prefill.mark_failed()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL,
                        grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED):
                log.warning("prefill replica %s failed (%s): the decode replica computes what is missing",
                            prefill.id, code)
                if self.front.router.metrics is not None:
                    self.front.router.metrics.pd.labels("prefill_failed").inc()
                return True
            if code is not None:  # bad input, deadline, auth, cancelled: the caller's answer as given
                context.abort(code, exc.details() or "")  # type: ignore[attr-defined]
            return False

        trailer = ((TRAILER_PREFILL, prefill.id),)
        yield from disagg.two_legs(request, ids, leg1,
                                   lambda req: self._forward(req, decision, order, context, trailer), failed)

    def _forward(self, request: scheduler_pb2.GenerateRequest, decision: Decision, order: list[Replica],
                 context: grpc.ServicerContext, trailer: Metadata = ()) -> Iterator[scheduler_pb2.GenerateResponse]:
        """One request to the candidates in ``order`` under the fault rules (module docstring)."""
        metadata = forwarded_metadata(context)
        unreachable, refused = 0, 0
        last: grpc.RpcError | None = None
        for attempt, replica in enumerate(order):
            if unreachable > 1:
                break
            started = False
            self.front.router.sending(replica.id, decision)
            with replica.track():
                call = replica.stub.Generate(request, metadata=metadata, timeout=_timeout(context))
                context.add_callback(call.cancel)
                try:
                    for msg in call:
                        started = True
                        yield msg
                except grpc.RpcError as exc:
                    if not started:  # not served there: withdraw what is still only predicted
                        self.front.router.not_sent(replica.id, decision)
                    if started or exc.code() not in (grpc.StatusCode.UNAVAILABLE,
                                                     grpc.StatusCode.RESOURCE_EXHAUSTED):
                        context.abort(exc.code(), exc.details() or "")
                    last = exc
                    if exc.code() == grpc.StatusCode.UNAVAILABLE:
                        replica.mark_failed()
                        unreachable += 1
                        reason = "unavailable"
                    else:
                        refused += 1
                        reason = "refused"
                    if self.front.router.metrics is not None and attempt + 1 < len(order):
                        self.front.router.metrics.retries.labels(reason).inc()
                    continue
            matched = next(s.matched_blocks for s in decision.scores if s.replica_id == replica.id)
            context.set_trailing_metadata(((TRAILER_REPLICA, replica.id), (TRAILER_MATCHED, str(matched)), *trailer))
            return
        if unreachable == 0 and last is not None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"every replica refused the request ({refused}): {last.details()}")
        context.abort(grpc.StatusCode.UNAVAILABLE, f"no replica could take the request: "
                      f"{last.details() if last else 'none healthy'}")

    def Tokenize(self, request: scheduler_pb2.TokenizeRequest, context: grpc.ServicerContext
                 ) -> scheduler_pb2.TokenizeResponse:
        md, timeout = forwarded_metadata(context), _timeout(context)
        return self.front.unary(lambda r: r.stub.Tokenize(request, metadata=md, timeout=timeout))

    def Detokenize(self, request: scheduler_pb2.DetokenizeRequest, context: grpc.ServicerContext
                   ) -> scheduler_pb2.DetokenizeResponse:
        md, timeout = forwarded_metadata(context), _timeout(context)
        return self.front.unary(lambda r: r.stub.Detokenize(request, metadata=md, timeout=timeout))

    def GetModelInfo(self, request: scheduler_pb2.SchedulerModelInfoRequest, context: grpc.ServicerContext
                     ) -> scheduler_pb2.SchedulerModelInfo:
        md, timeout = forwarded_metadata(context), _timeout(context)
        return self.front.unary(lambda r: r.stub.GetModelInfo(request, metadata=md, timeout=timeout))


class RouterServicer(router_pb2_grpc.RouterServicer):
    """``kvmesh.v1.Router``: the replica set and the index, for operators and tests."""

    def __init__(self, front: RouterFront) -> None:
        self.front = front

    def GetReplicas(self, request: router_pb2.GetReplicasRequest, context: grpc.ServicerContext
                    ) -> router_pb2.GetReplicasResponse:
        index, offload = self.front.router.index, self.front.router.offload
        return router_pb2.GetReplicasResponse(replicas=[
            convert.replica_state_to_pb(r, index.last_seq(r.id), index.num_blocks(r.id),
                                        {t: i.num_blocks(r.id) for t, i in offload.tiers.items()})
            for r in self.front.replicas.replicas])

    def Explain(self, request: scheduler_pb2.GenerateRequest, context: grpc.ServicerContext
                ) -> router_pb2.RouteDecision:
        decision, _ = self.front.decide(request, context, record=False)
        return convert.decision_to_pb(decision)
