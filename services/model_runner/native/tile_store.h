/*
 * The epilogue every AVX-512 GEMM row tile shares (gemm.c's fp32 tile, gemm_bf16.c's dot-product and
 * FMA tiles): an 8-row x 48-column tile of fp32 sums, plus the bias, stored masked to the panel's
 * live columns. One definition, so the kernels that must agree bit for bit (the FMA tile and
 * gemm.c's over a widened panel) add the bias the same way.
 */
#ifndef KVMESH_TILE_STORE_H
#define KVMESH_TILE_STORE_H

#if defined(__AVX512F__)
#include <immintrin.h>
#include <stdint.h>
#include <stddef.h>

/* c[r][j] + bias[16 j ..] into out row r, columns 16 j .., for r < mr and the first cols columns
 * (bias NULL: none). */
static inline __attribute__((always_inline)) void tile_store(__m512 c[][3], const int mr, int64_t cols,
                                                             const float *bias, float *out, int64_t out_stride)
{
    for (int j = 0; j < 3; j++) {
        const int64_t left = cols - j * 16;
        if (left <= 0) break;
        const __mmask16 live = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
        const __m512 bv = bias != NULL ? _mm512_maskz_loadu_ps(live, bias + j * 16) : _mm512_setzero_ps();
        for (int r = 0; r < mr; r++)
            _mm512_mask_storeu_ps(out + r * out_stride + j * 16, live, _mm512_add_ps(c[r][j], bv));
    }
}
#endif

#endif
