/*
 * The bf16 GEMMs on AMX tiles (Sapphire Rapids and later): kvmesh_linear_bf16 and
 * kvmesh_linear_bf16_swiglu (gemm_bf16.c) run these where kvmesh_linear_bf16_amx() is 1.
 *
 * Why: one TDPBF16PS multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 fp32 sums,
 * 16 times the work of a vdpbf16ps per instruction; the AVX512-BF16 kernel is bound by its
 * broadcasts and FMAs at batch and prefill sizes (docs/model_runner.md has the figures).
 *
 * Same packed weights, no repack: gemm_bf16.c's layout [ceil(n / 48)][kp][48][2] bf16 holds, for
 * 16 columns of a panel over 16 k pairs, exactly a B tile in the VNNI form TDPBF16PS takes (row =
 * one k pair, 16 columns x 2 bf16 = 64 bytes; rows 48 x 2 x 2 = 192 bytes apart). x is rounded to
 * bf16 as in gemm_bf16.c into xb [mp][2 kpp]: A tiles, 16 rows x 16 k pairs, rows 4 kpp bytes
 * apart. Tails: a lone last row tile of fewer than 16 rows is a shorter tile; the second row
 * tile of a 17-31-row block reads zero rows of xb past m (mp = m rounded up to 16) and drops
 * their sums; k pairs past kp are zero columns of xb (kpp = kp rounded up to 16) and zero rows of
 * a per-thread copy of the panel's last partial k tile (the panel itself ends there); columns
 * past n are the panel's zero columns.
 *
 * Batch invariance, by construction: each output is
 *     C = 0; for each k tile q in order: C = TDPBF16PS(C, A_q, B_q) (its 16 k pairs in order); C + b
 * and TDPBF16PS computes each element of C from its own row of A and column of B only, whatever
 * the other rows hold. The row tile a row lands in, the chunk, the thread, the blocking of tiles
 * (one or two row tiles per pass) change which sums run together, never any sum's terms or order.
 * The bits differ from the AVX512-BF16 kernel's (another order of fp32 additions), so a process
 * uses one kernel for every m and both entry points: decode rows (m = 1 included) must equal the
 * prefill rows of the same positions, and the fused SwiGLU must equal the GEMM + SwiGLU.
 *
 * Kernel: per panel, rows in blocks of two row tiles: 2 x 2 C tiles over the panel's first 32
 * columns (each A and B tile loaded once for two TDPBF16PS, every operand in its own tile
 * register), then 2 x 1 for its last 16; a last block of up to 16 rows takes one row tile x 3,
 * its C and A tiles configured as high as its live rows.
 * The C tiles are stored to a scratch and the bias added on the way out. At every row count the
 * next panel is prefetched (panel_prefetch.h) over the current one's k tiles: the weights come
 * from L3 or memory (a decode step's whole model, a prefill chunk's 3 MB gate_up), and the
 * hardware prefetcher alone left the tiles waiting on them (bench/gemm_bf16_amx.py,
 * docs/model_runner.md). A block of 2 row tiles x 3 column tiles sharing one A and one B tile
 * register measured no faster.
 *
 * Selection, once per process, when the object is loaded (a constructor): built with AMX
 * (-march=native on such a CPU defines __AMX_TILE__ / __AMX_BF16__), not disabled by
 * KVMESH_NATIVE_AMX=0, and Linux grants the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM,
 * process-wide). Deciding at load means no call can see another answer later in the process.
 * The tile configuration is per thread: each OpenMP thread loads it in each parallel region
 * before its first tile and releases the tiles at the region's end.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "gemm_bf16.h"
#include "kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__)

#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "exp_math.h"
#include "pairs.h"
#include "panel_prefetch.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define KT 16            /* k pairs per tile */
#define MT 16            /* rows per tile */
#define ROW_CHUNK 256    /* rows of xb per pass over the panels (their A tiles stay in L2) */
#define B_STRIDE (BF16_PANEL * 2 * 2)  /* bytes between a panel's k pairs */

static int amx_in_use;

__attribute__((constructor)) static void amx_select(void)
{
    const char *env = getenv("KVMESH_NATIVE_AMX");
    if (env != NULL && strcmp(env, "0") == 0) return;
    amx_in_use = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

int64_t kvmesh_linear_bf16_amx(void) { return amx_in_use; }

/* Tiles: 0-5 C (two row tiles x three column tiles), 6 A, 7 B; all 16 rows x 64 bytes. */

/* Loads the tile configuration for a block of `rows` rows unless this thread has it loaded
 * already (*current; 0: none): tiles 0-3 (the C and A tiles of a lone row tile) min(rows, 16)
 * rows high, the rest 16. A block of fewer than 16 rows (a decode batch of 1-15, a chunk's last
 * rows) then costs TDPBF16PS its live rows only; a row's sums are the same whatever the tile's
 * height. Loading zeroes every tile, so it happens between blocks only. */
static inline void tiles_rows(int *current, int64_t rows)
{
    const int want = rows < MT ? (int)rows : MT;
    if (*current == want) return;
    AmxTileConfig cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = (uint8_t)(t < 4 ? want : MT);
    }
    _tile_loadconfig(&cfg);
    *current = want;
}

