"""Decode attention's prefetch target (``paged_decode.c``'s ``KV_PREFETCH_HINT``): the loader builds
the L2 variant on ``L2_KV_PREFETCH_VENDOR``'s CPUs and the L1 one elsewhere, and the two builds
give the same bits (a hint moves cache lines, never a number), over an fp32 and a bf16 pool.
"""

from __future__ import annotations

import pytest
import torch

from services.model_runner import native

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def _both() -> tuple[native.NativeKernels, native.NativeKernels]:
    l1, l2 = native.load_kernels(kv_prefetch_l2=False), native.load_kernels(kv_prefetch_l2=True)
    if l1 is None or l2 is None:
        pytest.skip("no C compiler for the native kernels")
    return l1, l2


def test_the_vendor_rule_picks_l2_on_amd_only() -> None:
    assert native.kv_prefetch_into_l2("AuthenticAMD") is True
    assert native.kv_prefetch_into_l2("GenuineIntel") is False
    assert native.kv_prefetch_into_l2("") is False
    l1, l2 = _both()
    assert (l1.kv_prefetch_l2, l2.kv_prefetch_l2) == (False, True)
    default = native.load_kernels()
    assert default is not None
    assert default.kv_prefetch_l2 is native.kv_prefetch_into_l2(native.cpu_vendor())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_prefetch_targets_give_the_same_bits(dtype: torch.dtype) -> None:
    l1, l2 = _both()
    gen = torch.Generator().manual_seed(11)
    lens = [200, 17, 1, 64, 0, 129, 48, 191]
    per = 13  # blocks per table: 208 keys
    blocks = len(lens) * per + 1
    k, v = (torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=gen).to(dtype) for _ in range(2))
    tables = (torch.randperm(blocks - 1, generator=gen)[: len(lens) * per] + 1).to(torch.int32).view(len(lens), per)
    q = torch.randn(len(lens), HEADS * DIM, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    rows = torch.arange(len(lens), dtype=torch.int32)
    outs = []
    for kernels in (l1, l2):
        fn = kernels.paged_decode if dtype == torch.float32 else kernels.paged_decode_bf16
        out = torch.full((len(lens), HEADS * DIM), float("nan"))
        for window in (0, 50):
            status = fn(q.data_ptr(), HEADS * DIM, k.data_ptr(), v.data_ptr(), k.stride(0), tables.data_ptr(),
                        per, seq_lens.data_ptr(), rows.data_ptr(), len(lens), out.data_ptr(), HEADS * DIM, HEADS,
                        KV_HEADS, DIM, BLOCK, max(lens), DIM**-0.5, window)  # fmt: skip
            assert status == 0
            outs.append(out.clone())
    assert not torch.isnan(outs[0]).any()
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    assert not torch.equal(outs[0], outs[1])  # the window changed the answer: the cases differ
