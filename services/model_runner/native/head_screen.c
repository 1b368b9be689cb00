/*
 * Greedy heads screened in cheaper arithmetic. fp32 mode's, scored in bf16 (described first):
 * each row's argmax over x W^T + b, the same column head_argmax.c takes from gemm.c's fp32 logits,
 * with most columns' fp32 logits never computed. bf16 mode's, scored in int8, and fp32 mode's
 * scored in int8 too (at the end).
 *
 * Why: in fp32 mode the vocabulary projection is a fifth of a small model's GEMM work at batch 32
 * (SmolLM2: 49,152 x 576 of 134 M weights), and greedy decoding keeps one of its 49,152 columns a
 * row. A CPU with AVX512-BF16 (or AMX) multiplies bf16 at twice fp32's rate or more, and from
 * half the bytes. So every column is scored in bf16 first, with a bound on how far each score can
 * lie from its fp32 logit, and only the columns that could still be a row's maximum are computed in
 * fp32 (docs/model_runner.md, "Greedy heads screened").
 *
 * Steps, per call:
 *   1. Scores: gemm_bf16.c's GEMM over a bf16 copy of W (packed as every bf16 weight is), block
 *      by block so the [m, block] scores stay in L2 (head_argmax.c's blocking). For row r and
 *      column v, e = a_r N_v + B_v bounds |score - fp32 logit| (below).
 *   2. floor_r = max_v (score - e) is at most the row's largest fp32 logit, so a column with
 *      score + e < floor_r is below it: neither the argmax nor tied with it. The others survive;
 *      every column that holds the maximum does (its score + e >= its logit >= floor_r).
 *   3. The union of the rows' survivors, gathered from gemm.c's fp32 panels into panels of their
 *      own, goes through gemm.c with all m rows: each logit is sum_k x[k] w[k] in k order with
 *      FMA, plus the bias, whatever the column's panel or lane (gemm.c's numerics), so these are
 *      the bits of the full call.
 *   4. Each row's first maximum over its survivors, in column order: numpy's argmax of the full
 *      row, as head_argmax.c takes it.
 *
 * The bound. With y = x (the row), S_v = sum_i |y_i w_vi| <= ||y||_2 ||w_v||_2 = ||y|| N_v:
 *   - bf16 rounds y and w to nearest (relative error 2^-8 each), so the exact sum of the bf16
 *     products is within (2^-7 + 2^-16) S_v of the exact fp32 one;
 *   - the two fp32 sums (the score's, in any order and with round-to-nearest or toward zero, as an
 *     AMX unit may; the logit's, in k order) each add at most 2 (k + 1) u (1 + 2^-7) S_v, u = 2^-24;
 *   - the bias, added once to each, at most 4 u (S_v + |b_v|) more; flushed denormals (the bf16
 *     conversion and dot product's DAZ / FTZ) at most k 2^-126 (1 + max |w|) <= 2^-100 (1 + N_v)
 *     for k < 2^20.
 * So e = ((2^-7 + 2^-15 + 8 (k + 2) u) ||y|| + 2^-100) N_v + 16 u |b_v| + 2^-100 bounds it, and
 * a margin of 2^-8 on a_r (|| y || is computed in double and rounded up, N_v rounded up by the
 * caller) covers the fp32 rounding of e, score - e and score + e themselves (each at most u times
 * ||y|| N_v + |b_v|, 2^-7 below the margin). A non-finite x, score or survivor's logit makes the
 * call return 1 and the caller take the full path (head_argmax.c), as do more survivors than
 * ROW_CAP in a row or than the caller's cap in all.
 *
 * bf16 mode (kvmesh_head_screen_int8_argmax with bf16 = 1): the logits are gemm_bf16.c's, y = bf16(x)
 * times the bf16 weights w, so the score must be cheaper than bf16: int8 codes in groups of 32 on
 * both sides (screen_int8.c). With y's codes y^ = s_g q (e = y - y^) and the column's w^ = t_g c (r = w - w^),
 * y.w - y^.w^ = y.r + e.w^, so |y.w - y^.w^| <= ||y|| R_v + ||e|| Q_v with R_v = ||r||, Q_v = ||w^||
 * (the caller's, rounded up, each with rho N'_v added, N'_v >= ||w|| and ||w^||, for the two fp32
 * sums, the logit's and the score's: its group sums and its offset's cancellation, all within
 * 4 (k + 2) u + 256 u of ||y|| N'_v or ||e|| N'_v). Here a1 = ||y||, a2 = ||e|| (double, rounded
 * up, with the 2^-8 margin) and e = a1 C1_v + a2 C2_v + B_v; the rest is as above, the survivors'
 * logits computed by gemm_bf16.c over gathered bf16 panels (its result per column is a function of
 * the row and the column's weights alone: gemm_bf16.c's batch invariance).
 *
 * fp32 mode scored in int8 (the same entry with bf16 = 0): the same codes, made from the fp32
 * weights, and y = x itself, so w, R_v, Q_v and N'_v above are the fp32 rows'. gemm.c's logit, an
 * FMA chain in k order, is within the same fp32 sums' allowance as gemm_bf16.c's; the survivors'
 * logits are the first entry's. Where the CPU has AVX512-VNNI and the bf16 GEMM does not run on AMX,
 * this replaces the bf16 score (vpdpbusd does 4 k a lane per instruction against vdpbf16ps's 2,
 * from half the bytes: model/head_screen.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "gemm_bf16.h"
#include "kernels.h"
#include "screen_int8.h"

#define PANEL BF16_PANEL /* gemm.c's width too */
#define ROW_CAP 4096     /* survivors a row keeps between compactions */

