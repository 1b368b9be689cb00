"""The roofline arithmetic of ``bench/roofline.py`` (``bench/peerbench/roofline.py``), on SmolLM2-135M's shape."""

from __future__ import annotations

import pytest

from bench.peerbench.roofline import (
    DecoderShape,
    decode_step_cost,
    dtype_bytes,
    gemm_rate_gflop_s,
    mean_decode_context,
    peak_dtype,
    roofline,
    table_lines,
)

SMOLLM2_135M = {"num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
                "num_key_value_heads": 3, "vocab_size": 49152}
SHAPE = DecoderShape.from_hf_config(SMOLLM2_135M)


def test_shape_from_hf_config_and_weight_counts() -> None:
    assert DecoderShape(30, 576, 1536, 9, 3, 64, 49152) == SHAPE  # head_dim = 576 / 9
    assert SHAPE.layer_linear_weights == 3_538_944  # q, o 576^2; k, v 576 x 192; gate, up, down 576 x 1536
    assert SHAPE.linear_weights == 30 * 3_538_944 + 49152 * 576 == 134_479_872
    assert SHAPE.norm_weights == 61 * 576
    mha = DecoderShape.from_hf_config({**SMOLLM2_135M, "num_key_value_heads": None, "head_dim": 32})
    assert (mha.num_kv_heads, mha.head_dim) == (9, 32)


def test_gemm_shapes_cover_every_weight_of_a_layer_and_the_head() -> None:
    shapes = SHAPE.gemm_shapes(32)
    assert shapes == (("qkv", 32, 576, 960), ("o", 32, 576, 576), ("gate_up", 32, 576, 3072),
                      ("down", 32, 1536, 576), ("lm_head", 32, 576, 49152))
    assert sum(k * n for name, _, k, n in shapes if name != "lm_head") == SHAPE.layer_linear_weights


def test_batch32_decode_step_cost_fp32_and_bf16() -> None:
    ctx = mean_decode_context(128, 128)
    assert ctx == 192.0  # steps attend 129 .. 255 tokens
    fp32 = decode_step_cost(SHAPE, 32, ctx, "float32", "float32")
    assert fp32.weight_bytes == (134_479_872 + 35_136) * 4 == 538_060_032
    assert fp32.kv_bytes == 32 * 192 * (2 * 30 * 3 * 64 * 4) == 283_115_520
    assert fp32.flops == 2 * 32 * 134_479_872 + 4 * 32 * 192 * 30 * 9 * 64 == 9_031_385_088
    assert fp32.total_bytes == 821_175_552
    bf16 = decode_step_cost(SHAPE, 32, ctx, "bfloat16", "torch.bfloat16")
    assert (bf16.weight_bytes, bf16.kv_bytes, bf16.flops) == (269_030_016, 141_557_760, 9_031_385_088)
    assert decode_step_cost(SHAPE, 1, 1, "float32", "fp8_e4m3").kv_bytes == 2 * 30 * 3 * 64
    # Q4_1 projections (0.75 bytes a weight with fp32 scale and minimum per 32), a Q8_0 head (1.25)
    q4 = decode_step_cost(SHAPE, 32, ctx, "q4_1", "float32")
    assert q4.weight_bytes == 30 * 3_538_944 * 3 // 4 + 49_152 * 576 * 5 // 4 + 35_136 * 4 == 115_156_224
    assert (q4.kv_bytes, q4.flops) == (fp32.kv_bytes, fp32.flops)
    assert (peak_dtype("q4_1"), peak_dtype("float32"), peak_dtype("int8")) == ("float32", "float32", "bfloat16")


def test_roofline_takes_the_slower_side() -> None:
    cost = decode_step_cost(SHAPE, 32, 192.0, "float32", "float32")
    r = roofline(cost, 20.0, 100.0)
    assert r.memory_s == pytest.approx(821_175_552 / 20e9, rel=1e-15)
    assert r.compute_s == pytest.approx(9_031_385_088 / 100e9, rel=1e-15)
    assert (r.limit, r.bound_s) == ("compute", r.compute_s)
    fast = roofline(cost, 20.0, 1000.0)
    assert (fast.limit, fast.bound_s) == ("memory", fast.memory_s)
    with pytest.raises(ValueError, match="must be > 0"):
        roofline(cost, 0.0, 1.0)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        dtype_bytes("int3")
    with pytest.raises(ValueError, match="batch and context must be >= 1"):
        decode_step_cost(SHAPE, 0, 10, "float32", "float32")
    with pytest.raises(ValueError, match="output_len >= 2"):
        mean_decode_context(128, 1)
    with pytest.raises(ValueError, match="one time per shape"):
        gemm_rate_gflop_s([("a", 1, 1, 1)], [])


def test_gemm_rate_is_total_flops_over_total_time() -> None:
    assert gemm_rate_gflop_s([("a", 2, 3, 4), ("b", 1, 1, 2)], [1e-9, 1e-9]) == pytest.approx((48 + 4) / 2, rel=1e-12)


def test_table_line_states_ratio_and_target() -> None:
    row = {"mode": "auto", "threads": 2, "weight_dtype": "bfloat16", "kv_dtype": "bfloat16",
           "weight_bytes": 269_030_016, "kv_bytes": 141_557_760, "flops": 9_031_385_088, "bandwidth_gb_s": 20.0,
           "peak_gflop_s": 400.0,
           "roofline_s": 0.0225, "limit": "compute", "step_s": 0.045, "step_min_s": 0.04, "step_max_s": 0.05}
    lines = table_lines([row, {**row, "step_s": 0.03}])
    assert lines[2] == ("| auto | 2 | bfloat16 / bfloat16 | 269 + 142 | 9.03 | 20.0 | 400 | 22.5 (compute) "
                        "| 45.0 (40.0 - 50.0) | 2.00x (target <= 1.5x: **not met**) |")
    assert lines[3].endswith("| 1.33x (target <= 1.5x: met) |")
