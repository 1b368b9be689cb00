/*
 * fp32 linear layers for the CPU: out = x W^T + b on a weight packed once into column panels.
 *
 * Why it exists: a decode step's GEMMs are skinny (1-32 rows against a weight streamed from
 * memory once per step), and on a small CPU the weight stream and the FMAs of a batch-32 step
 * cost about the same. oneDNN's packed inner product (the runner's default) runs them one after
 * the other. Here each thread walks its own run of panels and prefetches the next panel in
 * software, a few lines per k step, while it computes on the current one, so the memory stream
 * hides behind the FMAs (the measurements: docs/model_runner.md).
 *
 * Layout: W [n, k] becomes packed [ceil(n / PANEL)][k][PANEL]: for each panel of PANEL output
 * columns, the k rows of its weights, contiguous (columns past n are zero). One panel is 48 x k
 * floats (110 KB at k = 576), which stays in L2 while every row tile of x passes over it.
 * The Python side packs (services/model_runner/model/packed.py) and reads PANEL from
 * kvmesh_linear_panel_width(), so the two cannot disagree.
 *
 * Kernel: rows of x in tiles of 8, a tile x one panel = 8 x 48 accumulators (24 zmm registers),
 * each k step one broadcast of x per row and three panel loads for 24 FMAs (AVX2 + FMA: 6 x 16
 * tiles, three per panel; plain C elsewhere). Rows come in chunks
 * of ROW_CHUNK, so a prefill's x chunk stays in L2 while the panels stream past it. The software
 * prefetch of the next panel runs during a chunk's first PREFETCH_TILES row tiles (AVX2:
 * PACED_TILES; all of a decode-sized chunk's): without it a larger chunk's first tile read each
 * panel at the memory's pace (the row tiles after it reuse the panel from cache, where the
 * prefetch's per-k bookkeeping would only cost them).
 *
 * Numerics: each output is sum_k x[k] * w[k] in k order with FMA, plus the bias: IEEE fp32 in
 * another order than oneDNN's (results differ in the last bits, as any two GEMMs do).
 *
 * Threads: panels are split as pairs.h describes; the OpenMP runtime is torch's (see
 * paged_decode.c).
 */
#include <stdint.h>
#include <stddef.h>
#include <omp.h>

#include "exp_math.h"
#include "kernels.h"
#include "pairs.h"
#include "panel_prefetch.h"
#include "tile_avx2.h"
#include "tile_store.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define PANEL 48
#if defined(__AVX512F__) || !(defined(__AVX2__) && defined(__FMA__))
#define ROW_TILE 8
#else
#define ROW_TILE TILE_AVX2_ROWS  /* tile_avx2.h */
#endif
#define ROW_CHUNK 256
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define EVEN_TILES 1  /* AVX2: a chunk's rows split evenly over its tiles (see tile_passes_avx2) */
#else
#define EVEN_TILES 0  /* AVX-512 and plain C: full tiles, the rest in the last (they compute only its rows) */
#endif
#define PREFETCH_TILES 4  /* row tiles per chunk over which the next panel's prefetch is spread */
#define PACED_TILES 6     /* AVX2: row tiles per chunk over which that prefetch is paced */

int64_t kvmesh_linear_panel_width(void) { return PANEL; }

/* The first row of tile t of a chunk of `rows` rows in `tiles` tiles (tile t's rows run to tile
 * t + 1's first): with EVEN_TILES the sizes differ by at most one, larger first. */
static inline int64_t tile_first_row(int64_t rows, int64_t tiles, int64_t t)
{
    if (!EVEN_TILES) return t * ROW_TILE < rows ? t * ROW_TILE : rows;
    const int64_t base = rows / tiles, extra = rows % tiles;
    return t * base + (t < extra ? t : extra);
}

#if defined(__AVX512F__)

/* One row tile (mr rows, a compile-time constant after inlining) times one panel; `prefetch`
 * (also a constant) steps the next panel's prefetch once per k. */
