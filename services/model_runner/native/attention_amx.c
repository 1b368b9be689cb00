/*
 * Attention over a bf16 pool on AMX tiles, decode and prefill: where kv_elem.h's kv_amx holds
 * (the process runs its bf16 GEMMs on AMX, a shape kv_bf16_dots takes), paged_decode.c and
 * prefill_attention.c hand their work here, so a prefill row stays bitwise the decode of its
 * position on AMX as it does on the vdpbf16ps path.
 *
 * Why: on an Intel core vdpbf16ps issues at half its fp32 FMA rate, and a 1,024-token prefill in
 * bf16 mode spent about half its time in attention (docs/model_runner.md, "AMX attention"). One
 * TDPBF16PS is 16 x 16 x 32 bf16 products with fp32 sums.
 *
 * A work item is up to 16 rows that share one KV head: a decode's query heads of that KV head
 * (one sequence), or 16 (query token, head) rows of a prefill chunk. Per item:
 *
 *   scores   per 16-key tile t (keys 16t .. 16t + 15, by absolute position): C = 0, then for each
 *            32-dimension slice j in order C = TDPBF16PS(C, K[tile][slice j], Q^T[slice j]), so
 *            C[key][row] = the score; A is 16 key rows of the pool (a tile load straight from a
 *            block of 16 or more keys; from a copy where the tile spans blocks), B the rows' scaled
 *            queries rounded to bf16 (kv_round_bf16) as 16 dimension pairs x 16 rows. C is stored
 *            and transposed so that each row's scores lie in key order.
 *   softmax  per row over its own keys first .. len - 1 (amx_softmax_row): the maximum, the
 *            numerators e^(s - max) (exp512_neg) rounded to bf16, and 1 / their sum, lane-wise
 *            (lane l = key 16t + l) over the row's own 16-key tiles in order, then reduced.
 *   weighted per 32-key tile w (16 key pairs, absolute), in order from the item's first:
 *   V        C = TDPBF16PS(C, P[rows][tile w], V pairs[tile w][16 dims]) into 16 x 16 output
 *            tiles (64 dims per pass over the keys), P the rounded numerators (zero outside each
 *            row's keys), V's word (u, d) = v[2u][d] | v[2u + 1][d] << 16 (zero for a key outside
 *            the item's keys); out = C * (1 / sum).
 *
 * Why the bits agree between decode and prefill: TDPBF16PS computes each element of C from its
 * own row of A and column of B (the GEMM's batch invariance rests on the same property), every
 * operand element above is a function of the row and the key only, and the tiles a prefill item
 * runs beyond a row's own keys add zero products (p = 0) to its sums. So a row's scores, its
 * softmax (a per-row function) and its weighted V are those of the decode of its position,
 * whatever rows share its item, the chunk's split or the thread (tests/kernel_tests/
 * test_amx_attention.py). The bits differ from the vdpbf16ps path's (other sums), which is why the
 * choice is per process, with the GEMMs'.
 *
 * Positions are absolute: the callers pass a sequence's whole block table and its length (the
 * tiles group keys by position, as the decode does); nothing before the first query's window is
 * read.
 *
 * Tiles (all 16 rows x 64 bytes): scores in 0 (and 3 for a prefill item's second key tile), their
 * K operands in 1 (and 4), Q^T in 2; the weighted V's P in 1, V in 2 and 7, outputs in 3-6. Each
 * OpenMP thread loads the configuration in its parallel region before its first tile and releases
 * the tiles at the region's end, as gemm_amx.c does.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "amx_tiles.h"
#include "attention_amx.h"
#include "exp_math.h"
#include "kernels.h"
#include "kv_elem.h"
#include "kv_prefetch.h"

#if KV_AMX_BUILT
#include <immintrin.h>

#define AT 16     /* keys per score tile; rows per item; a tile's columns (32-bit) */
#define PT 32     /* keys per weighted-V tile (16 key pairs) */
#define MAX_DIM 256

static void amx_tiles_on(void)
{
    AmxTileConfig cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = AT;
    }
    _tile_loadconfig(&cfg);
}

