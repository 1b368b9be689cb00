"""Greedy heads screened by a cheaper copy (``native/head_screen.c``, ``native/screen_int8.c``).

Greedy decoding keeps one column of the vocabulary projection a row. So every column is scored
first in arithmetic the CPU runs faster than the head's own, with a proven bound on how far a score
can lie from the column's logit, and only the columns that could still be the row's maximum get
their logits; the token is the one the full head gives, bit for bit (docs/model_runner.md, "Greedy
heads screened"):

- :class:`HeadScreenInt8`: scored in int8 dot products (``vpdpbusd``, 4 k a lane per instruction
  against ``vdpbf16ps``'s 2) in groups of 32 on both sides, as llama.cpp's Q8_0 x Q8_0; int8 codes
  (a quarter of the fp32 bytes), two floats per column and group, two per column. bf16 mode's head
  (codes of its bf16 weights, bf16 survivors) and fp32 mode's (codes of the fp32 weights, fp32
  survivors) where the CPU has AVX512-VNNI;
- :class:`HeadScreen`: fp32 mode's head scored in bf16 (``vdpbf16ps`` or AMX, twice fp32's rate or
  more); a bf16 copy of the head (half its fp32 bytes) and one float per column. Where the bf16
  GEMM runs on AMX tiles (several times ``vdpbf16ps``'s rate, so likely cheaper than ``vpdpbusd``;
  not measured on such a machine yet) or there is no VNNI.
"""

from __future__ import annotations

import math

import torch

from services.model_runner.model.packed import pack_panels_bf16
from services.model_runner.native import NativeKernels

# the most columns whose logits one call computes (a share of the vocabulary, at most UNION_MAX):
# past it the screen has not paid and the call takes the full head (rows of near-equal logits)
UNION_SHARE = 4
UNION_MAX = 16384
ALIGN = 64  # the workspace's alignment (head_screen.c carves it in 64-byte pieces)
U = 2.0**-24  # fp32's unit roundoff
PACK_PANELS = 16  # panels a chunk when packing (768 rows of a 576-wide head: ~3.5 MB of float64)


def screen_applies(kernels: NativeKernels | None) -> bool:
    """Whether an fp32 head's bf16 screen pays on this build: the bf16 GEMM runs ``vdpbf16ps`` or
    AMX tiles, not the fp32 FMAs an Intel core without AMX runs bf16 mode on (no faster there)."""
    return (kernels is not None and kernels.head_screen is not None and kernels.linear_bf16 is not None
            and not kernels.linear_bf16_fma)


def screen_bf16_applies(kernels: NativeKernels | None) -> bool:
    """Whether a bf16 head's int8 screen runs on this build: AVX512-VNNI beside bf16 mode's
    ``vdpbf16ps`` or AMX GEMM (not its FMA build, whose logits are not bf16 inputs')."""
    return (kernels is not None and kernels.head_screen_int8 is not None and kernels.linear_bf16 is not None
            and not kernels.linear_bf16_fma)


def screen_int8_applies(kernels: NativeKernels | None) -> bool:
    """Whether an fp32 head is screened in int8 on this build, rather than in bf16: AVX512-VNNI, and
    the bf16 GEMM not on AMX tiles (there the bf16 score is kept: see the module docstring)."""
    return kernels is not None and kernels.head_screen_int8 is not None and not kernels.linear_bf16_amx


