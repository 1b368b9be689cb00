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
 * bf16 as in gemm_bf16.c (bf16_round32) into xb, laid out as A tiles: [mp / 16][ktiles][16 rows]
 * [16 k pairs][2], each tile 1 KB contiguous, where a tile of row-major xb spans 16 rows 4 kpp
 * bytes apart (46 KB, twelve 4 KB pages, for a 1,536-wide x). Tails: a lone last row tile of fewer
 * than 16 rows is a shorter tile; the second row tile of a 17-31-row block reads zero rows of xb
 * past m (mp = m rounded up to 16) and drops their sums; k pairs past kp are zero columns of xb
 * (kpp = kp rounded up to 16) and zero rows of a per-thread copy of the panel's last partial k
 * tile (the panel itself ends there); columns past n are the panel's zero columns.
 *
 * Batch invariance, by construction: each output is
 *     C = 0; for each k tile q in order: C = TDPBF16PS(C, A_q, B_q) (its 16 k pairs in order); C + b
 * and TDPBF16PS computes each element of C from its own row of A and column of B only, whatever
 * the other rows hold. The row tile a row lands in, the chunk, the thread, the blocking of tiles
 * (which row and column tiles run together) change which sums run together, never any sum's terms
 * or order. The bits differ from the AVX512-BF16 kernel's (another order of fp32 additions), so a
 * process uses one kernel for every m and both entry points: decode rows (m = 1 included) must
 * equal the prefill rows of the same positions, and the fused SwiGLU must equal the GEMM + SwiGLU.
 *
 * Kernel: threads take panels two at a time (a unit; a lone last panel is a unit of one). A block
 * of 17-32 rows times a unit's two whole panels (96 columns, six column tiles) runs as three
 * 2 x 2 blocks, each with four C tiles, two A and two B tiles (every operand in its own tile
 * register, each loaded once for two TDPBF16PS); a block of up to 16 rows, or a lone or partial
 * panel, runs per panel: one row tile x its (up to) 3 column tiles, or two row tiles x two column
 * tiles then x one, its C and A tiles configured as high as its live rows. Without a bias, a
 * whole 32 x 96 block's C tiles are stored straight into out; otherwise into a scratch, the bias
 * added on the way out. At every row count the next unit is prefetched (panel_prefetch.h) over
 * the current one's k tiles: the weights come from L3 or memory (a decode step's whole model, a
 * prefill chunk's 3 MB gate_up), and the hardware prefetcher alone left the tiles waiting on them
 * (bench/gemm_bf16_amx.py, docs/model_runner.md has the figures of each choice).
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
#define A_TILE (MT * 2 * KT)  /* bf16 per A tile of xb */
#define ROW_CHUNK 512    /* rows of xb per pass over the panels (a 512-token chunk's A tiles, 1.5 MB at
                          * k = 1,536, stay in L2; the weights stream once per chunk) */
#define B_STRIDE (BF16_PANEL * 2 * 2)  /* bytes between a panel's k pairs */

static int amx_in_use;

