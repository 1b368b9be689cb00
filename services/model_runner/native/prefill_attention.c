/*
 * Causal attention of one prefill chunk over the paged cache (fp32 or bf16), for the CPU.
 *
 * Why it exists: torch's SDPA over a chunk was ~40% of a bf16-mode prefill step on SmolLM2 (one
 * flash-attention call per layer at ~40 GFLOP/s, after a gather of the chunk's K/V); this kernel
 * runs the same FLOPs as small register-blocked GEMMs (docs/model_runner.md, "Prefill").
 *
 * What it computes: query token i of the chunk (num_q tokens, the last of a seq_len-token context)
 * sees keys 0 .. seq_len - num_q + i, as SDPA with a bottom-right causal mask does. With a window
 * (window > 0) the query at position p sees keys p - window + 1 .. p only (transformers' rule), and
 * no key before the first query's window is gathered: a sliding-window KV cache group frees those
 * blocks, so they may hold another request's data.
 *
 * bf16 dot products: a bf16 cache for which kv_elem.h's kv_bf16_dots holds takes
 * prefill_attention_bf16dots instead (K gathered into tiles of dimension pairs, V into key-pair
 * words, vdpbf16ps in paged_decode.c's order with dots); what follows is the fp32 path.
 *
 * How: K and V of each KV head are gathered once from the paged cache (a bf16 cache widened
 * exactly to fp32 there, kv_elem.h: everything after the gather is the same code), K transposed in 16-key
 * tiles ([D][16]); then each work item is RT (query token, head) rows of one KV head: scores for
 * 16 keys at a time (each transposed-K vector loaded once for the RT rows), a softmax per row, and the
 * weighted V sum per row (each V vector loaded once for the RT rows).
 *
 * Numerics: bitwise paged_decode.c's for the same row (its dot-product order, see score_tile; the
 * same softmax over the row's own keys in 16-key steps from its first key; the weighted sum over
 * keys in order, masked outside the row's keys; the same exp): a row's bits depend only on its query, its
 * keys and its length, not on the rows beside it, the chunk's split, the thread, or whether the
 * position is computed as a prefill row or as a decode. So chunked prefill, prefix-cache hits and
 * preemption's recompute give a cold run's bits (tests/kernels/test_native_prefill_attention.py).
 *
 * A build without AVX-512 but with AVX2 + FMA runs the same tiles in 8 lanes, in that path's
 * decode order (prefill_attention_avx2.c). Shapes neither takes (head_dim not a multiple of 16 or
 * > 256, more than KV_MAX_HEADS query heads, a build without AVX2) run each row as the decode of
 * its position (prefill_as_decodes), so the rule above holds on every CPU. Returns 0; -1 for a shape the decode
 * kernel refuses too (the caller keeps SDPA); -2 when a buffer could not be allocated.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "attention_amx.h"
#include "exp_math.h"
#include "kernels.h"
#include "kv_elem.h"
#include "prefill_tiles.h"

#if defined(__AVX512F__)
/* Lane t of p[r] = d-chunk partial l of row r's score for key t of the tile kb ([head_dim][16]):
 * q[l] k[l], then fused multiply-adds over l + 16, l + 32, ... (paged_decode.c's chain). Each K
 * vector is loaded once for the RT rows. */
static inline __attribute__((always_inline)) void score_partial(const float *kb, const float *qs, int64_t head_dim,
                                                                int nd, int64_t l, __m512 *p)
{
    const __m512 k0 = _mm512_loadu_ps(kb + l * 16);
    for (int r = 0; r < RT; r++) p[r] = _mm512_mul_ps(_mm512_set1_ps(qs[r * head_dim + l]), k0);
    for (int j = 1; j < nd; j++) {
        const __m512 k = _mm512_loadu_ps(kb + (l + 16 * j) * 16);
        for (int r = 0; r < RT; r++) p[r] = _mm512_fmadd_ps(_mm512_set1_ps(qs[r * head_dim + l + 16 * j]), k, p[r]);
    }
}

/* Qc = (p[4c] + p[4c+2]) + (p[4c+1] + p[4c+3]) of the RT rows, the partials made in the order 4c,
 * 4c + 2, 4c + 1, 4c + 3 so that only three sets of RT are live at once (all in registers). */
