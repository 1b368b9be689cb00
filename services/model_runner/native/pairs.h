/*
 * How the kernels split a list of work items (GEMM panels, decode sequences) over an OpenMP team.
 *
 * Threads 2i and 2i+1 share the i-th contiguous run of items, one taking them from the front,
 * the other from the back, until they meet. Each thread knows its next item (the one after, or
 * before), so it can prefetch it while working on the current one, which a dynamic schedule
 * cannot promise; and unlike static halves, a thread slowed by another tenant on its core does
 * not leave its partner idle at the end. An odd last thread, or every thread of a team larger
 * than 2 * MAX_PAIRS, has a run to itself.
 */
#ifndef KVMESH_PAIRS_H
#define KVMESH_PAIRS_H

#include <stdint.h>
#include <omp.h>

#define MAX_PAIRS 64

typedef struct {
    int64_t lo, hi;  /* the run: items [lo, hi) */
    int backward;    /* this thread takes items from hi down */
    int64_t *claim;  /* items taken from the run so far, by both threads */
    int64_t solo;    /* the counter of a run with one thread */
} PairedRun;

/* Call inside the parallel region. `claimed`: MAX_PAIRS zeroed counters shared by the team. */
static inline void paired_run_init(PairedRun *r, int64_t items, int64_t *claimed)
{
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    const int paired = threads <= 2 * MAX_PAIRS;
    const int64_t runs = paired ? (threads + 1) / 2 : threads, run = paired ? me / 2 : me;
    r->lo = items * run / runs;
    r->hi = items * (run + 1) / runs;
    r->backward = paired && (me & 1);
    r->solo = 0;
    r->claim = paired ? &claimed[run] : &r->solo;
}

/* This thread's `taken`-th item (taken counts from 0), or -1 when the run is used up. */
static inline int64_t paired_run_take(PairedRun *r, int64_t taken)
{
    if (__atomic_fetch_add(r->claim, 1, __ATOMIC_RELAXED) >= r->hi - r->lo) return -1;
    return r->backward ? r->hi - 1 - taken : r->lo + taken;
}

/* The item this thread takes after `item` unless its partner gets there first; -1 past the run. */
static inline int64_t paired_run_after(const PairedRun *r, int64_t item)
{
    const int64_t next = r->backward ? item - 1 : item + 1;
    return next >= r->lo && next < r->hi ? next : -1;
}

#endif