/* The pool of one layer and the KV head an item reads. */
typedef struct {
    const uint16_t *k, *v;
    int64_t block_stride, token_stride, block_size, head_dim, kvh;
    const int32_t *table;
} Pool;

static inline const uint16_t *pool_row(const Pool *p, const uint16_t *cache, int64_t key)
{
    return cache + (int64_t)p->table[key / p->block_size] * p->block_stride + (key % p->block_size) * p->token_stride
           + p->kvh * p->head_dim;
}

/* An item's rows: row r attends keys first[r] .. len[r] - 1 with query q[r], into out[r]. */
typedef struct {
    int n;
    int64_t first[AT], len[AT];
    const float *q[AT];
    float *out[AT];
    int64_t first_min, len_max;
} Rows;

/* Per-thread scratch. */
typedef struct {
    uint32_t *qt;   /* [B][MAX_DIM / 32][16 pairs][16 rows]: B items' query tiles (a decode: its KV heads) */
    float *c;       /* [2][16][16] stored C tiles */
    uint16_t *kt;   /* [2][16][head_dim] K tiles that span blocks */
    uint16_t *qb;   /* [16][head_dim] the rounded queries */
    float *s;       /* [R][s_stride] scores, key t_lo * 16 first (R: 16, or a decode's query heads) */
    uint16_t *p;    /* [16][p_stride] numerators, key w_lo * 32 first */
    uint32_t *vp;   /* decode: [num_kv][v_pairs][head_dim] V pairs, key w_lo * 32 first */
    Rows *rw;       /* [B] the items' rows (a decode: one per KV head) */
    int64_t s_stride, p_stride, v_stride;
} Scratch;

/* 16 x 16 32-bit elements: r[i] lane j -> r[j] lane i. */
static inline void transpose16(__m512 r[16])
{
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    /* u[4i + k], 128-bit lane L: column 4L + k of rows 4i .. 4i + 3 */
    for (int k = 0; k < 4; k++) {
        const __m512 a0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88);       /* L0 L2 of rows 0-3, 4-7 */
        const __m512 a1 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD);       /* L1 L3 */
        const __m512 b0 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
        const __m512 b1 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
        r[k] = _mm512_shuffle_f32x4(a0, b0, 0x88);        /* column k */
        r[8 + k] = _mm512_shuffle_f32x4(a0, b0, 0xDD);    /* column 8 + k */
        r[4 + k] = _mm512_shuffle_f32x4(a1, b1, 0x88);    /* column 4 + k */
        r[12 + k] = _mm512_shuffle_f32x4(a1, b1, 0xDD);   /* column 12 + k */
    }
}

static inline __mmask16 keys_live(int64_t k0, int64_t first, int64_t len)
{
    uint32_t m = 0xFFFFu;
    if (first > k0) m &= 0xFFFFu << (first - k0 < 16 ? first - k0 : 16);
    if (len < k0 + 16) m &= len <= k0 ? 0u : (1u << (len - k0)) - 1u;
    return (__mmask16)m;
}

/* One row's softmax over its keys first .. len - 1: s and p both start at key tb = first rounded
 * down to 16 and run to len rounded up; p gets the bf16 numerators (zero for keys outside the
 * row). Returns 1 / the sum of the rounded numerators, summed lane-wise over the 16-key tiles in
 * order, then reduced: the one order the decode and the prefill share. */
