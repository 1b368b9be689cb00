/*
 * The epilogue every AVX-512 GEMM row tile shares (gemm.c's fp32 tile, gemm_bf16.c's dot-product and
 * FMA tiles): an 8-row x 48-column tile of fp32 sums, plus the bias, stored masked to the panel's
 * live columns. One definition, so the kernels that must agree bit for bit (the FMA tile and
 * gemm.c's over a widened panel) add the bias the same way. The AVX2 tiles' epilogues (gemm.c's
 * 16-column passes and one-row tile, gemm_q4_1.c's one row dequantized in registers) below: the
 * same sum + bias, a zero vector without one (x + 0.0f, so -0.0 becomes +0.0 on every path).
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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <stdint.h>
#include <stddef.h>

/* One row's epilogue on AVX2: c[j] (columns 8 j ..) + the bias (a zero vector without one: x + 0.0f,
 * as tile_store adds) into out's first cols columns; whole 8 nv columns (nv a compile-time
 * constant once inlined: 2 for a 16-column pass of gemm.c's tiles, 6 for a one-row panel) in
 * vector adds and stores, fewer (a panel's part columns) through a buffer. Whole passes had gone
 * through that buffer too: a 32-byte store read back as 4-byte loads, per row and pass
 * (docs/model_runner.md, "AVX2 machines, fifth round", has what it cost). */
static inline __attribute__((always_inline)) void row_store_avx2(const __m256 *c, const int nv, int64_t cols,
                                                                 const float *bias, float *out)
{
    if (cols == 8 * nv) {
        for (int j = 0; j < nv; j++)
            _mm256_storeu_ps(out + j * 8, _mm256_add_ps(c[j], bias != NULL ? _mm256_loadu_ps(bias + j * 8)
                                                                            : _mm256_setzero_ps()));
        return;
    }
    float tmp[48];
    for (int j = 0; j < nv; j++) _mm256_storeu_ps(tmp + j * 8, c[j]);
    for (int64_t j = 0; j < cols; j++) out[j] = tmp[j] + (bias != NULL ? bias[j] : 0.0f);
}
#endif

#endif
