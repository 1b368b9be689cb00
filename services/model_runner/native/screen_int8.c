/*
 * The int8 head screens: every column's score in int8 dot products (head_screen.c's int8 entry
 * point, bf16 mode's head and fp32 mode's), llama.cpp's Q8_0 x Q8_0 arithmetic in groups of 32
 * along k.
 *
 * Why int8: bf16 mode's head already runs vdpbf16ps (2 k a lane per instruction), fp32 mode's FMAs
 * (1); vpdpbusd takes 4, so a score costs fewer instructions than the logit it screens. Why groups of 32 on both
 * sides: a trained model's final hidden states carry a few channels tens of times the others,
 * and one scale per row makes the step of every other channel coarse (docs/model_runner.md, "Greedy
 * heads screened": survivors a row median 918 with row scales, 2 with groups).
 *
 * Layout (model/head_screen.py packs): codes [ceil(n / 48)][kq][48][4] int8, kq = k padded to the
 * group / 4 (a 64-byte load = 16 columns x 4 k, vpdpbusd's operand); scale and offset
 * [ceil(n / 48)][groups][48] fp32, scale the group's step (its largest |w| / 127), offset 128 x
 * scale x the group's code sum. The row's codes are unsigned (code + 128, vpdpbusd's first
 * operand), so a group's integer dot D' = D + 128 sum(w codes), and scale x D' - offset is the
 * signed one's scale x D.
 *
 * Kernel: rows in tiles of 4, a tile x one panel = 12 int32 sums per group (zeroed each group) and
 * 12 fp32 sums across groups; each k quad three panel loads and four broadcasts for 12 vpdpbusd,
 * each group's end a convert, an FMA into the group's scale and offset and an FMA by the row's
 * group step. The score of a column is a function of its row and its codes alone (any tile, any
 * m), as the bound in head_screen.c needs nothing more.
 */
#include <stdint.h>
#include <string.h>

#include "screen_int8.h"

#define PANEL 48
#define ROW_TILE 4

int64_t kvmesh_screen_int8_group(void) { return SCREEN_GROUP; }

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#include <immintrin.h>

/* One row tile (mr rows) of the codes of x times one panel: scores out[r][0..cols). */
static inline __attribute__((always_inline)) void tile(const uint8_t *qx, int64_t kq, const float *sx,
                                                       int64_t groups, const int8_t *codes, const float *scale,
                                                       const float *offset, float *out, int64_t out_stride,
                                                       const int mr, int64_t cols)
{
    __m512 f[ROW_TILE][3];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 3; j++) f[r][j] = _mm512_setzero_ps();
    const int64_t quads = SCREEN_GROUP / 4;
    for (int64_t g = 0; g < groups; g++) {
        __m512i d[ROW_TILE][3];
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < 3; j++) d[r][j] = _mm512_setzero_si512();
        const int8_t *c = codes + g * quads * PANEL * 4;
        for (int64_t q = 0; q < quads; q++, c += PANEL * 4) {
            __m512i w0 = _mm512_loadu_si512(c), w1 = _mm512_loadu_si512(c + 64), w2 = _mm512_loadu_si512(c + 128);
            /* in registers: GCC would fold each load into every row's vpdpbusd, 12 loads a quad, not 3 */
            __asm__("" : "+v"(w0), "+v"(w1), "+v"(w2));
            for (int r = 0; r < mr; r++) {
                int32_t quad;
                memcpy(&quad, qx + r * kq + (g * quads + q) * 4, 4);
                const __m512i a = _mm512_set1_epi32(quad);
                d[r][0] = _mm512_dpbusd_epi32(d[r][0], a, w0);
                d[r][1] = _mm512_dpbusd_epi32(d[r][1], a, w1);
                d[r][2] = _mm512_dpbusd_epi32(d[r][2], a, w2);
            }
        }
        for (int j = 0; j < 3; j++) {
            const __m512 s = _mm512_loadu_ps(scale + g * PANEL + j * 16), o = _mm512_loadu_ps(offset + g * PANEL + j * 16);
            for (int r = 0; r < mr; r++) {
                const __m512 t = _mm512_fmsub_ps(s, _mm512_cvtepi32_ps(d[r][j]), o);
                f[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(sx[r * groups + g]), t, f[r][j]);
            }
        }
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 3; j++) {
            const int64_t left = cols - j * 16;
            if (left <= 0) break;
            const __mmask16 live = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
            _mm512_mask_storeu_ps(out + r * out_stride + j * 16, live, f[r][j]);
        }
}

void kvmesh_screen_int8_scores(const uint8_t *qx, int64_t m, int64_t kq, const float *sx, const int8_t *codes,
                               const float *scale, const float *offset, int64_t n, float *out, int64_t out_stride)
{
    const int64_t groups = kq / SCREEN_GROUP, panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const int8_t *c = codes + p * kq * PANEL;
        const float *s = scale + p * groups * PANEL, *o = offset + p * groups * PANEL;
        const int64_t cols = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
        /* mr a constant in each call, so tile() unrolls for it */
#define TILE_ROWS(mr) \
    tile(qx + r * kq, kq, sx + r * groups, groups, c, s, o, out + r * out_stride + p * PANEL, out_stride, mr, cols)
        int64_t r = 0;
        for (; r + ROW_TILE <= m; r += ROW_TILE) TILE_ROWS(ROW_TILE);
        switch (m - r) {
        case 3: TILE_ROWS(3); break;
        case 2: TILE_ROWS(2); break;
        case 1: TILE_ROWS(1); break;
        default: break;
        }
#undef TILE_ROWS
    }
}

#endif