static inline float amx_softmax_row(const float *s, int64_t tb, int64_t first, int64_t len, uint16_t *p)
{
    __m512 mx = _mm512_set1_ps(-3.0e38f);
    for (int64_t k0 = tb; k0 < len; k0 += 16) {
        const __mmask16 live = keys_live(k0, first, len);
        mx = _mm512_mask_max_ps(mx, live, mx, _mm512_maskz_loadu_ps(live, s + (k0 - tb)));
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t k0 = tb; k0 < len; k0 += 16) {
        const __mmask16 live = keys_live(k0, first, len);
        const __m512 e = exp512_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + (k0 - tb)), m));
        const __m256i b = _mm256_maskz_mov_epi16(live, (__m256i)_mm512_cvtneps_pbh(e));
        _mm256_storeu_si256((__m256i *)(p + (k0 - tb)), b);
        sum = _mm512_add_ps(sum, kv_widen16(b));
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* V pairs of keys vbase .. vend - 1 (multiples of 32) of every KV head into vp ([num_kv][pairs]
 * [head_dim] words, head h's from vp + h * head_stride; word (u, d) = v[vbase + 2u][d] |
 * v[vbase + 2u + 1][d] << 16), a key outside lo .. hi - 1 zero (never read: its slot may be freed or
 * hold another request's data). Token rows are read whole, all heads, in key order; with `fetch`
 * (a decode, whose V comes from memory) each 16 keys' rows prefetch the next 16's, spread over them. */
static void pack_v(const Pool *pool, int64_t num_kv, int64_t lo, int64_t hi, int64_t vbase, int64_t vend,
                   uint32_t *vp, int64_t head_stride, int fetch)
{
    const int64_t hd = pool->head_dim, row_bytes = pool->token_stride * 2;
    const int64_t first = lo > vbase ? lo : vbase;
    const int spread = fetch && pool->block_size % AT == 0;
    const __m512i zero = _mm512_setzero_si512();
    if (spread && first < hi) prefetch_block((const char *)pool_row(pool, pool->v, first), row_bytes);
    Prefetcher pf = prefetcher(NULL, 0, 1);
    for (int64_t k = vbase; k < vend; k += 2) {
        if (spread && k % AT == 0) {
            const int64_t next = k + AT;  /* the next 16 keys lie in one block */
            pf = prefetcher(next < hi ? (const char *)(pool_row(pool, pool->v, next) - pool->kvh * hd) : NULL,
                            AT * row_bytes, AT / 2);
        }
        if (spread) prefetch_step(&pf);
        const uint16_t *r0 = k >= lo && k < hi ? pool_row(pool, pool->v, k) - pool->kvh * hd : NULL;
        const uint16_t *r1 = k + 1 >= lo && k + 1 < hi ? pool_row(pool, pool->v, k + 1) - pool->kvh * hd : NULL;
        if (fetch && r0 != NULL) {  /* the same keys' K rows into L2, for the scores after this pass */
            const char *kr = (const char *)(pool_row(pool, pool->k, k) - pool->kvh * hd);
            for (int64_t b = 0; b < (r1 != NULL ? 2 : 1) * row_bytes; b += 64) _mm_prefetch(kr + b, _MM_HINT_T1);
        }
        for (int64_t h = 0; h < num_kv; h++) {
            uint32_t *dst = vp + h * head_stride + ((k - vbase) / 2) * hd;
            for (int64_t d = 0; d < hd; d += 16) {
                const __m512i e = r0 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(r0 + h * hd + d))) : zero;
                const __m512i o = r1 ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                           (const __m256i *)(r1 + h * hd + d))), 16)
                                     : zero;
                _mm512_storeu_si512(dst + d, _mm512_or_si512(e, o));
            }
        }
    }
}

/* Output tiles 3 .. 3 + nc - 1 += P (tile 1, already loaded) x V pairs at b (16 dims apart). */
#define PV_TILE(c, ct, bt) do { _tile_loadd(bt, b + 16 * (c), b_stride); _tile_dpbf16ps(ct, 1, bt); } while (0)

static inline void pv_step(int nc, const uint32_t *b, int64_t b_stride)
{
    PV_TILE(0, 3, 2);
    if (nc > 1) PV_TILE(1, 4, 7);
    if (nc > 2) PV_TILE(2, 5, 2);
    if (nc > 3) PV_TILE(3, 6, 7);
}

static inline void store_out(int c, float *dst)
{
    switch (c) {
    case 0: _tile_stored(3, dst, 64); break;
    case 1: _tile_stored(4, dst, 64); break;
    case 2: _tile_stored(5, dst, 64); break;
    default: _tile_stored(6, dst, 64); break;
    }
}

/* Step 1 of an item (module comment): the rows' scaled queries rounded to bf16 (qb), as B tiles of
 * dimension pairs x rows (qt: [head_dim / 32][16][16] words). */
