"""Runs in llama-cpp-python's venv: batched greedy decoding through llama.cpp's C API.

The high-level ``Llama`` class decodes one sequence at a time; a batch of 32 would then measure 32
single streams. So this worker drives ``llama_decode`` itself, as llama.cpp's own
``batched`` example and ``llama-server`` do: every prompt a sequence of its own (``n_seq_max`` =
the batch), prompts fed in batches of at most ``n_batch`` tokens with logits only at each
prompt's last token, then one token per sequence per step, argmax of the logits (greedy; EOS is
not special here, so exactly ``output_len`` tokens come out).

Settings (``job["settings"]``): ``kv_type`` ``f32`` or ``f16`` (llama.cpp's default KV type is
f16; the F32 row uses f32 so it is an fp32 row end to end). One context per workload shape is
built at start-up, so no timed call allocates one. Threads: ``job["threads"]`` for both the
decode and the batch (prompt) phases.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # NOTE: run as a script in a foreign venv; only wire.py is imported
    sys.path.insert(0, str(ROOT))

from bench.peerbench import wire  # noqa: E402

N_BATCH = 2048  # llama.cpp's default logical batch (tokens per llama_decode call)
KV_TYPES = {"f32": 0, "f16": 1}  # GGML_TYPE_F32, GGML_TYPE_F16


class _Context:
    """One ``llama_context`` for up to ``n_seq`` sequences of up to ``seq_len`` tokens each."""

    def __init__(self, lib: Any, model: Any, n_seq: int, seq_len: int, threads: int, kv_type: int) -> None:
        params = lib.llama_context_default_params()
        params.n_seq_max = n_seq
        params.n_ctx = n_seq * seq_len
        params.n_batch = N_BATCH
        params.n_threads = threads
        params.n_threads_batch = threads
        params.type_k = kv_type
        params.type_v = kv_type
        params.no_perf = True
        self.lib = lib
        self.n_seq = n_seq
        self.seq_len = seq_len
        self.ctx = lib.llama_init_from_model(model, params)
        if not self.ctx:
            raise RuntimeError(f"llama_init_from_model failed for {n_seq} x {seq_len} tokens")
        self.batch = lib.llama_batch_init(max(N_BATCH, n_seq), 0, 1)

    def free(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)


class LlamaCppEngine:
    """A GGUF model and one context per workload shape."""

    def __init__(self, job: dict[str, Any]) -> None:
        import llama_cpp
        import numpy as np

        self.lib = llama_cpp
        self.np = np
        llama_cpp.llama_backend_init()
        settings = job["settings"]
        params = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(settings["gguf"].encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {settings['gguf']}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.kv_type = settings.get("kv_type", "f16")
        self.contexts: list[_Context] = []
        for w in job["workloads"]:
            seq_len = max(len(p) for rep in w["repeats"] for p in rep) + int(w["output_len"])
            n_seq = max(len(rep) for rep in w["repeats"])
            # NOTE: rounded up to 256 cells per sequence, llama.cpp's own padding of the KV size
            self.contexts.append(_Context(llama_cpp, self.model, n_seq, -(-seq_len // 256) * 256, int(job["threads"]),
                                          KV_TYPES[self.kv_type]))

    def _context(self, n_seq: int, seq_len: int) -> _Context:
        fits = [c for c in self.contexts if c.n_seq >= n_seq and c.seq_len >= seq_len]
        if not fits:
            raise RuntimeError(f"no context for {n_seq} x {seq_len} tokens")
        return min(fits, key=lambda c: c.n_seq * c.seq_len)

    def _argmax(self, ctx: Any, index: int) -> int:
        logits = self.np.ctypeslib.as_array(self.lib.llama_get_logits_ith(ctx, index), shape=(self.n_vocab,))
        return int(logits.argmax())

    def _decode(self, c: _Context, items: Sequence[tuple[int, int, int, bool]]) -> dict[int, int]:
        """Feeds ``(token, pos, seq, want_logits)`` items; returns seq -> argmax where logits were asked."""
        b = c.batch
        for i, (tok, pos, seq, want) in enumerate(items):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if want else 0
        b.n_tokens = len(items)
        rc = self.lib.llama_decode(c.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return {seq: self._argmax(c.ctx, i) for i, (_, _, seq, want) in enumerate(items) if want}

    def generate(self, prompts: Sequence[Sequence[int]], output_len: int) -> list[list[int]]:
        """Prefill every prompt, then ``output_len`` greedy steps of the whole batch."""
        c = self._context(len(prompts), max(len(p) for p in prompts) + output_len)
        self.lib.llama_memory_clear(self.lib.llama_get_memory(c.ctx), True)
        items = [(int(t), pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, t in enumerate(p)]
        nxt: dict[int, int] = {}
        for start in range(0, len(items), N_BATCH):
            nxt.update(self._decode(c, items[start:start + N_BATCH]))
        out: list[list[int]] = [[nxt[s]] for s in range(len(prompts))]
        for step in range(1, output_len):
            step_items = [(out[s][-1], len(p) + step - 1, s, True) for s, p in enumerate(prompts)]
            nxt = self._decode(c, step_items)
            for s in range(len(prompts)):
                out[s].append(nxt[s])
        return out

    def resolved(self) -> dict[str, str]:
        """The GGUF's own description (type and size), the KV type, llama.cpp's CPU feature line."""
        buf = ctypes.create_string_buffer(256)
        self.lib.llama_model_desc(self.model, buf, len(buf))
        desc = buf.value.decode(errors="replace")
        info = self.lib.llama_print_system_info().decode(errors="replace")
        return {"dtype": desc.split()[-1] if desc else "?", "backend": f"llama.cpp CPU ({desc})",
                "kv_cache_dtype": self.kv_type, "system_info": info}

    def close(self) -> None:
        """Frees every context and the model."""
        for c in self.contexts:
            c.free()
        self.lib.llama_model_free(self.model)


def _versions() -> dict[str, str]:
    from importlib import metadata

    return {"llama-cpp-python": metadata.version("llama-cpp-python"), "numpy": metadata.version("numpy")}


if __name__ == "__main__":
    sys.exit(wire.main(sys.argv, LlamaCppEngine, _versions))
