"""The ``cpu`` attention backend: decodes and prefill chunks through native kernels that read the
paged cache in place, anything else (caches neither fp32 nor bf16 nor INT4, shapes the kernels
refuse) through the torch reference.

Decode attention is what a busy server spends its attention time on, and it is memory-bound: the
torch reference must gather each sequence's blocks into a contiguous buffer before SDPA (no torch
op reads a paged cache), which moves every K/V byte two to three times. The native kernel
(``native/paged_decode.c``) reads each block once, in place, for all query heads of a KV head.
It is not bitwise SDPA (another summation order and exp), so greedy outputs agree with the torch
path and with transformers as any two fp32 implementations do: token for token except at
near-ties of the top two logits (tested on the tiny models and SmolLM2, see docs/model_runner.md).
Prefill chunks take ``native/prefill_attention.c`` (SDPA over a gathered chunk was ~40% of a
bf16-mode prefill step): register-blocked, each row's numbers fixed by its own query, keys and
length, so a prompt chunked any way gives the same bits (docs/model_runner.md, "Prefill").
With ``batch_invariant`` the prefill rows take the decode kernel too, one decode per position, so
no row's numbers depend on how its prompt was chunked (docs/model_runner.md, "auto").
INT4 caches (``uint8``) take ``native/int4_kv.c`` for the writes and for every query row, prefill
rows as decodes of their positions (``attention/int4_native.py``).
bf16 caches (bf16 mode's default, docs/kv_quantization.md) take the same kernels' bf16 entry points:
the write rounds to nearest even (torch's conversion, bit for bit). Where the build has AVX512-BF16
(and head_dim is a multiple of 32, the block size even) both kernels attend them in bf16 dot
products (the query and the softmax numerators rounded to bf16, fp32 sums; ``native/kv_elem.h``,
docs/model_runner.md, "bf16 attention"); elsewhere they widen each value exactly and compute in
fp32, bitwise the fp32 kernels over a pool of the rounded values. Either way a prefill row is
bitwise the decode of its position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.model_runner.attention import int4_native
from services.model_runner.attention.base import AttentionMetadata, MetaCache
from services.model_runner.attention.int4 import INT4_DTYPE
from services.model_runner.attention.int4_native import rows_contiguous as _rows_contiguous
from services.model_runner.attention.torch_backend import Chunk, TorchAttentionBackend, make_chunks
from services.model_runner.native import NativeKernels, is_cpu_fp32, is_cpu_kv, load_kernels


@dataclass(frozen=True)
class NativeDecodePlan:
    """One step's decode arrays (int32, contiguous) and its multi-row chunks, shared by all layers."""

    rows: torch.Tensor  # [n] query row of each decode
    seq_lens: torch.Tensor  # [n]
    tables: torch.Tensor  # [n, W]
    max_len: int
    chunks: list[Chunk]
    # [W] int32: each chunk's sequence's whole block table row, for the prefill kernel. NOTE: not the
    # chunk's own block_ids, which start at its window's first block: the kernels see absolute key
    # positions, since the AMX tiles (attention_amx.c) group keys by them, as a decode does.
    chunk_tables: tuple[torch.Tensor, ...] = ()
    window: int = 0  # the group's sliding window as the kernels take it, 0 = full attention


