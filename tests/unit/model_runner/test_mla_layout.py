"""MLA's KV layout: bytes per token against shared/kv_layout.py's formula (and the GQA equivalent),
ModelInfo's layout fields over the proto round trip, the factory's choices for an MLA model, and
what is refused (an MLA model on another backend, a pool of the wrong layout, unsupported configs).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

from services.model_runner import convert
from services.model_runner.attention.torch_mla import TorchMLABackend
from services.model_runner.config import RunnerConfig
from services.model_runner.factory import build_runner, select_backend, select_dtype
from services.model_runner.kv_pool import KVPool
from services.model_runner.loader import load_model
from services.model_runner.model.config import ModelConfig, UnsupportedModelError
from services.model_runner.model.yarn import mla_softmax_scale, yarn_inv_freq
from services.model_runner.runner import ModelRunner
from services.model_runner.types import CachedRequestData, NewRequestData, StepInput
from shared.errors import FailedPrecondition, InvalidArgument
from shared.kv_layout import gqa_kv_bytes_per_token, mla_kv_bytes_per_token
from shared.pb.kvmesh.v1 import model_runner_pb2
from tests.unit.model_runner.mla_checkpoints import build_deepseek

LAYERS, LATENT, ROPE, HEADS, QK_HEAD_DIM, V_HEAD_DIM = 3, 32, 8, 4, 24, 16
AMX = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})


@pytest.fixture(scope="module")
def ds_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_deepseek(tmp_path_factory.mktemp("ds_qlora"), "ds_qlora")


def test_the_formula_with_deepseek_v3s_numbers() -> None:
    """DeepSeek-V3 (61 layers, latent 512, rope 64, bf16) vs its MHA equivalent (128 KV heads of 128)."""
    assert mla_kv_bytes_per_token(61, 512, 64, 2) == 70_272
    assert gqa_kv_bytes_per_token(61, 128, 128, 2) == 3_997_696
    assert gqa_kv_bytes_per_token(61, 128, 128, 2) / mla_kv_bytes_per_token(61, 512, 64, 2) == pytest.approx(56.89,
                                                                                                         abs=0.01)


def test_pool_bytes_per_token_is_the_mla_formula(ds_folder: Path, make_runner: Any) -> None:
    runner = make_runner(ds_folder, num_blocks=10)
    pool = runner.pool
    per_token = mla_kv_bytes_per_token(LAYERS, LATENT, ROPE, 4)
    assert per_token == 480  # (32 + 8) x 3 layers x 4 bytes
    assert pool.bytes_per_block == 4 * per_token == 1920
    assert pool.tensor.numel() * 4 == pool.nbytes == 10 * 1920
    assert runner.config.kv_bytes_per_token(4) == per_token
    # the GQA equivalent: K and V of every head (K is nope + rope wide, V v_head_dim): 4x here
    expanded = LAYERS * HEADS * (QK_HEAD_DIM + V_HEAD_DIM) * 4
    assert expanded == 1920 and expanded / per_token == 4.0
    assert gqa_kv_bytes_per_token(LAYERS, HEADS, QK_HEAD_DIM, 4) / per_token == 4.8  # at one head_dim for both


def test_model_info_says_the_layout_over_the_proto_round_trip(ds_folder: Path, make_runner: Any,
                                                              checkpoint: Any) -> None:
    mla = make_runner(ds_folder).model_info()
    assert (mla.kv_layout, mla.kv_bytes_per_token, mla.num_kv_heads, mla.head_dim) == ("mla", 480.0, 1, 40)
    gqa = make_runner(checkpoint("llama")).model_info()  # 3 layers, 2 KV heads of 16, fp32
    assert (gqa.kv_layout, gqa.kv_bytes_per_token) == ("gqa", 2 * 3 * 2 * 16 * 4)
    for info in (mla, gqa):
        wire = model_runner_pb2.ModelInfo.FromString(convert.model_info_to_proto(info).SerializeToString())
        assert (wire.kv_layout, wire.kv_bytes_per_token) == (info.kv_layout, info.kv_bytes_per_token)
        assert convert.model_info_from_proto(wire) == info
    assert convert.model_info_from_proto(model_runner_pb2.ModelInfo()).kv_layout == "gqa"  # an older runner


def test_auto_picks_torch_and_float32_for_mla() -> None:
    shape = {"num_heads": 4, "num_kv_heads": 4, "head_dim": 8}
    for device, built in (("cpu", True), ("cpu", False), ("cuda", False)):
        choice = select_backend("auto", device, "float32", built, **shape, bf16_kernels=True, mla=True)
        assert (choice.value, choice.reason) == ("torch", "auto: MLA (latent KV) runs on the torch backend only")
    assert select_backend("torch", "cpu", "float32", True, **shape, mla=True).value == "torch"
    for requested in ("cpu", "triton"):
        with pytest.raises(FailedPrecondition, match=f"attention_backend={requested} does not implement MLA"):
            select_backend(requested, "cpu", "float32", True, **shape, mla=True)
    dtype = select_dtype("auto", "cpu", AMX, bf16_kernels=True, mla=True)
    assert dtype.value == "float32" and "MLA runs on the torch backend only" in dtype.reason
    assert select_dtype("bfloat16", "cpu", AMX, mla=True).value == "bfloat16"  # explicit stays explicit
    assert select_dtype("auto", "cpu", AMX, bf16_kernels=True).value == "bfloat16"  # GQA unchanged


def test_build_runner_defaults_serve_mla(ds_folder: Path, hf_model: Any, reference_greedy: Any) -> None:
    """The default config (dtype and backend auto, warm-up on) on a bf16 machine's flags: torch,
    fp32, a latent pool sized from the budget, and greedy tokens equal to transformers'."""
    config = RunnerConfig(model_dir=str(ds_folder), block_size=4, kv_cache_memory_bytes=40 * 1920)
    runner = build_runner(config, flags=AMX)
    try:
        info = runner.model_info()
        assert (info.dtype, info.attention_backend, info.kv_layout) == ("float32", "torch", "mla")
        assert info.attention_backend_reason == "auto: MLA (latent KV) runs on the torch backend only"
        assert (info.num_blocks, info.bytes_per_block) == (40, 1920)
        assert runner.pool.shape == (3, 1, 40, 4, 1, 40)
        prompt = [5, 9, 17, 33, 65, 129, 7]
        out = runner.execute(StepInput(0, new_requests=(NewRequestData("r", tuple(prompt), 7, (1, 2, 3), 0, 7),)))
        tokens = [out.sampled[0].token_id]
        for i in range(1, 5):
            step = StepInput(i, cached_requests=(CachedRequestData("r", (), 6 + i, 1),))
            tokens.append(runner.execute(step).sampled[0].token_id)
        assert tokens == reference_greedy(hf_model(ds_folder), prompt, 5)
    finally:
        runner.pool.close()
    with pytest.raises(FailedPrecondition, match="attention_backend=cpu does not implement MLA"):
        build_runner(replace(config, attention_backend="cpu"), flags=AMX)