/* One panel's B tile q: in the panel, or (q == the partial last one) in `tail`. */
static inline const uint16_t *b_tile(const uint16_t *panel, const uint16_t *tail, int64_t q, int64_t full)
{
    return q < full ? panel + q * KT * 2 * BF16_PANEL : tail;
}

/* C (one row tile, `ct` column tiles of the panel) = A (16 rows of xb) B, stored to c [16][48].
 * Tiles 0-2 C, 3 A, 4-6 B: no tile is reloaded while a TDPBF16PS may still read it. */
static void amx_rows16(const uint16_t *a, int64_t a_stride, int64_t ktiles, const uint16_t *panel,
                       const uint16_t *tail, int64_t full, int ct, float *c, PanelPrefetch *pf)
{
    _tile_zero(0); _tile_zero(1); _tile_zero(2);
    for (int64_t q = 0; q < ktiles; q++) {
        const uint16_t *b = b_tile(panel, tail, q, full);
        panel_prefetch_step(pf);
        _tile_loadd(3, a + q * 2 * KT, a_stride);
        _tile_loadd(4, b, B_STRIDE);
        _tile_dpbf16ps(0, 3, 4);
        if (ct > 1) { _tile_loadd(5, b + 32, B_STRIDE); _tile_dpbf16ps(1, 3, 5); }
        if (ct > 2) { _tile_loadd(6, b + 64, B_STRIDE); _tile_dpbf16ps(2, 3, 6); }
    }
    _tile_stored(0, c, BF16_PANEL * 4);
    if (ct > 1) _tile_stored(1, c + 16, BF16_PANEL * 4);
    if (ct > 2) _tile_stored(2, c + 32, BF16_PANEL * 4);
}

/* Two row tiles x two column tiles (tiles 0-3 C, 4-5 A, 6-7 B: every operand its own tile, each A
 * and B tile used twice), then the panel's third column tile for both row tiles (0-1 C). */
static void amx_rows32(const uint16_t *a, int64_t a_stride, int64_t ktiles, const uint16_t *panel,
                       const uint16_t *tail, int64_t full, int ct, float *c, PanelPrefetch *pf)
{
    const uint16_t *a1 = a + MT * (a_stride / 2);
    float *c1 = c + MT * BF16_PANEL;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t q = 0; q < ktiles; q++) {
        const uint16_t *b = b_tile(panel, tail, q, full);
        panel_prefetch_step(pf);
        _tile_loadd(4, a + q * 2 * KT, a_stride);
        _tile_loadd(6, b, B_STRIDE);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, a1 + q * 2 * KT, a_stride);
        _tile_dpbf16ps(2, 5, 6);
        if (ct > 1) {
            _tile_loadd(7, b + 32, B_STRIDE);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c, BF16_PANEL * 4);
    _tile_stored(2, c1, BF16_PANEL * 4);
    if (ct > 1) { _tile_stored(1, c + 16, BF16_PANEL * 4); _tile_stored(3, c1 + 16, BF16_PANEL * 4); }
    if (ct < 3) return;
    _tile_zero(0); _tile_zero(1);
    for (int64_t q = 0; q < ktiles; q++) {
        const uint16_t *b = b_tile(panel, tail, q, full);
        panel_prefetch_step(pf);
        _tile_loadd(4, a + q * 2 * KT, a_stride);
        _tile_loadd(6, b + 64, B_STRIDE);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, a1 + q * 2 * KT, a_stride);
        _tile_dpbf16ps(1, 5, 6);
    }
    _tile_stored(0, c + 32, BF16_PANEL * 4);
    _tile_stored(1, c1 + 32, BF16_PANEL * 4);
}

/* c [rows][48] + bias (NULL: none) -> out's first `cols` columns of `rows` rows. */
static void store_rows(const float *c, int64_t rows, int64_t cols, const float *bias, float *out, int64_t out_stride)
{
    for (int j = 0; j * 16 < cols; j++) {
        const int64_t left = cols - j * 16;
        const __mmask16 live = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
        const __m512 bv = bias != NULL ? _mm512_maskz_loadu_ps(live, bias + j * 16) : _mm512_setzero_ps();
        for (int64_t r = 0; r < rows; r++)
            _mm512_mask_storeu_ps(out + r * out_stride + j * 16, live,
                                  _mm512_add_ps(_mm512_loadu_ps(c + r * BF16_PANEL + j * 16), bv));
    }
}

