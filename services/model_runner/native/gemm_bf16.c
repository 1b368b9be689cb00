/*
 * bf16 linear layers for the CPU (AVX512-BF16): out = bf16(x) bf16(W)^T + b, fp32 accumulation.
 *
 * Why it exists: a CPU with AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids) multiplies bf16
 * pairs at twice fp32's FMA rate (vdpbf16ps), and a decode step's weight stream is half the
 * bytes. torch's bf16 GEMMs (oneDNN) pick their blocking and split of k by the row count, so a
 * row's result depends on the batch it came in, and the cache (a prefix hit, a chunked prefill,
 * another batch) would change the answer; here it cannot.
 *
 * Batch invariance, by construction: each output is
 *     acc = 0; for each k pair p in order: acc = vdpbf16ps(acc, x[2p..2p+1], w[2p..2p+1]); acc + b
 * whatever the row tile, the row chunk, the thread or m: a row's result is a function of that row
 * and the weights only (tests/kernels/test_native_gemm_bf16.py checks it bitwise for 1..33 rows).
 *
 * Rounding: the weights are rounded to bf16 once, when packed (round to nearest even, by torch);
 * x is rounded to bf16 here, at the GEMM input (gemm_bf16.h's bf16_round_rows, vcvtne2ps2bf16:
 * round to nearest even, denormals to zero), once per call. The products of two bf16 are exact
 * in fp32; the sums are fp32.
 *
 * Layout: W [n, k] becomes packed [ceil(n / PANEL)][kp][PANEL][2] bf16, kp = ceil(k / 2): per
 * panel of PANEL output columns and per k pair, the two weights of each column side by side, as
 * vdpbf16ps takes them (one 64-byte line = 16 columns x 2 k). Columns past n and the k past an
 * odd k are zero. PANEL is gemm.c's (kvmesh_linear_panel_width); the Python side packs
 * (model/packed.py, pack_panels_bf16).
 *
 * Kernel: rows in tiles of 8, a tile x one panel = 8 x 48 fp32 accumulators (24 zmm), each k pair
 * one 32-bit broadcast of x per row and three panel loads for 24 vdpbf16ps. The next panel's
 * prefetch runs during a chunk's first PREFETCH_TILES row tiles, as gemm.c's does (all of a
 * decode-sized chunk's; a prefill chunk's later tiles reuse the panel from cache, where the per-k-pair
 * bookkeeping would only cost them, 5-8%: docs/benchmarks.md); the fused SwiGLU entry point
 * prefetches the next gate and up panels the same way. Threads split the panels as pairs.h describes.
 *
 * Two kernels behind the two entry points: this file's, and AMX tiles' (gemm_amx.c) on the same
 * packed weights where kvmesh_linear_bf16_amx() is 1 (a CPU with AMX-BF16, chosen once when the
 * object loads; KVMESH_NATIVE_AMX=0 keeps this one). Their bits differ (another fp32 summation
 * order), so a process runs one of them for every call, whatever m: never AMX for prefill and
 * this kernel for decode, which would make a decoded row differ from the same row prefilled.
 *
 * Built only where the compiler targets AVX512-BF16 (-march=native on such a CPU defines
 * __AVX512BF16__); elsewhere kvmesh_linear_bf16_available() is 0 and the runner never packs bf16.
 */
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

#include "exp_math.h"
#include "gemm_bf16.h"
#include "kernels.h"
#include "pairs.h"
#include "panel_prefetch.h"
#include "tile_store.h"

#define PANEL BF16_PANEL
#define ROW_TILE 8
#define ROW_CHUNK 256
#define PREFETCH_TILES 4  /* row tiles per chunk over which the next panel's prefetch is spread */

typedef int32_t __attribute__((may_alias)) bf16_pair;  /* two bf16 read as one broadcast lane */

#if defined(__AVX512BF16__) && defined(__AVX512F__)

int64_t kvmesh_linear_bf16_available(void) { return 1; }

