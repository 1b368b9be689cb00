"""Builds a :class:`ModelRunnerCore` from a :class:`RunnerConfig`: device, model, pool, backend.

Shared by the service's ``main.py`` and the in-process engine, so both build the runner the same way.
"""

from __future__ import annotations

from pathlib import Path

import torch

from services.model_runner.attention.base import AttentionBackend
from services.model_runner.config import RunnerConfig
from services.model_runner.kv_pool import KVPool, kv_dtype_for
from services.model_runner.loader import load_model, parse_dtype
from services.model_runner.runner import ModelRunnerCore


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when available."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto``: the Triton kernels on CUDA, the torch reference on CPU."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from services.model_runner.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "cpu":
        from services.model_runner.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    from services.model_runner.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


def build_runner(config: RunnerConfig) -> ModelRunnerCore:
    """Loads the model, allocates the pool from the memory budget, picks the backend."""
    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    device = resolve_device(config.device)
    dtype = parse_dtype(config.dtype)
    model, mcfg = load_model(config.model_dir, dtype=dtype, device=device)
    pool = KVPool(
        num_layers=mcfg.num_layers, num_kv_heads=mcfg.num_kv_heads, head_dim=mcfg.head_dim,
        block_size=config.block_size, memory_bytes=config.kv_cache_memory_bytes,
        dtype=kv_dtype_for(config.kv_cache_dtype, dtype), device=device,
    )
    core = ModelRunnerCore(
        model, pool, make_backend(config.attention_backend, device),
        model_id=config.model_id or Path(config.model_dir).name,
        max_model_len=config.max_model_len or None, quantization=config.quantization,
        pack_tied_head=config.pack_tied_head,
    )
    if pool.is_fp8:
        core.calibrate_kv_scales()
    if config.warmup:
        core.warmup()
    return core