__attribute__((constructor)) static void amx_select(void)
{
    const char *env = getenv("KVMESH_NATIVE_AMX");
    if (env != NULL && strcmp(env, "0") == 0) return;
    amx_in_use = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

int64_t kvmesh_linear_bf16_amx(void) { return amx_in_use; }

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

/* C (one row tile, `ct` column tiles of the panel) = A (the row tile's k tiles in xb) B, stored
 * to c [16][48]. Tiles 0-2 C, 3 A, 4-6 B: no tile is reloaded while a TDPBF16PS may still read it. */
static void amx_rows16(const uint16_t *a, int64_t ktiles, const uint16_t *panel, const uint16_t *tail, int64_t full,
                       int ct, float *c, PanelPrefetch *pf)
{
    _tile_zero(0); _tile_zero(1); _tile_zero(2);
    for (int64_t q = 0; q < ktiles; q++) {
        const uint16_t *b = b_tile(panel, tail, q, full);
        panel_prefetch_step(pf);
        _tile_loadd(3, a + q * A_TILE, 64);
        _tile_loadd(4, b, B_STRIDE);
        _tile_dpbf16ps(0, 3, 4);
        if (ct > 1) { _tile_loadd(5, b + 32, B_STRIDE); _tile_dpbf16ps(1, 3, 5); }
        if (ct > 2) { _tile_loadd(6, b + 64, B_STRIDE); _tile_dpbf16ps(2, 3, 6); }
    }
    _tile_stored(0, c, BF16_PANEL * 4);
    if (ct > 1) _tile_stored(1, c + 16, BF16_PANEL * 4);
    if (ct > 2) _tile_stored(2, c + 32, BF16_PANEL * 4);
}

/* One column tile: its panel, that panel's tail copy, its first column in the panel, and where its
 * sums go (rows c_stride floats apart). */
typedef struct {
    const uint16_t *panel, *tail;
    int col;
    float *c;
} ColTile;

/* Two row tiles (a, then ktiles A tiles on) x two column tiles: tiles 0-3 C, 4-5 A, 6-7 B, every
 * operand in its own tile, each A and B tile loaded once for two TDPBF16PS. */
static inline void amx_2x2(const uint16_t *a, int64_t ktiles, int64_t full, ColTile x, ColTile y, int64_t c_stride,
                           PanelPrefetch *pf)
{
    const uint16_t *a1 = a + ktiles * A_TILE;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t q = 0; q < ktiles; q++) {
        const uint16_t *bx = b_tile(x.panel, x.tail, q, full) + 2 * x.col, *by = b_tile(y.panel, y.tail, q, full) + 2 * y.col;
        panel_prefetch_step(pf);
        _tile_loadd(4, a + q * A_TILE, 64);
        _tile_loadd(6, bx, B_STRIDE);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, a1 + q * A_TILE, 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_loadd(7, by, B_STRIDE);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, x.c, c_stride * 4);
    _tile_stored(2, x.c + MT * c_stride, c_stride * 4);
    _tile_stored(1, y.c, c_stride * 4);
    _tile_stored(3, y.c + MT * c_stride, c_stride * 4);
}

/* Two row tiles x the first `ct` column tiles of one panel into c [32][48]: 2 x 2, then 2 x 1 for a
 * third (tiles 0-1 C, 4-5 A, 6 B). */
static void amx_rows32(const uint16_t *a, int64_t ktiles, const uint16_t *panel, const uint16_t *tail, int64_t full,
                       int ct, float *c, PanelPrefetch *pf)
{
    const ColTile t0 = {panel, tail, 0, c}, t1 = {panel, tail, 16, c + 16};
    if (ct > 1) amx_2x2(a, ktiles, full, t0, t1, BF16_PANEL, pf);
    const int last = ct > 1 ? 2 : 0;  /* the column tile left for 2 x 1 */
    if (ct == 2) return;
    const uint16_t *a1 = a + ktiles * A_TILE;
    _tile_zero(0); _tile_zero(1);
    for (int64_t q = 0; q < ktiles; q++) {
        const uint16_t *b = b_tile(panel, tail, q, full) + 32 * last;
        panel_prefetch_step(pf);
        _tile_loadd(4, a + q * A_TILE, 64);
        _tile_loadd(6, b, B_STRIDE);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, a1 + q * A_TILE, 64);
        _tile_dpbf16ps(1, 5, 6);
    }
    _tile_stored(0, c + 16 * last, BF16_PANEL * 4);
    _tile_stored(1, c + MT * BF16_PANEL + 16 * last, BF16_PANEL * 4);
}

/* 17-32 rows x a unit's two whole panels: three 2 x 2 blocks over its six column tiles; panel i's
 * sums go to c[i] [32][48] (rows c_stride floats apart). */