static inline __attribute__((always_inline)) void score_chunk(const float *kb, const float *qs, int64_t head_dim,
                                                              int nd, int c, __m512 *q)
{
    __m512 s[RT], u[RT], p[RT];
    score_partial(kb, qs, head_dim, nd, 4 * c, s);
    score_partial(kb, qs, head_dim, nd, 4 * c + 2, p);
    for (int r = 0; r < RT; r++) s[r] = _mm512_add_ps(s[r], p[r]);
    score_partial(kb, qs, head_dim, nd, 4 * c + 1, u);
    score_partial(kb, qs, head_dim, nd, 4 * c + 3, p);
    for (int r = 0; r < RT; r++) q[r] = _mm512_add_ps(s[r], _mm512_add_ps(u[r], p[r]));
}

/* Scores of a work item's RT rows (scaled queries qs, RT x head_dim) for the 16 keys of one
 * transposed tile kb ([head_dim][16]) into a[0..RT): lane t = key t. The sum has paged_decode.c's
 * order exactly: the 16 d-chunk partials p[l] (score_partial) combine as ((Q0 + Q1) + (Q2 + Q3)),
 * Qc = (p[4c] + p[4c+2]) + (p[4c+1] + p[4c+3]) (its transpose_sum16), so a prefill row's scores are
 * bitwise a decode's. The tree's running sums wait in `tree` (2 x RT x 16 floats, touched once per
 * chunk c), so the registers hold the partials being made. */
static inline __attribute__((always_inline)) void score_tile(const float *kb, const float *qs, int64_t head_dim,
                                                             int nd, float *tree, __m512 *a)
{
    float *first = tree, *low = tree + RT * 16;  /* Q0, then Q2; Q0 + Q1 */
    for (int r = 0; r < RT; r++) a[r] = _mm512_setzero_ps();  /* set at c = 3 (the compiler cannot tell) */
    for (int c = 0; c < 4; c++) {
        __m512 q[RT];
        score_chunk(kb, qs, head_dim, nd, c, q);
        for (int r = 0; r < RT; r++) {
            if (c == 0 || c == 2) _mm512_storeu_ps(first + r * 16, q[r]);
            else if (c == 1) _mm512_storeu_ps(low + r * 16, _mm512_add_ps(_mm512_loadu_ps(first + r * 16), q[r]));
            else a[r] = _mm512_add_ps(_mm512_loadu_ps(low + r * 16),
                                      _mm512_add_ps(_mm512_loadu_ps(first + r * 16), q[r]));
        }
    }
}

/* One 16-key tile's scores a[RT] (lane l = key t0 + l) stored at each row's index from its own first
 * key (t0 - lo >= -15: sc[-16..-1] exist), masked to the row's keys. */
static inline void store_tile_scores(const TileRows *t, int64_t t0, const __m512 *a, float *sc, int64_t sc_stride)
{
    for (int r = 0; r < RT; r++) {
        const int64_t n = t->len[r] - t0;
        if (n <= 0 || t0 + 16 <= t->lo[r]) continue;
        const __mmask16 below = t->lo[r] > t0 ? (__mmask16)((1u << (t->lo[r] - t0)) - 1u) : (__mmask16)0;
        const __mmask16 live = (n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u)) & (__mmask16)~below;
        _mm512_mask_storeu_ps(sc + r * sc_stride + (t0 - t->lo[r]), live, a[r]);
    }
}

/* A row's maximum, lane-wise over its n_keys stored scores then across the lanes (the same value in
 * any order), after the scores rather than a horizontal reduce per 16-key tile between them. */
static inline float row_max(const float *sr, int64_t n_keys)
{
    __m512 m = _mm512_set1_ps(-3.0e38f);
    for (int64_t t = 0; t < n_keys; t += 16) {
        const __mmask16 live = n_keys - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n_keys - t)) - 1u);
        m = _mm512_mask_max_ps(m, live, m, _mm512_maskz_loadu_ps(live, sr + t));
    }
    return _mm512_reduce_max_ps(m);
}