/* The third kernel (a build with -DKVMESH_BF16_FMA: native/__init__.py's bf16_in_fma decides, for an
 * Intel CPU without AMX or KVMESH_NATIVE_BF16=fma): fp32 FMAs over the packed bf16 weights widened in
 * registers, x not rounded. Why: an Intel core issues vdpbf16ps once every two cycles and its fp32
 * FMA twice a cycle (docs/model_runner.md, "auto"), so there the bf16 dot product is half the FMA
 * rate; widening a bf16 pair is two integer ops (the even k is the word shifted left 16, the odd k
 * the word's top half), shared by the tile's 8 rows. Each output is sum_k x[k] w[k] in k order with
 * FMA from zero, plus the bias: bitwise gemm.c's fp32 kernel over the bf16-rounded weights,
 * whatever the batch. The attention kernels read the same switch (kv_elem.h's kv_bf16_dots): a bf16
 * pool is then attended in fp32 over widened values, not in bf16 dot products, for the same reason.
 * That build leaves AMX out, so one process runs one kernel for every call. */
#if defined(KVMESH_BF16_FMA)
#define FMA_IN_USE 1
#else
#define FMA_IN_USE 0
#endif

int64_t kvmesh_linear_bf16_fma(void) { return FMA_IN_USE; }

/* c[r][j] += x[r][kk] w[j] for the tile's mr rows (mr a constant after inlining). */
static inline __attribute__((always_inline)) void fma_rows(__m512 c[][3], const int mr, const float *x,
                                                           int64_t x_stride, int64_t kk, const __m512 *w)
{
    for (int r = 0; r < mr; r++) {
        const __m512 a = _mm512_set1_ps(x[r * x_stride + kk]);
        for (int j = 0; j < 3; j++) c[r][j] = _mm512_fmadd_ps(a, w[j], c[r][j]);
    }
}

/* One row tile (mr rows, a constant after inlining) of fp32 x times one packed bf16 panel. */
static inline __attribute__((always_inline)) void tile_fma(
    const float *x, int64_t x_stride, int64_t k, const uint16_t *panel, const float *bias, float *out,
    int64_t out_stride, const int mr, int64_t cols, PanelPrefetch *pf, const int prefetch)
{
    __m512 c[ROW_TILE][3];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 3; j++) c[r][j] = _mm512_setzero_ps();
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    const uint16_t *b = panel;
    __m512i pair[3];
    __m512 w[3];
    for (int64_t p = 0; p < k / 2; p++, b += 2 * PANEL) {
        if (prefetch) panel_prefetch_step(pf);
        for (int j = 0; j < 3; j++) {
            pair[j] = _mm512_loadu_si512(b + j * 32);
            w[j] = _mm512_castsi512_ps(_mm512_slli_epi32(pair[j], 16));  /* k = 2p: the low halves */
        }
        fma_rows(c, mr, x, x_stride, 2 * p, w);
        for (int j = 0; j < 3; j++) w[j] = _mm512_castsi512_ps(_mm512_and_si512(pair[j], top));  /* k = 2p + 1 */
        fma_rows(c, mr, x, x_stride, 2 * p + 1, w);
    }
    if (k % 2) {  /* the last k: the low halves of one more pair (x has no k + 1) */
        for (int j = 0; j < 3; j++) w[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(b + j * 32), 16));
        fma_rows(c, mr, x, x_stride, k - 1, w);
    }
    tile_store(c, mr, cols, bias, out, out_stride);
}

#define FMA_CASE(n) \
    case n: \
        if (pf != NULL) tile_fma(x, x_stride, k, panel, bias, out, out_stride, n, cols, pf, 1); \
        else tile_fma(x, x_stride, k, panel, bias, out, out_stride, n, cols, NULL, 0); \
        break;

static void tile_dispatch_fma(const float *x, int64_t x_stride, int64_t k, const uint16_t *panel, const float *bias,
                              float *out, int64_t out_stride, int mr, int64_t cols, PanelPrefetch *pf)
{
    switch (mr) {
    FMA_CASE(8) FMA_CASE(7) FMA_CASE(6) FMA_CASE(5) FMA_CASE(4) FMA_CASE(3) FMA_CASE(2)
    default: FMA_CASE(1)
    }
}
#undef FMA_CASE

/* One row tile (mr rows, a compile-time constant after inlining) times one panel; `prefetch`
 * (also a constant) steps the next panel's prefetch once per k pair. */
