/*
 * Weight-only int8 linear layers for the CPU (AVX512-BF16):
 *     out[r, c] = scale[c] * sum_k bf16(x[r, k]) q[c, k] + b[c]
 * with q the int8 weights (symmetric, one fp32 scale per output channel) and fp32 accumulation.
 *
 * Why it exists: a single-stream decode step streams every weight once per token and does
 * little arithmetic on it, so its time is the weight bytes over the memory bandwidth; int8
 * weights are half the bytes of bf16 mode's (docs/model_runner.md, "Weight-only int8").
 *
 * Arithmetic: q is converted to bf16 in registers (int8 -> int32 -> fp32 -> bf16, exact: every
 * int8 is a bf16), then the same vdpbf16ps accumulation as gemm_bf16.c: per output, acc = 0,
 * for each k pair p in order acc = vdpbf16ps(acc, x[2p..2p+1], q[2p..2p+1]), then
 * fma(acc, scale, bias). The products of two bf16 are exact in fp32; the sums are fp32.
 *
 * Batch invariance, by construction: that order is the same whatever m, the row tile, the row
 * chunk or the thread. Small row counts (a decode) convert each panel's weights in registers
 * for the one row tile; larger ones (a prefill chunk) first convert the panel once into a
 * per-thread bf16 copy and run every row tile on it. The conversion is exact, so both paths give
 * the same bits (tests/kernels/test_native_gemm_int8.py checks batches of 1..33 rows bitwise).
 *
 * Layout (model/packed.py, pack_int8): one byte buffer, first the scales as fp32
 * [ceil(n / PANEL) * PANEL] (zero past n), then the int8 weights [ceil(n / PANEL)][kp][PANEL][2],
 * kp = ceil(k / 2): gemm_bf16.c's panel layout with int8 elements, so 32 consecutive bytes
 * convert to the 16 (k pair, column) lanes vdpbf16ps takes. Columns past n and an odd k's last
 * half are zero.
 *
 * Built only where the compiler targets AVX512-BF16; elsewhere kvmesh_linear_int8_available() is
 * 0 and the runner refuses quantization=int8_weight_only.
 */
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

#include "kernels.h"
#include "pairs.h"
#include "panel_prefetch.h"

#define PANEL 48
#define ROW_TILE 8
#define ROW_CHUNK 256

typedef int32_t __attribute__((may_alias)) bf16_pair;  /* two bf16 read as one broadcast lane */

#if defined(__AVX512BF16__) && defined(__AVX512F__)

int64_t kvmesh_linear_int8_available(void) { return 1; }

/* x [m, k] fp32 -> xb [m, 2 kp] bf16 (round to nearest even), the padding k zero; gemm_bf16.c's
 * conversion (a static function there: that file belongs to the bf16 GEMM), so int8 mode rounds
 * its GEMM inputs exactly as bf16 mode does. */
static void round_rows(const float *x, int64_t x_stride, int64_t m, int64_t k, uint16_t *xb, int64_t kp)
{
    for (int64_t r = 0; r < m; r++) {
        const float *src = x + r * x_stride;
        uint16_t *dst = xb + r * 2 * kp;
        for (int64_t i = 0; i < 2 * kp; i += 32) {
            const int64_t left = k - i;
            const __mmask16 lo = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1u) : 0;
            const __mmask16 hi = left >= 32 ? (__mmask16)0xFFFF : left > 16 ? (__mmask16)((1u << (left - 16)) - 1u) : 0;
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, src + i + 16), _mm512_maskz_loadu_ps(lo, src + i));
            const int64_t out_left = 2 * kp - i;
            const __mmask32 live = out_left >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << out_left) - 1u);
            _mm512_mask_storeu_epi16(dst + i, live, (__m512i)v);
        }
    }
}