/* The fp32 weighted V of a work item's rows for dims j * 16 .. (j + w) * 16 (w = 1 or 2, a constant
 * where inlined: each broadcast weight feeds w FMAs, so a pass loads fewer broadcasts per FMA), keys
 * in order, each row masked to its own keys: keys only the earlier rows' windows hold, keys every
 * row sees, then the few that only the later rows see. Each lane's sum is the same chain of fused
 * multiply-adds whatever w, so the bits do not depend on it. */
static inline __attribute__((always_inline)) void weighted_v(
    const float *vc, int64_t head_dim, int j, const int w, const TileRows *rs, const float *sc, int64_t sc_stride,
    const float *inv_sum, float *out, int64_t out_row_stride, int64_t row0, int64_t rows_total)
{
    const int64_t *len = rs->len, *lo = rs->lo;
    const int64_t shared_end = rs->min_len > rs->max_lo ? rs->min_len : rs->max_lo;
    __m512 acc[RT][2];
    for (int r = 0; r < RT; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
#define V_KEY(t, checked)                                                                                     \
    do {                                                                                                      \
        __m512 v[2];                                                                                          \
        for (int x = 0; x < w; x++) v[x] = _mm512_loadu_ps(vc + (t) * head_dim + (j + x) * 16);               \
        for (int r = 0; r < RT; r++) {                                                                        \
            if ((checked) && ((t) < lo[r] || (t) >= len[r])) continue;                                        \
            const __m512 p = _mm512_set1_ps(sc[r * sc_stride + (t) - lo[r]]);                                 \
            for (int x = 0; x < w; x++) acc[r][x] = _mm512_fmadd_ps(p, v[x], acc[r][x]);                      \
        }                                                                                                     \
    } while (0)
    for (int64_t t = rs->min_lo; t < rs->max_lo; t++) V_KEY(t, 1);
    for (int64_t t = rs->max_lo; t < rs->min_len; t++) V_KEY(t, 0);
    for (int64_t t = shared_end; t < rs->max_len; t++) V_KEY(t, 1);
#undef V_KEY
    for (int r = 0; r < RT; r++) {
        if (row0 + r >= rows_total) continue;
        for (int x = 0; x < w; x++)
            _mm512_storeu_ps(out + rs->tok[r] * out_row_stride + rs->head[r] * head_dim + (j + x) * 16,
                             _mm512_mul_ps(acc[r][x], _mm512_set1_ps(inv_sum[r])));
    }
}

/* kt, vc hold the gathered keys from key kstart on (local index = key - kstart); ctx0 is the first
 * query's position; sc rows hold each row's scores from its own first key (sc[-16..-1] exist).
 * nd = head_dim / 16, a compile-time constant where attend_tile inlines it (the common sizes). */
static inline __attribute__((always_inline)) void attend_rows(
    const float *kt, const float *vc, const float *q, int64_t q_row_stride, float *out, int64_t out_row_stride,
    int64_t group, int64_t kvh, int64_t ctx0, int64_t kstart, int64_t window, int64_t row0, int64_t rows_total,
    float scale, float *qs, float *sc, int64_t sc_stride, const int nd)
{
    const int64_t head_dim = 16 * (int64_t)nd;
    TileRows rs;
    tile_rows(&rs, group, kvh, ctx0, kstart, window, row0, rows_total);
    const int64_t *len = rs.len, *lo = rs.lo, *tok = rs.tok, *head = rs.head;
    for (int r = 0; r < RT; r++) {
        const float *src = q + tok[r] * q_row_stride + head[r] * head_dim;
        for (int64_t d = 0; d < head_dim; d++) qs[r * head_dim + d] = src[d] * scale;
    }
    /* 1. scores, 16 keys at a time */
    float tree[2 * RT * 16] __attribute__((aligned(64))) = {0};  /* score_tile's running sums */
    for (int64_t t0 = rs.min_lo / 16 * 16; t0 < rs.max_len; t0 += 16) {
        const float *kb = kt + (t0 / 16) * head_dim * 16;
        __m512 a[RT];
        score_tile(kb, qs, head_dim, nd, tree, a);
        store_tile_scores(&rs, t0, a, sc, sc_stride);
    }
    float maxv[RT];
    for (int r = 0; r < RT; r++) maxv[r] = row_max(sc + r * sc_stride, len[r] - lo[r]);
    /* 2. softmax numerators in place, per row over its own keys */
    float inv_sum[RT];
    for (int r = 0; r < RT; r++) inv_sum[r] = softmax_row_f32(sc + r * sc_stride, len[r] - lo[r], maxv[r]);
    /* 3. weighted V, 32 dims at a time (a 16-dim tail where head_dim / 16 is odd) */
    int j = 0;
    for (; j + 1 < nd; j += 2)
        weighted_v(vc, head_dim, j, 2, &rs, sc, sc_stride, inv_sum, out, out_row_stride, row0, rows_total);
    if (j < nd) weighted_v(vc, head_dim, j, 1, &rs, sc, sc_stride, inv_sum, out, out_row_stride, row0, rows_total);
}

static void attend_tile(const float *kt, const float *vc, const float *q, int64_t q_row_stride, float *out,
                        int64_t out_row_stride, int64_t group, int64_t kvh, int64_t ctx0, int64_t kstart,
                        int64_t window, int64_t row0, int64_t rows_total, int64_t head_dim, float scale, float *qs,
                        float *sc, int64_t sc_stride)
{
#define ATTEND(nd) attend_rows(kt, vc, q, q_row_stride, out, out_row_stride, group, kvh, ctx0, kstart, window, \
                               row0, rows_total, scale, qs, sc, sc_stride, nd)
    switch (head_dim / 16) {
    case 4: ATTEND(4); break;   /* head_dim 64 (SmolLM2, Llama 3.2 1B) */
    case 8: ATTEND(8); break;   /* 128 */
    default: ATTEND((int)(head_dim / 16)); break;
    }
#undef ATTEND
}
#if KV_BF16_DOTS_BUILT
#define RH 4  /* rows scored together in bf16 dot products (4 x 4 partials + the halves in registers) */

