/*
 * prefill_attention.c's tiled kernel in 8 lanes, for a CPU with AVX2 + FMA but no AVX-512 (AMD Zen
 * 1-3, Intel client cores), fp32 or a bf16 cache widened exactly on the gather.
 *
 * Why it exists: there each prefill row ran as the decode of its position (four rows at a time
 * over one block table), a dot product and a horizontal reduction per key: a 1,024-token prompt's
 * attention ran at a quarter of the FMA rate the GEMMs reach, ~30% of the prefill
 * (docs/model_runner.md, "AVX2 prefill attention").
 *
 * How: K and V of each KV head gathered once (prefill_tiles.h), K transposed in 8-key tiles
 * ([D][8]); work items of RT (query token, head) rows of one KV head: scores for 8 keys at a time
 * (lane t = key t0 + t), four rows sharing each K vector; a softmax per row; the weighted V four
 * rows at a time in 16-dimension slices, each V vector loaded once for the four rows.
 *
 * Numerics: bitwise paged_decode.c's AVX2 decode of the same row. There lane l of a key's 8-lane
 * partial is q[l] k[l] then fused multiply-adds over l + 8, l + 16, ..., and quad_sum / octet_sum
 * combine the lanes as ((L0 + L1) + (L2 + L3)) + ((L4 + L5) + (L6 + L7)); here partial l is a
 * vector over 8 keys with the same chain per lane, combined in the same tree (score_rows8). The
 * softmax is exp_math.h's softmax_row_f32 over the row's own scores from its first key, and the
 * weighted sum runs over the row's keys in order, fused multiply-adds from zero, times 1 / sum, as
 * weighted_v_slice does. So a row's bits depend only on its query, its keys and its length: not
 * on the rows beside it, the chunk's split, the thread, or whether it is a prefill row or a decode
 * (tests/kernel_tests/test_native_prefill_attention.py runs both builds).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "exp_math.h"
#include "kernels.h"
#include "kv_elem.h"
#include "prefill_tiles.h"

#if KVM_AVX2
#define TW 8   /* keys per K tile (lanes) */
#define SR 4   /* rows scored together */
#define VB 64  /* keys per weighted-V block */
#define ST 2   /* K tiles scored together: SR x ST = 8 FMA chains (the FMA latency x rate), each
                * K vector loaded once for SR rows and each query broadcast once for ST tiles */

/* v, loaded once into a register. Without this GCC folds a vector that feeds several FMAs into
 * each of them as a memory operand: 8 256-bit loads for 8 FMAs, which on Zen 3 (two 256-bit loads
 * a cycle) make the loop as load-bound as it is FMA-bound. */
static inline __attribute__((always_inline)) __m256 in_register(__m256 v)
{
    __asm__("" : "+x"(v));
    return v;
}

/* The registers of one dimension-partial P(l) for SR rows x ST tiles: lane t of acc[r][u] is
 * row r's q[l] k[l] then fused multiply-adds over l + 8, l + 16, ... (nv = head_dim / 8 terms) for
 * key t of tile u (kb: the first tile, [head_dim][8], tiles head_dim * 8 floats apart). */
static inline __attribute__((always_inline)) void score_partial(const float *kb, const float *qs, int64_t head_dim,
                                                                const int nv, const int l, __m256 acc[SR][ST])
{
    const int64_t tile = head_dim * TW;
    {
        __m256 k[ST];
        for (int u = 0; u < ST; u++) k[u] = in_register(_mm256_loadu_ps(kb + u * tile + l * TW));
        for (int r = 0; r < SR; r++) {
            const __m256 b = _mm256_broadcast_ss(qs + r * head_dim + l);
            for (int u = 0; u < ST; u++) acc[r][u] = _mm256_mul_ps(b, k[u]);
        }
    }
    for (int j = 1; j < nv; j++) {
        __m256 k[ST];
        for (int u = 0; u < ST; u++) k[u] = in_register(_mm256_loadu_ps(kb + u * tile + (l + 8 * j) * TW));
        for (int r = 0; r < SR; r++) {
            const __m256 b = _mm256_broadcast_ss(qs + r * head_dim + l + 8 * j);
            for (int u = 0; u < ST; u++) acc[r][u] = _mm256_fmadd_ps(b, k[u], acc[r][u]);
        }
    }
}