/* The call's workspace, carved from the caller's buffer (kvmesh_head_screen_work_bytes). */
typedef struct {
    int32_t *col;  /* [m][ROW_CAP] survivors, ascending */
    float *hi;     /* [m][ROW_CAP] their score + e */
    int32_t *count;
    float *floor;  /* [m] */
    float *a;      /* [m] the rows' bound factors: e = a C1_v (+ a2 C2_v) + B_v */
    float *a2;     /* [m] */
    uint8_t *qx;   /* [m][kq] bf16 mode: the rows' unsigned int8 codes */
    float *sx;     /* [m][kq / SCREEN_GROUP] their group steps */
    uint8_t *mark; /* [n] union membership */
    int32_t *cols; /* [cap] the union, ascending */
    float *bias;   /* [cap] its biases */
    void *panels;  /* the union's weights, gathered: [ceil(cap / PANEL)][k][PANEL] fp32 or [..][kp][PANEL][2] bf16 */
    float *exact;  /* [m][cap] the union's fp32 logits */
} Work;

static size_t up64(size_t bytes) { return (bytes + 63) / 64 * 64; }

/* The bytes a call with these sizes needs as `work` (64-byte aligned by the caller). */
static size_t kq_of(int64_t k) { return (size_t)((k + SCREEN_GROUP - 1) / SCREEN_GROUP * SCREEN_GROUP); }

int64_t kvmesh_head_screen_work_bytes(int64_t m, int64_t k, int64_t n, int64_t cap)
{
    const size_t rows = (size_t)m;
    return (int64_t)(up64(rows * ROW_CAP * 4) * 2 + up64(rows * 4) * 4 + up64(rows * kq_of(k)) +
                     up64(rows * kq_of(k) / SCREEN_GROUP * 4) + up64((size_t)n) + up64((size_t)cap * 4) * 2 +
                     up64((size_t)((cap + PANEL - 1) / PANEL) * (size_t)k * PANEL * 4) + up64(rows * (size_t)cap * 4));
}

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>

int64_t kvmesh_head_screen_available(void) { return 1; }