class CpuAttentionBackend(TorchAttentionBackend):
    """:class:`TorchAttentionBackend` with decodes and prefill chunks on the native paged kernels
    (fp32 or bf16 caches on CPU; INT4 through ``int4_native``)."""

    name = "cpu"

    def __init__(self, portable: bool = False, batch_invariant: bool = False, plain: bool = False) -> None:
        """
        Args:
            portable: use the build without the AVX-512 paths (AVX2 where the CPU has it; tests).
            plain: use the build without AVX2 either, the plain C loops (tests).
            batch_invariant: attend every query row, prefill rows included, as a decode of its
                own position (``RunnerConfig.batch_invariant``): a row's numbers then depend on
                nothing but its sequence and position, so chunked prefill, prefix-cache hits and
                preemption's recompute are bitwise a cold run's, and every step (prefills, mixed
                steps) runs the one-call native stack. Where the prefill kernel runs, the bits
                are the default's (its rows are the decode kernel's); prefill attention is slower
                (a decode per row instead of the prefill kernel's tiles; docs/model_runner.md).
        """
        super().__init__()
        self.batch_invariant = batch_invariant
        # None when the kernels cannot be built here: every call then takes the torch path.
        self.native_kernels: NativeKernels | None = load_kernels(portable, plain=plain)
        self._native_plans: MetaCache[NativeDecodePlan] = MetaCache()
        self._row_plans: MetaCache[NativeDecodePlan] = MetaCache()  # every row a decode (INT4 reads)

    def write_kv(
        self,
        key: torch.Tensor,  # [T, KV, D]
        value: torch.Tensor,  # [T, KV, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Stores K/V at their slots with one native call (a decode step writes a few KB per layer:
        less than the OpenMP fork of ``index_copy_``)."""
        kernels = self.native_kernels
        if k_cache.dtype == INT4_DTYPE and int4_native.write_kv(kernels, key, value, k_cache, v_cache, slot_mapping):
            return
        if (kernels is None or not (is_cpu_fp32(key) and is_cpu_fp32(value) and is_cpu_kv(k_cache))
                or v_cache.dtype != k_cache.dtype
                or not _rows_contiguous(key) or not _rows_contiguous(value)
                or not k_cache.is_contiguous() or not v_cache.is_contiguous() or slot_mapping.dtype != torch.int64
                or not slot_mapping.is_contiguous()):
            super().write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
            return
        write = kernels.write_kv_bf16 if k_cache.dtype == torch.bfloat16 else kernels.write_kv
        write(
            key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
            k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), key.shape[0],
            key.shape[1] * key.shape[2], k_cache.shape[0] * k_cache.shape[1],
        )  # fmt: skip

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        softmax_scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [T, H, D]
        """Causal varlen attention; decodes in place on the paged cache."""
        kernels = self.native_kernels
        if kernels is not None and k_cache.dtype == INT4_DTYPE:
            out = int4_native.forward(kernels, self._plan_native(meta, k_cache.shape[1], per_row=True), query,
                                      k_cache, v_cache, softmax_scale, meta.window or 0)
            if out is not None:
                return out
        if (kernels is None or not (is_cpu_fp32(query) and is_cpu_kv(k_cache)) or v_cache.dtype != k_cache.dtype
                or not k_cache.is_contiguous() or not v_cache.is_contiguous()):
            return super().forward(query, k_cache, v_cache, meta, softmax_scale, k_scale, v_scale)
        bf16 = k_cache.dtype == torch.bfloat16
        plan = self._plan_native(meta, k_cache.shape[1])
        if not _rows_contiguous(query):
            query = query.contiguous()
        num_heads, head_dim = query.shape[1], query.shape[2]
        out = torch.empty(query.shape, dtype=query.dtype)
        n = plan.rows.shape[0]
        if n:
            status = (kernels.paged_decode_bf16 if bf16 else kernels.paged_decode)(
                query.data_ptr(), query.stride(0),
                k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
                plan.tables.data_ptr(), plan.tables.stride(0),
                plan.seq_lens.data_ptr(), plan.rows.data_ptr(), n,
                out.data_ptr(), out.stride(0),
                num_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
                plan.max_len, softmax_scale, plan.window,
            )  # fmt: skip
            if status != 0:
                raise RuntimeError(f"native paged decode failed with status {status}")
        self._attend_prefill(kernels, plan, query, k_cache, v_cache, out, softmax_scale, k_scale, v_scale)
        return out

    def _attend_prefill(
        self, kernels: NativeKernels, plan: NativeDecodePlan, query: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, out: torch.Tensor, softmax_scale: float, k_scale: float, v_scale: float,
    ) -> None:
        """The multi-row chunks through ``prefill_attention.c`` (causal, in place on the paged
        cache; where its tiles do not take the shape, as on a CPU without AVX2 or with an odd head
        size, each row as the decode of its position); a shape the decode kernel refuses too through
        SDPA."""
        num_heads, head_dim = query.shape[1], query.shape[2]
        attend = kernels.prefill_attention_bf16 if k_cache.dtype == torch.bfloat16 else kernels.prefill_attention
        rest: list[Chunk] = []
        for chunk, table in zip(plan.chunks, plan.chunk_tables, strict=True):
            num_q = chunk.end - chunk.start
            seq_len = chunk.table_len(k_cache.shape[1])
            status = attend(
                query.data_ptr() + chunk.start * query.stride(0) * query.element_size(), query.stride(0),
                k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
                table.data_ptr(), num_q, seq_len,
                out.data_ptr() + chunk.start * out.stride(0) * out.element_size(), out.stride(0),
                num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], softmax_scale, plan.window,
            )  # fmt: skip
            if status == -2:
                raise RuntimeError("native prefill attention could not allocate its buffers")
            if status != 0:
                rest.append(chunk)
        if rest:
            window = plan.window or None
            self._attend_chunks(query, k_cache, v_cache, rest, out, softmax_scale, k_scale, v_scale, window)

    def stack_plan(self, meta: AttentionMetadata, block_size: int, num_tokens: int) -> NativeDecodePlan | None:
        """The step's native plan when the kernels are built and every one of the ``num_tokens``
        rows is a decode or a row of a prefill chunk (no padding row); else None.

        The native layer stack (``model/native_stack.py``) runs a whole step's layers from it, the
        decode rows on the paged decode kernel and each chunk on the prefill kernel, as
        :meth:`forward` does layer by layer.
        """
        if self.native_kernels is None:
            return None
        plan = self._plan_native(meta, block_size)
        covered = plan.rows.shape[0] + sum(chunk.end - chunk.start for chunk in plan.chunks)
        return plan if covered == num_tokens else None

    def _plan_native(self, meta: AttentionMetadata, block_size: int, per_row: bool = False) -> NativeDecodePlan:
        """``per_row``: every query row a decode of its own position, as ``batch_invariant`` does."""
        if per_row and not self.batch_invariant:
            return self._row_plans.get(meta, lambda: _native_plan(meta, block_size, True))
        return self._native_plans.get(meta, lambda: _native_plan(meta, block_size, self.batch_invariant))


def _native_plan(meta: AttentionMetadata, block_size: int, per_row: bool) -> NativeDecodePlan:
    """The native decode arrays of one step's metadata (see :meth:`CpuAttentionBackend._plan_native`)."""
    num_seqs = meta.seq_lens.shape[0]
    if meta.max_query_len == 1 and int(meta.query_start_loc[-1]) == num_seqs:
        # NOTE: every sequence one decode row (a decode step; ``per_row`` changes nothing then): the
        # arrays are the metadata's own, with no Python pass over the sequences.
        decode_lens = meta.seq_lens.to(torch.int32).contiguous()
        return NativeDecodePlan(rows=meta.query_start_loc[:-1].to(torch.int32).contiguous(), seq_lens=decode_lens,
                                tables=meta.block_tables.to(torch.int32).contiguous(),
                                max_len=int(decode_lens.max()) if num_seqs else 0, chunks=[],
                                window=meta.window or 0)  # fmt: skip
    starts: list[int] = meta.query_start_loc.tolist()
    seq_lens: list[int] = meta.seq_lens.tolist()
    tables = meta.block_tables.to(torch.int32)
    if per_row:
        # Every query row is a decode of its own position: row j of a q-row chunk at the end
        # of a seq_len context sees seq_len - q + 1 + j keys.
        seqs = [i for i in range(len(seq_lens)) for _ in range(starts[i], starts[i + 1])]
        rows = list(range(starts[-1])) if starts else []
        lens = [seq_lens[i] - (starts[i + 1] - r) + 1 for r, i in zip(rows, seqs, strict=True)]
        chunks: list[Chunk] = []
    else:
        seqs = [i for i in range(len(seq_lens)) if starts[i + 1] - starts[i] == 1]
        rows, lens = [starts[i] for i in seqs], [seq_lens[i] for i in seqs]
        chunks = make_chunks(meta, starts, seq_lens, block_size)
    if seqs != list(range(len(seq_lens))):
        tables = tables[torch.tensor(seqs, dtype=torch.long)]
    return NativeDecodePlan(
        rows=torch.tensor(rows, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        tables=tables.contiguous(),
        max_len=max(lens, default=0),
        chunks=chunks,
        chunk_tables=tuple(meta.block_tables[c.seq].to(torch.int32).contiguous() for c in chunks),
        window=meta.window or 0,
    )

