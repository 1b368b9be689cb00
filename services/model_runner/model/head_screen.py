"""fp32 mode's greedy head, screened in bf16 (``native/head_screen.c``).

Greedy decoding keeps one column of the vocabulary projection a row. Where the CPU multiplies bf16
faster than fp32 (AVX512-BF16's ``vdpbf16ps``, AMX), every column is scored in bf16 first, with a
proven bound on how far a score can lie from its fp32 logit, and only the columns that could still
be the row's maximum get their fp32 logits; the token is the one the full fp32 head gives, bit for
bit (docs/model_runner.md, "The fp32 head screened in bf16"). The cost is a bf16 copy of the head
(half its fp32 bytes) and one float per column.
"""

from __future__ import annotations

import math

import torch

from services.model_runner.model.packed import pack_panels_bf16
from services.model_runner.native import NativeKernels

# the most columns whose fp32 logits one call computes (a share of the vocabulary, at most UNION_MAX):
# past it the screen has not paid and the call takes the full head (rows of near-equal logits)
UNION_SHARE = 8
UNION_MAX = 2048
ALIGN = 64  # the workspace's alignment (head_screen.c carves it in 64-byte pieces)


def screen_applies(kernels: NativeKernels | None) -> bool:
    """Whether a screen pays on this build: the bf16 GEMM runs ``vdpbf16ps`` or AMX tiles, not the
    fp32 FMAs an Intel core without AMX runs bf16 mode on (no faster than fp32 there)."""
    return (kernels is not None and kernels.head_screen is not None and kernels.linear_bf16 is not None
            and not kernels.linear_bf16_fma)


def screens(weight: torch.Tensor, kernels: NativeKernels | None) -> bool:
    """Whether :class:`HeadScreen` takes this fp32 head on this build."""
    return (screen_applies(kernels) and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and bool(torch.isfinite(weight).all()))


class HeadScreen:
    """The bf16 copy of an fp32 head ``[n, k]`` and each column's 2-norm, rounded up.

    ``packed`` is gemm_bf16.c's layout of the same weight (``pack_panels_bf16``), so it is moved
    onto huge pages with the other packed weights (``transforms.prepare_model``).
    """

    def __init__(self, weight: torch.Tensor, kernels: NativeKernels, dense: torch.Tensor | None = None):
        """``dense``: the same weights as fp32 rows that stay in memory anyway (a tied head's
        embedding), from which the survivors are gathered; None gathers them from the packed head."""
        if not screens(weight, kernels):
            raise ValueError("a bf16 screen needs finite fp32 weights and the native bf16 GEMM on vdpbf16ps or AMX")
        self.kernels = kernels
        weight = weight.detach()
        self.packed: object = pack_panels_bf16(weight, kernels.panel_width)  # a tensor (HoldsPacked)
        norm = weight.double().norm(dim=1).float()
        self.norm = torch.nextafter(norm, torch.full_like(norm, math.inf))  # never below the true norm
        self.cap = max(kernels.panel_width, min(UNION_MAX, weight.shape[0] // UNION_SHARE))
        if dense is not None and (dense.shape != weight.shape or not dense.is_contiguous()
                                  or dense.dtype != torch.float32):
            raise ValueError("dense must be the head's fp32 weights, contiguous")
        self.dense = dense
        self._work = torch.empty(0, dtype=torch.uint8)
        self._work_rows = 0

    def argmax(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, scratch: torch.Tensor,
               block: int, out: torch.Tensor) -> bool:
        """Writes each row's greedy token into ``out`` and returns True; False where the caller must
        run the full head instead (a non-finite value, or too many columns left to compute)."""
        n, k = self.norm.shape[0], x.shape[1]
        rows = x.shape[0]
        if rows > self._work_rows:  # kept between calls: no allocation, no page faults per step
            size = int(self.kernels.head_screen_work_bytes(rows, k, n, self.cap))
            self._work = torch.empty(size + ALIGN, dtype=torch.uint8)
            self._work_rows = rows
        work = -(-self._work.data_ptr() // ALIGN) * ALIGN
        screen = self.packed
        assert isinstance(screen, torch.Tensor)
        kernel = self.kernels.head_screen
        assert kernel is not None  # screens()
        status = kernel(
            x.data_ptr(), x.stride(0), rows, k, packed.data_ptr(),
            None if self.dense is None else self.dense.data_ptr(), n, None if bias is None else bias.data_ptr(),
            screen.data_ptr(), self.norm.data_ptr(), scratch.data_ptr(), block, work, self.cap,
            out.data_ptr(),
        )  # fmt: skip
        if status not in (0, 1):
            raise RuntimeError(f"native head screen failed with status {status}")
        return status == 0