static Work carve(char *base, int64_t m, int64_t k, int64_t n, int64_t cap)
{
    Work w;
    const size_t rows = (size_t)m;
    w.col = (int32_t *)base, base += up64(rows * ROW_CAP * 4);
    w.hi = (float *)base, base += up64(rows * ROW_CAP * 4);
    w.count = (int32_t *)base, base += up64(rows * 4);
    w.floor = (float *)base, base += up64(rows * 4);
    w.a = (float *)base, base += up64(rows * 4);
    w.a2 = (float *)base, base += up64(rows * 4);
    w.qx = (uint8_t *)base, base += up64(rows * kq_of(k));
    w.sx = (float *)base, base += up64(rows * kq_of(k) / SCREEN_GROUP * 4);
    w.mark = (uint8_t *)base, base += up64((size_t)n);
    w.cols = (int32_t *)base, base += up64((size_t)cap * 4);
    w.bias = (float *)base, base += up64((size_t)cap * 4);
    w.panels = (void *)base, base += up64((size_t)((cap + PANEL - 1) / PANEL) * (size_t)k * PANEL * 4);
    w.exact = (float *)base;
    return w;
}

/* a_r for row x (k floats), rounded up; 0 and *bad set where x is not finite. */
static float row_factor(const float *x, int64_t k, int *bad)
{
    double sq = 0.0;
    for (int64_t i = 0; i < k; i++) sq += (double)x[i] * (double)x[i];
    const double norm = sqrt(sq);
    if (!isfinite(norm)) {
        *bad = 1;
        return 0.0f;
    }
    const double u = ldexp(1.0, -24);
    const double rel = ldexp(1.0, -7) + ldexp(1.0, -15) + 8.0 * (double)(k + 2) * u;
    const float a = (float)((rel * norm * (1.0 + 1e-9) + ldexp(1.0, -100)) * (1.0 + ldexp(1.0, -8)));
    return nextafterf(a, INFINITY);
}

/* Keeps row r's survivors with hi >= its floor; returns the count left. */
static int32_t compact(Work *w, int64_t r)
{
    int32_t *col = w->col + r * ROW_CAP;
    float *hi = w->hi + r * ROW_CAP;
    const float floor = w->floor[r];
    int32_t kept = 0;
    for (int32_t i = 0; i < w->count[r]; i++)
        if (hi[i] >= floor) {
            col[kept] = col[i];
            hi[kept++] = hi[i];
        }
    w->count[r] = kept;
    return kept;
}

/* Folds one row's block of scores (len columns from col0) into its floor and survivors, with
 * e = a C1 + a2 C2 (C2 NULL: none) + B, in one pass: each lane keeps its own running floor (never
 * above the row's), and a column survives its lane's; the final floor prunes the rest. Returns 0,
 * or 1 where a score is not finite or the survivors outgrow ROW_CAP. */
static int screen_row(Work *w, int64_t r, const float *s, const float *c1, const float *c2, const float *bias,
                      int64_t col0, int64_t len)
{
    const __m512 a = _mm512_set1_ps(w->a[r]), a2 = _mm512_set1_ps(c2 ? w->a2[r] : 0.0f);
    const __m512 tiny = _mm512_set1_ps(0x1p-100f);
    const __m512 bias_rel = _mm512_set1_ps(0x1p-20f);  /* 16 u */
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 floor = _mm512_set1_ps(w->floor[r]);
    int32_t *col = w->col + r * ROW_CAP;
    float *hi = w->hi + r * ROW_CAP;
    for (int64_t i = 0; i < len; i += 16) {
        const __mmask16 live = len - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - i)) - 1u);
        const __m512 v = _mm512_maskz_loadu_ps(live, s + i);
        if (_mm512_mask_fpclass_ps_mask(live, v, 0x99)) return 1;  /* NaN or +-inf */
        __m512 b = tiny;
        if (bias) b = _mm512_fmadd_ps(_mm512_abs_ps(_mm512_maskz_loadu_ps(live, bias + i)), bias_rel, tiny);
        if (c2) b = _mm512_fmadd_ps(a2, _mm512_maskz_loadu_ps(live, c2 + i), b);
        const __m512 e = _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(live, c1 + i), b);
        floor = _mm512_mask_max_ps(floor, live, floor, _mm512_sub_ps(v, e));
        const __m512 h = _mm512_add_ps(v, e);
        const __mmask16 keep = _mm512_mask_cmp_ps_mask(live, h, floor, _CMP_GE_OQ);
        if (!keep) continue;
        const int add = __builtin_popcount(keep);
        if (w->count[r] + add > ROW_CAP) {
            const float now = _mm512_reduce_max_ps(floor);
            if (now > w->floor[r]) w->floor[r] = now;
            if (compact(w, r) + add > ROW_CAP) return 1;
        }
        const __m512i c = _mm512_add_epi32(_mm512_set1_epi32((int32_t)(col0 + i)), iota);
        _mm512_mask_compressstoreu_epi32(col + w->count[r], keep, c);
        _mm512_mask_compressstoreu_ps(hi + w->count[r], keep, h);
        w->count[r] += add;
    }
    const float now = _mm512_reduce_max_ps(floor);
    if (now > w->floor[r]) w->floor[r] = now;
    return 0;
}