static void queries_to_tiles(const Rows *rw, int64_t hd, float scale, uint16_t *qb, uint32_t *qt)
{
    for (int r = 0; r < AT; r++) {
        if (r < rw->n) kv_round_bf16(rw->q[r], scale, qb + r * hd, hd);
        else memset(qb + r * hd, 0, sizeof(uint16_t) * (size_t)hd);
    }
    for (int64_t j = 0; j < hd / 32; j++) {
        __m512 w[AT];
        for (int r = 0; r < AT; r++) w[r] = _mm512_loadu_ps((const float *)(qb + r * hd) + 16 * j);
        transpose16(w);
        for (int k = 0; k < AT; k++) _mm512_storeu_ps((float *)(qt + (j * AT + k) * AT), w[k]);
    }
}

/* Tile t's 16 K rows of one KV head as an A operand: in place where they lie in one block, else
 * copied into kt (a key outside the item's keys zero). */
static inline const uint16_t *k_tile(const Pool *pool, const Rows *rw, int64_t t, uint16_t *kt, int64_t *stride)
{
    const int64_t hd = pool->head_dim;
    if (pool->block_size % AT == 0) {
        *stride = pool->token_stride * 2;
        return pool_row(pool, pool->k, t * AT);
    }
    for (int i = 0; i < AT; i++) {
        const int64_t key = t * AT + i;
        if (key >= rw->first_min && key < rw->len_max)
            memcpy(kt + i * hd, pool_row(pool, pool->k, key), sizeof(uint16_t) * (size_t)hd);
        else
            memset(kt + i * hd, 0, sizeof(uint16_t) * (size_t)hd);
    }
    *stride = hd * 2;
    return kt;
}

/* A stored C tile (rows = keys, columns = the item's rows) into each row's scores at dst. */
static inline void scores_out(const Rows *rw, const float *c, float *dst, int64_t s_stride)
{
    if (rw->n <= 4) {  /* a decode's few rows: each one column of the stored tile */
        const __m512i col = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32(AT));
        for (int r = 0; r < rw->n; r++) _mm512_storeu_ps(dst + r * s_stride, _mm512_i32gather_ps(col, c + r, 4));
    } else {
        __m512 w[AT];
        for (int i = 0; i < AT; i++) w[i] = _mm512_loadu_ps(c + i * AT);
        transpose16(w);
        for (int r = 0; r < rw->n; r++) _mm512_storeu_ps(dst + r * s_stride, w[r]);
    }
}

/* Step 2 for score tiles t and, with `two`, t + 1 (each a chain of TDPBF16PS into its own C tile,
 * 0 and 3, sharing each Q^T load): each row's scores of their keys into its row of s (key t_lo * 16
 * first). kt: scratch for a K tile that spans blocks (two: 2 x 16 rows); c: 2 x [16][16]. */
static void score_tiles(const Pool *pool, const Rows *rw, int64_t t, int two, int64_t t_lo, const uint32_t *qt,
                        uint16_t *kt, float *c, float *s, int64_t s_stride)
{
    const int64_t hd = pool->head_dim;
    int64_t a0_stride, a1_stride = 0;
    const uint16_t *a0 = k_tile(pool, rw, t, kt, &a0_stride);
    const uint16_t *a1 = two ? k_tile(pool, rw, t + 1, kt + AT * hd, &a1_stride) : NULL;
    _tile_zero(0);
    if (two) _tile_zero(3);
    for (int64_t j = 0; j < hd / 32; j++) {
        _tile_loadd(2, qt + j * AT * AT, 64);
        _tile_loadd(1, a0 + 32 * j, a0_stride);
        _tile_dpbf16ps(0, 1, 2);
        if (two) {
            _tile_loadd(4, a1 + 32 * j, a1_stride);
            _tile_dpbf16ps(3, 4, 2);
        }
    }
    _tile_stored(0, c, 64);
    if (two) _tile_stored(3, c + AT * AT, 64);
    scores_out(rw, c, s + (t - t_lo) * AT, s_stride);
    if (two) scores_out(rw, c + AT * AT, s + (t + 1 - t_lo) * AT, s_stride);
}