static inline __attribute__((always_inline)) void tile_bf16(
    const uint16_t *xb, int64_t xb_stride, int64_t kp, const uint16_t *panel, const float *bias, float *out,
    int64_t out_stride, const int mr, int64_t cols, PanelPrefetch *pf, const int prefetch)
{
    __m512 c[ROW_TILE][3];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 3; j++) c[r][j] = _mm512_setzero_ps();
    const uint16_t *b = panel;
    _Pragma("GCC unroll 2")
    for (int64_t p = 0; p < kp; p++, b += 2 * PANEL) {
        if (prefetch) panel_prefetch_step(pf);
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b), b1 = (__m512bh)_mm512_loadu_si512(b + 32),
                       b2 = (__m512bh)_mm512_loadu_si512(b + 64);
        for (int r = 0; r < mr; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32(*(const bf16_pair *)(xb + r * xb_stride + 2 * p));
            c[r][0] = _mm512_dpbf16_ps(c[r][0], a, b0);
            c[r][1] = _mm512_dpbf16_ps(c[r][1], a, b1);
            c[r][2] = _mm512_dpbf16_ps(c[r][2], a, b2);
        }
    }
    tile_store(c, mr, cols, bias, out, out_stride);
}

#define TILE_CASE(n) \
    case n: \
        if (pf != NULL) tile_bf16(xb, xb_stride, kp, panel, bias, out, out_stride, n, cols, pf, 1); \
        else tile_bf16(xb, xb_stride, kp, panel, bias, out, out_stride, n, cols, NULL, 0); \
        break;

/* pf NULL: no prefetch (a prefill chunk's tiles after its first PREFETCH_TILES reuse the panel; the
 * prefetch's per-step bookkeeping cost them ~7%, measured in docs/benchmarks.md). */
static void tile_dispatch(const uint16_t *xb, int64_t xb_stride, int64_t kp, const uint16_t *panel,
                          const float *bias, float *out, int64_t out_stride, int mr, int64_t cols, PanelPrefetch *pf)
{
    switch (mr) {
    TILE_CASE(8) TILE_CASE(7) TILE_CASE(6) TILE_CASE(5) TILE_CASE(4) TILE_CASE(3) TILE_CASE(2)
    default: TILE_CASE(1)
    }
}

/* A chunk of at least WIDEN_ROWS rows in the FMA build: each panel widened once into an fp32 scratch
 * panel and the chunk's tiles run gemm.c's fp32 tile over it (kvmesh_linear_f32_panel), rather than
 * widening in registers per tile: a prefill chunk's 32 tiles then share one widening. Bitwise the
 * same (the same FMAs in the same order), so which path a row takes never shows. Decode-sized
 * chunks keep the in-register widening: their weights stream from memory once, prefetched. */
#define WIDEN_ROWS 64

/* panel ([kp][PANEL][2] bf16) -> dst ([k][PANEL] fp32), exact. */
static void widen_panel(const uint16_t *panel, int64_t k, float *dst)
{
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int64_t p = 0; p < (k + 1) / 2; p++)
        for (int j = 0; j < 3; j++) {
            const __m512i w = _mm512_loadu_si512(panel + p * 2 * PANEL + j * 32);
            _mm512_storeu_ps(dst + 2 * p * PANEL + j * 16, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
            if (2 * p + 1 < k)
                _mm512_storeu_ps(dst + (2 * p + 1) * PANEL + j * 16, _mm512_castsi512_ps(_mm512_and_si512(w, top)));
        }
}

/* Row tile `row` (mr rows) of the call's input times one panel, on the kernel in use: the rounded
 * rows xb (vdpbf16ps) or, in the FMA build, the fp32 rows x themselves (xb NULL). */
static inline void row_tile(const float *x, int64_t x_stride, const uint16_t *xb, int64_t width, int64_t row,
                            int64_t k, const uint16_t *panel, const float *bias, float *out, int64_t out_stride,
                            int mr, int64_t cols, PanelPrefetch *pf)
{
    if (xb == NULL)
        tile_dispatch_fma(x + row * x_stride, x_stride, k, panel, bias, out, out_stride, mr, cols, pf);
    else
        tile_dispatch(xb + row * width, width, (k + 1) / 2, panel, bias, out, out_stride, mr, cols, pf);
}

/* x rounded to bf16 rows for vdpbf16ps (NULL with *failed 0 where the FMA kernel reads x itself). */
static uint16_t *rounded_rows(const float *x, int64_t x_stride, int64_t m, int64_t k, int64_t width, int *failed)
{
    *failed = 0;
    if (FMA_IN_USE) return NULL;
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)(m * width) + 64);
    if (xb == NULL) {
        *failed = 1;
        return NULL;
    }
    bf16_round_rows(x, x_stride, m, k, xb, width);
    return xb;
}

