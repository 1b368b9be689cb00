/*
 * Weight-only grouped quantization for the CPU, in llama.cpp's two block formats:
 *     Q4_1: w = d * q + m, q a 4-bit code (0..15), d and m one pair per 32 weights along k;
 *     Q8_0: w = d * q,     q an 8-bit code (-127..127), d one per 32 weights along k;
 * and out[r, c] = sum_k x[r, k] w[c, k] + b[c], x in fp32 (not rounded).
 *
 * Why it exists: a single-stream decode step streams every weight once per token, so its time is
 * the weight bytes over the memory bandwidth. Q4_1 with fp32 d and m is 0.75 bytes a weight
 * against fp32's 4 (docs/model_runner.md, "Weight-only Q4_1"), and it needs no bf16 hardware.
 *
 * Arithmetic: every weight is dequantized to fp32 as fl(fl(d * q) + m) (Q8_0: fl(d * q)), the
 * value numpy's (and gguf-py's, and so transformers') dequantization gives. d and m are f16
 * values (llama.cpp's files store them so; held here in fp32), so d * q has at most 11 + 8
 * significant bits and is exact in fp32: fl(d * q) = d * q, and one FMA, fma(q, d, m), rounds
 * once to the same value as the multiply and add. Then the output is gemm.c's fp32 GEMM over
 * those weights, bit for bit: FMAs in k order from zero, plus the bias. So
 *   - the mode is batch invariant like every GEMM here (a row's bits never depend on its batch);
 *   - where a checkpoint's fp32 weights already lie on the grid (the embedded SmolLM2 is
 *     dequantized from a Q4_1 GGUF whose head is Q8_0), re-quantizing loses nothing and this mode
 *     is bitwise the fp32 mode, at a fifth of its weight bytes.
 * One row (a single-stream decode) dequantizes each panel in registers (AVX2 + FMA, also the
 * AVX-512 build's); more rows dequantize each panel once into a per-thread fp32 copy and run
 * gemm.c's tiles over it (kvmesh_linear_f32_panel). Both give the same bits
 * (tests/kernels/test_native_gemm_q4_1.py).
 *
 * Layout (model/packed.py, pack_q4_1 / pack_q8_0): ceil(n / PANEL) panels of PANEL output
 * columns; a panel is ceil(k / 32) groups, each: d fp32 [PANEL], m fp32 [PANEL] (Q8_0: zero),
 * then 32 rows of codes, one per k (the last group's rows past k are zero): Q4_1 24 bytes a row,
 * byte b holding column b in its low nibble and column b + 24 in its high one; Q8_0 PANEL int8.
 * Columns past n have d = m = 0 and zero codes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

#include "kernels.h"
#include "pairs.h"
#include "panel_prefetch.h"
#include "tile_avx2.h"
#include "tile_store.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define Q_VECTOR 1
#else
#define Q_VECTOR 0
#endif

#define PANEL 48
#define GROUP 32
#define ROW_CHUNK 256

/* Bytes of one row of codes and of one group (scales, mins, 32 rows of codes). */
static inline int64_t code_row_bytes(int bits) { return bits == 4 ? PANEL / 2 : PANEL; }
static inline int64_t group_bytes(int bits) { return 2 * PANEL * (int64_t)sizeof(float) + GROUP * code_row_bytes(bits); }

/* Group g of a panel: its scales, minimums, codes and k rows (the last group may be short). */
typedef struct {
    const float *d, *mn;
    const uint8_t *codes;
    int64_t rows;
} Group;

static inline Group group_at(const uint8_t *panel, int64_t g, int bits, int64_t k)
{
    const uint8_t *grp = panel + g * group_bytes(bits);
    const Group gr = {(const float *)grp, (const float *)grp + PANEL, grp + 2 * PANEL * sizeof(float),
                      k - g * GROUP < GROUP ? k - g * GROUP : GROUP};
    return gr;
}

