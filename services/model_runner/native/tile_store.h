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

/* The epilogue of one 16-column pass: acc[r] + the bias (a zero vector without one: x + 0.0f, as
 * the AVX-512 tile_store adds) into row r's first n columns. A whole pass in vector adds and stores;
 * a panel's last columns past n (a weight whose n is not a multiple of 48) through a buffer. Whole
 * passes had gone through that buffer too: a 32-byte store read back as 4-byte loads, per row and
 * pass (docs/model_runner.md, "AVX2 machines, fifth round", has what it cost). */
static inline __attribute__((always_inline)) void pass_store_avx2(const __m256 acc[][2], const int mr, int64_t n,
                                                                  const float *bias, float *out, int64_t out_stride)
{
    if (n == 16) {
        const __m256 b0 = bias != NULL ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
        const __m256 b1 = bias != NULL ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
        for (int r = 0; r < mr; r++) {
            _mm256_storeu_ps(out + r * out_stride, _mm256_add_ps(acc[r][0], b0));
            _mm256_storeu_ps(out + r * out_stride + 8, _mm256_add_ps(acc[r][1], b1));
        }
        return;
    }
    float tmp[16];
    for (int r = 0; r < mr; r++) {
        _mm256_storeu_ps(tmp, acc[r][0]);
        _mm256_storeu_ps(tmp + 8, acc[r][1]);
        float *o = out + r * out_stride;
        for (int64_t j2 = 0; j2 < n; j2++) o[j2] = tmp[j2] + (bias != NULL ? bias[j2] : 0.0f);
    }
}

/* The one-row epilogue: c[j] (columns 8 j ..) + the bias into out's first cols columns, a whole
 * panel (48) in vector adds and stores, a part panel through a buffer. */
static inline __attribute__((always_inline)) void row_store_avx2(const __m256 c[6], int64_t cols, const float *bias,
                                                                 float *out)
{
    if (cols == 48) {
        for (int j = 0; j < 6; j++)
            _mm256_storeu_ps(out + j * 8, _mm256_add_ps(c[j], bias != NULL ? _mm256_loadu_ps(bias + j * 8)
                                                                            : _mm256_setzero_ps()));
        return;
    }
    float tmp[48];
    for (int j = 0; j < 6; j++) _mm256_storeu_ps(tmp + j * 8, c[j]);
    for (int64_t j = 0; j < cols; j++) out[j] = tmp[j] + (bias != NULL ? bias[j] : 0.0f);
}
#endif

#endif