/* Scores of SR rows (scaled queries qs, SR x head_dim) for the 8 ST keys of tiles kb .. into
 * a[r][u]: the decode's tree ((P0 + P1) + (P2 + P3)) + ((P4 + P5) + (P6 + P7)) over the eight
 * partials, computed one partial at a time, the partial sums waiting in L1 (sum[0]: P0 + P1, then
 * with P2 + P3; sum[1]: P2, then P4 + P5; sum[2]: P6). The loop over the partials stays a loop: fully
 * unrolled, the compiler kept every sum in registers and spilled them (2x slower). */
static inline __attribute__((always_inline)) void score_rows8(const float *kb, const float *qs, int64_t head_dim,
                                                              const int nv, __m256 a[SR][ST])
{
    /* zeroed only so the compiler can see every sum written before it is read (a few stores) */
    float sum[3][SR][ST][TW] __attribute__((aligned(32))) = {{{{0.0f}}}};
#define EACH for (int r = 0; r < SR; r++) for (int u = 0; u < ST; u++)
#define LD(i) _mm256_load_ps(sum[i][r][u])
#define ST_(i, v) _mm256_store_ps(sum[i][r][u], v)
#pragma GCC unroll 1
    for (int l = 0; l < 8; l++) {
        __m256 p[SR][ST];
        score_partial(kb, qs, head_dim, nv, l, p);
        /* one branch per partial, not one per accumulator (a jump table inside the loop over the
         * accumulators cost as much as the partial's FMAs) */
        switch (l) {
        case 0: EACH ST_(0, p[r][u]); break;
        case 1: EACH ST_(0, _mm256_add_ps(LD(0), p[r][u])); break;
        case 2: case 4: EACH ST_(1, p[r][u]); break;
        case 3: EACH ST_(0, _mm256_add_ps(LD(0), _mm256_add_ps(LD(1), p[r][u]))); break;
        case 5: EACH ST_(1, _mm256_add_ps(LD(1), p[r][u])); break;
        case 6: EACH ST_(2, p[r][u]); break;
        default: EACH a[r][u] = _mm256_add_ps(LD(0), _mm256_add_ps(LD(1), _mm256_add_ps(LD(2), p[r][u])));
        }
    }
#undef EACH
#undef LD
#undef ST_
}

/* A row's maximum over its n stored scores (the same value in any order). */
static inline float row_max8(const float *sr, int64_t n)
{
    const __m256 floor = _mm256_set1_ps(-3.0e38f);
    __m256 m = floor;
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(sr + t));
    if (t < n) {
        const __m256i live = lanes_below(n - t);
        m = _mm256_max_ps(m, _mm256_blendv_ps(floor, _mm256_maskload_ps(sr + t, live), _mm256_castsi256_ps(live)));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}

/* The weighted V of rows r0 .. r0 + 3 of a work item for dims 8j .. 8j + 15 over keys b0 .. b1 - 1,
 * in order, each row masked to its own keys: keys only the earlier rows' windows hold, keys all
 * four see, then the few only the later rows see. acc: the item's running sums ([RT][head_dim],
 * exact in memory between key blocks). Each V slice (64 bytes: one line) is loaded once for the
 * four rows. */