/* The panel's partial last k tile (kp % 16 pairs), zero-padded to 16, into tail [16][48][2]. */
static void copy_tail(const uint16_t *panel, int64_t full, int64_t kp, uint16_t *tail)
{
    const int64_t pairs = kp - full * KT;
    memcpy(tail, panel + full * KT * 2 * BF16_PANEL, sizeof(uint16_t) * (size_t)(pairs * 2 * BF16_PANEL));
    memset(tail + pairs * 2 * BF16_PANEL, 0, sizeof(uint16_t) * (size_t)((KT - pairs) * 2 * BF16_PANEL));
}

typedef struct {
    const uint16_t *xb;
    int64_t kp, kpp, full, ktiles, panel_size;
} AmxShape;

/* x -> xb [mp][2 kpp], rows past m zero. NULL when the scratch cannot be had. */
static uint16_t *amx_round(const float *x, int64_t x_stride, int64_t m, int64_t k, AmxShape *s)
{
    s->kp = (k + 1) / 2;
    s->kpp = (s->kp + KT - 1) / KT * KT;
    s->full = s->kp / KT;
    s->ktiles = s->kpp / KT;
    s->panel_size = s->kp * 2 * BF16_PANEL;
    const int64_t mp = (m + MT - 1) / MT * MT, width = 2 * s->kpp;
    uint16_t *xb = aligned_alloc(64, sizeof(uint16_t) * (size_t)(mp * width));
    if (xb == NULL) return NULL;
    bf16_round_rows(x, x_stride, m, k, xb, width);
    memset(xb + m * width, 0, sizeof(uint16_t) * (size_t)((mp - m) * width));
    s->xb = xb;
    return xb;
}

/* Rows [row, row + rows) (rows <= 32; the xb rows up to the next multiple of 16 exist) times one
 * panel into c [32][48]. */
static inline void amx_block(const AmxShape *s, int64_t row, int64_t rows, const uint16_t *panel,
                             const uint16_t *tail, int ct, float *c, PanelPrefetch *pf, int *config)
{
    const uint16_t *a = s->xb + row * 2 * s->kpp;
    tiles_rows(config, rows);
    if (rows > MT) amx_rows32(a, 4 * s->kpp, s->ktiles, panel, tail, s->full, ct, c, pf);
    else amx_rows16(a, 4 * s->kpp, s->ktiles, panel, tail, s->full, ct, c, pf);
}

int kvmesh_amx_linear_bf16(const float *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                           const float *bias, float *out, int64_t out_stride)
{
    AmxShape s;
    uint16_t *xb = amx_round(x, x_stride, m, k, &s);
    if (xb == NULL) return -1;
    const int64_t panels = (n + BF16_PANEL - 1) / BF16_PANEL;
    for (int64_t r0 = 0; r0 < m; r0 += ROW_CHUNK) {
        const int64_t rows = m - r0 < ROW_CHUNK ? m - r0 : ROW_CHUNK;
        int64_t claimed[MAX_PAIRS] = {0};
        #pragma omp parallel if (panels > 1)
        {
            float c[2 * MT * BF16_PANEL] __attribute__((aligned(64)));
            uint16_t tail[KT * 2 * BF16_PANEL] __attribute__((aligned(64)));
            PairedRun run;
            paired_run_init(&run, panels, claimed);
            int config = 0;  /* the rows of this thread's loaded tile configuration; 0: none */
            for (int64_t taken = 0;; taken++) {
                const int64_t p = paired_run_take(&run, taken);
                if (p < 0) break;
                const uint16_t *panel = packed + p * s.panel_size;
                const int64_t cols = n - p * BF16_PANEL < BF16_PANEL ? n - p * BF16_PANEL : BF16_PANEL;
                const int ct = (int)((cols + 15) / 16);
                if (s.full < s.ktiles) copy_tail(panel, s.full, s.kp, tail);
                const int64_t next = paired_run_after(&run, p);
                PanelPrefetch pf = panel_prefetch(next >= 0 ? packed + next * s.panel_size : NULL,
                                                  s.panel_size * (int64_t)sizeof(uint16_t),
                                                  (rows + 2 * MT - 1) / (2 * MT) * s.ktiles);
                for (int64_t row = r0; row < r0 + rows; row += 2 * MT) {
                    const int64_t live = r0 + rows - row < 2 * MT ? r0 + rows - row : 2 * MT;
                    amx_block(&s, row, live, panel, tail, ct, c, &pf, &config);
                    store_rows(c, live, cols, bias != NULL ? bias + p * BF16_PANEL : NULL,
                               out + row * out_stride + p * BF16_PANEL, out_stride);
                }
            }
            if (config) _tile_release();
        }
    }
    free(xb);
    return 0;
}