/* score_tile in bf16 dot products (kv_elem.h), RH rows at a time (all RT rows at once, as the fp32
 * path, measured no faster here: docs/model_runner.md): kb one 16-key tile of bf16 pairs ([head_dim
 * / 2][16]: word P*16 + t holds key t's dimensions 2P, 2P + 1), qb RH rows of rounded queries. Lane l
 * of chunk j's partial is vdpbf16ps over pair 16j + l from zero, then the same tree: paged_decode.c's
 * attend_seq_avx512 order with dots, so the scores are bitwise a decode's. */
static inline __attribute__((always_inline)) void score_rows_bf16(const uint32_t *kb, const uint16_t *qb,
                                                                  int64_t head_dim, int nd, __m512 *a)
{
    const int np = nd / 2;
    __m512 half[RH];
    for (int r = 0; r < RH; r++) half[r] = _mm512_setzero_ps();
    for (int c = 0; c < 4; c++) {
        __m512 p[4][RH];
        for (int i = 0; i < 4; i++) {
            const int64_t l = 4 * c + i;
            for (int r = 0; r < RH; r++) p[i][r] = _mm512_setzero_ps();
            for (int j = 0; j < np; j++) {
                const int64_t pair = l + 16 * j;
                const __m512bh k = (__m512bh)_mm512_loadu_si512(kb + pair * 16);
                for (int r = 0; r < RH; r++)
                    p[i][r] = _mm512_dpbf16_ps(p[i][r], kv_pair_bcast(qb + r * head_dim + 2 * pair), k);
            }
        }
        for (int r = 0; r < RH; r++) {
            const __m512 q = _mm512_add_ps(_mm512_add_ps(p[0][r], p[2][r]), _mm512_add_ps(p[1][r], p[3][r]));
            if (c == 0 || c == 2) half[r] = q;
            else if (c == 1) a[r] = _mm512_add_ps(half[r], q);
            else a[r] = _mm512_add_ps(a[r], _mm512_add_ps(half[r], q));
        }
    }
}

/* attend_rows in bf16 dot products. kt: the head's K tiles of pairs, vp: its V as key-pair words
 * ([n_keys / 2][head_dim]: word (u, d) = v[2u][d] | v[2u + 1][d] << 16), both from local key 0 =
 * kbase (even, so a local pair is an absolute pair). Each row: the rounded query, scores as the
 * decode's, the softmax numerators rounded to bf16 into its pb row (at local key index, the keys
 * just outside its range zeroed), the weighted V over the row's key pairs in order, a pair's key
 * outside the row's range masked to zero in v as the decode does. */