/* 32 int8 (16 k pairs of one 16-column group) -> 32 bf16 in the same order, exactly. */
static inline __attribute__((always_inline)) __m512bh widen(const int8_t *q)
{
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* One row tile (mr rows, a compile-time constant after inlining) times one panel, whose weights
 * are int8 (q, converted here) or already bf16 (wb, the prefill path's converted copy). */
static inline __attribute__((always_inline)) void tile_int8(
    const uint16_t *xb, int64_t xb_stride, int64_t kp, const int8_t *q, const uint16_t *wb, const float *scale,
    const float *bias, float *out, int64_t out_stride, const int mr, int64_t cols, PanelPrefetch *pf)
{
    __m512 c[ROW_TILE][3];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 3; j++) c[r][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kp; p++) {
        panel_prefetch_step(pf);
        __m512bh b0, b1, b2;
        if (wb != NULL) {
            const uint16_t *b = wb + p * 2 * PANEL;
            b0 = (__m512bh)_mm512_loadu_si512(b);
            b1 = (__m512bh)_mm512_loadu_si512(b + 32);
            b2 = (__m512bh)_mm512_loadu_si512(b + 64);
        } else {
            const int8_t *b = q + p * 2 * PANEL;
            b0 = widen(b);
            b1 = widen(b + 32);
            b2 = widen(b + 64);
        }
        for (int r = 0; r < mr; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32(*(const bf16_pair *)(xb + r * xb_stride + 2 * p));
            c[r][0] = _mm512_dpbf16_ps(c[r][0], a, b0);
            c[r][1] = _mm512_dpbf16_ps(c[r][1], a, b1);
            c[r][2] = _mm512_dpbf16_ps(c[r][2], a, b2);
        }
    }
    for (int j = 0; j < 3; j++) {
        const int64_t left = cols - j * 16;
        if (left <= 0) break;
        const __mmask16 live = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
        const __m512 sv = _mm512_maskz_loadu_ps(live, scale + j * 16);
        const __m512 bv = bias != NULL ? _mm512_maskz_loadu_ps(live, bias + j * 16) : _mm512_setzero_ps();
        for (int r = 0; r < mr; r++)
            _mm512_mask_storeu_ps(out + r * out_stride + j * 16, live, _mm512_fmadd_ps(c[r][j], sv, bv));
    }
}

static void tile_dispatch(const uint16_t *xb, int64_t xb_stride, int64_t kp, const int8_t *q, const uint16_t *wb,
                          const float *scale, const float *bias, float *out, int64_t out_stride, int mr,
                          int64_t cols, PanelPrefetch *pf)
{
    switch (mr) {
    case 8: tile_int8(xb, xb_stride, kp, q, wb, scale, bias, out, out_stride, 8, cols, pf); break;
    case 7: tile_int8(xb, xb_stride, kp, q, wb, scale, bias, out, out_stride, 7, cols, pf); break;
    case 6: tile_int8(xb, xb_stride, kp, q, wb, scale, bias, out, out_stride, 6, cols, pf); break;
    case 5: tile_int8(xb, xb_stride, kp, q, wb, scale, bias, out, out_stride, 5, cols, pf); break;
    case 4: tile_int8(xb, xb_stride, kp, q, wb, scale, bias, out, out_stride, 4, cols, pf); break;
    case 3: tile_int8(xb, xb_stride, kp, q, wb, scale, bias, out, out_stride, 3, cols, pf); break;
    case 2: tile_int8(xb, xb_stride, kp, q, wb, scale, bias, out, out_stride, 2, cols, pf); break;
    default: tile_int8(xb, xb_stride, kp, q, wb, scale, bias, out, out_stride, 1, cols, pf); break;
    }
}

/* One panel's int8 weights -> bf16, same layout (the prefill path's per-thread copy). */
static void widen_panel(const int8_t *q, int64_t kp, uint16_t *wb)
{
    for (int64_t i = 0; i < kp * 2 * PANEL; i += 32) _mm512_storeu_si512(wb + i, (__m512i)widen(q + i));
}

/* out[m, n] (rows out_stride apart) = bf16(x[m, k]) (rows x_stride apart) (scale q)^T + bias
 * (NULL: none), with the weights packed as described above. Returns 0, or -1 when a scratch
 * buffer cannot be had. */
int kvmesh_linear_int8(const float *x, int64_t x_stride, int64_t m, int64_t k, const void *packed, int64_t n,
                       const float *bias, float *out, int64_t out_stride)
{
    const int64_t kp = (k + 1) / 2, panels = (n + PANEL - 1) / PANEL, panel_size = kp * 2 * PANEL;
    const float *scales = (const float *)packed;
    const int8_t *weights = (const int8_t *)packed + panels * PANEL * (int64_t)sizeof(float);
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)(m * 2 * kp) + 64);
    if (xb == NULL) return -1;
    round_rows(x, x_stride, m, k, xb, kp);
    int failed = 0;
    for (int64_t r0 = 0; r0 < m && !failed; r0 += ROW_CHUNK) {
        const int64_t rows = m - r0 < ROW_CHUNK ? m - r0 : ROW_CHUNK, tiles = (rows + ROW_TILE - 1) / ROW_TILE;
        int64_t claimed[MAX_PAIRS] = {0};
        #pragma omp parallel if (panels > 1) reduction(|| : failed)
        {
            /* more than one row tile: convert each panel once, not once per tile */
            uint16_t *wb = tiles > 1 ? malloc(sizeof(uint16_t) * (size_t)panel_size + 64) : NULL;
            failed = tiles > 1 && wb == NULL;
            PairedRun run;
            paired_run_init(&run, panels, claimed);
            for (int64_t taken = 0; !failed; taken++) {
                const int64_t p = paired_run_take(&run, taken);
                if (p < 0) break;
                const int8_t *panel = weights + p * panel_size;
                const int64_t cols = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
                const int64_t next = paired_run_after(&run, p);
                PanelPrefetch pf = panel_prefetch(next >= 0 ? weights + next * panel_size : NULL, panel_size,
                                                  tiles * kp);
                if (wb != NULL) widen_panel(panel, kp, wb);
                for (int64_t t = 0; t < tiles; t++) {
                    const int64_t row = r0 + t * ROW_TILE;
                    const int mr = (int)(r0 + rows - row < ROW_TILE ? r0 + rows - row : ROW_TILE);
                    tile_dispatch(xb + row * 2 * kp, 2 * kp, kp, panel, wb, scales + p * PANEL,
                                  bias != NULL ? bias + p * PANEL : NULL, out + row * out_stride + p * PANEL,
                                  out_stride, mr, cols, &pf);
                }
            }
            free(wb);
        }
    }
    free(xb);
    return failed ? -1 : 0;
}

#else

int64_t kvmesh_linear_int8_available(void) { return 0; }

/* Not built for this CPU: the runner checks kvmesh_linear_int8_available() and never calls it. */
int kvmesh_linear_int8(const float *x, int64_t x_stride, int64_t m, int64_t k, const void *packed, int64_t n,
                       const float *bias, float *out, int64_t out_stride)
{
    (void)x; (void)x_stride; (void)m; (void)k; (void)packed; (void)n; (void)bias; (void)out; (void)out_stride;
    return -2;
}

#endif
