"""The peers kvmesh is compared with: transformers on the same checkpoint, prompts and output lengths.

- :class:`StaticGeneratePeer`: ``model.generate()`` on the whole batch at once, left-padded with an
  attention mask, ``cache_implementation="static"`` (a preallocated max-length cache per sequence).
- :class:`ContinuousBatchingPeer`: transformers' own continuous batching (``generate_batch``'s
  manager, a paged cache, ``sdpa`` attention). The manager is started before the clock starts and
  stopped after it stops (its start/stop costs 1-3 s on this CPU); ``generate_batch`` itself would
  include both in every call.

Both decode greedily with EOS disabled, so every sequence produces exactly ``output_len`` tokens,
like kvmesh's ``ignore_eos`` + ``max_tokens``. Throughput = output tokens / wall seconds of the call.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PeerRun:
    """One timed run: how many tokens came out, how long it took, and the tokens themselves."""

    output_tokens: int
    seconds: float
    token_ids: tuple[tuple[int, ...], ...]

    @property
    def tokens_per_second(self) -> float:
        """Output tokens per wall-clock second."""
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


def _load(model_dir: str, attn: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn).eval()
    # NOTE: EOS disabled at the source, so no default generation config can bring it back.
    model.generation_config.eos_token_id = None
    return model


def _pad_id(model: Any) -> int:
    pad = model.config.pad_token_id
    return int(pad) if pad is not None else 0


class StaticGeneratePeer:
    """Batched ``generate()`` with a static cache."""

    name = "transformers generate() (static cache, batched)"

    def __init__(self, model_dir: str) -> None:
        self.model = _load(model_dir, "sdpa")

    def run(self, prompts: Sequence[Sequence[int]], output_len: int) -> PeerRun:
        """One batch of every prompt (left-padded), timed around ``generate``."""
        import torch
        from transformers import GenerationConfig

        width = max(len(p) for p in prompts)
        pad = _pad_id(self.model)
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])  # [B, T]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, T]
        config = GenerationConfig(
            max_new_tokens=output_len,
            do_sample=False,
            cache_implementation="static",
            eos_token_id=None,
            pad_token_id=pad,
        )
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, generation_config=config)
        seconds = time.perf_counter() - start
        new = out[:, width:]  # [B, output_len]
        return PeerRun(int(new.numel()), seconds, tuple(tuple(row) for row in new.tolist()))


class ContinuousBatchingPeer:
    """transformers' continuous batching with a paged cache sized for the workload."""

    name = "transformers generate_batch() (continuous batching, paged cache)"

    def __init__(self, model_dir: str, page_size: int = 16, max_batch_tokens: int = 2048) -> None:
        self.model = _load(model_dir, "sdpa")
        self.page_size = page_size
        self.max_batch_tokens = max_batch_tokens

    def run(self, prompts: Sequence[Sequence[int]], output_len: int) -> PeerRun:
        """Adds every request at once and waits for all results; manager start/stop are not timed.

        NOTE: the cache is sized to the workload (every sequence at full length, twice over): left
        to itself, transformers sizes it from free *host* memory on a CPU, tens of GB, and spends
        seconds allocating it.
        """
        from transformers import GenerationConfig
        from transformers.generation import ContinuousBatchingConfig

        longest = max(len(p) for p in prompts) + output_len
        blocks = 2 * len(prompts) * math.ceil(longest / self.page_size)
        cb = ContinuousBatchingConfig(
            page_size=self.page_size, num_blocks=blocks, max_batch_tokens=self.max_batch_tokens
        )
        config = GenerationConfig(
            max_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=_pad_id(self.model)
        )
        results: dict[str, tuple[int, ...]] = {}
        with self.model.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=cb, warmup=False, block=True, timeout=10
        ) as manager:
            start = time.perf_counter()
            ids = manager.add_requests([list(p) for p in prompts], max_new_tokens=output_len)
            while len(results) < len(ids):
                result = manager.get_result(timeout=60)
                if result is None:
                    raise RuntimeError("transformers continuous batching returned no result within 60 s")
                results[result.request_id] = tuple(result.generated_tokens)
            seconds = time.perf_counter() - start
        tokens = tuple(results[i] for i in ids)
        return PeerRun(sum(len(t) for t in tokens), seconds, tokens)