static inline __attribute__((always_inline)) void attend_rows_bf16(
    const uint32_t *kt, const uint32_t *vp, const float *q, int64_t q_row_stride, float *out,
    int64_t out_row_stride, int64_t group, int64_t kvh, int64_t ctx0, int64_t kbase, int64_t window, int64_t row0,
    int64_t rows_total, float scale, uint16_t *qb, float *sc, int64_t sc_stride, uint16_t *pb, int64_t pb_stride,
    const int nd)
{
    const int64_t head_dim = 16 * (int64_t)nd;
    TileRows rs;
    tile_rows(&rs, group, kvh, ctx0, kbase, window, row0, rows_total);
    const int64_t *len = rs.len, *lo = rs.lo, *tok = rs.tok, *head = rs.head;
    const int64_t max_len = rs.max_len, min_len = rs.min_len, min_lo = rs.min_lo, max_lo = rs.max_lo;
    for (int r = 0; r < RT; r++)
        kv_round_bf16(q + tok[r] * q_row_stride + head[r] * head_dim, scale, qb + r * head_dim, head_dim);
    /* 1. scores, 16 keys at a time */
    for (int64_t t0 = min_lo / 16 * 16; t0 < max_len; t0 += 16) {
        const uint32_t *kb = kt + (t0 / 16) * (head_dim / 2) * 16;
        __m512 a[RT];
        for (int h = 0; h < RT; h += RH) score_rows_bf16(kb, qb + h * head_dim, head_dim, nd, a + h);
        store_tile_scores(&rs, t0, a, sc, sc_stride);
    }
    /* 2. per row: the maximum, then the numerators rounded to bf16 (pb at local key index) */
    float inv_sum[RT];
    for (int r = 0; r < RT; r++) {
        const float *sr = sc + r * sc_stride;
        const int64_t n_keys = len[r] - lo[r];
        inv_sum[r] = kv_softmax_bf16(sr, n_keys, row_max(sr, n_keys), pb + r * pb_stride + lo[r], lo[r]);
    }
    /* 3. weighted V over key pairs, 32 dims at a time (two 16-lane slices: each broadcast numerator
     * pair feeds two vdpbf16ps, so a pass loads 1 V line per 4 products instead of 1 per 8 plus
     * a broadcast per product; every lane's sum is the same chain over the pairs in order): pairs
     * some row holds only partly or not at all (masked per row), pairs every row holds whole, then
     * the later rows' last pairs */
    const int64_t u_lo = min_lo / 2, u_hi = (max_len + 1) / 2;
    const int64_t s0 = (max_lo + 1) / 2, s1 = min_len / 2 > s0 ? min_len / 2 : s0;
    for (int j = 0; j < nd; j += 2) {  /* nd is even here (head_dim a multiple of 32) */
        __m512 acc[RT][2];
        for (int r = 0; r < RT; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
#define CHECKED_PAIR(u)                                                                                       \
        do {                                                                                                  \
            const __m512i v0 = _mm512_loadu_si512(vp + (u) * head_dim + j * 16);                             \
            const __m512i v1 = _mm512_loadu_si512(vp + (u) * head_dim + j * 16 + 16);                        \
            for (int r = 0; r < RT; r++) {                                                                    \
                if ((u) < lo[r] / 2 || (u) >= (len[r] + 1) / 2) continue;                                     \
                const uint32_t keep = (2 * (u) >= lo[r] ? 0x0000FFFFu : 0u) | (2 * (u) + 1 < len[r] ? 0xFFFF0000u : 0u); \
                const __m512i m = _mm512_set1_epi32((int)keep);                                               \
                const __m512bh p = kv_pair_bcast(pb + r * pb_stride + 2 * (u));                               \
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], p, (__m512bh)_mm512_and_si512(v0, m));                \
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], p, (__m512bh)_mm512_and_si512(v1, m));                \
            }                                                                                                 \
        } while (0)
        for (int64_t u = u_lo; u < s0 && u < u_hi; u++) CHECKED_PAIR(u);
        for (int64_t u = s0; u < s1; u++) {
            const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vp + u * head_dim + j * 16);
            const __m512bh v1 = (__m512bh)_mm512_loadu_si512(vp + u * head_dim + j * 16 + 16);
            for (int r = 0; r < RT; r++) {
                const __m512bh p = kv_pair_bcast(pb + r * pb_stride + 2 * u);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], p, v0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], p, v1);
            }
        }
        for (int64_t u = s1; u < u_hi; u++) CHECKED_PAIR(u);