def test_a_pool_of_the_other_layout_is_refused(ds_folder: Path, tmp_path: Path) -> None:
    model, _ = load_model(ds_folder)
    refused = r"not laid out for this model's mla KV \(\[layers, 1, blocks, block_size, 1, 40\]\)"
    with (KVPool(num_layers=3, num_kv_heads=4, head_dim=8, block_size=4, memory_bytes=1 << 16,
                 dtype=torch.float32, shm_dir=str(tmp_path)) as pool,
          pytest.raises(FailedPrecondition, match=refused)):  # fmt: skip
        ModelRunner(model, pool, TorchMLABackend(), model_id="x")
    assert model.prepared is None  # refused before the model was touched
    with pytest.raises(InvalidArgument, match="planes must be 1"):
        KVPool(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, memory_bytes=1 << 16, dtype=torch.float32,
               shm_dir=str(tmp_path), planes=3)


@pytest.mark.parametrize(("change", "message"), [
    ({"topk_method": "greedy"}, "topk_method 'greedy' is not supported"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
    ({"num_key_value_heads": 2}, "MLA needs num_key_value_heads == num_attention_heads"),
    ({"n_group": 3}, "do not split into 3 groups"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope_type 'llama3' is not supported"),
])  # fmt: skip
def test_unsupported_deepseek_configs_are_refused(ds_folder: Path, change: dict[str, Any], message: str) -> None:
    hf = {**json.loads((ds_folder / "config.json").read_text()), **change}
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf_dict(hf)


def test_an_fp8_latent_pool_is_calibrated_and_a_quarter_of_fp32(ds_folder: Path, make_runner: Any) -> None:
    """fp8 stores the latent plane scaled by the layer's K scale, calibrated from the latent's max."""
    runner = make_runner(ds_folder, kv_cache_dtype="fp8_e4m3")
    assert runner.model_info().kv_bytes_per_token == mla_kv_bytes_per_token(LAYERS, LATENT, ROPE, 1) == 120
    assert runner.pool.bytes_per_block == 4 * 120
    amax = runner.calibrate_kv_scales()  # [layers, 2]: the latent's max in both columns
    assert bool((amax > 0).all()) and torch.equal(amax[:, 0], amax[:, 1])
    assert torch.equal(runner.pool.scales, amax / 448.0)
    out = runner.execute(StepInput(0, new_requests=(NewRequestData("r", (5, 6, 7, 8, 9), 5, (1, 2), 0, 5),)))
    assert len(out.sampled) == 1
    assert runner.pool.tensor[:, 0, 1:3].view(torch.uint8).any()  # the latents were written


# DeepSeek-V3's own config.json from the Hub (legacy rope_scaling, no head_dim), less its
# auto_map and fp8 quantization_config
HUB_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip


def test_deepseek_v3s_hub_config_parses_to_its_numbers() -> None:
    """The real model's config: 576 cached elements per token and layer, 70,272 bf16 bytes per
    token, YaRN tables and softmax scale equal to transformers' for the same config."""
    config = ModelConfig.from_hf_dict(HUB_V3)
    assert config.mla is not None and config.moe is not None
    assert (config.head_dim, config.mla.cache_dim, config.mla.qk_head_dim) == (64, 576, 192)
    assert config.kv_cache_geometry == (1, 1, 576) and config.kv_bytes_per_token(2) == 70_272
    assert (config.moe.n_routed_experts, config.moe.n_group, config.moe.first_k_dense_replace) == (256, 8, 3)
    assert (config.rope.rope_type, config.rope.factor, config.rope.original_max_position_embeddings) == (
        "yarn", 40.0, 4096)
    reference = DeepseekV3Config(**HUB_V3)
    inv_freq, factor = yarn_inv_freq(config.rope, 64)
    expected_freq, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](reference, None)
    assert torch.equal(inv_freq, expected_freq) and factor == expected_factor
    scale = mla_softmax_scale(config.rope, 192)
    assert scale == yarn_apply_mscale(reference.rope_parameters, 192**-0.5) and scale > 192**-0.5
