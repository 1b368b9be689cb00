"""ModelRunner: per-request state across steps, whole-step validation, warmup, fp8 caches."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.model_runner.attention.torch_backend import TorchAttentionBackend
from services.model_runner.config import RunnerConfig
from services.model_runner.model.layers import Linear
from services.model_runner.model.packed import PackedWeight, onednn_available
from services.model_runner.model.transforms import prepare_model
from services.model_runner.types import CachedRequestData, NewRequestData, StepInput
from shared.errors import InvalidArgument
from shared.sampling_params import SamplingParams

PROMPT = [17, 3, 99, 250, 41, 8, 77]  # 7 tokens: blocks of 4 -> 2 blocks


def _new(rid: str = "a", tokens: list[int] | None = None, blocks: tuple[int, ...] = (1, 2), computed: int = 0,
         new: int | None = None, sampling: SamplingParams | None = None) -> NewRequestData:  # fmt: skip
    tokens = PROMPT if tokens is None else tokens
    return NewRequestData(rid, tuple(tokens), len(tokens), blocks, computed,
                          len(tokens) - computed if new is None else new, sampling or SamplingParams())  # fmt: skip


@pytest.fixture
def runner(checkpoint: Any, make_runner: Any) -> Any:
    return make_runner(checkpoint("llama"), num_blocks=32)


def _reference(checkpoint: Any, hf_model: Any, reference_greedy: Any, n: int = 3) -> list[int]:
    out: list[int] = reference_greedy(hf_model(checkpoint("llama")), PROMPT, n)
    return out


def test_prefill_then_decodes_follow_the_reference(
    runner: Any, checkpoint: Any, hf_model: Any, reference_greedy: Any
) -> None:
    expected = _reference(checkpoint, hf_model, reference_greedy)
    out = runner.execute(StepInput(0, new_requests=(_new(),)))
    assert [t.token_id for t in out.sampled] == expected[:1] and out.step_id == 0 and out.forward_seconds > 0
    # Token 8 (position 7) goes into a new block 3.
    out = runner.execute(StepInput(1, cached_requests=(CachedRequestData("a", (3,), 7, 1),)))
    out2 = runner.execute(StepInput(2, cached_requests=(CachedRequestData("a", (), 8, 1),)))
    assert [out.sampled[0].token_id, out2.sampled[0].token_id] == expected[1:3]


def test_partial_chunk_samples_nothing(runner: Any, checkpoint: Any, hf_model: Any, reference_greedy: Any) -> None:
    out = runner.execute(StepInput(0, new_requests=(_new(new=5),)))
    assert out.sampled == ()
    out = runner.execute(StepInput(1, cached_requests=(CachedRequestData("a", (), 5, 2),)))
    assert [t.token_id for t in out.sampled] == _reference(checkpoint, hf_model, reference_greedy, 1)


def _bad_steps() -> list[tuple[StepInput, str]]:
    ok = CachedRequestData("a", (), 7, 1)
    negative = SamplingParams(temperature=-1.0)
    return [
        (StepInput(5, new_requests=(_new("b", blocks=(4, 5)), _new("b", blocks=(6, 7)))), "twice"),
        (StepInput(5, new_requests=(_new("a", blocks=(4, 5)),)), "already running"),
        (StepInput(5, cached_requests=(ok, CachedRequestData("zzz", (), 0, 1))), "unknown request"),
        (StepInput(5, cached_requests=(CachedRequestData("a", (), 6, 1),)), "does not match"),
        (StepInput(5, cached_requests=(ok,), new_requests=(_new("b", tokens=[1, 2, 320], blocks=(4,)),)), "vocabulary"),
        (StepInput(5, cached_requests=(ok,), new_requests=(_new("b", blocks=(4, 32)),)), "outside the pool"),
        (StepInput(5, cached_requests=(ok,), new_requests=(_new("b", blocks=(4,)),)), "need 2 blocks"),
        (StepInput(5, cached_requests=(ok,), new_requests=(_new("b", blocks=tuple(range(4, 36))),)), "exceeds"),
        (StepInput(5, cached_requests=(ok,), new_requests=(_new("b", tokens=[]),)), "no token ids"),
        (
            StepInput(5, cached_requests=(ok,), new_requests=(_new("b", blocks=(4, 5), sampling=negative),)),
            "temperature",
        ),
        (StepInput(5, cached_requests=(CachedRequestData("a", (), 7, 2),)), "exceed its 8 tokens"),
        (StepInput(5, cached_requests=(ok,), finished_request_ids=("a",)), "unknown request"),
    ]


@pytest.mark.parametrize(("index"), range(len(_bad_steps())))
def test_a_bad_step_changes_nothing(
    index: int, runner: Any, checkpoint: Any, hf_model: Any, reference_greedy: Any
) -> None:
    expected = _reference(checkpoint, hf_model, reference_greedy, 2)
    runner.execute(StepInput(0, new_requests=(_new(),)))
    step, message = _bad_steps()[index]
    with pytest.raises(InvalidArgument, match=message):
        runner.execute(step)
    assert runner.request_ids == {"a"}
    out = runner.execute(StepInput(1, cached_requests=(CachedRequestData("a", (), 7, 1),)))
    assert out.sampled[0].token_id == expected[1]


def test_finished_ids_are_forgotten_and_reusable_in_the_same_step(runner: Any) -> None:
    first = runner.execute(StepInput(0, new_requests=(_new(),))).sampled[0].token_id
    runner.execute(StepInput(1, finished_request_ids=("a", "never-seen")))  # unknown finished ids are no-ops
    assert runner.request_ids == frozenset()
    again = runner.execute(StepInput(2, new_requests=(_new(blocks=(5, 6)),)))
    assert again.sampled[0].token_id == first
    replaced = runner.execute(StepInput(3, new_requests=(_new(blocks=(7, 8)),), finished_request_ids=("a",)))
    assert replaced.sampled[0].token_id == first and runner.request_ids == {"a"}


def test_resumed_request_carries_its_earlier_outputs(
    runner: Any, checkpoint: Any, hf_model: Any, reference_greedy: Any
) -> None:
    """After a preemption the scheduler resends prompt + outputs; num_prompt_tokens splits them."""
    expected = _reference(checkpoint, hf_model, reference_greedy, 3)
    resumed = NewRequestData("a", tuple(PROMPT + expected[:2]), len(PROMPT), (9, 10, 11), 0, 9, SamplingParams())
    out = runner.execute(StepInput(0, new_requests=(resumed,)))
    assert out.sampled[0].token_id == expected[2]


def test_model_info(runner: Any) -> None:
    info = runner.model_info()
    assert (info.architecture, info.vocab_size, info.max_model_len) == ("LlamaForCausalLM", 320, 512)
    assert (info.num_blocks, info.block_size, info.num_layers, info.num_kv_heads, info.head_dim) == (32, 4, 3, 2, 16)
    assert (info.dtype, info.kv_cache_dtype) == ("float32", "float32")
    assert (info.attention_backend, info.device) == ("torch", "cpu")
    assert info.bytes_per_block == 3 * 2 * 4 * 2 * 16 * 4 and info.bos_token_id == 1 and info.eos_token_ids == ()


def test_warmup_touches_no_block(runner: Any, checkpoint: Any, hf_model: Any, reference_greedy: Any) -> None:
    expected = _reference(checkpoint, hf_model, reference_greedy, 2)
    runner.execute(StepInput(0, new_requests=(_new(),)))
    before = runner.pool.tensor.clone()
    assert runner.warmup() > 0
    assert torch.equal(runner.pool.tensor, before)
    out = runner.execute(StepInput(1, cached_requests=(CachedRequestData("a", (3,), 7, 1),)))
    assert out.sampled[0].token_id == expected[1]


def test_seeded_sampling_does_not_depend_on_the_batch(runner: Any) -> None:
    params = SamplingParams(temperature=1.0, seed=1234, logprobs=2)

    def run(with_neighbour: bool) -> list[int]:
        tokens = []
        new = [_new("s", blocks=(1, 2, 3), sampling=params)]
        if with_neighbour:
            new.append(_new("n", tokens=[5, 6, 7], blocks=(10,), sampling=SamplingParams(temperature=0.7)))
        out = runner.execute(StepInput(0, new_requests=tuple(new)))
        tokens.append(out.sampled[0].token_id)
        logprobs = out.sampled[0].logprobs
        assert logprobs is not None and len(logprobs.top) == 2 and logprobs.sampled.token_id == tokens[0]
        for i in range(4):
            cached = [CachedRequestData("s", (), 7 + i, 1)]
            if with_neighbour:
                cached.append(CachedRequestData("n", () if i else (11,), 3 + i, 1))
            tokens.append(runner.execute(StepInput(i + 1, cached_requests=tuple(cached))).sampled[0].token_id)
        runner.execute(StepInput(9, finished_request_ids=("s", "n")))
        return tokens

    assert run(False) == run(True)


def test_fp8_cache_accuracy(checkpoint: Any, make_runner: Any, all_logits: Any) -> None:
    """Reports (run with -s) and bounds the fp8 cache's logit error and teacher-forced agreement.

    fp8 e4m3 keeps 3 mantissa bits, bf16 7: rounding errors ~16x apart; the tiny random models
    (init 0.2) are chaotic enough that both show in the logits.
    """
    folder = checkpoint("llama")
    fp32, bf16 = make_runner(folder), make_runner(folder, kv_cache_dtype="bfloat16")
    fp8, fp8_raw = make_runner(folder, num_blocks=64 * 4, kv_cache_dtype="fp8_e4m3"), make_runner(
        folder, kv_cache_dtype="fp8_e4m3")  # fmt: skip
    amax = fp8.calibrate_kv_scales()
    assert amax.shape == (3, 2) and (amax > 0).all()
    assert fp8.pool.scales.ne(1.0).all() and fp8_raw.pool.scales.eq(1.0).all()
    assert fp8.pool.num_blocks == 4 * fp32.pool.num_blocks
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 320, (40,), generator=generator).tolist() for _ in range(8)]
    stats: dict[str, tuple[float, float]] = {}
    for label, other in (("bf16", bf16), ("fp8", fp8), ("fp8 scale 1", fp8_raw)):
        errors, agree, total = [], 0, 0
        for prompt in prompts:
            ref, got = all_logits(fp32, prompt), all_logits(other, prompt)
            errors.append((ref - got).abs().max().item())
            agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
            total += len(prompt)
        stats[label] = (max(errors), agree / total)
        print(f"{label:12s} max |logit error| {max(errors):.4f}  argmax agreement {agree / total:.3f}")
    assert stats["bf16"][0] < 0.5 and stats["bf16"][1] > 0.95
    for label in ("fp8", "fp8 scale 1"):
        error, agreement = stats[label]
        assert error < 5.0 and agreement > 0.6, label
        assert 2 < error / stats["bf16"][0] < 100, label  # same order as the mantissa-bit gap


def test_fp8_runner_serves_a_request(checkpoint: Any, make_runner: Any, mini_scheduler: Any, sim_request: Any) -> None:
    runner = make_runner(checkpoint("qwen2"), kv_cache_dtype="fp8_e4m3")
    runner.calibrate_kv_scales(PROMPT * 3)
    sched = mini_scheduler(runner, chunk=4)
    sched.add(sim_request("a", PROMPT, max_new_tokens=5))
    sched.add(sim_request("b", PROMPT[:3], max_new_tokens=5, arrival_step=2))
    outputs = sched.run()
    assert all(len(o) == 5 and all(0 <= t < 320 for t in o) for o in outputs.values())
    assert runner.model_info().kv_cache_dtype == "fp8_e4m3"


@pytest.mark.parametrize("name", ["llama", "qwen2"])  # an untied head; a tied head with qkv bias
def test_quantized_weights_accuracy(
    name: str, checkpoint: Any, make_runner: Any, mini_scheduler: Any, sim_request: Any, all_logits: Any
) -> None:
    """Reports (run with -s) and bounds the logit error of the opt-in int8 / fp16 weights; they serve requests.

    Bounds as for the fp8 cache: the tiny random models (init 0.2) amplify rounding (SmolLM2's
    figures are in docs/model_runner.md).
    """
    folder = checkpoint(name)
    fp32 = make_runner(folder)
    generator = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, 320, (40,), generator=generator).tolist() for _ in range(4)]
    for mode, max_error, min_agreement in (("fp16", 0.1, 0.97), ("int8", 5.0, 0.6)):
        runner = make_runner(folder, quantization=mode)
        linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
        assert all(m.packed is not None and m.weight.numel() == 0 for m in linears)  # fp32 copies freed
        errors, agree = [], 0
        for prompt in prompts:
            ref, got = all_logits(fp32, prompt), all_logits(runner, prompt)
            errors.append((ref - got).abs().max().item())
            agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        agreement = agree / (len(prompts) * 40)
        print(f"{name} {mode}: max |logit error| {max(errors):.4f}  argmax agreement {agreement:.3f}")
        assert max(errors) < max_error and agreement >= min_agreement, mode
        sched = mini_scheduler(runner, chunk=4)
        sched.add(sim_request("a", PROMPT, max_new_tokens=4))
        sched.add(sim_request("b", PROMPT[:3], max_new_tokens=4, arrival_step=2))
        assert all(len(o) == 4 for o in sched.run().values())


def test_quantization_is_validated() -> None:
    with pytest.raises(ValueError, match="quantization"):
        RunnerConfig(model_dir="x", quantization="int4")
    with pytest.raises(ValueError, match="fp32 weights on the CPU"):
        PackedWeight(torch.zeros(4, 4, dtype=torch.bfloat16), None, "int8")


def test_fp32_weights_are_packed_once(runner: Any) -> None:
    """The default runner serves from oneDNN-packed fp32 weights (the path the tests above check)."""
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    if onednn_available():
        assert all(m.packed is not None and m.packed.mode == "fp32" and m.weight.numel() == 0 for m in linears)
    assert runner.model.prepared == "none"
    prepare_model(runner.model, "none")  # again: nothing to do
    with pytest.raises(ValueError, match="already prepared"):
        prepare_model(runner.model, "int8")


def test_cpu_backend_runs_every_linear_on_the_native_gemm(
    checkpoint: Any, make_runner: Any, all_logits: Any
) -> None:
    """``attention_backend=cpu`` packs all linears and the tied head for ``native/gemm.c``; its
    logits equal the oneDNN runner's within fp32 summation-order noise."""
    folder = checkpoint("qwen2")  # tied head, qkv biases
    native, reference = make_runner(folder, backend="cpu"), make_runner(folder)
    linears = [m for m in native.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None and m.packed.mode == "native" for m in linears)
    assert native.model.packed_head is not None and native.model.packed_head.mode == "native"
    assert native.model.prepared == "none"
    prompt = list(range(3, 40))
    torch.testing.assert_close(all_logits(native, prompt), all_logits(reference, prompt), atol=2e-4, rtol=1e-4)


def test_tied_head_is_packed_with_the_same_logits(checkpoint: Any, all_logits: Any) -> None:
    """qwen2's head is tied to the embedding: packed (default) or not, the logits are bitwise the same."""
    from services.model_runner.kv_pool import KVPool, bytes_per_block
    from services.model_runner.loader import load_model
    from services.model_runner.runner import ModelRunner

    logits = {}
    for pack in (True, False):
        model, cfg = load_model(checkpoint("qwen2"))
        per_block = bytes_per_block(cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        pool = KVPool(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                      block_size=4, memory_bytes=32 * per_block, dtype=torch.float32)  # fmt: skip
        runner = ModelRunner(model, pool, TorchAttentionBackend(), model_id="q", pack_tied_head=pack)
        try:
            assert runner.model.lm_head is None
            assert (runner.model.packed_head is not None) == (pack and onednn_available())
            logits[pack] = all_logits(runner, PROMPT)
        finally:
            runner.pool.close()
    assert torch.equal(logits[True], logits[False])