static inline __attribute__((always_inline)) void tile_avx512(
    const float *x, int64_t x_stride, int64_t k, const float *panel, const float *bias, float *out,
    int64_t out_stride, const int mr, int64_t cols, PanelPrefetch *pf, const int prefetch)
{
    __m512 c[ROW_TILE][3];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 3; j++) c[r][j] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        if (prefetch) panel_prefetch_step(pf);
        const float *b = panel + kk * PANEL;
        const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16), b2 = _mm512_loadu_ps(b + 32);
        for (int r = 0; r < mr; r++) {
            const __m512 a = _mm512_set1_ps(x[r * x_stride + kk]);
            c[r][0] = _mm512_fmadd_ps(a, b0, c[r][0]);
            c[r][1] = _mm512_fmadd_ps(a, b1, c[r][1]);
            c[r][2] = _mm512_fmadd_ps(a, b2, c[r][2]);
        }
    }
    tile_store(c, mr, cols, bias, out, out_stride);
}

#define TILE_CASE(n) \
    case n: \
        if (pf != NULL) tile_avx512(x, x_stride, k, panel, bias, out, out_stride, n, cols, pf, 1); \
        else tile_avx512(x, x_stride, k, panel, bias, out, out_stride, n, cols, NULL, 0); \
        break;

/* pf NULL: no prefetch (a larger chunk's tiles after its first PREFETCH_TILES reuse the panel
 * from cache, and the prefetch's per-k bookkeeping cost them several per cent: docs/benchmarks.md). */
static void tile_dispatch(const float *x, int64_t x_stride, int64_t k, const float *panel, const float *bias,
                          float *out, int64_t out_stride, int mr, int64_t cols, PanelPrefetch *pf)
{
    switch (mr) {
    TILE_CASE(8) TILE_CASE(7) TILE_CASE(6) TILE_CASE(5) TILE_CASE(4) TILE_CASE(3) TILE_CASE(2)
    default: TILE_CASE(1)
    }
}

#elif defined(__AVX2__) && defined(__FMA__)

/* mr rows (2..6, a compile-time constant after inlining: each count its own code, the
 * accumulators in registers) times one panel, in three passes of 16 columns (one 64-byte line
 * of each k row): 2 x mr ymm accumulators, each panel load feeding mr FMAs (BLIS's AVX2 shape
 * at 6 rows). A tile computes only its own rows, so the chunk's rows are split evenly over its
 * tiles (32 rows: 6 6 5 5 5 5, not 6 6 6 6 6 2 with the 2-row tile paying for 6). */
static inline __attribute__((always_inline)) void tile_passes_avx2(
    const float *x, int64_t x_stride, int64_t k, const float *panel, const float *bias, float *out,
    int64_t out_stride, const int mr, int64_t cols, PacedPrefetch *pf, const int prefetch)
{
    for (int h = 0; h < 3; h++) {
        const int64_t left = cols - h * 16;
        if (left <= 0) break;
        const int64_t n = left < 16 ? left : 16;
        const float *b = panel + h * 16;
        TILE_AVX2_BEGIN(x, x_stride);
        const char *pf_line = prefetch ? pf->line : NULL;
        int64_t pf_countdown = prefetch ? pf->countdown : 0;
        const int64_t pf_every = prefetch ? pf->every : 0;
        for (int64_t kk = 0; kk < k; kk++, b += PANEL) {
            if (prefetch) paced_prefetch_step(&pf_line, &pf_countdown, pf_every);
            const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
            TILE_AVX2_STEP(mr, kk, b0, b1);
        }
        if (prefetch) {
            pf->line = pf_line;
            pf->countdown = pf_countdown;
        }
        TILE_AVX2_END(mr, n, bias != NULL ? bias + h * 16 : NULL, out + h * 16, out_stride);
    }
}