static inline __attribute__((always_inline)) void weighted_v4(
    const float *vc, int64_t head_dim, int j, const TileRows *rs, int r0, const float *sc, int64_t sc_stride,
    float *acc, int64_t b0, int64_t b1)
{
    const int64_t *len = rs->len + r0, *lo = rs->lo + r0;
    int64_t min_lo = lo[0], max_lo = lo[0], min_len = len[0], max_len = len[0];
    for (int r = 1; r < 4; r++) {
        if (lo[r] < min_lo) min_lo = lo[r];
        if (lo[r] > max_lo) max_lo = lo[r];
        if (len[r] < min_len) min_len = len[r];
        if (len[r] > max_len) max_len = len[r];
    }
    const int64_t shared_end = min_len > max_lo ? min_len : max_lo;
    const float *s = sc + r0 * sc_stride;
    float *ar = acc + r0 * head_dim + j * 8;
    __m256 c[4][2];
    for (int r = 0; r < 4; r++) {
        c[r][0] = _mm256_load_ps(ar + r * head_dim);
        c[r][1] = _mm256_load_ps(ar + r * head_dim + 8);
    }
#define V_KEY(t, checked)                                                                                     \
    do {                                                                                                      \
        const __m256 v0 = in_register(_mm256_loadu_ps(vc + (t) * head_dim + j * 8));                         \
        const __m256 v1 = in_register(_mm256_loadu_ps(vc + (t) * head_dim + j * 8 + 8));                     \
        for (int r = 0; r < 4; r++) {                                                                         \
            if ((checked) && ((t) < lo[r] || (t) >= len[r])) continue;                                        \
            const __m256 p = _mm256_broadcast_ss(s + r * sc_stride + (t) - lo[r]);                            \
            c[r][0] = _mm256_fmadd_ps(p, v0, c[r][0]);                                                        \
            c[r][1] = _mm256_fmadd_ps(p, v1, c[r][1]);                                                        \
        }                                                                                                     \
    } while (0)
#define MAX(a, b) ((a) > (b) ? (a) : (b))
#define MIN(a, b) ((a) < (b) ? (a) : (b))
    for (int64_t t = MAX(b0, min_lo); t < MIN(b1, max_lo); t++) V_KEY(t, 1);
    for (int64_t t = MAX(b0, max_lo); t < MIN(b1, min_len); t++) V_KEY(t, 0);
    for (int64_t t = MAX(b0, shared_end); t < MIN(b1, max_len); t++) V_KEY(t, 1);
#undef MAX
#undef MIN
#undef V_KEY
    for (int r = 0; r < 4; r++) {
        _mm256_store_ps(ar + r * head_dim, c[r][0]);
        _mm256_store_ps(ar + r * head_dim + 8, c[r][1]);
    }
}

/* One work item: kt, vc hold the KV head's gathered keys from local index 0 = kstart; ctx0 is the
 * first query's position. sc rows (sc_stride apart, 8 writable floats before each) take each row's
 * scores from its own first key: a tile's 8 scores are stored whole (a vmaskmovps store costs ~10x
 * a plain one on AMD), the lanes outside the row's keys landing in its slack, never read.
 * nv = head_dim / 8, a compile-time constant where attend_tile8 inlines it. */
static inline __attribute__((always_inline)) void attend_rows8(
    const float *kt, const float *vc, const float *q, int64_t q_row_stride, float *out, int64_t out_row_stride,
    int64_t group, int64_t kvh, int64_t ctx0, int64_t kstart, int64_t window, int64_t row0, int64_t rows_total,
    float scale, float *qs, float *acc, float *sc, int64_t sc_stride, const int nv)
{
    const int64_t head_dim = 8 * (int64_t)nv;
    TileRows rs;
    tile_rows(&rs, group, kvh, ctx0, kstart, window, row0, rows_total);
    const int64_t *len = rs.len, *lo = rs.lo;
    for (int r = 0; r < RT; r++) {
        const float *src = q + rs.tok[r] * q_row_stride + rs.head[r] * head_dim;
        for (int64_t d = 0; d < head_dim; d++) qs[r * head_dim + d] = src[d] * scale;
    }
    /* 1. scores, ST tiles of 8 keys at a time (padded holds whole groups of them) */
    for (int64_t t0 = rs.min_lo / (ST * TW) * (ST * TW); t0 < rs.max_len; t0 += ST * TW) {
        const float *kb = kt + (t0 / TW) * head_dim * TW;
        for (int h = 0; h < RT; h += SR) {
            __m256 a[SR][ST] = {{_mm256_setzero_ps()}};  /* all set by score_rows8 (the compiler cannot tell) */
            score_rows8(kb, qs + h * head_dim, head_dim, nv, a);
            for (int r = h; r < h + SR; r++)
                for (int u = 0; u < ST; u++) {
                    const int64_t k0 = t0 + u * TW;
                    if (k0 < len[r] && k0 + TW > lo[r]) _mm256_storeu_ps(sc + r * sc_stride + (k0 - lo[r]), a[r - h][u]);
                }
        }
    }
    /* 2. softmax numerators in place, per row over its own keys */
    float inv_sum[RT];
    for (int r = 0; r < RT; r++) {
        float *sr = sc + r * sc_stride;
        inv_sum[r] = softmax_row_f32(sr, len[r] - lo[r], row_max8(sr, len[r] - lo[r]));
    }
    /* 3. weighted V: blocks of VB keys (VB x head_dim floats stay in L1 while every four rows and
     * 16 dims pass over them; whole-context passes read V from L2 or beyond, 8x per item), then
     * times 1 / sum */
    for (int64_t i = 0; i < RT * head_dim; i += 8) _mm256_store_ps(acc + i, _mm256_setzero_ps());
    for (int64_t b0 = rs.min_lo; b0 < rs.max_len; b0 += VB)
        for (int r0 = 0; r0 < RT; r0 += 4)
            for (int j = 0; j < nv; j += 2) weighted_v4(vc, head_dim, j, &rs, r0, sc, sc_stride, acc, b0, b0 + VB);
    for (int r = 0; r < RT; r++) {
        if (row0 + r >= rows_total) continue;
        const __m256 inv = _mm256_set1_ps(inv_sum[r]);
        float *o = out + rs.tok[r] * out_row_stride + rs.head[r] * head_dim;
        for (int j = 0; j < nv; j++) _mm256_storeu_ps(o + j * 8, _mm256_mul_ps(_mm256_load_ps(acc + r * head_dim + j * 8), inv));
    }
}

