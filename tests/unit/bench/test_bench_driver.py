"""The driver against a fake transport: turn-by-turn history, the concurrency cap, failures."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from bench.serve.datasets import Conversation, Turn
from bench.serve.driver import Driver, DriverConfig
from bench.serve.transports import FinalInfo, StreamEvent, WireRequest


class FakeTransport:
    """Answers ``max_tokens`` tokens ``[1000 + len(prompt) + k]``, one per chunk, after ``delay`` seconds."""

    def __init__(self, delay: float = 0.0, fail_on_len: int = -1) -> None:
        self.delay = delay
        self.fail_on_len = fail_on_len
        self.prompts: list[tuple[int, ...]] = []
        self.live = 0
        self.peak = 0
        self._lock = threading.Lock()

    def stream(self, request: WireRequest) -> Iterator[StreamEvent]:
        with self._lock:
            self.prompts.append(request.prompt_token_ids)
            self.live += 1
            self.peak = max(self.peak, self.live)
        try:
            time.sleep(self.delay)
            n = len(request.prompt_token_ids)
            if n == self.fail_on_len:
                raise RuntimeError("boom")
            for k in range(request.max_tokens):
                last = k == request.max_tokens - 1
                final = FinalInfo(n, request.max_tokens, 0, 0, "length") if last else None
                yield StreamEvent((1000 + n + k,), final)
        finally:
            with self._lock:
                self.live -= 1


def _quiet(**kwargs: object) -> DriverConfig:
    return DriverConfig(progress=False, **kwargs)  # type: ignore[arg-type]


def test_multi_turn_prompt_is_history_plus_answer_plus_new_user_tokens() -> None:
    conv = Conversation(0, (Turn((1, 2, 3), 2), Turn((4, 5), 3), Turn((6,), 1)))
    fake = FakeTransport()
    run = Driver(fake, _quiet()).run([conv])
    assert fake.prompts == [
        (1, 2, 3),
        (1, 2, 3, 1003, 1004, 4, 5),
        (1, 2, 3, 1003, 1004, 4, 5, 1007, 1008, 1009, 6),
    ]
    assert [r.turn for r in run.records] == [0, 1, 2]
    assert [r.prompt_len for r in run.records] == [3, 7, 11]
    assert all(r.success and r.output_len == r.expected_output_len for r in run.records)
    assert all(r.send_time <= r.chunk_times[0] <= r.chunk_times[-1] <= r.end_time for r in run.records)
    # a turn is sent only after the previous one finished
    assert run.records[0].end_time <= run.records[1].send_time <= run.records[1].end_time <= run.records[2].send_time


def test_max_concurrency_caps_requests_in_flight() -> None:
    convs = [Conversation(i, (Turn((i + 1,) * 4, 2),)) for i in range(6)]
    fake = FakeTransport(delay=0.03)
    run = Driver(fake, _quiet(max_concurrency=2)).run(convs)
    assert fake.peak == 2
    assert len(run.records) == 6 and all(r.success for r in run.records)
    assert [r.conversation_id for r in run.records] == list(range(6))


def test_poisson_arrivals_spread_the_sends() -> None:
    convs = [Conversation(i, (Turn((7,) * 3, 1),)) for i in range(4)]
    run = Driver(FakeTransport(), _quiet(request_rate=40.0, seed=3)).run(convs)
    sends = [r.send_time for r in run.records]
    assert sends == sorted(sends)
    assert sends[-1] - sends[0] > 0.01


def test_failures_are_recorded_and_end_the_conversation() -> None:
    conv = Conversation(0, (Turn((1, 2), 2), Turn((3,), 2), Turn((4,), 2)))
    # the second turn's prompt is 2 + 2 + 1 = 5 tokens long
    run = Driver(FakeTransport(fail_on_len=5), _quiet()).run([conv, Conversation(1, (Turn((9,), 1),))])
    first, second, third, other = run.records
    assert first.success
    assert not second.success and second.error == "RuntimeError: boom"
    assert not third.success and third.error.startswith("an earlier turn failed")
    assert other.success


def test_bad_concurrency_is_refused() -> None:
    with pytest.raises(ValueError):
        DriverConfig(max_concurrency=0)
