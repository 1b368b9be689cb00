"""MLA's KV size and fp8 agreement: the figures of docs/mla.md, reproducible.

1. **Bytes per token** of DeepSeek-V3 (61 layers, latent 512, rope 64, 128 heads of 128) by
   ``shared/kv_layout.py``'s formula, MLA against its MHA equivalent, the expanded K/V and an
   8-group GQA, at fp32 / bf16 / fp8, with the 16-token blocks a 512 MiB pool holds.
2. **fp8 agreement with fp32** on tiny random checkpoints built here (the tests' DeepSeek-V3
   variants and the tests' tiny Llama): ``--prompts`` random prompts of ``--length`` tokens, one
   prefill each through runners built by ``factory.build_runner``; top-1 agreement of every
   position's logits and the largest logit error.

Run: ``python bench/mla_kv.py [--prompts 8] [--length 64]``; prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # NOTE: run as a script, the repo root is not on sys.path
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.model_runner.config import RunnerConfig  # noqa: E402
from services.model_runner.factory import build_runner  # noqa: E402
from services.model_runner.input_batch import ScheduledRequest, prepare_inputs  # noqa: E402
from services.model_runner.model.context import ForwardContext  # noqa: E402
from services.model_runner.runner import ModelRunner  # noqa: E402
from shared.kv_layout import gqa_kv_bytes_per_token, mla_kv_bytes_per_token  # noqa: E402

POOL_BYTES, BLOCK = 512 << 20, 16


def size_table() -> list[dict[str, Any]]:
    """DeepSeek-V3's bytes per token per layout and dtype, and blocks of 16 in 512 MiB."""
    layouts = {
        "MLA (512 + 64)": lambda b: mla_kv_bytes_per_token(61, 512, 64, b),
        "MHA equivalent (128 x 128)": lambda b: gqa_kv_bytes_per_token(61, 128, 128, b),
        "expanded K 192 / V 128, 128 heads": lambda b: 61 * 128 * (192 + 128) * b,
        "GQA 8 x 128": lambda b: gqa_kv_bytes_per_token(61, 8, 128, b),
    }
    rows = []
    for name, formula in layouts.items():
        for dtype, size in (("fp32", 4), ("bf16", 2), ("fp8", 1)):
            per_token = formula(size)
            rows.append({"layout": name, "dtype": dtype, "bytes_per_token": per_token,
                         "vs_mla": per_token / mla_kv_bytes_per_token(61, 512, 64, size),
                         "blocks_in_512MiB": int(POOL_BYTES // (BLOCK * per_token))})
    return rows


def _logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    blocks = list(range(1, -(-len(tokens) // runner.pool.block_size) + 1))
    batch = prepare_inputs([ScheduledRequest("p", tokens, blocks, 0, len(tokens))], runner.geometry)
    ctx = ForwardContext(runner.pool.tensor, runner.pool.layer_scales(), batch.meta, runner.backend)
    with torch.inference_mode():
        return runner.model.compute_logits(runner.model(batch.input_ids, batch.positions, ctx))


def agreement(folder: Path, prompts: int, length: int) -> dict[str, Any]:
    """fp8 KV against fp32 KV on one checkpoint (both fp32 weights, torch backend)."""
    common = {"model_dir": str(folder), "block_size": 4, "kv_cache_memory_bytes": 4 << 20, "warmup": False,
              "dtype": "float32", "attention_backend": "torch"}
    ref, fp8 = (build_runner(RunnerConfig(**common, kv_cache_dtype=kv)) for kv in ("auto", "fp8_e4m3"))  # type: ignore[arg-type]
    try:
        same = total = 0
        err = 0.0
        for seed in range(prompts):
            tokens = torch.randint(2, 320, (length,), generator=torch.Generator().manual_seed(100 + seed)).tolist()
            a, b = _logits(ref, tokens), _logits(fp8, tokens)
            same += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += a.shape[0]
            err = max(err, float((a - b).abs().max()))
        return {"kv_layout": ref.model_info().kv_layout, "top1_agree": same, "positions": total,
                "max_logit_error": round(err, 3), "kv_bytes_per_token_fp32": ref.model_info().kv_bytes_per_token,
                "kv_bytes_per_token_fp8": fp8.model_info().kv_bytes_per_token}
    finally:
        ref.pool.close()
        fp8.pool.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    args = parser.parse_args(argv)
    from tests.unit.model_runner.conftest import build_checkpoint
    from tests.unit.model_runner.mla_checkpoints import VARIANTS, build_deepseek

    result: dict[str, Any] = {"deepseek_v3_sizes": size_table(), "fp8_agreement": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted(VARIANTS):
            folder = build_deepseek(Path(tmp) / name, name)
            result["fp8_agreement"][name] = agreement(folder, args.prompts, args.length)
        folder = build_checkpoint(Path(tmp) / "llama", "llama")
        result["fp8_agreement"]["llama"] = agreement(folder, args.prompts, args.length)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