static void attend_tile8(const float *kt, const float *vc, const float *q, int64_t q_row_stride, float *out,
                         int64_t out_row_stride, int64_t group, int64_t kvh, int64_t ctx0, int64_t kstart,
                         int64_t window, int64_t row0, int64_t rows_total, int64_t head_dim, float scale, float *qs,
                         float *acc, float *sc, int64_t sc_stride)
{
#define ATTEND(nv) attend_rows8(kt, vc, q, q_row_stride, out, out_row_stride, group, kvh, ctx0, kstart, window, \
                                row0, rows_total, scale, qs, acc, sc, sc_stride, nv)
    switch (head_dim / 8) {
    case 8: ATTEND(8); break;    /* head_dim 64 (SmolLM2, Llama 3.2 1B) */
    case 16: ATTEND(16); break;  /* 128 */
    default: ATTEND((int)(head_dim / 8)); break;
    }
#undef ATTEND
}

int kvm_prefill_tiled_avx2(const float *q, int64_t q_row_stride, const char *k_cache, const char *v_cache,
                           int64_t block_stride, const int32_t *table, int64_t num_q, int64_t seq_len, float *out,
                           int64_t out_row_stride, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size, float scale, int64_t window, int esz)
{
    const int64_t group = num_heads / num_kv_heads;
    /* the first query's first key: nothing before it is gathered (window 0 = full attention) */
    const int64_t ctx0 = seq_len - num_q, kstart = first_key(ctx0 + 1, window);
    const int64_t padded = (seq_len - kstart + ST * TW - 1) / (ST * TW) * (ST * TW);
    float *kt = NULL, *vc = NULL;
    if (prefill_gather(k_cache, v_cache, block_stride, table, kstart, seq_len, num_kv_heads, head_dim, block_size,
                       esz, TW, padded, &kt, &vc) != 0)
        return -2;
    const int64_t rows = num_q * group, per_head = (rows + RT - 1) / RT, items = num_kv_heads * per_head;
    const int64_t sc_stride = padded + TW;
    int failed = 0;
    #pragma omp parallel if (items > 1)
    {
        /* the scaled queries, then the weighted V's running sums (RT x head_dim each, 32-byte aligned) */
        float *qs = (float *)aligned_alloc(64, sizeof(float) * (size_t)(2 * RT * head_dim));
        float *acc = qs == NULL ? NULL : qs + RT * head_dim;
        /* TW floats of slack before each row: a row's first tile may start up to 7 keys before it */
        float *sc_buf = (float *)malloc(sizeof(float) * (size_t)(RT * sc_stride + TW));
        float *sc = sc_buf == NULL ? NULL : sc_buf + TW;
        if (qs == NULL || sc == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        /* KV head by KV head (its K and V stay in L2 while its items pass over them), the longest
         * items (last query rows) first, so threads end together */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (qs == NULL || sc == NULL) continue;
            const int64_t h = item / per_head, tile = per_head - 1 - item % per_head;
            attend_tile8(kt + h * padded * head_dim, vc + h * padded * head_dim, q, q_row_stride, out,
                         out_row_stride, group, h, ctx0, kstart, window, tile * RT, rows, head_dim, scale, qs, acc,
                         sc, sc_stride);
        }
        free(qs);
        free(sc_buf);
    }
    free(kt);
    free(vc);
    return failed ? -2 : 0;
}
#endif