/* Steps 3 and 4: each row's softmax over its scores s (row r at s + r * s_stride, key t_lo * 16
 * first), then the weighted V from vp (the head's V pairs from key vbase) into the rows' outputs. */
static void finish_rows(const Rows *rw, int64_t hd, const float *s, int64_t s_stride, int64_t t_lo, Scratch *sc,
                        const uint32_t *vp, int64_t vbase)
{
    const int64_t w_lo = rw->first_min / PT, w_hi = (rw->len_max - 1) / PT;
    float inv[AT];
    const int64_t p_keys = (w_hi - w_lo + 1) * PT;
    for (int r = 0; r < AT; r++) {
        uint16_t *pr = sc->p + r * sc->p_stride;
        memset(pr, 0, sizeof(uint16_t) * (size_t)p_keys);
        if (r >= rw->n) continue;
        const int64_t tb = rw->first[r] / AT * AT;
        inv[r] = amx_softmax_row(s + r * s_stride + (tb - t_lo * AT), tb, rw->first[r], rw->len[r],
                                 pr + (tb - w_lo * PT));
    }
    for (int64_t d0 = 0; d0 < hd; d0 += 64) {
        const int nc = (int)((hd - d0) / 16 < 4 ? (hd - d0) / 16 : 4);
        _tile_zero(3); _tile_zero(4); _tile_zero(5); _tile_zero(6);
        for (int64_t w = w_lo; w <= w_hi; w++) {
            _tile_loadd(1, sc->p + (w - w_lo) * PT, sc->p_stride * 2);
            pv_step(nc, vp + ((w * PT - vbase) / 2) * hd + d0, hd * 4);
        }
        for (int c = 0; c < nc; c++) {
            store_out(c, sc->c);
            for (int r = 0; r < rw->n; r++)
                _mm512_storeu_ps(rw->out[r] + d0 + 16 * c,
                                 _mm512_mul_ps(_mm512_loadu_ps(sc->c + r * AT), _mm512_set1_ps(inv[r])));
        }
    }
}

/* Grow-only buffers of the calling thread, kept for its next call: a step calls a kernel once per
 * layer, and fresh buffers of these sizes come from mmap, each page zeroed by the OS on first touch
 * (clear_page_erms took 5% of a prefill's profile). Never freed: OpenMP's threads, like the caller,
 * live as long as the process, and each keeps the largest of its calls' sizes. */
enum { BUF_QT, BUF_C, BUF_KT, BUF_QB, BUF_S, BUF_P, BUF_VP, BUF_ROWS, BUF_CALL_VP, BUF_COUNT };
static __thread void *thread_buf[BUF_COUNT];
static __thread size_t thread_cap[BUF_COUNT];

static void *thread_buffer(int slot, size_t bytes)
{
    if (bytes <= thread_cap[slot]) return thread_buf[slot];
    free(thread_buf[slot]);
    const size_t cap = (bytes + bytes / 4 + 63) / 64 * 64;
    thread_buf[slot] = aligned_alloc(64, cap);
    thread_cap[slot] = thread_buf[slot] != NULL ? cap : 0;
    return thread_buf[slot];
}

#define QT_WORDS ((MAX_DIM / 32) * AT * AT)

/* Room for items of up to `keys` keys, `blocks` query tiles and `rows` score rows; V pairs of
 * `vp_heads` heads (a decode; 0: none). Returns 0 or -2. */
