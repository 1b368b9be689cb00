"""The victim policy alone (services/scheduler/preemption.py): admitted-this-step first, then the
newest running request, the refused request itself last; what each victim is told (rollback)."""

from __future__ import annotations

from services.kv_cache_manager.types import AllocationResult, AllocationStatus
from services.scheduler.preemption import preempt_until_fits
from services.scheduler.request import Request, RequestSpec
from shared.sampling_params import SamplingParams

OK = AllocationResult("r", AllocationStatus.OK, (9,), 4, 1)
OUT = AllocationResult("r", AllocationStatus.OUT_OF_BLOCKS)


def _req(rid: str) -> Request:
    return Request(RequestSpec(rid, (1, 2, 3), SamplingParams(), 4), seq=0)


def _run(fits_after: int) -> tuple[AllocationResult | None, list[tuple[str, dict[str, bool]]], list[str], list[str]]:
    a, b, c, new1, new2 = (_req(x) for x in ("a", "b", "c", "n1", "n2"))
    running = [a, b, c]
    scheduled = [(a, OK), (c, OK)]
    admitted = [(new1, OK), (new2, OK)]
    calls: list[tuple[str, dict[str, bool]]] = []

    def preempt(victim: Request, **kw: bool) -> None:
        calls.append((victim.request_id, kw))
        if victim in running:
            running.remove(victim)

    answers = iter([OUT] * fits_after + [OK])
    preempted: list[str] = []
    result = preempt_until_fits(b, running, scheduled, admitted, preempted, {"c"}, preempt, lambda: next(answers))
    return result, calls, preempted, [r.request_id for r, _ in scheduled]


def test_admitted_requests_go_first_newest_first() -> None:
    result, calls, preempted, scheduled = _run(fits_after=1)
    assert result == OK
    assert calls == [("n2", {"was_admitting": True}), ("n1", {"was_admitting": True})]
    assert (preempted, scheduled) == (["n2", "n1"], ["a", "c"])


def test_then_the_newest_running_with_a_rollback_when_its_slots_were_granted_this_step() -> None:
    result, calls, preempted, scheduled = _run(fits_after=2)
    assert result == OK
    assert calls[2] == ("c", {"rollback": True})  # c's allocation of this step will never run
    assert (preempted, scheduled) == (["n2", "n1", "c"], ["a"])


def test_the_refused_request_preempts_itself_when_nothing_newer_is_left() -> None:
    result, calls, preempted, scheduled = _run(fits_after=10)
    assert result is None
    assert calls[-1] == ("b", {"rollback": False})
    assert (preempted, scheduled) == (["n2", "n1", "c", "b"], ["a"])