/* One row tile (mr <= 6 rows) times one panel, AVX2 + FMA: tiles of 2-6 rows as above; one row
 * has its own loop (a batch-1 decode streams the weight: all 48 columns in one pass). Either way
 * the arithmetic per output is the AVX-512 tile's (FMA in k order from zero, then the bias), so a
 * row's result never depends on the rows beside it or on the tile it falls in. Without these an
 * AVX2 CPU ran the portable loops below, whose 8 x 48 accumulators do not fit 16 registers
 * (several times slower: docs/model_runner.md). */
static void tile_dispatch(const float *x, int64_t x_stride, int64_t k, const float *panel, const float *bias,
                          float *out, int64_t out_stride, int mr, int64_t cols, PacedPrefetch *pf)
{
    if (mr == 1) {
        /* One row: the whole panel in one pass, six chains of FMAs (two were latency-bound at a
         * third of the FMA rate) and the panel read front to back, as the hardware prefetcher
         * likes a weight streamed from memory; each k step prefetches the same k row of the next
         * panel (its three lines), which needs no count. */
        __m256 c[6];
        for (int j = 0; j < 6; j++) c[j] = _mm256_setzero_ps();
        const float *b = panel;
        const char *next = pf != NULL ? pf->line : NULL;
        for (int64_t kk = 0; kk < k; kk++, b += PANEL) {
            if (next != NULL) {
                const char *row = next + kk * PANEL * (int64_t)sizeof(float);
                _mm_prefetch(row, _MM_HINT_T1);
                _mm_prefetch(row + 64, _MM_HINT_T1);
                _mm_prefetch(row + 128, _MM_HINT_T1);
            }
            const __m256 a = _mm256_broadcast_ss(x + kk);
            for (int j = 0; j < 6; j++) c[j] = _mm256_fmadd_ps(a, _mm256_loadu_ps(b + j * 8), c[j]);
        }
        row_store_avx2(c, 6, cols, bias, out);
        return;
    }
#define PASSES_CASE(n) \
    case n: \
        if (pf != NULL) tile_passes_avx2(x, x_stride, k, panel, bias, out, out_stride, n, cols, pf, 1); \
        else tile_passes_avx2(x, x_stride, k, panel, bias, out, out_stride, n, cols, NULL, 0); \
        break;
    switch (mr) {
    PASSES_CASE(6) PASSES_CASE(5) PASSES_CASE(4) PASSES_CASE(3)
    default: PASSES_CASE(2)
    }
}

#else

typedef char NoPrefetch;  /* the plain build prefetches nothing */

/* One row tile times one panel, portable C (the compiler vectorizes the 48 columns). */
static void tile_dispatch(const float *x, int64_t x_stride, int64_t k, const float *panel, const float *bias,
                          float *out, int64_t out_stride, int mr, int64_t cols, NoPrefetch *unused)
{
    (void)unused;
    float c[ROW_TILE][PANEL];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < PANEL; j++) c[r][j] = 0.0f;
    for (int64_t kk = 0; kk < k; kk++) {
        const float *b = panel + kk * PANEL;
        for (int r = 0; r < mr; r++) {
            const float a = x[r * x_stride + kk];
            #pragma omp simd
            for (int j = 0; j < PANEL; j++) c[r][j] += a * b[j];
        }
    }
    for (int r = 0; r < mr; r++)
        for (int64_t j = 0; j < cols; j++) out[r * out_stride + j] = c[r][j] + (bias != NULL ? bias[j] : 0.0f);
}

#endif

/* The next panel's prefetch over a chunk of `tiles` row tiles, and in *pf_tiles how many of its
 * first tiles run it: all of a decode-sized chunk's; the later tiles of a larger chunk find the
 * panel in cache and skip the per-k bookkeeping. AVX-512: spread over the k steps of the first
 * (up to) PREFETCH_TILES tiles. AVX2: paced (one line every few k steps, counters in registers)
 * over the first PACED_TILES tiles' three column passes. A line per k step over the first tile
 * alone asked for about twice the memory's pace there and left the memory idle during the other
 * tiles (docs/model_runner.md, "AVX2 machines, third round"). One row: see tile_dispatch. */