#undef CHECKED_PAIR
        for (int r = 0; r < RT; r++) {
            if (row0 + r >= rows_total) continue;
            const __m512 inv = _mm512_set1_ps(inv_sum[r]);
            float *o = out + tok[r] * out_row_stride + head[r] * head_dim + j * 16;
            _mm512_storeu_ps(o, _mm512_mul_ps(acc[r][0], inv));
            _mm512_storeu_ps(o + 16, _mm512_mul_ps(acc[r][1], inv));
        }
    }
}

static void attend_tile_bf16(const uint32_t *kt, const uint32_t *vp, const float *q, int64_t q_row_stride,
                             float *out, int64_t out_row_stride, int64_t group, int64_t kvh, int64_t ctx0,
                             int64_t kbase, int64_t window, int64_t row0, int64_t rows_total, int64_t head_dim,
                             float scale, uint16_t *qb, float *sc, int64_t sc_stride, uint16_t *pb, int64_t pb_stride)
{
#define ATTEND(nd) attend_rows_bf16(kt, vp, q, q_row_stride, out, out_row_stride, group, kvh, ctx0, kbase, window, \
                                    row0, rows_total, scale, qb, sc, sc_stride, pb, pb_stride, nd)
    switch (head_dim / 16) {
    case 4: ATTEND(4); break;
    case 8: ATTEND(8); break;
    default: ATTEND((int)(head_dim / 16)); break;
    }
#undef ATTEND
}

/* prefill_attention's bf16-dot path (kv_bf16_dots holds): K gathered into 16-key tiles of bf16 pairs,
 * V into key-pair words, from kbase = the first gathered key rounded down to even (that key, when it
 * is before the first query's window, is left zero: no row reads it unmasked). */
static int prefill_attention_bf16dots(
    const float *q, int64_t q_row_stride, const uint16_t *k_cache, const uint16_t *v_cache, int64_t block_stride,
    const int32_t *table, int64_t num_q, int64_t seq_len, float *out, int64_t out_row_stride, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window)
{
    const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * head_dim;
    const int64_t ctx0 = seq_len - num_q, kstart = first_key(ctx0 + 1, window);
    const int64_t kbase = kstart & ~(int64_t)1, n_keys = seq_len - kbase, tiles = (n_keys + 15) / 16;
    const int64_t padded = tiles * 16, half = head_dim / 2;
    uint32_t *kt = (uint32_t *)calloc((size_t)(num_kv_heads * padded * half), sizeof(uint32_t));
    uint32_t *vp = (uint32_t *)calloc((size_t)(num_kv_heads * (padded / 2) * head_dim), sizeof(uint32_t));
    if (kt == NULL || vp == NULL) {
        free(kt);
        free(vp);
        return -2;
    }
    for (int64_t t = kstart; t < seq_len; t++) {
        const int64_t off = (int64_t)table[t / block_size] * block_stride + (t % block_size) * token_stride;
        const int64_t u = t - kbase;
        const int shift = (int)(u & 1) * 16;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const uint16_t *ks = k_cache + off + h * head_dim, *vs = v_cache + off + h * head_dim;
            uint32_t *kd = kt + h * padded * half + (u / 16) * half * 16 + (u % 16);
            for (int64_t p = 0; p < half; p++) kd[p * 16] = (uint32_t)ks[2 * p] | (uint32_t)ks[2 * p + 1] << 16;
            uint32_t *vd = vp + (h * (padded / 2) + u / 2) * head_dim;
            for (int64_t d = 0; d < head_dim; d++) vd[d] |= (uint32_t)vs[d] << shift;
        }
    }
    const int64_t rows = num_q * group, per_head = (rows + RT - 1) / RT, items = num_kv_heads * per_head;
    const int64_t sc_stride = padded, pb_stride = padded + 2;
    int failed = 0;
    #pragma omp parallel if (items > 1)
    {
        uint16_t *qb = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(RT * head_dim));
        float *sc_buf = (float *)malloc(sizeof(float) * (size_t)(RT * sc_stride + 16));
        float *sc = sc_buf == NULL ? NULL : sc_buf + 16;
        uint16_t *pb = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(RT * pb_stride));
        if (qb == NULL || sc == NULL || pb == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (qb == NULL || sc == NULL || pb == NULL) continue;
            const int64_t h = item / per_head, tile = per_head - 1 - item % per_head;
            attend_tile_bf16(kt + h * padded * half, vp + h * (padded / 2) * head_dim, q, q_row_stride, out,
                             out_row_stride, group, h, ctx0, kbase, window, tile * RT, rows, head_dim, scale, qb, sc,
                             sc_stride, pb, pb_stride);
        }
        free(qb);
        free(sc_buf);
        free(pb);
    }
    free(kt);
    free(vp);
    return failed ? -2 : 0;
}
#endif
#endif

