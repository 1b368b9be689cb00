"""Runs in vLLM's own venv: offline ``LLM.generate`` on token ids, greedy, EOS ignored.

Settings (``job["settings"]``): ``dtype`` (``float32``, or ``auto`` = vLLM's default, bf16 on this
CPU for a float32 checkpoint), ``enforce_eager`` (skips the inductor compile, minutes on two
cores). Everything else is vLLM's default (prefix caching on, chunked prefill). The thread count
goes in through ``VLLM_CPU_OMP_THREADS_BIND``, which the orchestrator sets.

NOTE: vLLM spawns its engine core process, so everything runs under ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # NOTE: run as a script in a foreign venv; only wire.py is imported
    sys.path.insert(0, str(ROOT))

from bench.peerbench import wire  # noqa: E402


def _get(obj: Any, *path: str) -> Any:
    for name in path:
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


class VllmEngine:
    """One ``vllm.LLM`` on the HF folder."""

    def __init__(self, job: dict[str, Any]) -> None:
        from vllm import LLM

        s = job["settings"]
        self.llm = LLM(model=job["model_dir"], dtype=s.get("dtype", "auto"),
                       enforce_eager=bool(s.get("enforce_eager", True)), seed=0,
                       max_model_len=int(s.get("max_model_len", 4096)))

    def generate(self, prompts: Sequence[Sequence[int]], output_len: int) -> list[list[int]]:
        """One ``LLM.generate`` call with every prompt."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def resolved(self) -> dict[str, str]:
        """The dtype and cache settings vLLM resolved."""
        engine = self.llm.llm_engine
        model = _get(engine, "model_config") or _get(engine, "vllm_config", "model_config")
        cache = _get(engine, "vllm_config", "cache_config") or _get(engine, "cache_config")
        sched = _get(engine, "vllm_config", "scheduler_config")
        return {
            "dtype": str(_get(model, "dtype")).removeprefix("torch."),
            "backend": "vLLM CPU (eager)" if _get(model, "enforce_eager") else "vLLM CPU (compiled)",
            "kv_cache_dtype": str(_get(cache, "cache_dtype")),
            "prefix_caching": str(_get(cache, "enable_prefix_caching")),
            "block_size": str(_get(cache, "block_size")),
            "max_num_batched_tokens": str(_get(sched, "max_num_batched_tokens")),
        }

    def close(self) -> None:
        """Shuts the engine core down."""
        shutdown = _get(self.llm, "llm_engine", "engine_core", "shutdown")
        if callable(shutdown):
            shutdown()
        del self.llm


def _versions() -> dict[str, str]:
    import torch
    import vllm

    return {"vllm": str(vllm.__version__), "torch": str(torch.__version__)}


if __name__ == "__main__":
    sys.exit(wire.main(sys.argv, VllmEngine, _versions))