/* Code of column c in row `row` of a group's codes. */
static inline float code_at(const uint8_t *row, int64_t c, int bits)
{
    if (bits == 8) return (float)((const int8_t *)row)[c];
    return (float)(c < PANEL / 2 ? row[c] & 0x0F : row[c - PANEL / 2] >> 4);
}

#if Q_VECTOR

/* Columns 8j..8j+7 of one k row (j a constant after inlining): Q4_1 columns 0-23 are the low
 * nibbles of bytes 0-23, columns 24-47 their high nibbles. */
static inline __attribute__((always_inline)) __m256 dequant_vec(const uint8_t *row, const float *d, const float *mn,
                                                                const int bits, const int j)
{
    if (bits == 4) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + 8 * (j % 3))));
        const __m256i q = j < 3 ? _mm256_and_si256(v, _mm256_set1_epi32(0x0F)) : _mm256_srli_epi32(v, 4);
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_loadu_ps(d + 8 * j), _mm256_loadu_ps(mn + 8 * j));
    }
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + 8 * j)))),
                         _mm256_loadu_ps(d + 8 * j));
}

/* The 48 weights of one k row as 6 x 8 fp32 lanes, columns in order (w[j]: columns 8j..8j+7). */
static inline __attribute__((always_inline)) void dequant_row(const uint8_t *row, const float *d, const float *mn,
                                                              const int bits, __m256 w[6])
{
    for (int j = 0; j < 6; j++) w[j] = dequant_vec(row, d, mn, bits, j);
}

/* One row of x times one panel, dequantizing in registers: gemm.c's one-row arithmetic (six
 * chains of FMAs in k order from zero, then the bias) on the same weights widen_panel writes. */
static inline __attribute__((always_inline)) void row_panel(const float *x, int64_t k, const uint8_t *panel,
                                                            const int bits, const float *bias, float *out,
                                                            int64_t cols, PacedPrefetch pf)
{
    const int64_t rb = code_row_bytes(bits);
    const char *line = pf.line;
    int64_t countdown = pf.countdown;
    __m256 c[6];
    for (int j = 0; j < 6; j++) c[j] = _mm256_setzero_ps();
    for (int64_t g = 0; g * GROUP < k; g++) {
        const Group gr = group_at(panel, g, bits, k);
        const float *d = gr.d, *mn = gr.mn;
        const uint8_t *codes = gr.codes;
        const int64_t rows = gr.rows;
        for (int64_t kk = 0; kk < rows; kk++) {
            paced_prefetch_step(&line, &countdown, pf.every);
            __m256 w[6];
            dequant_row(codes + kk * rb, d, mn, bits, w);
            const __m256 a = _mm256_broadcast_ss(x + g * GROUP + kk);
            for (int j = 0; j < 6; j++) c[j] = _mm256_fmadd_ps(a, w[j], c[j]);
        }
    }
    row_store_avx2(c, 6, cols, bias, out);
}

#endif

#if Q_VECTOR && !defined(__AVX512F__)
/* AVX2 builds: a chunk's first row tile dequantizes the panel itself (first_tile) instead of
 * widen_panel doing it before the tiles run. */
#define FUSED_FIRST_TILE 1
#define FIRST_TILE_MAX TILE_AVX2_ROWS  /* gemm.c's AVX2 row tile (tile_avx2.h) */

/* Pass h (columns 16h..16h+15) of the first tile: mr rows (2..6; both constants after inlining). */
static inline __attribute__((always_inline)) void first_tile_pass(
    const float *x, int64_t x_stride, int64_t k, const uint8_t *panel, const int bits, const int mr, const int h,
    float *wf, const float *bias, float *out, int64_t out_stride, int64_t cols)
{
    const int64_t left = cols - h * 16;
    if (left <= 0) return;
    const int64_t rb = code_row_bytes(bits), n = left < 16 ? left : 16;
    TILE_AVX2_BEGIN(x, x_stride);  /* gemm.c's tile, register for register */
    for (int64_t g = 0; g * GROUP < k; g++) {
        const Group gr = group_at(panel, g, bits, k);
        for (int64_t kk = 0, kr = g * GROUP; kk < gr.rows; kk++, kr++) {
            const uint8_t *row = gr.codes + kk * rb;
            const __m256 b0 = dequant_vec(row, gr.d, gr.mn, bits, 2 * h);
            const __m256 b1 = dequant_vec(row, gr.d, gr.mn, bits, 2 * h + 1);
            _mm256_storeu_ps(wf + kr * PANEL + 16 * h, b0);
            _mm256_storeu_ps(wf + kr * PANEL + 16 * h + 8, b1);
            TILE_AVX2_STEP(mr, kr, b0, b1);
        }
    }
    TILE_AVX2_END(mr, n, bias != NULL ? bias + h * 16 : NULL, out + h * 16, out_stride);
}