def _finite_cpu_fp32(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and bool(torch.isfinite(weight).all())


def _fp32_applies(kernels: NativeKernels | None) -> bool:
    return screen_int8_applies(kernels) or screen_applies(kernels)


def screens(weight: torch.Tensor, kernels: NativeKernels | None, mode: str) -> bool:
    """Whether a screen takes this fp32 (master) head packed for ``mode`` on this build."""
    applies = {"native": _fp32_applies, "native_bf16": screen_bf16_applies}.get(mode)
    return applies is not None and applies(kernels) and _finite_cpu_fp32(weight)


def make_screen(weight: torch.Tensor, kernels: NativeKernels, mode: str,
                dense: torch.Tensor | None = None) -> HeadScreen | HeadScreenInt8:
    """The screen of a head packed for ``mode`` (``native`` or ``native_bf16``; see :func:`screens`):
    int8 where it applies, else (fp32 mode) bf16."""
    if mode == "native" and not screen_int8_applies(kernels):
        return HeadScreen(weight, kernels, dense)
    return HeadScreenInt8(weight, kernels, mode, dense)


def _up(values: torch.Tensor) -> torch.Tensor:
    """float64 -> float32, never below the value."""
    rounded = values.float()
    return torch.where(rounded.double() < values, torch.nextafter(rounded, torch.full_like(rounded, math.inf)),
                       rounded)


class _Screen:
    """What both screens share: the survivors' cap, the dense rows they may be gathered from, and
    the call's workspace (kept between calls: no allocation, no page faults per step)."""

    def __init__(self, weight: torch.Tensor, kernels: NativeKernels, dense: torch.Tensor | None):
        if dense is not None and (dense.shape != weight.shape or not dense.is_contiguous()
                                  or dense.dtype != torch.float32):
            raise ValueError("dense must be the head's fp32 weights, contiguous")
        self.kernels = kernels
        self.dense = dense
        self.n, self.k = weight.shape
        self.cap = max(kernels.panel_width, min(UNION_MAX, self.n // UNION_SHARE))
        self._work = torch.empty(0, dtype=torch.uint8)
        self._work_rows = 0

    def _workspace(self, rows: int) -> int:
        if rows > self._work_rows:
            size = int(self.kernels.head_screen_work_bytes(rows, self.k, self.n, self.cap))
            self._work = torch.empty(size + ALIGN, dtype=torch.uint8)
            self._work_rows = rows
        return -(-self._work.data_ptr() // ALIGN) * ALIGN

    def _source(self) -> str:
        return "packed head" if self.dense is None else "embedding's rows"

    def _dense_ptr(self) -> int | None:
        return None if self.dense is None else self.dense.data_ptr()

    @staticmethod
    def _outcome(status: int) -> bool:
        if status not in (0, 1):
            raise RuntimeError(f"native head screen failed with status {status}")
        return status == 0


class HeadScreen(_Screen):
    """fp32 mode's head ``[n, k]`` as bf16 panels, and each column's 2-norm, rounded up.

    ``packed`` is gemm_bf16.c's layout of the same weight (``pack_panels_bf16``), so it is moved
    onto huge pages with the other packed weights (``transforms.prepare_model``).
    """

    def __init__(self, weight: torch.Tensor, kernels: NativeKernels, dense: torch.Tensor | None = None):
        """``dense``: the same weights as fp32 rows that stay in memory anyway (a tied head's
        embedding), from which the survivors are gathered; None gathers them from the packed head."""
        if not (screen_applies(kernels) and _finite_cpu_fp32(weight)):
            raise ValueError("a bf16 screen needs finite fp32 weights and the native bf16 GEMM on vdpbf16ps or AMX")
        super().__init__(weight, kernels, dense)
        weight = weight.detach()
        self.packed: object = pack_panels_bf16(weight, kernels.panel_width)  # a tensor (HoldsPacked)
        chunks = weight.split(PACK_PANELS * kernels.panel_width)  # float64 a chunk at a time
        self.norm = torch.cat([_up(rows.double().norm(dim=1)) for rows in chunks])

    def describe(self) -> str:
        unit = "AMX" if self.kernels.linear_bf16_amx else "vdpbf16ps"
        return f"greedy fp32 head screened in bf16 ({unit}), survivors gathered from the {self._source()}"

    def argmax(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, scratch: torch.Tensor,
               block: int, out: torch.Tensor) -> bool:
        """Writes each row's greedy token into ``out`` and returns True; False where the caller must
        run the full head instead (a non-finite value, or too many columns left to compute)."""
        work = self._workspace(x.shape[0])
        screen, kernel = self.packed, self.kernels.head_screen
        assert isinstance(screen, torch.Tensor) and kernel is not None  # screens()
        return self._outcome(kernel(
            x.data_ptr(), x.stride(0), x.shape[0], self.k, packed.data_ptr(), self._dense_ptr(), self.n,
            None if bias is None else bias.data_ptr(), screen.data_ptr(), self.norm.data_ptr(), scratch.data_ptr(),
            block, work, self.cap, out.data_ptr(),
        ))  # fmt: skip


def pack_screen_int8(weight: torch.Tensor, width: int, group: int,
                     round_bf16: bool = True) -> tuple[torch.Tensor, ...]:
    """A head ``[n, k]`` (fp32 master weights; ``round_bf16``: bf16 mode's, rounded to bf16 as
    ``pack_panels_bf16`` rounds them, else fp32 mode's as they are) -> screen_int8.c's operands and
    head_screen.c's bound constants (w below the rounded or the fp32 rows):

    - codes ``[ceil(n / width), kq / 4, width, 4]`` int8: per ``group`` weights along k (kq = k
      padded to it; screen_int8.h's SCREEN_GROUP, ``NativeKernels.screen_group``), round(w / step),
      step = the group's largest |w| / 127;
    - scale, offset ``[ceil(n / width), kq / group, width]`` fp32: the step, and 128 x step x the
      group's code sum (the row's codes are unsigned, code + 128);
    - c1, c2 ``[n]`` fp32, rounded up: ||w - w^|| and ||w^|| (w^ = step x code), each plus
      rho x max(||w||, ||w^||) for the fp32 sums' rounding (head_screen.c's header comment).

    Computed a chunk of panels at a time, so loading holds a few MB of float64 at once, not a
    head's worth.
    """
    n, k = weight.shape
    kq, panels, groups = -(-k // group) * group, -(-n // width), -(-k // group)
    codes = torch.empty(panels, kq // 4, width, 4, dtype=torch.int8)
    step_out = torch.empty(panels, groups, width)
    offset_out = torch.empty(panels, groups, width)
    c1, c2 = torch.empty(n), torch.empty(n)
    rho, scale_up = 4 * (k + 2) * U + 256 * U, 1.0 + 2.0**-20
    for p0 in range(0, panels, PACK_PANELS):
        p1 = min(panels, p0 + PACK_PANELS)
        r0, r1 = p0 * width, min(n, p1 * width)
        w = torch.zeros((p1 - p0) * width, kq)
        rows = weight[r0:r1].detach()
        w[: r1 - r0, :k] = rows.to(torch.bfloat16).float() if round_bf16 else rows
        by_group = w.view(-1, groups, group)
        step = by_group.abs().amax(dim=2) / 127.0  # fp32, as the kernel multiplies by it
        safe = torch.where(step > 0, step, torch.ones_like(step))
        code = torch.where(step[..., None] > 0, torch.round(by_group / safe[..., None]), 0.0).clamp(-127, 127)
        codes[p0:p1] = code.to(torch.int8).view(p1 - p0, width, kq // 4, 4).transpose(1, 2)
        step_out[p0:p1] = step.view(p1 - p0, width, groups).transpose(1, 2)
        offset_out[p0:p1] = (128.0 * step * code.sum(dim=2)).view(p1 - p0, width, groups).transpose(1, 2)
        w_hat = (code.double() * step.double()[..., None]).view(-1, kq)[: r1 - r0]
        exact = w.double()[: r1 - r0]
        n_max = torch.maximum(exact.norm(dim=1), w_hat.norm(dim=1))
        c1[r0:r1] = _up(((exact - w_hat).norm(dim=1) + rho * n_max) * scale_up)
        c2[r0:r1] = _up((w_hat.norm(dim=1) + rho * n_max) * scale_up)
    return codes, step_out, offset_out, c1, c2


class HeadScreenInt8(_Screen):
    """A head ``[n, k]`` packed for ``mode`` (``native_bf16``: bf16 mode's, ``native``: fp32 mode's)
    as int8 codes in groups of 32 (``pack_screen_int8``) of the weights its logits are computed
    from.

    ``packed`` (the codes) is moved onto huge pages with the other packed weights.
    """

    def __init__(self, weight: torch.Tensor, kernels: NativeKernels, mode: str = "native_bf16",
                 dense: torch.Tensor | None = None):
        """``dense``: the head's fp32 master rows that stay in memory anyway (a tied head's
        embedding), from which the survivors are gathered (and rounded to bf16 in bf16 mode); None
        gathers them from the packed head."""
        # NOTE: screens() alone admits fp32 mode's head where only the bf16 screen is built
        if kernels.head_screen_int8 is None or not screens(weight, kernels, mode):
            raise ValueError("an int8 screen needs finite fp32 weights and AVX512-VNNI (beside the bf16 GEMM "
                             "in bf16 mode)")
        super().__init__(weight, kernels, dense)
        self.mode = mode
        codes, self.scale, self.offset, self.c1, self.c2 = pack_screen_int8(
            weight, kernels.panel_width, kernels.screen_group, round_bf16=mode == "native_bf16")
        self.packed: object = codes  # a tensor (HoldsPacked)

    def describe(self) -> str:
        head = "bf16" if self.mode == "native_bf16" else "fp32"
        return (f"greedy {head} head screened in int8 groups of {self.kernels.screen_group} (vpdpbusd), "
                f"survivors gathered from the {self._source()}")

    def argmax(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, scratch: torch.Tensor,
               block: int, out: torch.Tensor) -> bool:
        """As :meth:`HeadScreen.argmax`, over the head packed for :attr:`mode`."""
        work = self._workspace(x.shape[0])
        codes, kernel = self.packed, self.kernels.head_screen_int8
        assert isinstance(codes, torch.Tensor) and kernel is not None  # __init__
        return self._outcome(kernel(
            x.data_ptr(), x.stride(0), x.shape[0], self.k, packed.data_ptr(), self._dense_ptr(), self.n,
            None if bias is None else bias.data_ptr(), codes.data_ptr(), self.scale.data_ptr(),
            self.offset.data_ptr(), self.c1.data_ptr(), self.c2.data_ptr(), scratch.data_ptr(), block, work,
            self.cap, int(self.mode == "native_bf16"), out.data_ptr(),
        ))  # fmt: skip