static int scratch_init(Scratch *sc, int64_t hd, int64_t keys, int64_t blocks, int64_t rows, int64_t vp_heads)
{
    memset(sc, 0, sizeof(*sc));
    sc->s_stride = (keys + 2 * PT + 15) / 16 * 16;
    sc->p_stride = sc->s_stride + PT;
    sc->v_stride = (sc->s_stride / 2 + PT) * hd;
    sc->qt = (uint32_t *)thread_buffer(BUF_QT, sizeof(uint32_t) * QT_WORDS * (size_t)blocks);
    sc->c = (float *)thread_buffer(BUF_C, sizeof(float) * 2 * AT * AT);
    sc->kt = (uint16_t *)thread_buffer(BUF_KT, sizeof(uint16_t) * (size_t)(2 * AT * hd));
    sc->qb = (uint16_t *)thread_buffer(BUF_QB, sizeof(uint16_t) * (size_t)(AT * hd));
    sc->s = (float *)thread_buffer(BUF_S, sizeof(float) * (size_t)(rows * sc->s_stride));
    sc->p = (uint16_t *)thread_buffer(BUF_P, sizeof(uint16_t) * (size_t)(AT * sc->p_stride));
    if (vp_heads) sc->vp = (uint32_t *)thread_buffer(BUF_VP, sizeof(uint32_t) * (size_t)(vp_heads * sc->v_stride));
    sc->rw = (Rows *)thread_buffer(BUF_ROWS, sizeof(Rows) * (size_t)blocks);
    return !sc->qt || !sc->c || !sc->kt || !sc->qb || !sc->s || !sc->p || (vp_heads && !sc->vp) || !sc->rw ? -2 : 0;
}

/* A parallel region's start on each thread: its scratch (scratch_init's arguments), then the tile
 * configuration. 0, with *failed set, where the scratch could not be had. */
static int region_begin(Scratch *sc, int64_t hd, int64_t keys, int64_t blocks, int64_t rows, int64_t vp_heads,
                        int *failed)
{
    if (scratch_init(sc, hd, keys, blocks, rows, vp_heads) != 0) {
        #pragma omp atomic write
        *failed = 1;
        return 0;
    }
    amx_tiles_on();
    return 1;
}

/* A decode is one item per sequence, every KV head: its V token rows packed in key order, then its
 * K tiles in key order with each KV head's scores per tile (so a block's rows are read together, the
 * next tile's prefetched over the heads), then each KV head's softmax and weighted V. */
int kvm_decode_amx(const float *q, int64_t q_row_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                   int64_t block_stride, const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                   const int32_t *rows, int64_t num_seqs, float *out, int64_t out_row_stride, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_seq_len, float scale,
                   int64_t window)
{
    const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * head_dim;
    int failed = 0;
    #pragma omp parallel if (num_seqs > 1)
    {
        Scratch sc;
        const int ok = region_begin(&sc, head_dim, max_seq_len > 0 ? max_seq_len : 1, num_kv_heads, num_heads,
                                    num_kv_heads, &failed);
        Rows *rw = sc.rw;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t s = 0; s < num_seqs; s++) {
            if (!ok) continue;
            const int64_t len = seq_lens[s];
            const float *qs = q + (int64_t)rows[s] * q_row_stride;
            float *os = out + (int64_t)rows[s] * out_row_stride;
            if (len <= 0) {
                memset(os, 0, sizeof(float) * (size_t)(num_heads * head_dim));
                continue;
            }
            const int64_t first = first_key(len, window);
            const int64_t vbase = first / PT * PT, t_lo = first / AT, t_hi = (len - 1) / AT;
            Pool pool = {k_cache, v_cache, block_stride, token_stride, block_size, head_dim, 0,
                         tables + s * table_stride};
            pack_v(&pool, num_kv_heads, first, len, vbase, (len + PT - 1) / PT * PT, sc.vp, sc.v_stride, 1);
            for (int64_t h = 0; h < num_kv_heads; h++) {
                Rows *r = &rw[h];
                r->n = (int)group;
                r->first_min = first;
                r->len_max = len;
                for (int64_t g = 0; g < group; g++) {
                    r->first[g] = first;
                    r->len[g] = len;
                    r->q[g] = qs + (h * group + g) * head_dim;
                    r->out[g] = os + (h * group + g) * head_dim;
                }
                queries_to_tiles(r, head_dim, scale, sc.qb, sc.qt + h * QT_WORDS);
            }
            const int spread = block_size % AT == 0;
            if (spread) prefetch_block((const char *)pool_row(&pool, k_cache, t_lo * AT), AT * token_stride * 2);
            for (int64_t t = t_lo; t <= t_hi; t++) {
                Prefetcher pf = prefetcher(spread && t < t_hi ? (const char *)pool_row(&pool, k_cache, (t + 1) * AT)
                                                              : NULL, AT * token_stride * 2, num_kv_heads);
                for (int64_t h = 0; h < num_kv_heads; h++) {
                    prefetch_step(&pf);
                    pool.kvh = h;
                    score_tiles(&pool, &rw[h], t, 0, t_lo, sc.qt + h * QT_WORDS, sc.kt, sc.c,
                               sc.s + h * group * sc.s_stride, sc.s_stride);
                }
            }
            for (int64_t h = 0; h < num_kv_heads; h++)
                finish_rows(&rw[h], head_dim, sc.s + h * group * sc.s_stride, sc.s_stride, t_lo, &sc,
                            sc.vp + h * sc.v_stride, vbase);
        }
        if (ok) _tile_release();
    }
    return failed ? -2 : 0;
}