#if defined(__AVX512F__)
typedef PanelPrefetch Prefetch;
static inline Prefetch next_panel_prefetch(const float *next, int64_t k, int64_t tiles, int64_t *pf_tiles)
{
    *pf_tiles = tiles < PREFETCH_TILES ? tiles : PREFETCH_TILES;
    return panel_prefetch(next, k * PANEL * (int64_t)sizeof(float), *pf_tiles * k);
}
#elif defined(__AVX2__) && defined(__FMA__)
typedef PacedPrefetch Prefetch;
static inline Prefetch next_panel_prefetch(const float *next, int64_t k, int64_t tiles, int64_t *pf_tiles)
{
    *pf_tiles = tiles < PACED_TILES ? tiles : PACED_TILES;
    return paced_prefetch(next, k * PANEL * (int64_t)sizeof(float), *pf_tiles * 3 * k);
}
#else
typedef NoPrefetch Prefetch;
static inline Prefetch next_panel_prefetch(const float *next, int64_t k, int64_t tiles, int64_t *pf_tiles)
{
    (void)next, (void)k, (void)tiles;
    *pf_tiles = 0;
    return 0;
}
#endif

/* This thread's panels (pairs.h) for one chunk of rows. */
static void run_panels(const float *x, int64_t x_stride, int64_t r0, int64_t rows, int64_t k, const float *packed,
                       int64_t n, const float *bias, float *out, int64_t out_stride, PairedRun *run)
{
    const int64_t panel_size = k * PANEL, tiles = (rows + ROW_TILE - 1) / ROW_TILE;
    for (int64_t taken = 0;; taken++) {
        const int64_t p = paired_run_take(run, taken);
        if (p < 0) break;
        const float *panel = packed + p * panel_size;
        const int64_t cols = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
        const float *bp = bias != NULL ? bias + p * PANEL : NULL;
        const int64_t next = paired_run_after(run, p);
        int64_t pf_tiles;
        Prefetch pf = next_panel_prefetch(next >= 0 ? packed + next * panel_size : NULL, k, tiles, &pf_tiles);
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t row = r0 + tile_first_row(rows, tiles, t);
            const int mr = (int)(r0 + tile_first_row(rows, tiles, t + 1) - row);
            tile_dispatch(x + row * x_stride, x_stride, k, panel, bp, out + row * out_stride + p * PANEL, out_stride,
                          mr, cols, t < pf_tiles ? &pf : NULL);
        }
    }
}

/* run_panels for the merged gate_up weight: this thread's gate panels g, each with its up panel
 * g + panels, both computed per row tile into a scratch tile by the same tile_dispatch, then the
 * tile's SwiGLU rows into out (column g * PANEL on). */
static void run_swiglu_panels(const float *x, int64_t x_stride, int64_t r0, int64_t rows, int64_t k,
                              const float *packed, int64_t panels, const float *bias, float *out, int64_t out_stride,
                              PairedRun *run)
{
    const int64_t panel_size = k * PANEL, tiles = (rows + ROW_TILE - 1) / ROW_TILE;
    float gate[ROW_TILE * PANEL], up[ROW_TILE * PANEL];
    for (int64_t taken = 0;; taken++) {
        const int64_t g = paired_run_take(run, taken);
        if (g < 0) break;
        const float *gp = packed + g * panel_size, *upp = packed + (g + panels) * panel_size;
        const float *bg = bias != NULL ? bias + g * PANEL : NULL;
        const float *bu = bias != NULL ? bias + (g + panels) * PANEL : NULL;
        const int64_t next = paired_run_after(run, g);
        int64_t pf_tiles;
        Prefetch pf_gate = next_panel_prefetch(next >= 0 ? packed + next * panel_size : NULL, k, tiles, &pf_tiles);
        Prefetch pf_up = next_panel_prefetch(next >= 0 ? packed + (next + panels) * panel_size : NULL, k, tiles,
                                             &pf_tiles);
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t row = r0 + tile_first_row(rows, tiles, t);
            const int mr = (int)(r0 + tile_first_row(rows, tiles, t + 1) - row);
            const float *xt = x + row * x_stride;
            tile_dispatch(xt, x_stride, k, gp, bg, gate, PANEL, mr, PANEL, t < pf_tiles ? &pf_gate : NULL);
            tile_dispatch(xt, x_stride, k, upp, bu, up, PANEL, mr, PANEL, t < pf_tiles ? &pf_up : NULL);
            for (int r = 0; r < mr; r++)
                silu_mul_row(gate + r * PANEL, up + r * PANEL, out + (row + r) * out_stride + g * PANEL, PANEL);
        }
    }
}

