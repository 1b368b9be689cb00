"""The StreamingLLM oracle itself (``streaming_reference.py``): exact where the rule drops nothing."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.unit.model_runner.conftest import TINY
from tests.unit.model_runner.streaming_reference import streaming_generate


def _model() -> torch.nn.Module:
    config = AutoConfig.for_model("llama", **{**TINY, "num_hidden_layers": 2})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_reference_equals_generate_while_nothing_is_dropped() -> None:
    model = _model()
    prompt = list(range(5, 45))
    hf = model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0, len(prompt):].tolist()
    assert streaming_generate(model, prompt, 30, sink_tokens=4, window=66) == hf  # 40 + 30 - 1 < 4 + 66


def test_dropping_the_middle_changes_the_answer() -> None:
    """Why the mode is opt-in and documented as not a parity mode."""
    model = _model()
    prompt = list(range(5, 45))
    hf = model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0, len(prompt):].tolist()
    assert streaming_generate(model, prompt, 30, sink_tokens=4, window=16) != hf