/* The union of the rows' survivors (each row's kept with its final floor), ascending, into w->cols;
 * returns its size, or -1 past cap. */
static int64_t gather_union(Work *w, int64_t m, int64_t n, int64_t cap)
{
    memset(w->mark, 0, (size_t)n);
    for (int64_t r = 0; r < m; r++) {
        compact(w, r);
        for (int32_t i = 0; i < w->count[r]; i++) w->mark[w->col[r * ROW_CAP + i]] = 1;
    }
    int64_t u = 0;
    for (int64_t v = 0; v < n; v++)
        if (w->mark[v]) {
            if (u == cap) return -1;
            w->cols[u++] = (int32_t)v;
        }
    return u;
}

/* out[r] = each row's first maximum over its survivors, from the union's logits w->exact [m][u]
 * (both lists ascending); 1 where a logit is not finite. */
static int fold_survivors(const Work *w, int64_t m, int64_t u, int64_t *out)
{
    for (int64_t r = 0; r < m; r++) {
        const int32_t *col = w->col + r * ROW_CAP;
        const float *exact = w->exact + r * u;
        float best = -INFINITY;
        int64_t at = -1;
        for (int32_t i = 0, j = 0; i < w->count[r]; i++) {
            while (w->cols[j] != col[i]) j++;
            const float v = exact[j];
            if (!isfinite(v)) return 1;
            if (at < 0 || v > best) {
                best = v;
                at = col[i];
            }
        }
        if (at < 0) return 1;  /* cannot happen: the floor's own column survives */
        out[r] = at;
    }
    return 0;
}

/* The union's fp32 logits into w->exact [m][u]: its weights gathered into panels of their own (from
 * the dense rows where the caller has them: a column's k floats side by side, where the packed
 * panels hold them a line each), then all m rows through gemm.c in one call. */
static void exact_fp32(Work *w, const float *x, int64_t x_stride, int64_t m, int64_t k, const float *packed,
                       const float *dense, const float *bias, int64_t u)
{
    float *panels = (float *)w->panels;
    for (int64_t j = 0; j < u; j++) {
        const int64_t v = w->cols[j];
        float *dst = panels + j / PANEL * k * PANEL + j % PANEL;
        if (dense) {
            const float *src = dense + v * k;
            for (int64_t kk = 0; kk < k; kk++) dst[kk * PANEL] = src[kk];
        } else {
            const float *src = packed + v / PANEL * k * PANEL + v % PANEL;
            for (int64_t kk = 0; kk < k; kk++) dst[kk * PANEL] = src[kk * PANEL];
        }
        if (bias) w->bias[j] = bias[v];
    }
    if (u % PANEL)
        for (int64_t kk = 0; kk < k; kk++)
            memset(panels + u / PANEL * k * PANEL + kk * PANEL + u % PANEL, 0,
                   sizeof(float) * (size_t)(PANEL - u % PANEL));
    kvmesh_linear_f32(x, x_stride, m, k, panels, u, bias ? w->bias : NULL, w->exact, u);
}

static void start_rows(Work *w, int64_t m)
{
    for (int64_t r = 0; r < m; r++) {
        w->floor[r] = -INFINITY;
        w->count[r] = 0;
    }
}

