/*
 * The software prefetch of the decode kernels (paged_decode.c, attention_amx.c): a sequence's
 * blocks are scattered over the pool, and the hardware prefetcher, which stops at 4 KB pages,
 * restarts at every block, so the next block's lines are prefetched while the current one is
 * used, a share per unit of work (all at once they queue behind each other: docs/model_runner.md).
 */
#ifndef KVMESH_KV_PREFETCH_H
#define KVMESH_KV_PREFETCH_H

#include <stdint.h>

#include "kv_elem.h"

#if defined(__AVX512F__) || KVM_AVX2
#include <immintrin.h>

/* Spreads the prefetch of one block's cache lines over `steps` units of work on the block before
 * it: `prefetch_step` issues the next share each time it is called. */
typedef struct {
    const char *line, *end;  /* the next line to prefetch and the block's end (both NULL: nothing) */
    int64_t share;           /* bytes a step prefetches: whole lines */
} Prefetcher;

static inline Prefetcher prefetcher(const char *next, int64_t bytes, int64_t steps) {
    const int64_t lines = bytes / 64;
    Prefetcher p = {next, next != NULL ? next + lines * 64 : NULL, (lines + steps - 1) / steps * 64};
    /* now, the first line of each later 4 KB page of the block: their address translations (a
     * TLB miss each, the pool on 4 KB pages) start at once instead of as the spread reaches them
     * (docs/model_runner.md, "Decode attention's prefetch distance") */
    if (next != NULL)
        for (int64_t off = 4096 - (int64_t)((uintptr_t)next & 4095); off < bytes; off += 4096)
            _mm_prefetch(next + off, _MM_HINT_T1);
    return p;
}

/* The first block of a pass has nothing before it to hide behind: all its lines at once. */
static inline void prefetch_block(const char *base, int64_t bytes) {
    const char *p = base;
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

/* Where the spread prefetch puts the next block's lines. On AMD (KVMESH_KV_PREFETCH_L2, set by the
 * loader from the vendor) L2: on a Zen 4, fills into L1 evicted the lines the current block was
 * being read from, and cost even with the K/V in cache; Zen 3 fills L1 whatever the hint.
 * Elsewhere L1, as measured first (an early run found L2 no better). The figures:
 * docs/model_runner.md, "Decode attention's prefetch on AMD". */
#if defined(KVMESH_KV_PREFETCH_L2)
#define KV_PREFETCH_HINT _MM_HINT_T1
#else
#define KV_PREFETCH_HINT _MM_HINT_T0
#endif

/* A block of at most this many bytes is prefetched two blocks ahead, larger ones one ahead
 * (paged_decode.c's AVX-512 path): on a Zen 5 two ahead paid for a bf16 SmolLM2 block (6 KB) and
 * not for an fp32 one (12 KB), three or four ahead for neither (docs/model_runner.md, "Decode
 * attention's prefetch distance"). */
#define KV_PREFETCH_SMALL_BLOCK 8192

static inline __attribute__((always_inline)) void prefetch_step(Prefetcher *p) {
    const char *line = p->line, *end = p->end;
    if (line >= end) return;
    const char *stop = end - line > p->share ? line + p->share : end;
    for (; line < stop; line += 64) _mm_prefetch(line, KV_PREFETCH_HINT);
    p->line = line;
}

#endif

#endif