/* rows of x (any count) times one packed fp32 panel ([k][PANEL]), no prefetch, into out (the panel's
 * first column): gemm_bf16.c's FMA build runs a prefill chunk here over a panel it widened from bf16
 * once, bitwise what its in-register tiles give (the same FMAs in the same order). */
void kvmesh_linear_f32_panel(const float *x, int64_t x_stride, int64_t rows, int64_t k, const float *panel,
                             const float *bias, float *out, int64_t out_stride, int64_t cols)
{
    const int64_t tiles = (rows + ROW_TILE - 1) / ROW_TILE;
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t row = tile_first_row(rows, tiles, t);
        const int mr = (int)(tile_first_row(rows, tiles, t + 1) - row);
        tile_dispatch(x + row * x_stride, x_stride, k, panel, bias, out + row * out_stride, out_stride, mr, cols, NULL);
    }
}

/* Rows in chunks of ROW_CHUNK, each chunk's panels split over the team as pairs.h describes: run_panels
 * over n columns, or (swiglu) run_swiglu_panels over gate panels whose up panels follow them. */
static void each_chunk(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *packed, int64_t panels,
                       int64_t n, const float *bias, float *out, int64_t out_stride, int swiglu)
{
    for (int64_t r0 = 0; r0 < m; r0 += ROW_CHUNK) {
        const int64_t rows = m - r0 < ROW_CHUNK ? m - r0 : ROW_CHUNK;
        int64_t claimed[MAX_PAIRS] = {0};
        #pragma omp parallel if (panels > 1)
        {
            PairedRun run;
            paired_run_init(&run, panels, claimed);
            if (swiglu)
                run_swiglu_panels(x, x_stride, r0, rows, k, packed, panels, bias, out, out_stride, &run);
            else
                run_panels(x, x_stride, r0, rows, k, packed, n, bias, out, out_stride, &run);
        }
    }
}

/* out[m, n] (rows out_stride apart) = x[m, k] (rows x_stride apart) W^T + bias (NULL: none),
 * with W packed as described above. */
void kvmesh_linear_f32(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *packed, int64_t n,
                       const float *bias, float *out, int64_t out_stride)
{
    each_chunk(x, x_stride, m, k, packed, (n + PANEL - 1) / PANEL, n, bias, out, out_stride, 0);
}

/* act[m, inter] (rows out_stride apart) = silu(gate) * up, [gate | up] = x W^T + bias for the
 * merged gate_up weight W [2 inter, k] packed as above (bias NULL or [2 inter]): the SwiGLU in the
 * GEMM's epilogue, as gemm_bf16.c's kvmesh_linear_bf16_swiglu does for bf16 mode, so the
 * [m, 2 inter] projection is never written out and read back. Bitwise kvmesh_linear_f32 then
 * kvmesh_silu_mul_f32 (the same tiles, exp_math.h's silu_mul_row), batch invariant as both are.
 * Returns 0, or -3 for an inter that is not a multiple of PANEL (the gate and up panels would not
 * pair up; the caller runs the two steps). */
int kvmesh_linear_f32_swiglu(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *packed,
                             int64_t inter, const float *bias, float *out, int64_t out_stride)
{
    if (inter <= 0 || inter % PANEL) return -3;
    each_chunk(x, x_stride, m, k, packed, inter / PANEL, inter, bias, out, out_stride, 1);
    return 0;
}