/* out[m, n] (rows out_stride apart) = bf16(x[m, k]) (rows x_stride apart) W^T + bias (NULL: none),
 * with W packed as described above (with the FMA kernel: x W^T, x as given). Returns 0, or -1 when
 * the scratch for bf16(x) cannot be had. */
int kvmesh_linear_bf16(const float *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                       const float *bias, float *out, int64_t out_stride)
{
    if (kvmesh_linear_bf16_amx()) return kvmesh_amx_linear_bf16(x, x_stride, m, k, packed, n, bias, out, out_stride);
    const int64_t kp = (k + 1) / 2, panels = (n + PANEL - 1) / PANEL, panel_size = kp * 2 * PANEL;
    const int64_t width = (2 * kp + 31) / 32 * 32;  /* xb's row: a whole number of 32-bf16 stores */
    int failed;
    uint16_t *xb = rounded_rows(x, x_stride, m, k, width, &failed);
    if (failed) return -1;
    for (int64_t r0 = 0; r0 < m; r0 += ROW_CHUNK) {
        const int64_t rows = m - r0 < ROW_CHUNK ? m - r0 : ROW_CHUNK, tiles = (rows + ROW_TILE - 1) / ROW_TILE;
        int64_t claimed[MAX_PAIRS] = {0};
        const int widen = FMA_IN_USE && rows >= WIDEN_ROWS;
        #pragma omp parallel if (panels > 1)
        {
            PairedRun run;
            paired_run_init(&run, panels, claimed);
            float *wide = widen ? malloc(sizeof(float) * (size_t)(k * PANEL)) : NULL;
            for (int64_t taken = 0;; taken++) {
                const int64_t p = paired_run_take(&run, taken);
                if (p < 0) break;
                const uint16_t *panel = packed + p * panel_size;
                const int64_t cols = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
                if (wide != NULL) {
                    widen_panel(panel, k, wide);
                    kvmesh_linear_f32_panel(x + r0 * x_stride, x_stride, rows, k, wide,
                                            bias != NULL ? bias + p * PANEL : NULL,
                                            out + r0 * out_stride + p * PANEL, out_stride, cols);
                    continue;
                }
                /* the next panel's prefetch over the chunk's first (up to) PREFETCH_TILES tiles, as gemm.c */
                const int64_t next = paired_run_after(&run, p), pf_tiles = tiles < PREFETCH_TILES ? tiles : PREFETCH_TILES;
                PanelPrefetch pf = panel_prefetch(next >= 0 ? packed + next * panel_size : NULL,
                                                  panel_size * (int64_t)sizeof(uint16_t), pf_tiles * kp);
                for (int64_t t = 0; t < tiles; t++) {
                    const int64_t row = r0 + t * ROW_TILE;
                    const int mr = (int)(r0 + rows - row < ROW_TILE ? r0 + rows - row : ROW_TILE);
                    row_tile(x, x_stride, xb, width, row, k, panel, bias != NULL ? bias + p * PANEL : NULL,
                             out + row * out_stride + p * PANEL, out_stride, mr, cols, t < pf_tiles ? &pf : NULL);
                }
            }
            free(wide);
        }
    }
    free(xb);
    return 0;
}

/* act[m, inter] (rows out_stride apart) = silu(gate) * up, [gate | up] = bf16(x) W^T + bias for the
 * merged gate_up weight W [2 inter, k] packed as above (bias NULL or [2 inter]): the SwiGLU in the
 * GEMM's epilogue, so the [m, 2 inter] projection is never written out and read back. Each row tile
 * computes gate panel g and up panel g + inter / PANEL with the same tile as kvmesh_linear_bf16
 * into a scratch tile, then silu_mul_row (exp_math.h, layer_ops.c's SwiGLU row): bitwise the unfused
 * kvmesh_linear_bf16 + kvmesh_silu_mul_f32, batch invariant as both are. Returns 0; -1 when the
 * scratch cannot be had; -3 for an inter that is not a multiple of PANEL (the caller runs the
 * two steps). */
