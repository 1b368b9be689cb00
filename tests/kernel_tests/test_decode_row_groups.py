"""``native/paged_decode.c``'s rows of one block table (``table_stride`` 0), as
``prefill_attention.c`` passes a chunk whose shape its tiles do not take (``prefill_as_decodes``).
Whatever the rows beside it (other lengths, empty rows, a row whose keys start blocks later), each
row's output must be bitwise the same row decoded alone, and the same as with a table per row;
pinned on every build. (Session 29 to 32 the AVX2 path walked four such rows block by block
together; since the AVX2 prefill tiles, every path takes them one at a time.)
"""

from __future__ import annotations

import pytest
import torch

from services.model_runner import native

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 64, 16
NUM_BLOCKS = 12  # 192 keys in the table


def _kernels(variant: str) -> native.NativeKernels:
    kernels = native.load_kernels(portable=variant == "portable", plain=variant == "plain")
    if kernels is None:
        pytest.skip("no C compiler for the native kernels")
    return kernels


def _decode(kernels: native.NativeKernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
            lens: list[int], window: int, table_stride: int) -> torch.Tensor:
    out = torch.full((len(lens), HEADS * DIM), float("nan"))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    rows = torch.arange(len(lens), dtype=torch.int32)
    status = kernels.paged_decode(
        q.data_ptr(), HEADS * DIM, k.data_ptr(), v.data_ptr(), k.stride(0), table.data_ptr(), table_stride,
        seq_lens.data_ptr(), rows.data_ptr(), len(lens), out.data_ptr(), HEADS * DIM, HEADS, KV_HEADS, DIM, BLOCK,
        max(lens), DIM**-0.5, window)  # fmt: skip
    assert status == 0
    return out


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("variant", ["native", "portable", "plain"])
def test_rows_of_one_table_are_bitwise_each_row_alone(variant: str, window: int) -> None:
    kernels = _kernels(variant)
    gen = torch.Generator().manual_seed(7 + window)
    k, v = (torch.randn(NUM_BLOCKS + 3, BLOCK, KV_HEADS, DIM, generator=gen) for _ in range(2))
    table = torch.randperm(NUM_BLOCKS + 3, generator=gen)[:NUM_BLOCKS].to(torch.int32)
    # groups of four: consecutive lengths (a prefill chunk), far apart (blocks no row of the group
    # needs between them), an empty row among them, one key, a block's last key, the whole table
    lens = [100, 101, 102, 103, 5, 180, 0, 33, 1, 16, 17, 192, 64, 0, 0, 150, 77]
    q = torch.randn(len(lens), HEADS * DIM, generator=gen)
    together = _decode(kernels, q, k, v, table, lens, window, table_stride=0)
    for i, n in enumerate(lens):
        alone = _decode(kernels, q[i : i + 1], k, v, table, [n], window, table_stride=0)
        assert torch.equal(together[i], alone[0]), (i, n)
        if n == 0:
            assert torch.equal(together[i], torch.zeros(HEADS * DIM))
    # and the same rows as separate sequences (a table per row: one row per work item) agree too
    tables = table.repeat(len(lens), 1)
    assert torch.equal(_decode(kernels, q, k, v, tables, lens, window, table_stride=NUM_BLOCKS), together)
