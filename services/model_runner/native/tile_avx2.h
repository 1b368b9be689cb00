/*
 * The AVX2 fp32 row tile's registers and k step, shared by gemm.c (a 16-column pass of a weight
 * panel) and gemm_q4_1.c (a chunk's first tile, dequantizing as it goes): one definition, so the
 * two compute every output the same way, FMAs in k order from zero, and give the same bits.
 *
 * Macros, not functions: the 12 accumulators must stay named variables in the caller's registers
 * (an array of them, or their addresses passed to a function, was stored to the stack after every
 * FMA with GCC 12: docs/model_runner.md, "AVX2 machines, second round").
 */
#ifndef KVMESH_TILE_AVX2_H
#define KVMESH_TILE_AVX2_H

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "tile_store.h"

#define TILE_AVX2_ROWS 6  /* 6 rows x 16 columns = 12 ymm accumulators, 2 for the panel, 1 for x */

/* Declares a tile's accumulators c00 .. c51 (row r: cr0, cr1), zero, and its row pointers x0 .. x5
 * (row r of x at x + r x_stride; the rows past the tile's count are never read). */
#define TILE_AVX2_BEGIN(x, x_stride) \
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00; \
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00; \
    const float *x0 = (x), *x1 = (x) + (x_stride), *x2 = (x) + 2 * (x_stride), *x3 = (x) + 3 * (x_stride), \
                *x4 = (x) + 4 * (x_stride), *x5 = (x) + 5 * (x_stride)

/* One k step: row r's two accumulators += x_r[kk] * (b0, b1), for the first mr rows (mr 2 .. 6, a
 * compile-time constant, so the rows past it are dead code). */
#define TILE_AVX2_ROW(r, kk, b0, b1) \
    do { \
        const __m256 a_ = _mm256_broadcast_ss(x##r + (kk)); \
        c##r##0 = _mm256_fmadd_ps(a_, (b0), c##r##0); \
        c##r##1 = _mm256_fmadd_ps(a_, (b1), c##r##1); \
    } while (0)
#define TILE_AVX2_STEP(mr, kk, b0, b1) \
    do { \
        TILE_AVX2_ROW(0, kk, b0, b1); \
        TILE_AVX2_ROW(1, kk, b0, b1); \
        if ((mr) > 2) TILE_AVX2_ROW(2, kk, b0, b1); \
        if ((mr) > 3) TILE_AVX2_ROW(3, kk, b0, b1); \
        if ((mr) > 4) TILE_AVX2_ROW(4, kk, b0, b1); \
        if ((mr) > 5) TILE_AVX2_ROW(5, kk, b0, b1); \
    } while (0)

/* The tile's first mr rows stored: row r's n columns (n <= 16) plus bias (NULL: none) into out
 * + r out_stride (row_store_avx2). */
#define TILE_AVX2_END(mr, n, bias, out, out_stride) \
    do { \
        const __m256 acc_[TILE_AVX2_ROWS][2] = {{c00, c01}, {c10, c11}, {c20, c21}, \
                                                {c30, c31}, {c40, c41}, {c50, c51}}; \
        for (int r_ = 0; r_ < (mr); r_++) row_store_avx2(acc_[r_], 2, (n), (bias), (out) + r_ * (out_stride)); \
    } while (0)

#endif

#endif
