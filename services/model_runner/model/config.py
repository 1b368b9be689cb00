"""The model's shape and numerics, read once from a Hugging Face ``config.json``.

Only what the decoder needs is kept, in a frozen dataclass, so the rest of the runner never touches
the loosely typed HF dict. Both config formats are accepted: transformers >= 5 writes
``rope_parameters`` (with ``rope_theta`` inside); older checkpoints (and most on the Hub) have a
top-level ``rope_theta`` plus an optional ``rope_scaling`` dict.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import FailedPrecondition
from shared.kv_layout import KVGroup, kv_groups

# Architecture name -> (qkv projections carry a bias by design, model_type).
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, str]] = {
    "LlamaForCausalLM": (False, "llama"),
    "MistralForCausalLM": (False, "mistral"),
    "Qwen2ForCausalLM": (True, "qwen2"),
    "Qwen3ForCausalLM": (False, "qwen3"),
}
_BY_MODEL_TYPE = {model_type: arch for arch, (_, model_type) in SUPPORTED_ARCHITECTURES.items()}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(FailedPrecondition):
    """The checkpoint's architecture or one of its options is not implemented here."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; ``factor`` etc. only matter for the scaled rope types."""

    theta: float = 10000.0
    rope_type: str = "default"  # "default", "linear" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs; built by :meth:`from_hf_dict` / :meth:`from_dir`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each query and key head before rotary
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None  # None = full attention at every length
    # per layer: its sliding window in tokens, None = full attention (empty: every layer uses
    # ``sliding_window``); see :attr:`layer_windows`
    layer_types_windows: tuple[int | None, ...] = ()
    torch_dtype: str = "float32"  # the checkpoint's declared dtype (informational)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise UnsupportedModelError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None = full attention), as transformers decides it.

        ``layer_types`` in config.json (transformers >= 4.56 writes it for Qwen2/Qwen3, Gemma-style
        models list their alternation there) names each layer ``sliding_attention`` or
        ``full_attention``; without it (Mistral) every layer uses ``sliding_window``.
        """
        if self.layer_types_windows:
            return self.layer_types_windows
        return (self.sliding_window,) * self.num_layers

    @property
    def kv_groups(self) -> tuple[KVGroup, ...]:
        """The KV cache groups of this model's layers (``shared/kv_layout.py``)."""
        return kv_groups(self.layer_windows)

    @property
    def max_model_len(self) -> int:
        """Longest sequence served: ``max_position_embeddings`` (every attention path honours each
        layer's window, so a window does not cap it; docs/kv_layout.md)."""
        return self.max_position_embeddings

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Reads ``<path>/config.json``."""
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise FailedPrecondition(f"no config.json in {path}")
        with config_path.open() as f:
            hf = json.load(f)
        # NOTE: instruct checkpoints often list extra end-of-turn ids only in generation_config.json.
        generation_path = Path(path) / "generation_config.json"
        if generation_path.is_file():
            with generation_path.open() as f:
                extra = json.load(f).get("eos_token_id")
            if extra is not None:
                hf = {**hf, "eos_token_id": _as_list(hf.get("eos_token_id")) + _as_list(extra)}
        return cls.from_hf_dict(hf)

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Builds the config from a parsed HF ``config.json``; raises on unsupported models."""
        arch = _architecture(hf)
        implied_qkv_bias, _ = SUPPORTED_ARCHITECTURES[arch]
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        num_heads = int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // num_heads
        attention_bias = bool(hf.get("attention_bias", False))
        sliding_window = hf.get("sliding_window")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not hf.get("use_sliding_window", False):
            sliding_window = None
        num_layers = int(hf["num_hidden_layers"])
        layer_types = hf.get("layer_types")
        windows: tuple[int | None, ...] = ()
        if layer_types:
            if len(layer_types) != num_layers:
                raise UnsupportedModelError(f"layer_types lists {len(layer_types)} layers, the model has {num_layers}")
            unknown = set(layer_types) - {"full_attention", "sliding_attention"}
            if unknown:
                raise UnsupportedModelError(f"layer_types {sorted(unknown)} are not supported")
            windows = tuple(
                None if kind == "full_attention" or sliding_window is None else int(sliding_window)
                for kind in layer_types
            )
        eos_ids = tuple(dict.fromkeys(int(e) for e in _as_list(hf.get("eos_token_id"))))
        bos = hf.get("bos_token_id")
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=_rope(hf, int(hf.get("max_position_embeddings", 2048))),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=implied_qkv_bias or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            sliding_window=None if sliding_window is None else int(sliding_window),
            layer_types_windows=windows,
            torch_dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
        )


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _architecture(hf: Mapping[str, Any]) -> str:
    archs = hf.get("architectures") or []
    if not archs and hf.get("model_type") in _BY_MODEL_TYPE:
        archs = [_BY_MODEL_TYPE[hf["model_type"]]]
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return str(arch)
    supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    found = archs or hf.get("model_type") or "nothing"
    raise UnsupportedModelError(f"unsupported architecture {found!r}; supported: {supported}")


def _rope(hf: Mapping[str, Any], max_position_embeddings: int) -> RopeConfig:
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
    defaults = RopeConfig()
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", defaults.factor)),
        low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", max_position_embeddings)),
    )
