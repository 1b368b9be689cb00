"""MLA (DeepSeek-V3) through the real loader and ModelRunner against transformers, fp32.

Tiny random checkpoints (``mla_checkpoints.py``): logits of one pass and of chunks, then greedy
tokens through :class:`MiniScheduler` (arrivals, chunked prefill, a prefix hit over another
request's cached latent blocks), each token-identical to ``generate(do_sample=False)``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from services.model_runner.attention.torch_backend import TorchAttentionBackend
from services.model_runner.model.config import ModelConfig
from services.model_runner.model.yarn import mla_softmax_scale, yarn_inv_freq
from services.model_runner.types import CachedRequestData, NewRequestData, StepInput
from shared.errors import FailedPrecondition
from tests.unit.model_runner.mla_checkpoints import CACHE_DIM, VARIANTS, build_deepseek

NAMES = sorted(VARIANTS)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``deepseek(name)`` -> the folder of that tiny checkpoint, built on first use."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_deepseek(tmp_path_factory.mktemp(name), name)
        return built[name]

    return get


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(2, 320, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name: str, deepseek: Any, hf_model: Any, make_runner: Any,
                                   all_logits: Any) -> None:
    folder = deepseek(name)
    tokens = _prompt(1, 37)
    with torch.inference_mode():
        expected = hf_model(folder)(torch.tensor([tokens])).logits[0]  # [37, V]
    runner = make_runner(folder)
    assert runner.config.kv_layout == "mla"
    assert runner.pool.shape == (3, 1, 64, 4, 1, CACHE_DIM)
    torch.testing.assert_close(all_logits(runner, tokens), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(all_logits(runner, tokens, chunks=[5, 1, 13, 18]), expected, atol=1e-4, rtol=0)
    decodes = all_logits(runner, tokens, chunks=[30] + [1] * 7)  # the last 7 rows as decodes
    torch.testing.assert_close(decodes, expected, atol=1e-4, rtol=0)


def test_the_cache_holds_the_normed_latent_and_the_rotated_key(deepseek: Any, hf_model: Any,
                                                                make_runner: Any, all_logits: Any) -> None:
    """Block rows equal transformers' own cache entries (``kv_a_layernorm``'d latent, rotated key)."""
    folder = deepseek("ds_qlora")
    tokens = _prompt(2, 9)
    runner = make_runner(folder)
    all_logits(runner, tokens)  # blocks 1..3
    with torch.inference_mode():
        cache = hf_model(folder)(torch.tensor([tokens]), use_cache=True).past_key_values
    for layer in range(3):
        ours = runner.pool.tensor[layer, 0, 1:4].reshape(12, CACHE_DIM)[:9]  # [9, latent + rope]
        latent, k_rope = cache.layers[layer].keys[0, 0], cache.layers[layer].values[0, 0]  # [9, 32], [9, 8]
        torch.testing.assert_close(ours, torch.cat((latent, k_rope), dim=-1), atol=1e-5, rtol=0)


def _check_against_generate(sched: Any, folder: Path, hf_model: Any, reference_greedy: Any) -> None:
    outputs = sched.run()
    model = hf_model(folder)
    for rid, req in sched.requests.items():
        assert outputs[rid] == reference_greedy(model, req.prompt, req.max_new_tokens), rid


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_generate_with_chunks_and_a_prefix_hit(
    name: str, deepseek: Any, hf_model: Any, make_runner: Any, mini_scheduler: Any, sim_request: Any,
    reference_greedy: Any,
) -> None:  # fmt: skip
    folder = deepseek(name)
    runner = make_runner(folder, num_blocks=96)
    sched = mini_scheduler(runner, chunk=5)
    shared = _prompt(20, 13)
    sched.add(sim_request("donor", shared + _prompt(21, 3), max_new_tokens=10))
    sched.add(sim_request("other", _prompt(22, 11), max_new_tokens=8, arrival_step=2))
    # Arrives while the donor decodes: 12 of its 15 tokens are in the donor's 3 full blocks.
    sched.add(sim_request("hit", shared + _prompt(23, 2), max_new_tokens=6, arrival_step=5, prefix_from="donor"))
    _check_against_generate(sched, folder, hf_model, reference_greedy)
    firsts = {r.request_id: r for s in sched.steps for r in s.new_requests}
    assert firsts["hit"].num_computed_tokens == 12
    assert firsts["hit"].block_ids[:3] == tuple(sched.requests["donor"].blocks[:3])
    donor_chunks = [r.num_new_tokens for s in sched.steps for r in (*s.new_requests, *s.cached_requests)
                    if r.request_id == "donor"][:4]  # fmt: skip
    assert donor_chunks == [5, 5, 5, 1]  # chunked prefill of 16 prompt tokens, then decodes
    assert any(s.new_requests and s.cached_requests for s in sched.steps)


def test_yarn_tables_and_scale_are_transformers(deepseek: Any, hf_model: Any) -> None:
    """YaRN's frequencies and attention factor bitwise transformers', and the softmax scale with
    ``mscale_all_dim`` equal to the reference attention's."""
    folder = deepseek("ds_dense_q")
    config = ModelConfig.from_dir(folder)
    assert config.rope.rope_type == "yarn" and config.mla is not None and config.mla.q_lora_rank is None
    reference = hf_model(folder)
    inv_freq, factor = yarn_inv_freq(config.rope, 8)
    expected_freq, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](reference.config, torch.device("cpu"))
    assert torch.equal(inv_freq, expected_freq) and factor == expected_factor and factor != 1.0
    scale = mla_softmax_scale(config.rope, config.mla.qk_head_dim)
    assert scale == reference.model.layers[0].self_attn.scaling != 24**-0.5


