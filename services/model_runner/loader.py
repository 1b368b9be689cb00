"""Loading a local Hugging Face checkpoint folder into :class:`CausalLM`.

A folder holds ``config.json`` and either one ``*.safetensors`` file or several, listed by
``model.safetensors.index.json``. HF tensor names map onto ours one to one, except q/k/v and
gate/up, which land in row ranges of the merged ``qkv_proj`` / ``gate_up_proj``. Every parameter
must be filled exactly once and every tensor in the files must find a home; anything else is a
:class:`ModelLoadError` that names the tensors, because a silently half-loaded model produces
fluent garbage.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from services.model_runner.model.config import ModelConfig
from services.model_runner.model.deepseek import DeepseekModel
from services.model_runner.model.layers import Linear
from services.model_runner.model.transformer import CausalLM
from shared.errors import FailedPrecondition

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

# Our merged module -> the HF modules stacked in it (its siblings), in row order; by the module's
# own name, so every MLP merges alike (a layer's, each MoE expert's, the shared experts').
_MERGED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# Tensors some checkpoints carry that the model recomputes or does not need.
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.rotary_emb\.)")


class ModelLoadError(FailedPrecondition):
    """The checkpoint folder does not match the model it declares."""


def parse_dtype(name: str) -> torch.dtype:
    """``"float32"`` / ``"fp16"`` / ``"bf16"``... -> the torch dtype; raises on anything else."""
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ModelLoadError(f"unsupported dtype {name!r}; use one of {sorted(set(DTYPES))}") from None


def load_model(
    path: str | Path, dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu"
) -> tuple[CausalLM, ModelConfig]:
    """Builds the model a folder describes and fills it from its safetensors files.

    Args:
        path: folder with ``config.json`` and ``*.safetensors`` (optionally an index).
        dtype: weights dtype (the checkpoint's own dtype is converted).
        device: where the weights live.

    Returns:
        The model in eval mode, and its config.

    Raises:
        ModelLoadError: missing files, or missing / unexpected / misshapen tensors.
        UnsupportedModelError: an architecture or option not implemented.
    """
    folder = Path(path)
    config = ModelConfig.from_dir(folder)
    torch_dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    with torch.device(device):
        model = CausalLM(config, DeepseekModel(config) if config.mla is not None else None)
    # NOTE: cast parameters only; the rope tables stay float32 and are cast per step. Parameters
    # marked keep_fp32 (the MoE router's) stay float32, as transformers keeps them.
    for param in model.parameters():
        if not getattr(param, "keep_fp32", False):
            param.data = param.data.to(torch_dtype)
    load_weights(model, safetensors_files(folder))
    return model.eval(), config


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files: those named by ``model.safetensors.index.json`` if present, else all."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with index.open() as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [folder / name for name in names]
        missing = [str(p.name) for p in files if not p.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists files that do not exist: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {folder}")
    return files


def load_weights(model: CausalLM, files: list[Path]) -> None:
    """Copies every tensor of ``files`` into ``model``; raises unless each parameter got exactly its data."""
    targets = hf_weight_map(model)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for hf_name in f.keys():  # noqa: SIM118  (safe_open is not a dict)
                if hf_name not in targets:
                    tied_head = hf_name == "lm_head.weight" and model.lm_head is None
                    if not (tied_head or _IGNORED.search(hf_name)):
                        unexpected.append(hf_name)
                    continue
                dest = targets[hf_name]
                tensor = f.get_tensor(hf_name)
                if tensor.shape != dest.shape:
                    raise ModelLoadError(
                        f"{file.name}: {hf_name} has shape {list(tensor.shape)}, the model expects {list(dest.shape)}"
                    )
                dest.copy_(tensor)
                loaded.add(hf_name)
    if unexpected:
        raise ModelLoadError(f"unexpected tensors in the checkpoint: {sorted(unexpected)[:20]}")
    missing = sorted(set(targets) - loaded)
    if missing:
        raise ModelLoadError(f"tensors missing from the checkpoint: {missing[:20]}")


def hf_weight_map(model: CausalLM) -> dict[str, torch.Tensor]:
    """HF tensor name -> the (view of the) parameter data it is copied into.

    Merged projections contribute one entry per stacked HF tensor, each a row-slice view.
    """
    modules = dict(model.named_modules())
    targets: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        module_name, kind = name.rsplit(".", 1)
        module = modules[module_name]
        prefix, _, local = module_name.rpartition(".")
        if isinstance(module, Linear) and local in _MERGED:
            for shard, hf_module in enumerate(_MERGED[local]):
                start, rows = module.shard_offset(shard)
                targets[f"{prefix}.{hf_module}.{kind}"] = param.data[start : start + rows]
        else:
            targets[name] = param.data
    return targets
