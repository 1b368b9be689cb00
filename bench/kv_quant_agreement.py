"""KV cache precisions against an fp32 cache: bytes per token, blocks in a budget, agreement.

Same fp32 weights and the same attention backend (``--backend``, default ``torch``: only the cache
differs) for every mode; the KV cache holds float32, float16, bfloat16, fp8_e4m3 (per-layer scales,
calibrated as ``factory.build_runner`` does), int4 (``attention/int4.py``), or int4 with the Hadamard
rotation. For each mode:

1. **Geometry**: KV bytes per token (``shared.kv_layout``) and blocks of ``--block-size`` tokens in
   ``--budget-mib`` (``kv_pool.bytes_per_block``, what the pool allocates).
2. **Greedy agreement**: ``--prompts`` fixed prompts, ``--new-tokens`` greedy tokens each, all in one
   batch (``bench/dtype_agreement.py``'s driver): sequences identical to fp32's, tokens before the
   first difference, and the sampled token's logprob error over the common prefix.
3. **Top-1 logit error**, teacher-forced: fp32's whole greedy sequences (prompt + output) prefilled
   through each mode; at every position, ``|logit[t] - logit_fp32[t]|`` of fp32's top-1 token ``t``
   (mean and max), and how often the mode's top-1 is fp32's.

Models: the embedded SmolLM2-135M (``--model``, prompts: ``dtype_agreement.PROMPTS`` tokenized) and
``--tiny`` (a random llama of the unit tests' shape, init 0.2, random token prompts).

Run: ``python bench/kv_quant_agreement.py --model DIR`` (and ``--tiny``); writes
``bench/results/kv_quant_agreement[_tiny].json``. Figures: docs/kv_quantization.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # NOTE: run as a script, the repo root is not on sys.path
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.dtype_agreement import BLOCK_SIZE, DEFAULT_MODEL, PROMPTS, Seq, agreement, greedy  # noqa: E402
from services.model_runner.factory import make_backend  # noqa: E402
from services.model_runner.input_batch import ScheduledRequest, prepare_inputs  # noqa: E402
from services.model_runner.kv_pool import KVPool, bytes_per_block, kv_dtype_for, row_elements  # noqa: E402
from services.model_runner.loader import load_model  # noqa: E402
from services.model_runner.model.context import ForwardContext  # noqa: E402
from services.model_runner.runner import ModelRunner  # noqa: E402
from shared.kv_layout import gqa_kv_bytes_per_token  # noqa: E402

MODES = {  # name -> (kv_cache_dtype, hadamard)
    "fp32": ("float32", False), "fp16": ("float16", False), "bf16": ("bfloat16", False),
    "fp8_e4m3": ("fp8_e4m3", False), "int4": ("int4", False), "int4+hadamard": ("int4", True),
}  # fmt: skip


def build(model_dir: str, mode: str, backend: str, blocks: int) -> ModelRunner:
    kv_name, rotate = MODES[mode]
    model, cfg = load_model(model_dir)
    dtype = kv_dtype_for(kv_name, torch.float32)
    per_block = bytes_per_block(cfg.num_layers, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, dtype)
    pool = KVPool(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                  block_size=BLOCK_SIZE, memory_bytes=blocks * per_block, dtype=dtype, hadamard=rotate)  # fmt: skip
    runner = ModelRunner(model, pool, make_backend(backend, torch.device("cpu")), model_id=Path(model_dir).name)
    if pool.is_fp8:
        runner.calibrate_kv_scales()
    return runner


def all_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), vocab]`` logits, the sequence prefilled in one chunk into blocks 1..n."""
    blocks = list(range(1, -(-len(tokens) // BLOCK_SIZE) + 1))
    batch = prepare_inputs([ScheduledRequest("probe", tokens, blocks, 0, len(tokens))], runner.geometry)
    pool = runner.pool
    ctx = ForwardContext(pool.tensor, pool.layer_scales(), batch.meta, runner.backend, kv_rotation=pool.rotation)
    with torch.inference_mode():
        return runner.model.compute_logits(runner.model(batch.input_ids, batch.positions, ctx)).float()


def logit_error(ref_logits: list[torch.Tensor], other: ModelRunner, seqs: list[Seq]) -> dict[str, Any]:
    errors: list[float] = []
    agree = total = 0
    for a, seq in zip(ref_logits, seqs, strict=True):
        b = all_logits(other, seq.tokens)
        top = a.argmax(-1)
        errors += (a.gather(1, top[:, None]) - b.gather(1, top[:, None])).abs().squeeze(1).tolist()
        agree += int((b.argmax(-1) == top).sum())
        total += len(seq.tokens)
    return {"top1_logit_err_mean": statistics.mean(errors), "top1_logit_err_max": max(errors),
            "top1_agreement": agree / total, "positions": total}  # fmt: skip


def geometry(model_dir: str, budget: int) -> dict[str, Any]:
    from services.model_runner.model.config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    out = {}
    for mode, (kv_name, _) in MODES.items():
        dtype = kv_dtype_for(kv_name, torch.float32)
        per_token = gqa_kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                           row_elements(cfg.head_dim, dtype) * dtype.itemsize / cfg.head_dim)
        per_block = bytes_per_block(cfg.num_layers, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, dtype)
        out[mode] = {"bytes_per_token": per_token, "bytes_per_block": per_block, "blocks": budget // per_block}
    return out


def tiny_model(folder: Path) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                                  max_position_embeddings=512, initializer_range=0.2, bos_token_id=1,
                                  eos_token_id=None, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder, safe_serialization=True)
    return str(folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="HF checkpoint folder (fp32 safetensors)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random llama instead of --model")
    parser.add_argument("--backend", default="torch", choices=["torch", "cpu"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--budget-mib", type=int, default=512)
    parser.add_argument("--modes", default=",".join(MODES), help="compared with fp32 (always run)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model(Path(tmp)) if args.tiny else args.model
        if args.tiny:
            gen = torch.Generator().manual_seed(7)
            prompts = [torch.randint(2, 320, (int(n),), generator=gen).tolist()
                       for n in torch.randint(6, 24, (args.prompts,), generator=gen)]  # fmt: skip
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model_dir)
            prompts = [tok(p)["input_ids"] for p in PROMPTS[: args.prompts]]
        report: dict[str, Any] = {"args": vars(args), "geometry": geometry(model_dir, args.budget_mib << 20)}
        blocks = len(prompts) * -(-(max(map(len, prompts)) + args.new_tokens) // BLOCK_SIZE) + 8
        report["agreement_with_fp32"] = {}
        ref: list[Seq] = []
        ref_logits: list[torch.Tensor] = []
        for mode in [m for m in MODES if m in args.modes.split(",") or m == "fp32"]:
            runner = build(model_dir, mode, args.backend, blocks)  # one at a time: SmolLM2 is 0.5 GB in fp32
            try:
                seqs = greedy(runner, prompts, args.new_tokens, True)
                if mode == "fp32":
                    ref, ref_logits = seqs, [all_logits(runner, s.tokens) for s in seqs]
                    continue
                report["agreement_with_fp32"][mode] = {**agreement(ref, seqs), **logit_error(ref_logits, runner, ref)}
                print(f"  {mode}: done", flush=True)
            finally:
                runner.pool.close()
    for m, g in report["geometry"].items():
        a = report["agreement_with_fp32"].get(m)
        line = f"{m:14s} {g['bytes_per_token']:8.0f} B/token {g['blocks']:6d} blocks in {args.budget_mib} MiB"
        if a:
            line += (f" | {a['identical']}/{a['of']} seqs identical, {a['tokens_agreeing']}/{a['tokens']} tokens"
                     f" before 1st diff, logprob err max {a['logprob_max_err']:.3f} | teacher-forced top-1 logit err"
                     f" mean {a['top1_logit_err_mean']:.4f} max {a['top1_logit_err_max']:.3f},"
                     f" top-1 agreement {a['top1_agreement']:.3f}")
        print(line)
    out = Path(args.out or ROOT / "bench" / "results" / f"kv_quant_agreement{'_tiny' if args.tiny else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
