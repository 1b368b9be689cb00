"""Loading HF checkpoints: every tensor lands where it belongs, or the loader says what is wrong."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.model_runner.loader import ModelLoadError, load_model, parse_dtype
from services.model_runner.model.config import ModelConfig, UnsupportedModelError
from shared.errors import FailedPrecondition


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "llama3"])
def test_weights_match_the_checkpoint(name: str, checkpoint: Callable[[str], Path]) -> None:
    folder = checkpoint(name)
    model, config = load_model(folder)
    hf = load_file(str(folder / "model.safetensors"))
    layer: Any = model.model.layers[1]
    q, k, v = layer.self_attn.qkv_proj.weight.split([config.num_heads * config.head_dim] + [
        config.num_kv_heads * config.head_dim] * 2)  # fmt: skip
    assert torch.equal(q, hf["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(k, hf["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(v, hf["model.layers.1.self_attn.v_proj.weight"])
    gate, up = layer.mlp.gate_up_proj.weight.split(config.intermediate_size)
    assert torch.equal(gate, hf["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(up, hf["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(model.model.norm.weight, hf["model.norm.weight"])
    if name == "qwen2":
        assert config.qkv_bias and not config.o_bias and config.tie_word_embeddings
        assert model.lm_head is None and "lm_head.weight" not in hf
        bias = layer.self_attn.qkv_proj.bias
        assert bias is not None
        assert torch.equal(bias[: config.num_heads * config.head_dim], hf["model.layers.1.self_attn.q_proj.bias"])
    else:
        assert model.lm_head is not None and torch.equal(model.lm_head.weight, hf["lm_head.weight"])
    if name == "mistral":
        assert config.head_dim == 32 != config.hidden_size // config.num_heads
    if name == "llama3":
        assert config.rope.rope_type == "llama3" and config.rope.theta == 500000.0 and config.num_kv_heads == 1


def test_sharded_checkpoint_loads_like_the_single_file(
    checkpoint: Callable[[str], Path], build: Callable[..., Path], tmp_path: Path
) -> None:
    sharded = build(tmp_path / "sharded", "llama", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    ours, _ = load_model(sharded)
    single, _ = load_model(checkpoint("llama"))
    for (name, a), (_, b) in zip(ours.named_parameters(), single.named_parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(("dtype", "expected"), [("float16", torch.float16), ("bf16", torch.bfloat16)])
def test_dtype(dtype: str, expected: torch.dtype, checkpoint: Callable[[str], Path]) -> None:
    model, _ = load_model(checkpoint("qwen2"), dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {expected}
    assert model.model.rotary.cos.dtype == torch.float32  # rope tables stay exact


def test_parse_dtype_rejects_unknown_names() -> None:
    assert parse_dtype("FP32") == torch.float32
    with pytest.raises(ModelLoadError, match="unsupported dtype"):
        parse_dtype("int8")


def _copy(folder: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "copy"
    shutil.copytree(folder, dest)
    return dest


def _edit_tensors(folder: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_missing_tensor_is_named(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    folder = _copy(checkpoint("llama"), tmp_path)
    _edit_tensors(folder, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing.*model\.layers\.0\.self_attn\.k_proj\.weight"):
        load_model(folder)


def test_untied_model_without_lm_head_is_refused(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    folder = _copy(checkpoint("llama"), tmp_path)
    _edit_tensors(folder, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ModelLoadError, match=r"lm_head\.weight"):
        load_model(folder)


def test_unexpected_tensor_is_named(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    folder = _copy(checkpoint("llama"), tmp_path)
    _edit_tensors(folder, lambda t: t.update({"model.layers.9.extra.weight": torch.zeros(2)}))
    with pytest.raises(ModelLoadError, match=r"unexpected.*model\.layers\.9\.extra\.weight"):
        load_model(folder)


def test_shape_mismatch_is_named(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    folder = _copy(checkpoint("llama"), tmp_path)
    _edit_tensors(folder, lambda t: t.update({"model.norm.weight": torch.zeros(3)}))
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight has shape \[3\]"):
        load_model(folder)


def test_ignores_rotary_inv_freq_and_a_redundant_tied_head(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    folder = _copy(checkpoint("qwen2"), tmp_path)

    def add(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    _edit_tensors(folder, add)
    model, _ = load_model(folder)
    assert model.lm_head is None


def test_unsupported_architecture(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    folder = _copy(checkpoint("llama"), tmp_path)
    _edit_config(folder, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedModelError, match=r"GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        load_model(folder)


def test_unsupported_rope_type(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    folder = _copy(checkpoint("llama"), tmp_path)
    _edit_config(folder, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        load_model(folder)


def test_missing_files(tmp_path: Path, checkpoint: Callable[[str], Path]) -> None:
    with pytest.raises(FailedPrecondition, match=r"no config\.json"):
        load_model(tmp_path)
    folder = _copy(checkpoint("llama"), tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(folder)


def test_legacy_config_format_and_generation_config_eos(tmp_path: Path) -> None:
    hf = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 5e5,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072, "eos_token_id": 7, "bos_token_id": 6,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(hf))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    config = ModelConfig.from_dir(tmp_path)
    assert config.rope.theta == 5e5 and config.rope.rope_type == "llama3"
    assert config.rope.original_max_position_embeddings == 8192
    assert config.eos_token_ids == (7, 9) and config.bos_token_id == 6
    assert config.head_dim == 8 and config.max_model_len == 131072


def test_mistral_window_does_not_cap_max_model_len() -> None:
    hf = {
        "architectures": ["MistralForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 32768, "sliding_window": 4096,
    }  # fmt: skip
    config = ModelConfig.from_hf_dict(hf)
    assert config.num_kv_heads == 2 and config.max_model_len == 32768  # the window is honoured, not a cap
    assert config.layer_windows == (4096,) and [g.window for g in config.kv_groups] == [4096]
    with pytest.raises(UnsupportedModelError, match="multiple"):
        ModelConfig.from_hf_dict({**hf, "num_key_value_heads": 3, "num_attention_heads": 4})


def test_qwen3_has_per_head_qk_norms_and_its_window_only_with_use_sliding_window() -> None:
    hf = {
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
        "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 16, "max_position_embeddings": 64,
        "sliding_window": 8, "use_sliding_window": False, "layer_types": ["full_attention", "sliding_attention"],
    }  # fmt: skip
    config = ModelConfig.from_hf_dict(hf)
    assert config.qk_norm and not config.qkv_bias and config.head_dim == 16
    assert config.layer_windows == (None, None) and len(config.kv_groups) == 1
    windowed = ModelConfig.from_hf_dict({**hf, "use_sliding_window": True})
    assert windowed.layer_windows == (None, 8) and [g.window for g in windowed.kv_groups] == [None, 8]
