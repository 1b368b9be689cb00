"""``quantization=q4_1``: configuration, what ``build_runner`` builds and reports, and the runner's
logits against fp32 mode on the dequantized weights (bitwise: the mode is fp32 mode over them).

The end-to-end guarantees (prefix hits, chunked prefill, preemption and batch composition give
bitwise the cold run's tokens and logprobs) are in tests/integration/test_default_mode.py, which
runs every scenario in this mode too; the decode stack's bitwise equality with the per-layer
path is in test_native_stack.py; the kernel itself in tests/kernel_tests/test_native_gemm_q4_1.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.model_runner.config import RunnerConfig
from services.model_runner.factory import Choice, build_runner, select_quantization
from services.model_runner.loader import load_model
from services.model_runner.model.layers import Linear
from services.model_runner.model.native_layers import NativeDecoderModel
from services.model_runner.model.packed import dequantize_groups, quantize_q4_1, quantize_q8_0
from services.model_runner.model.transforms import on_q4_1_grid
from services.model_runner.native import load_kernels

AVX2_ONLY = frozenset({"avx2", "fma"})  # no bf16 hardware: the mode needs none

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="the native kernels did not build here")


@pytest.mark.parametrize(("fields", "message"), [
    ({"quantization": "q4_1", "dtype": "bfloat16"}, "quantization=q4_1 runs on the native CPU kernels from float32 "
                                                    "weights: dtype must be auto or float32 (got 'bfloat16')"),
    ({"quantization": "q4_1", "attention_backend": "torch"}, "attention_backend auto or cpu (got 'torch')"),
    ({"quantization": "q4_2"},
     "quantization must be one of auto, none, int8, fp16, int8_weight_only, q4_1, got 'q4_2'"),
])  # fmt: skip
def test_config_refuses_what_q4_1_cannot_run(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as err:
        RunnerConfig(model_dir="x", **fields)
    assert message in str(err.value)


def test_build_runner_packs_projections_q4_1_and_the_tied_head_q8_0_and_says_so(checkpoint: Any) -> None:
    config = RunnerConfig(model_dir=str(checkpoint("qwen2")), block_size=4, kv_cache_memory_bytes=16 * 8192,
                          warmup=False, quantization="q4_1")  # fmt: skip
    runner = build_runner(config, flags=AVX2_ONLY)
    try:
        info = runner.model_info()
        assert (info.dtype, info.kv_cache_dtype, info.attention_backend) == ("q4_1", "float32", "cpu")
        assert info.dtype_reason == ("auto: quantization=q4_1 loads float32 weights and packs the projections as "
                                     "Q4_1 and the head as Q8_0 groups for the native GEMM, fp32 over the "
                                     "dequantized weights (fp32 everything else)")
        model = runner.model
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert linears and {m.packed.mode for m in linears if m.packed is not None} == {"native_q4_1"}
        assert all(m.packed is not None and m.weight.numel() == 0 for m in linears)  # dense copies freed
        assert model.lm_head is None and model.packed_head is not None and model.packed_head.mode == "native_q8_0"
        assert model.model.embed_tokens.weight.dtype == torch.float32  # lookups stay fp32
        assert isinstance(model.model, NativeDecoderModel)  # decode steps in one native call
    finally:
        runner.pool.close()


def _snapped(folder: Path, out: Path, tied: bool) -> Path:
    """A copy of the checkpoint whose projections hold their Q4_1 values and whose head (the
    embedding, when tied) its Q8_0 values: what a checkpoint dequantized from a Q4_1 GGUF holds."""
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    head = hf.get_input_embeddings() if tied else hf.get_output_embeddings()
    with torch.no_grad():
        for module in hf.modules():
            if isinstance(module, torch.nn.Linear) and module is not head:
                module.weight.copy_(dequantize_groups(*quantize_q4_1(module.weight, 32), 32))
        head.weight.copy_(dequantize_groups(*quantize_q8_0(head.weight, 32), 32))
    hf.save_pretrained(out, safe_serialization=True)
    return out


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_on_weights_already_on_the_grid_it_is_bitwise_fp32_mode(
    checkpoint: Any, make_runner: Any, all_logits: Any, tmp_path: Path, name: str
) -> None:
    """Every position's logits: q4_1 over a checkpoint on the grid is bitwise fp32 mode (the native
    kernels) over the same checkpoint, and greedy-identical to the torch fp32 reference."""
    folder = _snapped(checkpoint(name), tmp_path / "snapped", tied=name == "qwen2")
    prompt = list(range(3, 40))
    got = all_logits(make_runner(folder, backend="cpu", quantization="q4_1"), prompt)
    fp32 = all_logits(make_runner(folder, backend="cpu"), prompt)
    reference = all_logits(make_runner(folder, backend="torch"), prompt)
    assert got.shape == (len(prompt), 320)
    assert torch.equal(got, fp32)
    assert torch.equal(got.argmax(-1), reference.argmax(-1))


def test_on_any_weights_it_is_fp32_mode_over_the_dequantized_weights(
    checkpoint: Any, make_runner: Any, all_logits: Any, tmp_path: Path
) -> None:
    """On weights off the grid (random), the mode is lossy, and exactly so: bitwise fp32 mode over
    the weights quantize + dequantize give (the untied llama: its lookups are unchanged)."""
    folder = checkpoint("llama")
    prompt = list(range(3, 40))
    got = all_logits(make_runner(folder, backend="cpu", quantization="q4_1"), prompt)
    snapped = all_logits(make_runner(_snapped(folder, tmp_path / "snapped", tied=False), backend="cpu"), prompt)
    original = all_logits(make_runner(folder, backend="cpu"), prompt)
    assert torch.equal(got, snapped)
    assert not torch.equal(got, original)  # random weights lie on no grid: the quantization shows
    assert make_runner(folder, backend="cpu", quantization="q4_1").model.lm_head.packed.mode == "native_q8_0"


def _never() -> bool:
    raise AssertionError("the grid check must not run here")


def test_select_quantization_auto_rule() -> None:
    """``auto``: q4_1 only for float32 on the native kernels and a model on the grid (checked only
    then: it costs a quantization of every weight); an explicit setting is kept as is."""
    assert select_quantization("none", True, _never) == Choice("none", "set explicitly")
    assert select_quantization("q4_1", False, _never) == Choice("q4_1", "set explicitly")
    off = select_quantization("auto", False, _never)
    assert off.value == "none" and "float32 on the native kernels" in off.reason
    off_grid = select_quantization("auto", True, lambda: False)
    assert off_grid == Choice("none", "auto: the weights are not all on llama.cpp's Q4_1 / Q8_0 grid (packing them "
                                      "so would change the answer)")
    on = select_quantization("auto", True, lambda: True)
    assert on.value == "q4_1" and "bitwise float32 mode, a fifth of the weight bytes" in on.reason


@pytest.mark.parametrize(("name", "tied"), [("llama", False), ("qwen2", True)])
def test_on_q4_1_grid_is_exact(checkpoint: Any, tmp_path: Path, name: str, tied: bool) -> None:
    """True for a checkpoint snapped onto the grid (head Q8_0: lm_head, or the embedding when
    tied); False for the random original, and for a snapped one with a single weight moved by one ulp."""
    snapped = _snapped(checkpoint(name), tmp_path / "snapped", tied=tied)
    model, _ = load_model(snapped)
    assert on_q4_1_grid(model, 32)
    original, _ = load_model(checkpoint(name))
    assert not on_q4_1_grid(original, 32)
    weight = model.model.layers[-1].mlp.down_proj.weight
    with torch.no_grad():
        weight[3, 7] = torch.nextafter(weight[3, 7], torch.tensor(1e9))
    assert not on_q4_1_grid(model, 32)


def test_auto_keeps_weights_on_the_grid_as_q4_1_and_others_as_fp32(checkpoint: Any, all_logits: Any,
                                                                     tmp_path: Path) -> None:
    """The default config (quantization auto) on an AVX2-only machine class (auto dtype float32):
    a checkpoint on the grid runs q4_1, says so, and is bitwise ``quantization=none``; the random
    original stays fp32 panels."""
    snapped = _snapped(checkpoint("qwen2"), tmp_path / "snapped", tied=True)
    runners = {}
    try:
        for key, folder, quantization in (("auto", snapped, "auto"), ("none", snapped, "none"),
                                          ("raw", checkpoint("qwen2"), "auto")):
            config = RunnerConfig(model_dir=str(folder), block_size=4, kv_cache_memory_bytes=16 * 8192, warmup=False,
                                  quantization=quantization)  # fmt: skip
            runners[key] = build_runner(config, flags=AVX2_ONLY)
        info = runners["auto"].model_info()
        assert (info.dtype, info.attention_backend, info.kv_cache_dtype) == ("q4_1", "cpu", "float32")
        assert info.dtype_reason.startswith("auto: the CPU has no AMX-BF16 or AVX512-BF16")
        assert info.dtype_reason.endswith("; weights: every projection on llama.cpp's Q4_1 grid and the head on "
                                          "Q8_0's (checked at load), kept so (quantization auto: q4_1): fp32 "
                                          "arithmetic over the same numbers, bitwise float32 mode, a fifth of the "
                                          "weight bytes")
        assert runners["auto"].model.packed_head.mode == "native_q8_0"
        assert (runners["none"].model_info().dtype, runners["raw"].model_info().dtype) == ("float32", "float32")
        assert runners["raw"].model.model.layers[0].mlp.down_proj.packed.mode == "native"
        prompt = list(range(3, 40))
        assert torch.equal(all_logits(runners["auto"], prompt), all_logits(runners["none"], prompt))
    finally:
        for runner in runners.values():
            runner.pool.close()
