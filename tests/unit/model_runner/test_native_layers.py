"""The native backend as a transform of the loaded model (``model/native_layers.py``).

The plain layers carry no trace of it; the transform swaps modules in place, keeps the loaded
parameters themselves (same tensors, same names), and the runner applies it exactly when the
attention backend says it runs on native kernels (``AttentionBackend.native_kernels``).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from torch import nn

from services.model_runner.attention.cpu_backend import CpuAttentionBackend
from services.model_runner.kv_pool import KVPool, bytes_per_block
from services.model_runner.loader import load_model
from services.model_runner.model.config import ModelConfig
from services.model_runner.model.layers import MLP, ApplyRotary, Linear, RMSNorm, SiluAndMul
from services.model_runner.model.native_layers import (
    NativeDecoderModel,
    NativeMLP,
    NativeRMSNorm,
    NativeRotary,
    NativeSiluAndMul,
    use_native_kernels,
)
from services.model_runner.model.transforms import prepare_model
from services.model_runner.native import NativeKernels, load_kernels
from services.model_runner.runner import ModelRunner

NATIVE_TYPES = (NativeRMSNorm, NativeRotary, NativeSiluAndMul, NativeDecoderModel)


def _types(model: nn.Module) -> dict[type, int]:
    counts: dict[type, int] = {}
    for module in model.modules():
        counts[type(module)] = counts.get(type(module), 0) + 1
    return counts


def test_the_transform_swaps_every_op_and_keeps_the_parameters(checkpoint: Any) -> None:
    kernels = load_kernels()
    assert kernels is not None, "the native kernels did not build on this machine"
    model, config = load_model(checkpoint("qwen2"))
    plain = _types(model)
    assert not any(t in plain for t in NATIVE_TYPES)
    assert not any(hasattr(m, "kernels") or hasattr(m, "native") for m in model.modules())  # plain torch
    names = [name for name, _ in model.named_parameters()]
    norm_weights = {name: p for name, p in model.named_parameters() if "norm" in name}

    prepare_model(model, "none", kernels=kernels)

    swapped = _types(model)
    assert not any(t in swapped for t in (RMSNorm, ApplyRotary, SiluAndMul))
    assert swapped[NativeRMSNorm] == plain[RMSNorm] == 2 * config.num_layers + 1
    assert swapped[NativeRotary] == plain[ApplyRotary] == config.num_layers
    assert swapped[NativeSiluAndMul] == plain[SiluAndMul] == config.num_layers
    assert isinstance(model.model, NativeDecoderModel)
    assert [name for name, _ in model.named_parameters()] == names  # the loader's names still hold
    for name, p in model.named_parameters():
        if name in norm_weights:
            assert p is norm_weights[name]  # the loaded tensor itself, not a copy
    assert all(m.packed is not None and m.packed.mode == "native" for m in model.modules() if isinstance(m, Linear))

    modules = list(model.modules())
    use_native_kernels(model, kernels)  # again: nothing changes
    assert list(model.modules()) == modules


def test_the_runner_follows_the_backends_native_kernels(checkpoint: Any, tmp_path: Path) -> None:
    """A ``cpu`` backend whose kernels did not build (``native_kernels`` None) serves the torch path."""
    backend = CpuAttentionBackend()
    backend.native_kernels = None
    model, cfg = load_model(checkpoint("llama"))
    per_block = bytes_per_block(cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    with KVPool(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, block_size=4,
                memory_bytes=16 * per_block, dtype=torch.float32, shm_dir=str(tmp_path)) as pool:  # fmt: skip
        runner = ModelRunner(model, pool, backend, model_id="llama")
        assert not any(t in _types(runner.model) for t in NATIVE_TYPES)
        assert all(m.packed is None or m.packed.mode == "fp32" for m in runner.model.modules() if isinstance(m, Linear))


def _bf16_mlp(hidden: int, inter: int, bias: bool, seed: int) -> MLP:
    kernels = load_kernels()
    assert kernels is not None, "the native kernels did not build on this machine"
    config = cast(ModelConfig, SimpleNamespace(hidden_size=hidden, intermediate_size=inter, mlp_bias=bias))
    mlp = MLP(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    mlp.gate_up_proj.pack("native_bf16", kernels)
    mlp.down_proj.pack("native_bf16", kernels)
    mlp.act_fn = NativeSiluAndMul(kernels)
    return mlp


def _bf16_kernels() -> NativeKernels:
    """The native kernels with their bf16 GEMM, or a skip where the CPU has no AVX512-BF16 (the
    GEMM is not built there: bf16 mode is off and NativeMLP never runs, docs/model_runner.md)."""
    kernels = load_kernels()
    assert kernels is not None, "the native kernels must build on every CPU this suite runs on"
    if kernels.linear_bf16 is None:
        pytest.skip("the CPU has no AVX512-BF16: the native bf16 GEMM is not built here")
    return kernels


@pytest.mark.parametrize("bias", [False, True])
def test_the_fused_mlp_is_bitwise_the_unfused_one(bias: bool) -> None:
    """bf16 mode's NativeMLP (gate_up GEMM with SwiGLU in its epilogue for prefill chunks) gives
    the unfused path's bits at every row count: 1..32 rows take the unfused path, 33 and more the
    fused kernel, and each row is bitwise its value computed alone (batch invariance)."""
    kernels = _bf16_kernels()
    mlp = _bf16_mlp(64, 96, bias, seed=3)
    fused = NativeMLP(mlp, kernels)
    assert fused.gate_up_proj is mlp.gate_up_proj and fused.down_proj is mlp.down_proj  # the same modules
    unfused_rows: list[int] = []

    class Counted(SiluAndMul):  # the unfused path's SwiGLU, counting its calls
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            unfused_rows.append(t.shape[0])
            return mlp.act_fn(t)

    fused.act_fn = Counted()
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([mlp(x[i : i + 1]) for i in range(300)])
    for rows in (1, 32, 33, 40, 300):
        assert torch.equal(fused(x[:rows]), mlp(x[:rows])), rows
        assert torch.equal(fused(x[:rows]), alone[:rows]), rows
    assert unfused_rows == [1, 1, 32, 32]  # 33 rows and more never ran the separate SwiGLU


def test_the_fused_mlp_replaces_only_bf16_mlps_of_whole_panels() -> None:
    """use_native_kernels swaps an MLP for NativeMLP when its gate_up is packed for bf16 mode and its
    intermediate size is whole 48-wide panels; 128 (the tiny test models) keeps the plain MLP."""
    kernels = _bf16_kernels()
    holder = nn.Module()
    holder.whole, holder.partial = _bf16_mlp(64, 96, False, seed=5), _bf16_mlp(64, 128, False, seed=6)
    holder.model = nn.Identity()  # no decoder to swap
    use_native_kernels(cast(Any, holder), kernels)
    assert type(holder.whole) is NativeMLP and type(holder.partial) is MLP
