/*
 * Greedy decoding's vocabulary projection without its logits: each row's argmax over x W^T + b.
 *
 * Why: a batch-32 decode step's head writes 32 x 49,152 fp32 logits (6.3 MB) that a greedy request
 * only takes the argmax of. Written out, they leave the caches: each line is read for ownership
 * and written back, traffic the head's own weight stream competes with, and the argmax then reads
 * them back (docs/model_runner.md, "Greedy tokens without the logits"). Here the columns go in
 * blocks whose logits stay in L2 (the caller's scratch), each block's argmax taken while they are
 * there, so the [m, n] logits never reach memory.
 *
 * Bitwise: every block is the packed GEMM's own call (gemm.c's fp32 panels, or gemm_bf16.c's bf16
 * ones with whatever kernel it runs) on a run of whole panels, and a column's logit depends only on
 * its row and its weights (gemm_amx.c's tiles included: their blocking changes which sums run
 * together, never a sum's terms or order), so the logits are the ones the full call writes. The argmax is numpy's
 * (sampler.greedy_tokens): the first maximum, a NaN counting as the maximum (the first NaN wins),
 * -0.0 equal to 0.0; a row of -inf only is column 0.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "gemm_bf16.h"
#include "kernels.h"

#define PANEL BF16_PANEL /* gemm.c's width too (kvmesh_linear_panel_width) */

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

int64_t kvmesh_linear_argmax_available(void) { return 1; }

/* Row state across blocks: the best value so far, its column, and whether a NaN decided it. */
typedef struct {
    float best;
    int64_t col;
    int nan;
} RowBest;

#if defined(__AVX512F__)

/* Folds the block's `len` logits of one row (column col0 onwards) into *rb. */
static void fold_row(const float *v, int64_t len, int64_t col0, RowBest *rb)
{
    if (rb->nan) return;
    const __m512i step = _mm512_set1_epi32(16);
    __m512 bv = _mm512_set1_ps(-INFINITY);
    __m512i bi = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), cur = bi;
    for (int64_t i = 0; i < len; i += 16, cur = _mm512_add_epi32(cur, step)) {
        const __mmask16 live = len - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - i)) - 1u);
        const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, v + i);
        const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        if (nan) {  /* the first NaN of the row: nothing before it was one */
            rb->nan = 1;
            rb->col = col0 + i + __builtin_ctz(nan);
            return;
        }
        /* strictly greater: a lane keeps its first maximum */
        const __mmask16 gt = _mm512_cmp_ps_mask(x, bv, _CMP_GT_OQ);
        bv = _mm512_mask_mov_ps(bv, gt, x);
        bi = _mm512_mask_mov_epi32(bi, gt, cur);
    }
    const float best = _mm512_reduce_max_ps(bv);
    /* among the lanes holding the maximum, the first column (lanes left at -inf keep their own
     * index, so a row of -inf only gives its first column) */
    const int64_t at = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(bv, _mm512_set1_ps(best), _CMP_EQ_OQ), bi);
    if (best > rb->best) {  /* an earlier block keeps a tie; a row of -inf only keeps column 0 */
        rb->best = best;
        rb->col = col0 + at;
    }
}

#else

/* fold_row in 8 lanes (AVX2): whole vectors as the AVX-512 loop, each lane keeping its first
 * maximum; then, among the lanes holding the maximum, the first column; the last len % 8 columns
 * one at a time after them (strictly greater: a later column never takes a tie). */