/* out[r] = the argmax of row r of x W^T + bias over the n columns (numpy's: the first maximum), W
 * packed for gemm.c (`packed`; `dense`, where not NULL, the same weights as rows [n, k]) and, rounded
 * to bf16, for gemm_bf16.c (`screen`); norm[v] >= the fp32 row v's 2-norm. scratch holds
 * [m, block_cols] fp32 (block_cols a multiple of the panel width), work
 * kvmesh_head_screen_work_bytes(m, k, n, cap) bytes, 64-byte aligned. Returns 0; 1 where the caller
 * must take the full path (a non-finite value, too many survivors: out is not set); -1 for a bad
 * block_cols, cap or n, -4 for 2^31 columns or more; 100 - the bf16 GEMM's (negative) failure status. */
int kvmesh_head_screen_argmax(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *packed,
                              const float *dense, int64_t n, const float *bias, const uint16_t *screen,
                              const float *norm, float *scratch, int64_t block_cols, void *work, int64_t cap,
                              int64_t *out)
{
    if (block_cols <= 0 || block_cols % PANEL || cap <= 0 || n <= 0) return -1;
    if (n >= ((int64_t)1 << 31)) return -4;
    if (m <= 0) return 0;
    Work w = carve((char *)work, m, k, n, cap);
    int bad = 0;
    for (int64_t r = 0; r < m; r++) w.a[r] = row_factor(x + r * x_stride, k, &bad);
    if (bad) return 1;
    start_rows(&w, m);
    const int64_t screen_panel = (k + 1) / 2 * 2 * PANEL;  /* bf16 elements of one panel */
    for (int64_t c0 = 0; c0 < n; c0 += block_cols) {
        const int64_t cols = n - c0 < block_cols ? n - c0 : block_cols;
        const int failed = kvmesh_linear_bf16(x, x_stride, m, k, screen + c0 / PANEL * screen_panel, cols,
                                              bias ? bias + c0 : NULL, scratch, block_cols);
        if (failed) return 100 - failed;
        for (int64_t r = 0; r < m; r++)
            if (screen_row(&w, r, scratch + r * block_cols, norm + c0, NULL, bias ? bias + c0 : NULL, c0, cols))
                return 1;
    }
    const int64_t u = gather_union(&w, m, n, cap);
    if (u < 0) return 1;
    exact_fp32(&w, x, x_stride, m, k, packed, dense, bias, u);
    return fold_survivors(&w, m, u, out);
}

#else

int64_t kvmesh_head_screen_available(void) { return 0; }

/* Without AVX512-BF16 there is no cheaper score: the caller runs head_argmax.c. */
int kvmesh_head_screen_argmax(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *packed,
                              const float *dense, int64_t n, const float *bias, const uint16_t *screen,
                              const float *norm, float *scratch, int64_t block_cols, void *work, int64_t cap,
                              int64_t *out)
{
    (void)x, (void)x_stride, (void)m, (void)k, (void)packed, (void)dense, (void)n, (void)bias, (void)screen,
        (void)norm, (void)scratch, (void)block_cols, (void)work, (void)cap, (void)out;
    return -3;
}

#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
int64_t kvmesh_head_screen_int8_available(void) { return 1; }

/* The rows' codes for screen_int8.c: y = bf16(x) as gemm_bf16.c rounds it (round_bf16: the bf16
 * head's logits) or x itself (the fp32 head's), per group of SCREEN_GROUP a step s = max |y| / 127
 * and codes round(y / s) + 128; a = ||y||, a2 = ||y - s q|| (double, with the 2^-8 margin, rounded
 * up). *bad set where x is not finite. */