static void amx_pair32(const uint16_t *a, int64_t ktiles, int64_t full, const uint16_t *const panel[2],
                       const uint16_t *const tail[2], float *const c[2], int64_t c_stride, PanelPrefetch *pf)
{
    for (int j = 0; j < 6; j += 2) {
        const ColTile x = {panel[j / 3], tail[j / 3], 16 * (j % 3), c[j / 3] + 16 * (j % 3)};
        const ColTile y = {panel[(j + 1) / 3], tail[(j + 1) / 3], 16 * ((j + 1) % 3), c[(j + 1) / 3] + 16 * ((j + 1) % 3)};
        amx_2x2(a, ktiles, full, x, y, c_stride, pf);
    }
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
    int64_t kp, full, ktiles, panel_size;
} AmxShape;

/* x -> xb as A tiles (the layout above), rows past m zero. NULL when the scratch cannot be had. */
static uint16_t *amx_round(const float *x, int64_t x_stride, int64_t m, int64_t k, AmxShape *s)
{
    s->kp = (k + 1) / 2;
    s->full = s->kp / KT;
    s->ktiles = (s->kp + KT - 1) / KT;
    s->panel_size = s->kp * 2 * BF16_PANEL;
    const int64_t row_tiles = (m + MT - 1) / MT, tile_row = s->ktiles * A_TILE;
    uint16_t *xb = aligned_alloc(64, sizeof(uint16_t) * (size_t)(row_tiles * tile_row));
    if (xb == NULL) return NULL;
    for (int64_t r = 0; r < row_tiles * MT; r++) {
        uint16_t *dst = xb + (r / MT) * tile_row + (r % MT) * 2 * KT;
        for (int64_t q = 0; q < s->ktiles; q++) {
            if (r < m) bf16_round32(x + r * x_stride + q * 2 * KT, k - q * 2 * KT, dst + q * A_TILE);
            else memset(dst + q * A_TILE, 0, 2 * 2 * KT);
        }
    }
    s->xb = xb;
    return xb;
}

/* Rows [row, row + rows) (rows <= 32; the xb rows up to the next multiple of 16 exist) times one
 * panel's first `ct` column tiles into c [32][48]. */
static inline void amx_block(const AmxShape *s, int64_t row, int64_t rows, const uint16_t *panel,
                             const uint16_t *tail, int ct, float *c, PanelPrefetch *pf, int *config)
{
    const uint16_t *a = s->xb + row / MT * s->ktiles * A_TILE;
    tiles_rows(config, rows);
    if (rows > MT) amx_rows32(a, s->ktiles, panel, tail, s->full, ct, c, pf);
    else amx_rows16(a, s->ktiles, panel, tail, s->full, ct, c, pf);
}

/* A unit's panels (from `first`, `np` of them, of `panels`), their tail copies made, and its
 * next unit's prefetch spread over the k steps its rows [r0, r0 + rows) will take. */
typedef struct {
    const uint16_t *panel[2], *tail[2];
    int64_t np;
} Unit;

static Unit unit_at(const AmxShape *s, const uint16_t *packed, int64_t first, int64_t panels, uint16_t (*tails)[KT * 2 * BF16_PANEL])
{
    Unit u;
    u.np = first + 1 < panels ? 2 : 1;
    for (int64_t i = 0; i < 2; i++) {
        u.panel[i] = packed + (first + (i < u.np ? i : 0)) * s->panel_size;
        u.tail[i] = tails[i];
        if (i < u.np && s->full < s->ktiles) copy_tail(u.panel[i], s->full, s->kp, tails[i]);
    }
    return u;
}

/* k steps (panel_prefetch_step calls) of a unit's rows: per block of 32 rows, three 2 x 2 passes
 * where both panels are whole (`pairable`) and the block has more than 16 rows, else one per panel. */
