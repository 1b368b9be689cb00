/*
 * What gemm_bf16.c (the entry points, the AVX512-BF16 kernel) and gemm_amx.c (the AMX kernel)
 * share: the packed layout's panel width, the rounding of x to bf16, and the AMX kernel's
 * internal entry points, which gemm_bf16.c's kvmesh_linear_bf16 / kvmesh_linear_bf16_swiglu call
 * when kvmesh_linear_bf16_amx() says the AMX path is in use.
 */
#ifndef KVMESH_GEMM_BF16_H
#define KVMESH_GEMM_BF16_H

#include <stdint.h>

#define BF16_PANEL 48  /* output columns per packed panel: gemm.c's kvmesh_linear_panel_width */

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

/* 32 floats at src, of which the first `left` are live (fewer: zeros past them) -> 32 bf16 at dst. */
static inline void bf16_round32(const float *src, int64_t left, uint16_t *dst)
{
    const __mmask16 lo = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1u) : 0;
    const __mmask16 hi = left >= 32 ? (__mmask16)0xFFFF : left > 16 ? (__mmask16)((1u << (left - 16)) - 1u) : 0;
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, src + 16), _mm512_maskz_loadu_ps(lo, src));
    _mm512_storeu_si512(dst, (__m512i)v);
}

/* x [m, k] fp32 (rows x_stride apart) -> xb [m, width] bf16 (round to nearest even, denormals to
 * zero), the columns past k zero; width a multiple of 32, at least 2 ceil(k / 2). One thread: a
 * 512 x 1536 prefill input is 0.8 M conversions, less than an OpenMP fork and join costs on a
 * loaded machine (one parallel region per GEMM, not two). */
static inline void bf16_round_rows(const float *x, int64_t x_stride, int64_t m, int64_t k, uint16_t *xb,
                                   int64_t width)
{
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < width; i += 32) bf16_round32(x + r * x_stride + i, k - i, xb + r * width + i);
}
#endif

/* The AMX kernels (gemm_amx.c): the same contract and status codes as kvmesh_linear_bf16 and
 * kvmesh_linear_bf16_swiglu; only called when kvmesh_linear_bf16_amx() is 1. */
int kvmesh_amx_linear_bf16(const float *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                           const float *bias, float *out, int64_t out_stride);
int kvmesh_amx_linear_bf16_swiglu(const float *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *packed,
                                  int64_t inter, const float *bias, float *out, int64_t out_stride);

#endif