static void quantize_rows(Work *w, const float *x, int64_t x_stride, int64_t m, int64_t k, int round_bf16, int *bad)
{
    const int64_t kq = (int64_t)kq_of(k), groups = kq / SCREEN_GROUP;
    uint16_t yb[SCREEN_GROUP];
    for (int64_t r = 0; r < m; r++) {
        double yy = 0.0, ee = 0.0;
        for (int64_t g = 0; g < groups; g++) {
            const float *src = x + r * x_stride + g * SCREEN_GROUP;
            const int64_t left = k - g * SCREEN_GROUP;
            if (round_bf16) bf16_round32(src, left, yb);
            float y[SCREEN_GROUP], top = 0.0f;
            for (int i = 0; i < SCREEN_GROUP; i++) {
                if (round_bf16) {
                    const uint32_t bits = (uint32_t)yb[i] << 16;
                    memcpy(&y[i], &bits, 4);
                } else {
                    y[i] = i < left ? src[i] : 0.0f;
                }
                const float mag = fabsf(y[i]);
                if (!(mag <= 3.0e38f)) *bad = 1;  /* NaN, inf, or a step past fp32 */
                top = mag > top ? mag : top;
            }
            const float step = top / 127.0f;
            w->sx[r * groups + g] = step;
            uint8_t *q = w->qx + r * kq + g * SCREEN_GROUP;
            for (int i = 0; i < SCREEN_GROUP; i++) {
                float c = step > 0.0f ? nearbyintf(y[i] / step) : 0.0f;
                c = c > 127.0f ? 127.0f : c < -127.0f ? -127.0f : c;
                q[i] = (uint8_t)(int)(c + 128.0f);
                const double e = (double)y[i] - (double)step * (double)c;
                yy += (double)y[i] * (double)y[i];
                ee += e * e;
            }
        }
        const double margin = 1.0 + ldexp(1.0, -8);
        w->a[r] = nextafterf((float)(sqrt(yy) * margin), INFINITY);
        w->a2[r] = nextafterf((float)(sqrt(ee) * margin), INFINITY);
    }
}

/* Scores every column in int8 (round_bf16: of bf16(x), else of x) and keeps each row's survivors;
 * returns the size of their union (w->cols), -1 past cap, or -2 where the caller must take the full
 * path (a non-finite value, a row's survivors past ROW_CAP). */
static int64_t int8_survivors(Work *w, const float *x, int64_t x_stride, int64_t m, int64_t k, int64_t n,
                              const float *bias, const int8_t *codes, const float *scale, const float *offset,
                              const float *c1, const float *c2, float *scratch, int64_t block_cols, int64_t cap,
                              int round_bf16)
{
    int bad = 0;
    quantize_rows(w, x, x_stride, m, k, round_bf16, &bad);
    if (bad) return -2;
    start_rows(w, m);
    const int64_t kq = (int64_t)kq_of(k), groups = kq / SCREEN_GROUP;
    for (int64_t c0 = 0; c0 < n; c0 += block_cols) {
        const int64_t cols = n - c0 < block_cols ? n - c0 : block_cols, p0 = c0 / PANEL;
        kvmesh_screen_int8_scores(w->qx, m, kq, w->sx, codes + p0 * kq * PANEL, scale + p0 * groups * PANEL,
                                  offset + p0 * groups * PANEL, cols, scratch, block_cols);
        for (int64_t r = 0; r < m; r++) {
            float *s = scratch + r * block_cols;
            if (bias)
                for (int64_t i = 0; i < cols; i++) s[i] += bias[c0 + i];
            if (screen_row(w, r, s, c1 + c0, c2 + c0, bias ? bias + c0 : NULL, c0, cols)) return -2;
        }
    }
    return gather_union(w, m, n, cap);
}

/* The union's bf16 logits (gemm_bf16.c's) into w->exact [m][u]: its weights in panels of their
 * own, [kp][PANEL][2] as pack_panels_bf16 lays them out, from the fp32 rows (rounded to nearest
 * even as torch rounded them when packing) or from the packed panels. Returns 0 or the bf16 GEMM's
 * (negative) failure status. */