int kvm_prefill_amx(const float *q, int64_t q_row_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                    int64_t block_stride, const int32_t *table, int64_t num_q, int64_t seq_len, float *out,
                    int64_t out_row_stride, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    int64_t block_size, float scale, int64_t window)
{
    const int64_t group = num_heads / num_kv_heads, ctx0 = seq_len - num_q, token_stride = num_kv_heads * head_dim;
    /* the first query's first key: nothing before it is read (a window's freed blocks) */
    const int64_t kstart = first_key(ctx0 + 1, window);
    const int64_t vbase = kstart / PT * PT, vend = (seq_len + PT - 1) / PT * PT, pairs = (vend - vbase) / 2;
    uint32_t *vp = (uint32_t *)thread_buffer(BUF_CALL_VP, sizeof(uint32_t) * (size_t)(num_kv_heads * pairs * head_dim));
    if (vp == NULL) return -2;
    const Pool all = {k_cache, v_cache, block_stride, token_stride, block_size, head_dim, 0, table};
    pack_v(&all, num_kv_heads, kstart, seq_len, vbase, vend, vp, pairs * head_dim, 0);
    const int64_t rows = num_q * group, per_head = (rows + AT - 1) / AT, items = num_kv_heads * per_head;
    int failed = 0;
    #pragma omp parallel if (items > 1)
    {
        Scratch sc;
        const int ok = region_begin(&sc, head_dim, seq_len - vbase, 1, AT, 0, &failed);
        /* KV head by KV head (its V pairs stay in L2), the longest items (last rows) first */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!ok) continue;
            const int64_t h = item / per_head, row0 = (per_head - 1 - item % per_head) * AT;
            const Pool pool = {k_cache, v_cache, block_stride, token_stride, block_size, head_dim, h, table};
            Rows rw;
            rw.n = (int)(rows - row0 < AT ? rows - row0 : AT);
            rw.first_min = INT64_MAX;
            rw.len_max = 0;
            for (int r = 0; r < rw.n; r++) {
                const int64_t tok = (row0 + r) / group, head = h * group + (row0 + r) % group, pos = ctx0 + tok;
                rw.first[r] = first_key(pos + 1, window);
                rw.len[r] = pos + 1;
                rw.q[r] = q + tok * q_row_stride + head * head_dim;
                rw.out[r] = out + tok * out_row_stride + head * head_dim;
                if (rw.first[r] < rw.first_min) rw.first_min = rw.first[r];
                if (rw.len[r] > rw.len_max) rw.len_max = rw.len[r];
            }
            const int64_t t_lo = rw.first_min / AT, t_hi = (rw.len_max - 1) / AT;
            queries_to_tiles(&rw, head_dim, scale, sc.qb, sc.qt);
            for (int64_t t = t_lo; t <= t_hi; t += 2)
                score_tiles(&pool, &rw, t, t < t_hi, t_lo, sc.qt, sc.kt, sc.c, sc.s, sc.s_stride);
            finish_rows(&rw, head_dim, sc.s, sc.s_stride, t_lo, &sc, vp + h * pairs * head_dim, vbase);
        }
        if (ok) _tile_release();
    }
    return failed ? -2 : 0;
}

#endif