static inline __attribute__((always_inline)) void first_tile_rows(
    const float *x, int64_t x_stride, int64_t k, const uint8_t *panel, const int bits, const int mr, float *wf,
    const float *bias, float *out, int64_t out_stride, int64_t cols)
{
    first_tile_pass(x, x_stride, k, panel, bits, mr, 0, wf, bias, out, out_stride, cols);
    first_tile_pass(x, x_stride, k, panel, bits, mr, 1, wf, bias, out, out_stride, cols);
    first_tile_pass(x, x_stride, k, panel, bits, mr, 2, wf, bias, out, out_stride, cols);
}

/* A chunk's first row tile (mr rows, 2..6) over a panel of codes: each pass dequantizes its 16
 * columns of every k row in registers, stores them into wf ([k][PANEL], widen_panel's layout) for
 * the chunk's other tiles, and multiplies them at once. The FMAs are gemm.c's AVX2 tile's (k order
 * from zero, then the bias) over the same weights, so the bits are widen_panel + gemm.c's. Why:
 * widening a panel before the tiles ran did its dequantizing beside no FMA at all, a visible share
 * of a decode chunk's few tiles (docs/model_runner.md, "Q4_1 at batch 32: the first tile
 * dequantizes"). */
static void first_tile(const float *x, int64_t x_stride, int64_t k, const uint8_t *panel, int bits, int mr,
                       float *wf, const float *bias, float *out, int64_t out_stride, int64_t cols)
{
#define FIRST_CASE(n) \
    case n: \
        if (bits == 4) first_tile_rows(x, x_stride, k, panel, 4, n, wf, bias, out, out_stride, cols); \
        else first_tile_rows(x, x_stride, k, panel, 8, n, wf, bias, out, out_stride, cols); \
        break;
    switch (mr) {
    FIRST_CASE(6) FIRST_CASE(5) FIRST_CASE(4) FIRST_CASE(3)
    default: FIRST_CASE(2)
    }
#undef FIRST_CASE
}
#else
#define FUSED_FIRST_TILE 0
#endif

#if !FUSED_FIRST_TILE
/* One panel's weights, dequantized into wf [k][PANEL] (gemm.c's panel layout): the rows of a
 * chunk of more than one row then run gemm.c's tiles over it. */
static void widen_panel(const uint8_t *panel, int64_t k, int bits, float *wf)
{
    const int64_t rb = code_row_bytes(bits);
    for (int64_t g = 0; g * GROUP < k; g++) {
        const Group gr = group_at(panel, g, bits, k);
        const float *d = gr.d, *mn = gr.mn;
        const uint8_t *codes = gr.codes;
        const int64_t rows = gr.rows;
        for (int64_t kk = 0; kk < rows; kk++) {
            float *w = wf + (g * GROUP + kk) * PANEL;
            const uint8_t *row = codes + kk * rb;
#if Q_VECTOR
            __m256 v[6];
            if (bits == 4) dequant_row(row, d, mn, 4, v);
            else dequant_row(row, d, mn, 8, v);
            for (int j = 0; j < 6; j++) _mm256_storeu_ps(w + 8 * j, v[j]);
#else
            for (int64_t c = 0; c < PANEL; c++) w[c] = d[c] * code_at(row, c, bits) + mn[c];  /* exact product */
#endif
        }
    }
}
#endif