def test_a_backend_without_mla_is_refused_and_nothing_changes(deepseek: Any, make_runner: Any) -> None:
    runner = make_runner(deepseek("ds_qlora"))
    runner.backend = TorchAttentionBackend()  # the plain torch backend has no latent attention
    before = runner.pool.tensor.clone()
    new = NewRequestData("r", (5, 6, 7), 3, (1,), 0, 3)
    with pytest.raises(FailedPrecondition, match="'torch' does not implement MLA"):
        runner.execute(StepInput(0, new_requests=(new,)))
    assert runner.request_ids == frozenset()
    assert torch.equal(runner.pool.tensor, before)


@pytest.mark.parametrize("resume_from_cache", [True, False])
def test_preempted_and_resumed_request_matches_generate(resume_from_cache: bool, deepseek: Any, hf_model: Any,
                                                        make_runner: Any, reference_greedy: Any) -> None:
    """Preemption as the scheduler does it: the request is finished and sent again as new with its
    outputs appended, either over its own cached latent blocks (12 tokens, outputs included) or
    recomputed into fresh blocks; the continuation equals generate()'s."""
    folder = deepseek("ds_qlora")
    runner = make_runner(folder, num_blocks=16)
    prompt = _prompt(30, 10)
    sampled = [runner.execute(StepInput(0, new_requests=(NewRequestData("r", tuple(prompt), 10, (1, 2, 3), 0, 10),)))
               .sampled[0].token_id]  # fmt: skip
    for i in range(1, 4):
        step = StepInput(i, cached_requests=(CachedRequestData("r", (4,) if i == 3 else (), 9 + i, 1),))
        sampled.append(runner.execute(step).sampled[0].token_id)
    tokens = (*prompt, *sampled)  # 14 known tokens, 13 of them computed
    if resume_from_cache:
        again = NewRequestData("r", tokens, 10, (1, 2, 3, 4), 12, 2)
    else:
        again = NewRequestData("r", tokens, 10, (5, 6, 7, 8), 0, 14)
    step = StepInput(4, new_requests=(again,), finished_request_ids=("r",))
    sampled.append(runner.execute(step).sampled[0].token_id)
    extra = (again.block_ids[-1] + 1,)  # position 16 opens a fifth block
    for i in range(5, 8):
        step = StepInput(i, cached_requests=(CachedRequestData("r", extra if i == 7 else (), 9 + i, 1),))
        sampled.append(runner.execute(step).sampled[0].token_id)
    assert sampled == reference_greedy(hf_model(folder), prompt, 8)
