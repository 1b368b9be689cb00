/*
 * The GEMMs' software prefetch of a thread's next weight panel, spread over the k steps of the
 * current one (gemm.c, gemm_bf16.c): a decode step's weights stream from memory once per step,
 * and a few prefetched lines per k step hide that stream behind the FMAs (docs/model_runner.md).
 */
#ifndef KVMESH_PANEL_PREFETCH_H
#define KVMESH_PANEL_PREFETCH_H

#include <stdint.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

typedef struct {
    const char *next;  /* NULL: nothing to prefetch */
    int64_t line, lines, per;
} PanelPrefetch;

/* The prefetch of `bytes` at `next` (NULL: none) spread over `steps` calls of panel_prefetch_step. */
static inline PanelPrefetch panel_prefetch(const void *next, int64_t bytes, int64_t steps) {
    const int64_t lines = bytes / 64;
    PanelPrefetch p = {(const char *)next, 0, lines, steps > 0 ? (lines + steps - 1) / steps : lines};
    return p;
}

static inline void panel_prefetch_step(PanelPrefetch *p) {
    if (p->next == NULL) return;
    for (int64_t i = 0; i < p->per && p->line < p->lines; i++, p->line++)
        _mm_prefetch(p->next + p->line * 64, _MM_HINT_T1);
}

/* The same stream paced: one line every `every` calls of paced_prefetch_step, so a panel's lines
 * spread evenly over all of `steps` (AVX2 gemm.c: a decode chunk's every row tile, where a line
 * per k step over the first tile alone asked for twice the memory's pace and left it idle during
 * the other tiles). The hot loop keeps `line` and `countdown` in registers and writes them back
 * once per pass; `every` rounds up (at least 1), so the stream never runs past the panel. */
typedef struct {
    const char *line;  /* the next line to prefetch */
    int64_t countdown, every;
} PacedPrefetch;

static inline PacedPrefetch paced_prefetch(const void *next, int64_t bytes, int64_t steps) {
    const int64_t lines = bytes / 64;
    const int64_t every = next == NULL || lines == 0 || steps <= 0 ? INT64_MAX : (steps + lines - 1) / lines;
    PacedPrefetch p = {(const char *)next, every, every};
    return p;
}

/* One call of the paced stream, on the caller's register copies of `line` and `countdown`. */
static inline __attribute__((always_inline)) void paced_prefetch_step(const char **line, int64_t *countdown,
                                                                      int64_t every) {
    if (--*countdown == 0) {
        _mm_prefetch(*line, _MM_HINT_T1);
        *line += 64;
        *countdown = every;
    }
}

#endif
#endif
