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
 * each k step one broadcast of x per row and three panel loads for 24 FMAs. Rows come in chunks
 * of ROW_CHUNK, so a prefill's x chunk stays in L2 while the panels stream past it.
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

#include "kernels.h"
#include "pairs.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define PANEL 48
#define ROW_TILE 8
#define ROW_CHUNK 256

int64_t kvmesh_linear_panel_width(void) { return PANEL; }

#if defined(__AVX512F__)

/* Spreads the prefetch of the next panel's cache lines over the k steps of the current one. */
typedef struct {
    const char *next;  /* NULL: nothing to prefetch */
    int64_t line, lines, per;
} PanelPrefetch;

static inline void panel_prefetch_step(PanelPrefetch *p) {
    if (p->next == NULL) return;
    for (int64_t i = 0; i < p->per && p->line < p->lines; i++, p->line++)
        _mm_prefetch(p->next + p->line * 64, _MM_HINT_T1);
}

/* One row tile (mr rows, a compile-time constant after inlining) times one panel. */
static inline __attribute__((always_inline)) void tile_avx512(
    const float *x, int64_t x_stride, int64_t k, const float *panel, const float *bias, float *out,
    int64_t out_stride, const int mr, int64_t cols, PanelPrefetch *pf)
{
    __m512 c[ROW_TILE][3];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 3; j++) c[r][j] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        panel_prefetch_step(pf);
        const float *b = panel + kk * PANEL;
        const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16), b2 = _mm512_loadu_ps(b + 32);
        for (int r = 0; r < mr; r++) {
            const __m512 a = _mm512_set1_ps(x[r * x_stride + kk]);
            c[r][0] = _mm512_fmadd_ps(a, b0, c[r][0]);
            c[r][1] = _mm512_fmadd_ps(a, b1, c[r][1]);
            c[r][2] = _mm512_fmadd_ps(a, b2, c[r][2]);
        }
    }
    for (int j = 0; j < 3; j++) {
        const int64_t left = cols - j * 16;
        if (left <= 0) break;
        const __mmask16 live = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
        const __m512 bv = bias != NULL ? _mm512_maskz_loadu_ps(live, bias + j * 16) : _mm512_setzero_ps();
        for (int r = 0; r < mr; r++)
            _mm512_mask_storeu_ps(out + r * out_stride + j * 16, live, _mm512_add_ps(c[r][j], bv));
    }
}

static void tile_dispatch(const float *x, int64_t x_stride, int64_t k, const float *panel, const float *bias,
                          float *out, int64_t out_stride, int mr, int64_t cols, PanelPrefetch *pf)
{
    switch (mr) {
    case 8: tile_avx512(x, x_stride, k, panel, bias, out, out_stride, 8, cols, pf); break;
    case 7: tile_avx512(x, x_stride, k, panel, bias, out, out_stride, 7, cols, pf); break;
    case 6: tile_avx512(x, x_stride, k, panel, bias, out, out_stride, 6, cols, pf); break;
    case 5: tile_avx512(x, x_stride, k, panel, bias, out, out_stride, 5, cols, pf); break;
    case 4: tile_avx512(x, x_stride, k, panel, bias, out, out_stride, 4, cols, pf); break;
    case 3: tile_avx512(x, x_stride, k, panel, bias, out, out_stride, 3, cols, pf); break;
    case 2: tile_avx512(x, x_stride, k, panel, bias, out, out_stride, 2, cols, pf); break;
    default: tile_avx512(x, x_stride, k, panel, bias, out, out_stride, 1, cols, pf); break;
    }
}

#else

/* One row tile times one panel, portable C (the compiler vectorizes the 48 columns). */
static void tile_dispatch(const float *x, int64_t x_stride, int64_t k, const float *panel, const float *bias,
                          float *out, int64_t out_stride, int mr, int64_t cols, void *unused)
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
#if defined(__AVX512F__)
        const int64_t next = paired_run_after(run, p);
        const int64_t lines = panel_size * (int64_t)sizeof(float) / 64, steps = tiles * k;
        PanelPrefetch pf = {next >= 0 ? (const char *)(packed + next * panel_size) : NULL, 0, lines,
                            (lines + steps - 1) / steps};
        PanelPrefetch *pfp = &pf;
#else
        void *pfp = NULL;
#endif
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t row = r0 + t * ROW_TILE;
            const int mr = (int)(r0 + rows - row < ROW_TILE ? r0 + rows - row : ROW_TILE);
            tile_dispatch(x + row * x_stride, x_stride, k, panel, bp, out + row * out_stride + p * PANEL, out_stride,
                          mr, cols, pfp);
        }
    }
}

/* out[m, n] (rows out_stride apart) = x[m, k] (rows x_stride apart) W^T + bias (NULL: none),
 * with W packed as described above. */
void kvmesh_linear_f32(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *packed, int64_t n,
                       const float *bias, float *out, int64_t out_stride)
{
    const int64_t panels = (n + PANEL - 1) / PANEL;
    for (int64_t r0 = 0; r0 < m; r0 += ROW_CHUNK) {
        const int64_t rows = m - r0 < ROW_CHUNK ? m - r0 : ROW_CHUNK;
        int64_t claimed[MAX_PAIRS] = {0};
        #pragma omp parallel if (panels > 1)
        {
            PairedRun run;
            paired_run_init(&run, panels, claimed);
            run_panels(x, x_stride, r0, rows, k, packed, n, bias, out, out_stride, &run);
        }
    }
}