/* A chunk the tiled kernels do not take (neither AVX-512 nor AVX2 in the build, head_dim not a
 * multiple of 16, more query heads than the decode kernel's vector paths take): every row as the decode of
 * its position, paged_decode.c's kernel with one block table for all rows (table stride 0) and
 * row i seeing seq_len - num_q + 1 + i keys. Bitwise what decoding the prompt token by token gives,
 * by construction; SDPA here instead made a prefix hit, a chunked prompt or a preemption's
 * recompute change the answer on a CPU without AVX-512. -1 for a shape the decode kernel refuses. */
static int prefill_as_decodes(
    const float *q, int64_t q_row_stride, const char *k_cache, const char *v_cache, int64_t block_stride,
    const int32_t *table, int64_t num_q, int64_t seq_len, float *out, int64_t out_row_stride,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window,
    int esz)
{
    int32_t *lens = (int32_t *)malloc(sizeof(int32_t) * (size_t)num_q);
    int32_t *rows = (int32_t *)malloc(sizeof(int32_t) * (size_t)num_q);
    if (lens == NULL || rows == NULL) {
        free(lens);
        free(rows);
        return -2;
    }
    for (int64_t i = 0; i < num_q; i++) {
        lens[i] = (int32_t)(seq_len - num_q + 1 + i);
        rows[i] = (int32_t)i;
    }
    const int status = kvmesh_paged_decode_elem(q, q_row_stride, k_cache, v_cache, block_stride, table, 0, lens, rows,
                                                num_q, out, out_row_stride, num_heads, num_kv_heads, head_dim,
                                                block_size, seq_len, scale, window, esz);
    free(lens);
    free(rows);
    return status;
}