static void fold_row(const float *v, int64_t len, int64_t col0, RowBest *rb)
{
    if (rb->nan) return;
    const __m256i step = _mm256_set1_epi32(8);
    __m256 bv = _mm256_set1_ps(-INFINITY);
    __m256i bi = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), cur = bi;
    int64_t i = 0;
    for (; i + 8 <= len; i += 8, cur = _mm256_add_epi32(cur, step)) {
        const __m256 x = _mm256_loadu_ps(v + i);
        const int nan = _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        if (nan) {  /* the first NaN of the row: nothing before it was one */
            rb->nan = 1;
            rb->col = col0 + i + __builtin_ctz((unsigned)nan);
            return;
        }
        const __m256 gt = _mm256_cmp_ps(x, bv, _CMP_GT_OQ);
        bv = _mm256_blendv_ps(bv, x, gt);
        bi = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(bi), _mm256_castsi256_ps(cur), gt));
    }
    float lane_best[8];
    int32_t lane_col[8];
    _mm256_storeu_ps(lane_best, bv);
    _mm256_storeu_si256((__m256i *)lane_col, bi);
    /* lanes left at -inf keep their own index, so a row of -inf only gives its first column */
    float best = lane_best[0];
    for (int l = 1; l < 8; l++) best = lane_best[l] > best ? lane_best[l] : best;
    int64_t at = INT64_MAX;
    for (int l = 0; l < 8; l++)
        if (lane_best[l] == best && lane_col[l] < at) at = lane_col[l];
    for (; i < len; i++) {
        const float x = v[i];
        if (x != x) {
            rb->nan = 1;
            rb->col = col0 + i;
            return;
        }
        if (x > best) {
            best = x;
            at = i;
        }
    }
    if (best > rb->best) {  /* an earlier block keeps a tie; a row of -inf only keeps column 0 */
        rb->best = best;
        rb->col = col0 + at;
    }
}

#endif

/* out[r] = the argmax of row r of x W^T + bias over the n columns, W packed for gemm.c (bf16 0) or
 * gemm_bf16.c (bf16 1); scratch holds [m, block_cols] fp32, block_cols a multiple of the panel
 * width. Every row in each block's one GEMM call, so the weights stream once whatever m. Returns
 * 0, -1 for a block_cols that is not, -2 when the rows' state cannot be had, -4 for 2^31 columns or
 * more, or 100 - the bf16 GEMM's (negative) failure status. */
int kvmesh_linear_argmax(const float *x, int64_t x_stride, int64_t m, int64_t k, const void *packed, int64_t n,
                         const float *bias, int64_t bf16, float *scratch, int64_t block_cols, int64_t *out)
{
    if (block_cols <= 0 || block_cols % PANEL) return -1;
    if (n >= ((int64_t)1 << 31)) return -4;
    if (m <= 0) return 0;
    const int64_t panel_size = bf16 ? (k + 1) / 2 * 2 * PANEL : k * PANEL;  /* elements of one panel */
    const int64_t esz = bf16 ? 2 : 4;
    RowBest *rows_best = malloc(sizeof(RowBest) * (size_t)m);
    if (rows_best == NULL) return -2;
    for (int64_t r = 0; r < m; r++) rows_best[r] = (RowBest){-INFINITY, 0, 0};
    for (int64_t c0 = 0; c0 < n; c0 += block_cols) {
        const int64_t cols = n - c0 < block_cols ? n - c0 : block_cols;
        const char *panels = (const char *)packed + c0 / PANEL * panel_size * esz;
        const float *b = bias != NULL ? bias + c0 : NULL;
        if (bf16) {
            const int failed = kvmesh_linear_bf16(x, x_stride, m, k, (const uint16_t *)panels, cols, b, scratch,
                                                  block_cols);
            if (failed) {
                free(rows_best);
                return 100 - failed;
            }
        } else {
            kvmesh_linear_f32(x, x_stride, m, k, (const float *)panels, cols, b, scratch, block_cols);
        }
        for (int64_t r = 0; r < m; r++) fold_row(scratch + r * block_cols, cols, c0, &rows_best[r]);
    }
    for (int64_t r = 0; r < m; r++) out[r] = rows_best[r].col;
    free(rows_best);
    return 0;
}

#else

int64_t kvmesh_linear_argmax_available(void) { return 0; }

/* Without AVX-512 or AVX2 the caller takes the logits and numpy's argmax (sampler.greedy_tokens). */
int kvmesh_linear_argmax(const float *x, int64_t x_stride, int64_t m, int64_t k, const void *packed, int64_t n,
                         const float *bias, int64_t bf16, float *scratch, int64_t block_cols, int64_t *out)
{
    (void)x, (void)x_stride, (void)m, (void)k, (void)packed, (void)n, (void)bias, (void)bf16, (void)scratch,
        (void)block_cols, (void)out;
    return -3;
}

#endif
