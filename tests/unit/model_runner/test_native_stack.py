"""The native layer stack (``model/native_stack.py`` + ``native/decode_stack.c``, applied by
``model/native_layers.py``) against the per-layer path it replaces: decode steps, prompts' chunks
and mixed steps must give bitwise the same hidden states and K/V; a step it cannot run (fp8
calibration) must not take it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.model_runner.input_batch import ScheduledRequest, prepare_inputs
from services.model_runner.model.context import ForwardContext
from services.model_runner.model.native_layers import NativeDecoderModel, NativeMLP
from services.model_runner.model.native_stack import NativeDecodeStack
from services.model_runner.native import load_kernels
from services.model_runner.runner import ModelRunner

PROMPTS = {"a": list(range(3, 8)), "b": list(range(40, 57)), "c": list(range(100, 130))}


def _stack(runner: ModelRunner) -> NativeDecodeStack:
    model = runner.model.model
    assert isinstance(model, NativeDecoderModel)
    return model.stack


def _forward(
    runner: ModelRunner, reqs: list[ScheduledRequest], stack: bool, sampled_only: bool = False
) -> torch.Tensor:
    """The model's hidden states for one step, with the native stack on, or declining the step
    (as it does for any step it does not run: the per-layer path runs instead); ``sampled_only``:
    of the rows the step samples from alone (``ForwardContext.output_rows``, as the runner asks)."""
    native = _stack(runner)
    saved = native.__dict__.get("run")
    if not stack:
        native.run = lambda *args: None  # type: ignore[method-assign]
    try:
        batch = prepare_inputs(reqs, runner.geometry)
        ctx = ForwardContext(runner.pool.tensor, runner.pool.layer_scales(), batch.meta, runner.backend,
                             output_rows=batch.logits_indices if sampled_only else None)
        with torch.inference_mode():
            return runner.model(batch.input_ids, batch.positions, ctx)
    finally:
        if saved is None:
            native.__dict__.pop("run", None)
        else:
            native.run = saved  # type: ignore[method-assign]


def _bitwise(runner: ModelRunner, reqs: list[ScheduledRequest]) -> None:
    """Runs the step with the stack, then again layer by layer after zeroing the K/V slots it wrote
    (the per-layer path must write them again): the same hidden states and pool, bitwise."""
    bs = runner.pool.block_size
    fused = _forward(runner, reqs, stack=True)
    pool_after_fused = runner.pool.tensor.clone()
    for slot in prepare_inputs(reqs, runner.geometry).meta.slot_mapping.tolist():
        runner.pool.tensor[:, :, slot // bs, slot % bs] = 0.0
    assert torch.equal(fused, _forward(runner, reqs, stack=False))
    assert torch.equal(runner.pool.tensor, pool_after_fused)


def _prefilled(runner: ModelRunner) -> dict[str, list[int]]:
    """Prefills the three prompts (blocks interleaved in the pool), each bitwise the per-layer
    path; returns each one's blocks."""
    bs = runner.pool.block_size
    tables: dict[str, list[int]] = {}
    next_block = 1
    for rid, prompt in PROMPTS.items():
        n = -(-(len(prompt) + 2) // bs)
        tables[rid] = list(range(next_block, next_block + 2 * n, 2))  # every other block
        next_block += 1 if rid == "a" else 2 * n
        _bitwise(runner, [ScheduledRequest(rid, prompt, tables[rid], 0, len(prompt))])
    return tables


def _mixed(tables: dict[str, list[int]]) -> list[ScheduledRequest]:
    """Two decodes, a new prompt's 6-token chunk and a 2-token chunk of c's prompt over its cached
    context (positions 28-29: under a window of 6 its keys start in block 5 of c's table)."""
    return [*_decodes(tables, 1)[:2], ScheduledRequest("d", list(range(9, 15)), [60, 61], 0, 6),
            ScheduledRequest("c2", PROMPTS["c"], tables["c"], 28, 2)]  # fmt: skip


def _decodes(tables: dict[str, list[int]], step: int) -> list[ScheduledRequest]:
    return [ScheduledRequest(rid, [*p, *range(200, 200 + step + 1)], tables[rid], len(p) + step, 1)
            for rid, p in PROMPTS.items()]  # fmt: skip


# (gemm_dtype, quantization) -> (the projections' PackedWeight mode, ModelInfo.dtype)
GEMMS = {("float32", "none"): ("native", "float32"), ("bfloat16", "none"): ("native_bf16", "bfloat16"),
         ("float32", "int8_weight_only"): ("native_int8", "int8"), ("float32", "q4_1"): ("native_q4_1", "q4_1")}


# the KV pool's dtypes per mode: fp32, and bf16 (bf16 mode's default; fp32 weights over it too)
CASES = [(*gemm, kv) for gemm in sorted(GEMMS) for kv in ("float32", "bfloat16")
         if gemm[1] == "none" or kv == "float32"]


@pytest.mark.parametrize(("gemm_dtype", "quantization", "kv_cache_dtype"), CASES)
@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "llama3", "mistral_window"])
def test_steps_are_bitwise_the_per_layer_path(
    checkpoint: Any, make_runner: Any, name: str, gemm_dtype: str, quantization: str, kv_cache_dtype: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prompts in one chunk, decode steps and a mixed step (decodes, a new prompt, a chunk over
    cached context), in fp32, in bf16 mode, with int8 weights and with Q4_1 weights (the stack's
    GEMMs then the bf16, int8 or Q4_1 ones, as the per-layer path's), over an fp32 and a bf16 pool
    (the stack's K/V writes and reads then the bf16 ones, as the per-layer path's)."""
    mode, reported = GEMMS[(gemm_dtype, quantization)]
    if mode not in ("native", "native_q4_1"):  # the Q4_1 GEMM is in every build
        kernels = load_kernels()
        if kernels is None or kernels.linear_bf16 is None or kernels.linear_int8 is None:
            pytest.skip("the CPU has no AVX512-BF16: no native bf16 / int8 GEMM here")
    runner = make_runner(checkpoint(name), backend="cpu", gemm_dtype=gemm_dtype, quantization=quantization,
                         kv_cache_dtype=kv_cache_dtype)
    stack = _stack(runner)
    assert (runner.model_info().dtype, runner.model_info().kv_cache_dtype) == (reported, kv_cache_dtype)
    assert {layer.self_attn.qkv_proj.packed.mode for layer in runner.model.model.layers} == {mode}
    if name == "mistral_window":
        assert runner.model_info().kv_group_windows == (6,)
    ran: list[bool] = []
    run = stack.run

    def spy(*args: Any) -> Any:
        result = run(*args)
        ran.append(result is not None)
        return result

    monkeypatch.setattr(stack, "run", spy)
    tables = _prefilled(runner)  # (_forward's per-layer runs replace the spy: they are not in `ran`)
    for step in range(2):
        _bitwise(runner, _decodes(tables, step))
    _bitwise(runner, _mixed(tables))
    assert ran == [True] * 6  # three prompts, two decode steps, the mixed step


@pytest.mark.parametrize(("gemm_dtype", "quantization", "kv_cache_dtype"), CASES)
@pytest.mark.parametrize("name", ["llama", "mistral_window"])
def test_the_last_layer_runs_the_sampled_rows_alone_bitwise(
    checkpoint: Any, make_runner: Any, name: str, gemm_dtype: str, quantization: str, kv_cache_dtype: str
) -> None:
    """With ``output_rows`` (the runner's sampled rows) the stack runs its last layer past the K/V
    writes for those rows alone and returns them first: they are bitwise the rows of the whole
    step, and the K/V written are the same. Covered: a prompt's first chunk (no row sampled), its
    last chunk (one row, at the end), a decode step, and the mixed step (rows 0, 1, 7 and 9 of 10:
    a new prompt's last row, and a chunk over cached context, under a window of 6 for
    mistral_window). Rows the C code did not put first would not match."""
    mode, _ = GEMMS[(gemm_dtype, quantization)]
    if mode not in ("native", "native_q4_1"):
        kernels = load_kernels()
        if kernels is None or kernels.linear_bf16 is None or kernels.linear_int8 is None:
            pytest.skip("the CPU has no AVX512-BF16: no native bf16 / int8 GEMM here")
    runner = make_runner(checkpoint(name), backend="cpu", gemm_dtype=gemm_dtype, quantization=quantization,
                         kv_cache_dtype=kv_cache_dtype)
    bs = runner.pool.block_size
    tables = _prefilled(runner)
    long = list(range(300, 320))
    steps = [[ScheduledRequest("e", long, [50, 52, 54, 56, 58], 0, 12)],  # 12 of 20: nothing sampled
             [ScheduledRequest("e", long, [50, 52, 54, 56, 58], 12, 8)],
             _decodes(tables, 0), _mixed(tables)]  # fmt: skip
    expected_rows = [[], [7], [0, 1, 2], [0, 1, 7, 9]]
    for reqs, rows in zip(steps, expected_rows, strict=True):
        assert prepare_inputs(reqs, runner.geometry).logits_indices.tolist() == rows
        whole = _forward(runner, reqs, stack=True)
        pool_after_whole = runner.pool.tensor.clone()
        for slot in prepare_inputs(reqs, runner.geometry).meta.slot_mapping.tolist():
            runner.pool.tensor[:, :, slot // bs, slot % bs] = 0.0  # written again below
        sampled = _forward(runner, reqs, stack=True, sampled_only=True)
        assert sampled.shape == (len(rows), runner.config.hidden_size)
        assert torch.equal(sampled, whole[rows])
        assert torch.equal(runner.pool.tensor, pool_after_whole)
        # the per-layer path takes the same rows after running every row
        assert torch.equal(_forward(runner, reqs, stack=False, sampled_only=True), sampled)


def test_steps_of_changing_batch_sizes_are_bitwise_the_per_layer_path(checkpoint: Any, make_runner: Any) -> None:
    """The stack's scratch rows are kept between steps (views of buffers grown to the largest
    step): a smaller step after a larger one, and a larger one again, still match."""
    runner = make_runner(checkpoint("llama"), backend="cpu")
    tables = _prefilled(runner)  # 30 rows: the scratch's first size
    for step, rows in ((0, 3), (1, 1), (1, 2), (1, 3)):  # NOTE: the tables hold 2 decode positions
        _bitwise(runner, _decodes(tables, step)[:rows])
    _bitwise(runner, _mixed(tables))


def test_bf16_decodes_of_17_rows_and_more_fuse_the_swiglu_bitwise(checkpoint: Any, make_runner: Any) -> None:
    """From 17 rows ``decode_stack.c`` runs bf16 mode's gate_up with the SwiGLU in the GEMM's epilogue
    (``kvmesh_linear_bf16_swiglu``, where the intermediate size is whole weight panels); below, the
    GEMM then the SwiGLU. Either way bitwise the per-layer path, hidden states and K/V alike."""
    kernels = load_kernels()
    if kernels is None or kernels.linear_bf16_swiglu is None:
        pytest.skip("the CPU has no AVX512-BF16: no native bf16 GEMM here")
    runner = make_runner(checkpoint("llama_panels"), backend="cpu", gemm_dtype="bfloat16", kv_cache_dtype="bfloat16")
    assert runner.config.intermediate_size % kernels.panel_width == 0
    bs = runner.pool.block_size
    prompts = {f"r{i}": [3 + i, 40 + i, 100 + i, 7, 9] for i in range(20)}
    tables = {rid: [1 + 2 * i, 2 + 2 * i] for i, rid in enumerate(prompts)}  # 5 + 1 tokens: 2 blocks of 4
    for rid, prompt in prompts.items():
        _forward(runner, [ScheduledRequest(rid, prompt, tables[rid], 0, len(prompt))], stack=True)
    for rows in (20, 16):  # fused, then the two steps (the same decode position again)
        reqs = [ScheduledRequest(rid, [*p, 200], tables[rid], len(p), 1) for rid, p in prompts.items()][:rows]
        fused = _forward(runner, reqs, stack=True)
        pool_after_fused = runner.pool.tensor.clone()
        for slot in prepare_inputs(reqs, runner.geometry).meta.slot_mapping.tolist():
            runner.pool.tensor[:, :, slot // bs, slot % bs] = 0.0  # the per-layer path must write them again
        assert torch.equal(fused, _forward(runner, reqs, stack=False))
        assert torch.equal(runner.pool.tensor, pool_after_fused)


def test_fp32_chunks_of_33_rows_and_more_fuse_the_swiglu_bitwise(checkpoint: Any, make_runner: Any) -> None:
    """From 33 rows ``decode_stack.c`` runs fp32 mode's gate_up with the SwiGLU in the GEMM's epilogue
    (``kvmesh_linear_f32_swiglu``, where the intermediate size is whole weight panels): a 40-token
    prompt through the stack is bitwise the per-layer path with its own fused kernel turned off (the
    GEMM, then the SwiGLU pass), hidden states and K/V alike; a 20-row step (unfused in both) too."""
    runner = make_runner(checkpoint("llama_panels"), backend="cpu")
    kernels = runner.backend.native_kernels
    assert kernels is not None and kernels.linear_f32_swiglu is not None
    assert runner.config.intermediate_size % kernels.panel_width == 0
    mlps = [m for m in runner.model.modules() if isinstance(m, NativeMLP)]
    assert len(mlps) == len(runner.model.model.layers) and all(m.fused is kernels.linear_f32_swiglu for m in mlps)
    bs = runner.pool.block_size
    for rows in (40, 20):
        prompt = [3 + (7 * i) % 200 for i in range(rows)]
        table = list(range(1, 1 + -(-rows // bs)))
        reqs = [ScheduledRequest(f"p{rows}", prompt, table, 0, rows)]
        fused = _forward(runner, reqs, stack=True)
        pool_after_fused = runner.pool.tensor.clone()
        for slot in prepare_inputs(reqs, runner.geometry).meta.slot_mapping.tolist():
            runner.pool.tensor[:, :, slot // bs, slot % bs] = 0.0  # the per-layer path must write them again
        for m in mlps:
            m.fused = None  # the per-layer path's GEMM, then kvmesh_silu_mul_f32
        try:
            assert torch.equal(fused, _forward(runner, reqs, stack=False))
        finally:
            for m in mlps:
                m.fused = kernels.linear_f32_swiglu
        assert torch.equal(runner.pool.tensor, pool_after_fused)


def test_chunks_and_mixed_steps_take_the_stack_fp8_calibration_does_not(checkpoint: Any, make_runner: Any) -> None:
    runner = make_runner(checkpoint("llama"), backend="cpu")
    stack = _stack(runner)
    tables = _prefilled(runner)

    def runs(reqs: list[ScheduledRequest], calibrating: bool = False) -> bool:
        batch = prepare_inputs(reqs, runner.geometry)
        amax = torch.zeros(len(runner.model.model.layers), 2) if calibrating else None
        ctx = ForwardContext(runner.pool.tensor, runner.pool.layer_scales(), batch.meta, runner.backend, kv_amax=amax)
        x = runner.model.model.embed_tokens(batch.input_ids)
        cos, sin = runner.model.model.rotary(batch.positions, x.dtype)
        with torch.inference_mode():
            return stack.run(x, cos, sin, ctx) is not None

    assert runs(_decodes(tables, 0))
    assert runs(_mixed(tables))
    assert runs([ScheduledRequest("c2", PROMPTS["c"], tables["c"], 28, 2)])  # a 2-token chunk of a running request
    assert not runs(_mixed(tables), calibrating=True)  # fp8 calibration records |K|, |V| layer by layer


def test_other_backends_and_quantizations_build_no_stack(checkpoint: Any, make_runner: Any) -> None:
    assert not isinstance(make_runner(checkpoint("llama")).model.model, NativeDecoderModel)  # torch: oneDNN
    int8 = make_runner(checkpoint("llama"), backend="cpu", quantization="int8")
    assert not isinstance(int8.model.model, NativeDecoderModel)