/* out[m, n] (rows out_stride apart) = x[m, k] (rows x_stride apart) W^T + bias (NULL: none), W
 * in `bits`-bit groups as laid out above. Returns 0, or -1 when a scratch panel cannot be had. */
static int linear_grouped(const float *x, int64_t x_stride, int64_t m, int64_t k, const uint8_t *packed, int64_t n,
                          const float *bias, float *out, int64_t out_stride, int bits)
{
    const int64_t panels = (n + PANEL - 1) / PANEL, panel_size = (k + GROUP - 1) / GROUP * group_bytes(bits);
    int failed = 0;
    for (int64_t r0 = 0; r0 < m && !failed; r0 += ROW_CHUNK) {
        const int64_t rows = m - r0 < ROW_CHUNK ? m - r0 : ROW_CHUNK;
        const int in_registers = Q_VECTOR && rows == 1;
        int64_t claimed[MAX_PAIRS] = {0};
        #pragma omp parallel if (panels > 1) reduction(|| : failed)
        {
            float *wf = in_registers ? NULL : malloc(sizeof(float) * (size_t)(k * PANEL) + 64);
            failed = !in_registers && wf == NULL;
            PairedRun run;
            paired_run_init(&run, panels, claimed);
            for (int64_t taken = 0; !failed; taken++) {
                const int64_t p = paired_run_take(&run, taken);
                if (p < 0) break;
                const uint8_t *panel = packed + p * panel_size;
                const int64_t cols = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
                const float *bp = bias != NULL ? bias + p * PANEL : NULL;
                float *o = out + r0 * out_stride + p * PANEL;
#if Q_VECTOR
                if (in_registers) {
                    const int64_t next = paired_run_after(&run, p);
                    /* the next panel's lines paced over this one's k rows, one every few rows from a
                     * countdown in a register: a loop per row asking whether a line is due cost
                     * more than the prefetch itself (docs/model_runner.md, "The one-row Q4_1 GEMM's
                     * prefetch") */
                    const PacedPrefetch pf = paced_prefetch(next >= 0 ? packed + next * panel_size : NULL,
                                                            panel_size, k);
                    if (bits == 4) row_panel(x + r0 * x_stride, k, panel, 4, bp, o, cols, pf);
                    else row_panel(x + r0 * x_stride, k, panel, 8, bp, o, cols, pf);
                    continue;
                }
#endif
#if FUSED_FIRST_TILE
                /* the first tile's rows as gemm.c splits a chunk (rows spread evenly over its tiles) */
                const int64_t tiles = (rows + FIRST_TILE_MAX - 1) / FIRST_TILE_MAX, first = (rows + tiles - 1) / tiles;
                first_tile(x + r0 * x_stride, x_stride, k, panel, bits, (int)first, wf, bp, o, out_stride, cols);
                if (rows > first)
                    kvmesh_linear_f32_panel(x + (r0 + first) * x_stride, x_stride, rows - first, k, wf, bp,
                                            o + first * out_stride, out_stride, cols);
#else
                widen_panel(panel, k, bits, wf);
                kvmesh_linear_f32_panel(x + r0 * x_stride, x_stride, rows, k, wf, bp, o, out_stride, cols);
#endif
            }
            free(wf);
        }
    }
    return failed ? -1 : 0;
}

int kvmesh_linear_q4_1(const float *x, int64_t x_stride, int64_t m, int64_t k, const void *packed, int64_t n,
                       const float *bias, float *out, int64_t out_stride)
{
    return linear_grouped(x, x_stride, m, k, (const uint8_t *)packed, n, bias, out, out_stride, 4);
}

int kvmesh_linear_q8_0(const float *x, int64_t x_stride, int64_t m, int64_t k, const void *packed, int64_t n,
                       const float *bias, float *out, int64_t out_stride)
{
    return linear_grouped(x, x_stride, m, k, (const uint8_t *)packed, n, bias, out, out_stride, 8);
}

/* Weights per (d, m) pair along k: the packing reads it (model/packed.py), so the two cannot disagree. */
int64_t kvmesh_linear_q_group(void) { return GROUP; }
