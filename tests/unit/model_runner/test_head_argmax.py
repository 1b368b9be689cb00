"""Greedy steps without logits: a step whose every row is greedy with nothing reported takes the
packed head's argmax (``CausalLM.head_argmax``, ``native/head_argmax.c``) instead of the logits, and
its tokens are the logits path's; a row that needs the logits (logprobs, a penalty, a temperature)
sends the whole step down the logits path."""

from __future__ import annotations

from typing import Any

import pytest

from services.model_runner.native import load_kernels
from services.model_runner.types import NewRequestData, StepInput
from shared.sampling_params import SamplingParams

KERNELS = load_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None or KERNELS.linear_argmax is None,
                                reason="no AVX-512 or AVX2 build of the native kernels here")  # fmt: skip


def _dtypes() -> list[str]:
    return ["float32", *(["bfloat16"] if KERNELS is not None and KERNELS.linear_bf16 is not None else [])]


@pytest.mark.parametrize("gemm_dtype", _dtypes())
@pytest.mark.parametrize("name", ["llama", "qwen2"])  # an untied head (lm_head.packed), a tied one (packed_head)
def test_greedy_steps_take_the_head_argmax_with_the_logits_tokens(
    name: str, gemm_dtype: str, checkpoint: Any, make_runner: Any, mini_scheduler: Any, sim_request: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    outputs = {}
    for fused in (True, False):
        runner = make_runner(checkpoint(name), backend="cpu", gemm_dtype=gemm_dtype)
        argmax = runner.model.head_argmax
        took: list[bool] = []

        def spy(hidden: Any, fused: bool = fused, argmax: Any = argmax, took: list[bool] = took) -> Any:
            tokens = argmax(hidden) if fused else None
            took.append(tokens is not None)
            return tokens

        monkeypatch.setattr(runner.model, "head_argmax", spy)
        sched = mini_scheduler(runner, chunk=7)
        for i, prompt in enumerate(([5, 9, 2, 7, 3, 3, 8, 1, 4], [11, 12, 13], list(range(40, 60)))):
            sched.add(sim_request(f"r{i}", prompt, 12, arrival_step=2 * i))
        outputs[fused] = sched.run()
        assert took and all(t == fused for t in took)  # every sampling step, prefills and mixed ones too
    assert outputs[True] == outputs[False]


NEEDS_LOGITS = [SamplingParams(logprobs=1), SamplingParams(repetition_penalty=1.3),
                SamplingParams(temperature=0.7, seed=3)]  # fmt: skip


@pytest.mark.parametrize("params", NEEDS_LOGITS)
def test_a_row_needing_logits_sends_the_step_down_the_logits_path(
    params: SamplingParams, checkpoint: Any, make_runner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = make_runner(checkpoint("llama"), backend="cpu")
    calls: list[int] = []
    argmax = runner.model.head_argmax
    monkeypatch.setattr(runner.model, "head_argmax", lambda hidden: calls.append(len(hidden)) or argmax(hidden))
    plain = NewRequestData("a", (5, 9, 2), 3, (1,), 0, 3)
    out = runner.execute(StepInput(0, (plain, NewRequestData("b", (7, 8), 2, (2,), 0, 2, params))))
    assert calls == [] and len(out.sampled) == 2
    assert (out.sampled[1].logprobs is not None) == (params.logprobs is not None)
    out = runner.execute(StepInput(1, (NewRequestData("c", (4, 4, 4), 3, (3,), 0, 3),)))
    assert calls == [1] and out.sampled[0].logprobs is None