static int64_t unit_steps(const AmxShape *s, int64_t rows, int64_t np, int pairable)
{
    int64_t steps = 0;
    for (int64_t row = 0; row < rows; row += 2 * MT) {
        const int64_t live = rows - row < 2 * MT ? rows - row : 2 * MT;
        const int pair = pairable && live > MT;
        steps += (pair ? 3 : np * (live > MT ? 2 : 1)) * s->ktiles;
    }
    return steps;
}

int kvmesh_amx_linear_bf16(const float *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                           const float *bias, float *out, int64_t out_stride)
{
    AmxShape s;
    uint16_t *xb = amx_round(x, x_stride, m, k, &s);
    if (xb == NULL) return -1;
    const int64_t panels = (n + BF16_PANEL - 1) / BF16_PANEL, units = (panels + 1) / 2;
    const int64_t unit_bytes = 2 * s.panel_size * (int64_t)sizeof(uint16_t);
    for (int64_t r0 = 0; r0 < m; r0 += ROW_CHUNK) {
        const int64_t rows = m - r0 < ROW_CHUNK ? m - r0 : ROW_CHUNK;
        int64_t claimed[MAX_PAIRS] = {0};
        #pragma omp parallel if (units > 1)
        {
            float c[2][2 * MT * BF16_PANEL] __attribute__((aligned(64)));
            uint16_t tails[2][KT * 2 * BF16_PANEL] __attribute__((aligned(64)));
            PairedRun run;
            paired_run_init(&run, units, claimed);
            int config = 0;  /* the rows of this thread's loaded tile configuration; 0: none */
            for (int64_t taken = 0;; taken++) {
                const int64_t un = paired_run_take(&run, taken);
                if (un < 0) break;
                const int64_t p0 = 2 * un;
                const Unit u = unit_at(&s, packed, p0, panels, tails);
                const int64_t cols = n - p0 * BF16_PANEL < u.np * BF16_PANEL ? n - p0 * BF16_PANEL : u.np * BF16_PANEL;
                const int pairable = cols == 2 * BF16_PANEL;
                const int64_t next = paired_run_after(&run, un);
                PanelPrefetch pf = panel_prefetch(next >= 0 ? packed + 2 * next * s.panel_size : NULL,
                                                  next >= 0 && 2 * next + 1 < panels ? unit_bytes : unit_bytes / 2,
                                                  unit_steps(&s, rows, u.np, pairable));
                for (int64_t row = r0; row < r0 + rows; row += 2 * MT) {
                    const int64_t live = r0 + rows - row < 2 * MT ? r0 + rows - row : 2 * MT;
                    float *dst = out + row * out_stride + p0 * BF16_PANEL;
                    if (pairable && live > MT) {
                        const uint16_t *a = s.xb + row / MT * s.ktiles * A_TILE;
                        tiles_rows(&config, live);
                        if (live == 2 * MT && bias == NULL) {  /* the sums are the outputs: into out directly */
                            float *const direct[2] = {dst, dst + BF16_PANEL};
                            amx_pair32(a, s.ktiles, s.full, u.panel, u.tail, direct, out_stride, &pf);
                            continue;
                        }
                        float *const scratch[2] = {c[0], c[1]};
                        amx_pair32(a, s.ktiles, s.full, u.panel, u.tail, scratch, BF16_PANEL, &pf);
                    }
                    for (int64_t i = 0; i < u.np; i++) {
                        const int64_t pc = cols - i * BF16_PANEL < BF16_PANEL ? cols - i * BF16_PANEL : BF16_PANEL;
                        if (!(pairable && live > MT))
                            amx_block(&s, row, live, u.panel[i], u.tail[i], (int)((pc + 15) / 16), c[i], &pf, &config);
                        store_rows(c[i], live, pc, bias != NULL ? bias + (p0 + i) * BF16_PANEL : NULL,
                                   dst + i * BF16_PANEL, out_stride);
                    }
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
    const int64_t panels = inter / BF16_PANEL, units = (panels + 1) / 2;
    const int64_t unit_bytes = 2 * s.panel_size * (int64_t)sizeof(uint16_t);
    for (int64_t r0 = 0; r0 < m; r0 += ROW_CHUNK) {
        const int64_t rows = m - r0 < ROW_CHUNK ? m - r0 : ROW_CHUNK;
        int64_t claimed[MAX_PAIRS] = {0};
        #pragma omp parallel if (units > 1)
        {
            float gate[2][2 * MT * BF16_PANEL] __attribute__((aligned(64)));
            float up[2][2 * MT * BF16_PANEL] __attribute__((aligned(64)));
            uint16_t gtails[2][KT * 2 * BF16_PANEL] __attribute__((aligned(64)));
            uint16_t utails[2][KT * 2 * BF16_PANEL] __attribute__((aligned(64)));
            PairedRun run;
            paired_run_init(&run, units, claimed);
            int config = 0;  /* the rows of this thread's loaded tile configuration; 0: none */
            for (int64_t taken = 0;; taken++) {
                const int64_t un = paired_run_take(&run, taken);
                if (un < 0) break;
                const int64_t g0 = 2 * un;
                const Unit ug = unit_at(&s, packed, g0, panels, gtails);
                const Unit uu = unit_at(&s, packed + panels * s.panel_size, g0, panels, utails);
                const int64_t next = paired_run_after(&run, un), steps = unit_steps(&s, rows, ug.np, ug.np == 2);
                const int64_t next_bytes = next >= 0 && 2 * next + 1 < panels ? unit_bytes : unit_bytes / 2;
                PanelPrefetch pg = panel_prefetch(next >= 0 ? packed + 2 * next * s.panel_size : NULL, next_bytes, steps);
                PanelPrefetch pu = panel_prefetch(next >= 0 ? packed + (2 * next + panels) * s.panel_size : NULL,
                                                  next_bytes, steps);
                for (int64_t row = r0; row < r0 + rows; row += 2 * MT) {
                    const int64_t live = r0 + rows - row < 2 * MT ? r0 + rows - row : 2 * MT;
                    if (ug.np == 2 && live > MT) {
                        const uint16_t *a = s.xb + row / MT * s.ktiles * A_TILE;
                        float *const gc[2] = {gate[0], gate[1]}, *const uc[2] = {up[0], up[1]};
                        tiles_rows(&config, live);
                        amx_pair32(a, s.ktiles, s.full, ug.panel, ug.tail, gc, BF16_PANEL, &pg);
                        amx_pair32(a, s.ktiles, s.full, uu.panel, uu.tail, uc, BF16_PANEL, &pu);
                    } else {
                        for (int64_t i = 0; i < ug.np; i++) {
                            amx_block(&s, row, live, ug.panel[i], ug.tail[i], 3, gate[i], &pg, &config);
                            amx_block(&s, row, live, uu.panel[i], uu.tail[i], 3, up[i], &pu, &config);
                        }
                    }
                    /* gate + bias and up + bias as kvmesh_linear_bf16 writes them, then the SwiGLU of
                     * kvmesh_silu_mul_f32: bitwise the unfused pair */
                    for (int64_t i = 0; i < ug.np; i++) {
                        const int64_t col = (g0 + i) * BF16_PANEL;
                        for (int j = 0; j < BF16_PANEL; j += 16) {
                            const __m512 gb = bias != NULL ? _mm512_loadu_ps(bias + col + j) : _mm512_setzero_ps();
                            const __m512 ub = bias != NULL ? _mm512_loadu_ps(bias + inter + col + j) : _mm512_setzero_ps();
                            for (int64_t r = 0; r < live; r++)
                                _mm512_storeu_ps(out + (row + r) * out_stride + col + j,
                                                 silu_mul512(_mm512_add_ps(_mm512_loadu_ps(gate[i] + r * BF16_PANEL + j), gb),
                                                             _mm512_add_ps(_mm512_loadu_ps(up[i] + r * BF16_PANEL + j), ub)));
                        }
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