/* esz: the cache element's bytes (4 fp32, 2 bf16); block_stride in elements */
int kvmesh_prefill_attention_elem(
    const float *q, int64_t q_row_stride,  /* the chunk's first query row; [num_q, H, D] */
    const char *k_cache, const char *v_cache, int64_t block_stride,
    const int32_t *table, int64_t num_q, int64_t seq_len,
    float *out, int64_t out_row_stride,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window,
    int esz)
{
    if (num_kv_heads <= 0 || num_heads % num_kv_heads) return -1;
    if (num_q <= 0 || seq_len < num_q) return num_q <= 0 ? 0 : -1;
#if defined(__AVX512F__) || KVM_AVX2
    /* the shapes the decode kernel's vector path takes, whose order the tiles reproduce */
    const int tiled = head_dim % 16 == 0 && head_dim <= PF_MAX_DIM && num_heads <= KV_MAX_HEADS;
#else
    const int tiled = 0;
#endif
    if (!tiled)
        return prefill_as_decodes(q, q_row_stride, k_cache, v_cache, block_stride, table, num_q, seq_len, out,
                                  out_row_stride, num_heads, num_kv_heads, head_dim, block_size, scale, window, esz);
#if KVM_AVX2
    return kvm_prefill_tiled_avx2(q, q_row_stride, k_cache, v_cache, block_stride, table, num_q, seq_len, out,
                                  out_row_stride, num_heads, num_kv_heads, head_dim, block_size, scale, window, esz);
#endif
#if defined(__AVX512F__)
#if KV_AMX_BUILT
    if (kv_amx(esz, num_heads, head_dim, block_size))  /* attention_amx.c: the decode kernel's tiles too */
        return kvm_prefill_amx(q, q_row_stride, (const uint16_t *)k_cache, (const uint16_t *)v_cache, block_stride,
                               table, num_q, seq_len, out, out_row_stride, num_heads, num_kv_heads, head_dim,
                               block_size, scale, window);
#endif
#if KV_BF16_DOTS_BUILT
    if (kv_bf16_dots(esz, num_heads, head_dim, block_size))
        return prefill_attention_bf16dots(q, q_row_stride, (const uint16_t *)k_cache, (const uint16_t *)v_cache,
                                          block_stride, table, num_q, seq_len, out, out_row_stride, num_heads,
                                          num_kv_heads, head_dim, block_size, scale, window);
#endif
    const int64_t group = num_heads / num_kv_heads;
    /* the first query's first key: nothing before it is gathered (window 0 = full attention) */
    const int64_t ctx0 = seq_len - num_q, kstart = first_key(ctx0 + 1, window);
    const int64_t padded = (seq_len - kstart + 15) / 16 * 16;
    /* per KV head: K transposed in 16-key tiles [tiles][D][16], V contiguous [seq_len][D] */
    float *kt = NULL, *vc = NULL;
    if (prefill_gather(k_cache, v_cache, block_stride, table, kstart, seq_len, num_kv_heads, head_dim, block_size,
                       esz, 16, padded, &kt, &vc) != 0)
        return -2;
    const int64_t rows = num_q * group, per_head = (rows + RT - 1) / RT, items = num_kv_heads * per_head;
    const int64_t sc_stride = padded;
    int failed = 0;
    #pragma omp parallel if (items > 1)
    {
        float *qs = (float *)malloc(sizeof(float) * (size_t)(RT * head_dim));
        /* 16 floats before the rows: a row's first (masked) store may start up to 15 before it */
        float *sc_buf = (float *)malloc(sizeof(float) * (size_t)(RT * sc_stride + 16));
        float *sc = sc_buf == NULL ? NULL : sc_buf + 16;
        if (qs == NULL || sc == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        /* KV head by KV head, so the one head's K and V (2 x n_keys x head_dim floats) stay in L2
         * while its tiles pass over them (the heads in turn were slower: docs/benchmarks.md); within
         * a head the longest tiles (last query rows) first, so threads end together */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (qs == NULL || sc == NULL) continue;
            const int64_t h = item / per_head, tile = per_head - 1 - item % per_head;
            attend_tile(kt + h * padded * head_dim, vc + h * padded * head_dim, q, q_row_stride, out,
                        out_row_stride, group, h, ctx0, kstart, window, tile * RT, rows, head_dim, scale, qs, sc,
                        sc_stride);
        }
        free(qs);
        free(sc_buf);
    }
    free(kt);
    free(vc);
    return failed ? -2 : 0;
#endif
}

int kvmesh_prefill_attention_f32(
    const float *q, int64_t q_row_stride, const float *k_cache, const float *v_cache, int64_t block_stride,
    const int32_t *table, int64_t num_q, int64_t seq_len, float *out, int64_t out_row_stride, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window)
{
    return kvmesh_prefill_attention_elem(q, q_row_stride, (const char *)k_cache, (const char *)v_cache, block_stride, table,
                             num_q, seq_len, out, out_row_stride, num_heads, num_kv_heads, head_dim, block_size,
                             scale, window, 4);
}

/* The same over a bf16 cache: bf16 dot products where kv_bf16_dots holds, else bitwise the fp32
 * entry point over the widened values. */
int kvmesh_prefill_attention_bf16(
    const float *q, int64_t q_row_stride, const uint16_t *k_cache, const uint16_t *v_cache, int64_t block_stride,
    const int32_t *table, int64_t num_q, int64_t seq_len, float *out, int64_t out_row_stride, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window)
{
    return kvmesh_prefill_attention_elem(q, q_row_stride, (const char *)k_cache, (const char *)v_cache, block_stride, table,
                             num_q, seq_len, out, out_row_stride, num_heads, num_kv_heads, head_dim, block_size,
                             scale, window, 2);
}