int kvmesh_linear_bf16_swiglu(const float *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *packed,
                              int64_t inter, const float *bias, float *out, int64_t out_stride)
{
    if (inter <= 0 || inter % PANEL) return -3;
    if (kvmesh_linear_bf16_amx())
        return kvmesh_amx_linear_bf16_swiglu(x, x_stride, m, k, packed, inter, bias, out, out_stride);
    const int64_t kp = (k + 1) / 2, panels = inter / PANEL, panel_size = kp * 2 * PANEL;
    const int64_t width = (2 * kp + 31) / 32 * 32;
    int failed;
    uint16_t *xb = rounded_rows(x, x_stride, m, k, width, &failed);
    if (failed) return -1;
    for (int64_t r0 = 0; r0 < m; r0 += ROW_CHUNK) {
        const int64_t rows = m - r0 < ROW_CHUNK ? m - r0 : ROW_CHUNK, tiles = (rows + ROW_TILE - 1) / ROW_TILE;
        int64_t claimed[MAX_PAIRS] = {0};
        const int widen = FMA_IN_USE && rows >= WIDEN_ROWS;
        #pragma omp parallel if (panels > 1)
        {
            float gate[ROW_TILE * PANEL], up[ROW_TILE * PANEL];
            PairedRun run;
            paired_run_init(&run, panels, claimed);
            /* the FMA build's widened gate and up panels, side by side */
            float *wide = widen ? malloc(sizeof(float) * (size_t)(2 * k * PANEL)) : NULL;
            for (int64_t taken = 0;; taken++) {
                const int64_t g = paired_run_take(&run, taken);
                if (g < 0) break;
                const uint16_t *gp = packed + g * panel_size, *upp = packed + (g + panels) * panel_size;
                if (wide != NULL) {
                    widen_panel(gp, k, wide);
                    widen_panel(upp, k, wide + k * PANEL);
                }
                /* the next gate and up panels' prefetch over the first (up to) PREFETCH_TILES tiles */
                const int64_t next = paired_run_after(&run, g), pf_tiles = tiles < PREFETCH_TILES ? tiles : PREFETCH_TILES;
                const int64_t bytes = panel_size * (int64_t)sizeof(uint16_t);
                PanelPrefetch pf_gate = panel_prefetch(next >= 0 ? packed + next * panel_size : NULL, bytes,
                                                       pf_tiles * kp);
                PanelPrefetch pf_up = panel_prefetch(next >= 0 ? packed + (next + panels) * panel_size : NULL, bytes,
                                                     pf_tiles * kp);
                for (int64_t t = 0; t < tiles; t++) {
                    const int64_t row = r0 + t * ROW_TILE;
                    const int mr = (int)(r0 + rows - row < ROW_TILE ? r0 + rows - row : ROW_TILE);
                    const float *bg = bias != NULL ? bias + g * PANEL : NULL;
                    const float *bu = bias != NULL ? bias + inter + g * PANEL : NULL;
                    if (wide != NULL) {
                        kvmesh_linear_f32_panel(x + row * x_stride, x_stride, mr, k, wide, bg, gate, PANEL, PANEL);
                        kvmesh_linear_f32_panel(x + row * x_stride, x_stride, mr, k, wide + k * PANEL, bu, up, PANEL,
                                                PANEL);
                    } else {
                        row_tile(x, x_stride, xb, width, row, k, gp, bg, gate, PANEL, mr, PANEL,
                                 t < pf_tiles ? &pf_gate : NULL);
                        row_tile(x, x_stride, xb, width, row, k, upp, bu, up, PANEL, mr, PANEL,
                                 t < pf_tiles ? &pf_up : NULL);
                    }
                    for (int r = 0; r < mr; r++)
                        silu_mul_row(gate + r * PANEL, up + r * PANEL, out + (row + r) * out_stride + g * PANEL, PANEL);
                }
            }
            free(wide);
        }
    }
    free(xb);
    return 0;
}

#else

int64_t kvmesh_linear_bf16_available(void) { return 0; }

int64_t kvmesh_linear_bf16_fma(void) { return 0; }

/* Not built for this CPU: the runner checks kvmesh_linear_bf16_available() and never calls it. */
int kvmesh_linear_bf16(const float *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                       const float *bias, float *out, int64_t out_stride)
{
    (void)x; (void)x_stride; (void)m; (void)k; (void)packed; (void)n; (void)bias; (void)out; (void)out_stride;
    return -2;
}

int kvmesh_linear_bf16_swiglu(const float *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *packed,
                              int64_t inter, const float *bias, float *out, int64_t out_stride)
{
    (void)x; (void)x_stride; (void)m; (void)k; (void)packed; (void)inter; (void)bias; (void)out; (void)out_stride;
    return -2;
}

#endif