int kvmesh_amx_linear_bf16_swiglu(const float *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *packed,
                                  int64_t inter, const float *bias, float *out, int64_t out_stride)
{
    AmxShape s;
    uint16_t *xb = amx_round(x, x_stride, m, k, &s);
    if (xb == NULL) return -1;
    const int64_t panels = inter / BF16_PANEL;
    for (int64_t r0 = 0; r0 < m; r0 += ROW_CHUNK) {
        const int64_t rows = m - r0 < ROW_CHUNK ? m - r0 : ROW_CHUNK;
        int64_t claimed[MAX_PAIRS] = {0};
        #pragma omp parallel if (panels > 1)
        {
            float gate[2 * MT * BF16_PANEL] __attribute__((aligned(64)));
            float up[2 * MT * BF16_PANEL] __attribute__((aligned(64)));
            uint16_t gtail[KT * 2 * BF16_PANEL] __attribute__((aligned(64)));
            uint16_t utail[KT * 2 * BF16_PANEL] __attribute__((aligned(64)));
            PairedRun run;
            paired_run_init(&run, panels, claimed);
            int config = 0;  /* the rows of this thread's loaded tile configuration; 0: none */
            for (int64_t taken = 0;; taken++) {
                const int64_t g = paired_run_take(&run, taken);
                if (g < 0) break;
                const uint16_t *gp = packed + g * s.panel_size, *upp = packed + (g + panels) * s.panel_size;
                if (s.full < s.ktiles) {
                    copy_tail(gp, s.full, s.kp, gtail);
                    copy_tail(upp, s.full, s.kp, utail);
                }
                const int64_t next = paired_run_after(&run, g), steps = (rows + 2 * MT - 1) / (2 * MT) * s.ktiles;
                const int64_t bytes = s.panel_size * (int64_t)sizeof(uint16_t);
                PanelPrefetch pg = panel_prefetch(next >= 0 ? packed + next * s.panel_size : NULL, bytes, steps);
                PanelPrefetch pu = panel_prefetch(next >= 0 ? packed + (next + panels) * s.panel_size : NULL, bytes,
                                                  steps);
                for (int64_t row = r0; row < r0 + rows; row += 2 * MT) {
                    const int64_t live = r0 + rows - row < 2 * MT ? r0 + rows - row : 2 * MT;
                    amx_block(&s, row, live, gp, gtail, 3, gate, &pg, &config);
                    amx_block(&s, row, live, upp, utail, 3, up, &pu, &config);
                    /* gate + bias and up + bias as kvmesh_linear_bf16 writes them, then the SwiGLU of
                     * kvmesh_silu_mul_f32: bitwise the unfused pair */
                    for (int j = 0; j < BF16_PANEL; j += 16) {
                        const __m512 gb = bias != NULL ? _mm512_loadu_ps(bias + g * BF16_PANEL + j) : _mm512_setzero_ps();
                        const __m512 ub = bias != NULL ? _mm512_loadu_ps(bias + inter + g * BF16_PANEL + j)
                                                       : _mm512_setzero_ps();
                        for (int64_t r = 0; r < live; r++)
                            _mm512_storeu_ps(out + (row + r) * out_stride + g * BF16_PANEL + j,
                                             silu_mul512(_mm512_add_ps(_mm512_loadu_ps(gate + r * BF16_PANEL + j), gb),
                                                         _mm512_add_ps(_mm512_loadu_ps(up + r * BF16_PANEL + j), ub)));
                    }
                }
            }
            if (config) _tile_release();
        }
    }
    free(xb);
    return 0;
}

#else

/* Built without AMX (another CPU, or the tests' -mno-amx-tile variant): the AVX512-BF16 kernel runs. */
int64_t kvmesh_linear_bf16_amx(void) { return 0; }

int kvmesh_amx_linear_bf16(const float *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                           const float *bias, float *out, int64_t out_stride)
{
    (void)x; (void)x_stride; (void)m; (void)k; (void)packed; (void)n; (void)bias; (void)out; (void)out_stride;
    return -2;
}

int kvmesh_amx_linear_bf16_swiglu(const float *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *packed,
                                  int64_t inter, const float *bias, float *out, int64_t out_stride)
{
    (void)x; (void)x_stride; (void)m; (void)k; (void)packed; (void)inter; (void)bias; (void)out; (void)out_stride;
    return -2;
}

#endif