static int exact_bf16(Work *w, const float *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *packed,
                      const float *dense, const float *bias, int64_t u)
{
    const int64_t kp = (k + 1) / 2;
    uint16_t *panels = (uint16_t *)w->panels;
    memset(panels, 0, sizeof(uint16_t) * (size_t)((u + PANEL - 1) / PANEL * kp * PANEL * 2));
    for (int64_t j = 0; j < u; j++) {
        const int64_t v = w->cols[j];
        uint16_t *dst = panels + (j / PANEL * kp * PANEL + j % PANEL) * 2;
        if (dense) {
            const float *src = dense + v * k;
            for (int64_t kk = 0; kk < k; kk++) {
                uint32_t bits;
                memcpy(&bits, src + kk, 4);
                dst[kk / 2 * PANEL * 2 + kk % 2] = (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
            }
        } else {
            const uint16_t *src = packed + (v / PANEL * kp * PANEL + v % PANEL) * 2;
            for (int64_t p = 0; p < kp; p++) {
                dst[p * PANEL * 2] = src[p * PANEL * 2];
                dst[p * PANEL * 2 + 1] = src[p * PANEL * 2 + 1];
            }
        }
        if (bias) w->bias[j] = bias[v];
    }
    return kvmesh_linear_bf16(x, x_stride, m, k, panels, u, bias ? w->bias : NULL, w->exact, u);
}

/* bf16 = 1, bf16 mode's head: out[r] = the argmax of row r of bf16(x) W^T + bias (gemm_bf16.c's
 * logits, numpy's first maximum), W packed for gemm_bf16.c (`packed`, uint16; `dense`, where not
 * NULL, W's fp32 rows [n, k] that it was rounded from, to nearest even). bf16 = 0, fp32 mode's head:
 * the argmax of row r of x W^T + bias (gemm.c's logits), W packed for gemm.c (`packed`, fp32;
 * `dense` as kvmesh_head_screen_argmax's); the bound's terms are the same with w the fp32 rows
 * (gemm.c's FMA chain is within the fp32 sums' allowance). Either way W also as int8 codes for
 * screen_int8.c (`codes`, `scale`, `offset`, made from the weights the logits use), c1[v] and c2[v]
 * the column's bound constants (the header comment). scratch, work, block_cols, cap and the
 * statuses as kvmesh_head_screen_argmax's. */
int kvmesh_head_screen_int8_argmax(const float *x, int64_t x_stride, int64_t m, int64_t k, const void *packed,
                                   const float *dense, int64_t n, const float *bias, const int8_t *codes,
                                   const float *scale, const float *offset, const float *c1, const float *c2,
                                   float *scratch, int64_t block_cols, void *work, int64_t cap, int64_t bf16,
                                   int64_t *out)
{
    if (block_cols <= 0 || block_cols % PANEL || cap <= 0 || n <= 0) return -1;
    if (n >= ((int64_t)1 << 31)) return -4;
    if (m <= 0) return 0;
    Work w = carve((char *)work, m, k, n, cap);
    const int64_t u = int8_survivors(&w, x, x_stride, m, k, n, bias, codes, scale, offset, c1, c2, scratch,
                                     block_cols, cap, bf16 != 0);
    if (u < 0) return 1;
    if (bf16) {
        const int failed = exact_bf16(&w, x, x_stride, m, k, (const uint16_t *)packed, dense, bias, u);
        if (failed) return 100 - failed;
    } else {
        exact_fp32(&w, x, x_stride, m, k, (const float *)packed, dense, bias, u);
    }
    return fold_survivors(&w, m, u, out);
}
#else

/* Without AVX512-VNNI (or AVX512-BF16) no head has an int8 screen: the caller runs head_argmax.c
 * (or, fp32 mode's head, the bf16 screen where it has one). */
int64_t kvmesh_head_screen_int8_available(void) { return 0; }

int kvmesh_head_screen_int8_argmax(const float *x, int64_t x_stride, int64_t m, int64_t k, const void *packed,
                                   const float *dense, int64_t n, const float *bias, const int8_t *codes,
                                   const float *scale, const float *offset, const float *c1, const float *c2,
                                   float *scratch, int64_t block_cols, void *work, int64_t cap, int64_t bf16,
                                   int64_t *out)
{
    (void)x, (void)x_stride, (void)m, (void)k, (void)packed, (void)dense, (void)n, (void)bias, (void)codes,
        (void)scale, (void)offset, (void)c1, (void)c2, (void)scratch, (void)block_cols, (void)work, (void)cap,
        (void)bf16, (void)out;
    return -3;
}

#endif
