/*
 * The calling thread's OpenMP team: its size, and each member bound to one CPU.
 *
 * Why: OpenMP's thread count is a per-thread setting, and every thread that opens a parallel
 * region gets its own team. The model-runner runs all its steps on one compute thread
 * (compute_thread.py) and sizes and binds that thread's team once: the team's member i is the
 * same OS thread in every later region of that thread (libgomp keeps a thread pool per master
 * and hands out its threads in order), so each kernel's thread stays on its CPU and keeps its
 * caches, instead of the OS moving it whenever another process wakes up (docs/model_runner.md,
 * "The compute thread and its CPUs").
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdint.h>
#include <omp.h>

#include "kernels.h"

/* The threads a parallel region opened by the calling thread gets (its nthreads ICV). */
int64_t kvmesh_team_size(void) { return omp_get_max_threads(); }

/* Opens a team of n threads and binds member i to cpus[i]. Returns 0, or -1 when the team came
 * out smaller than n or a CPU could not be set (the members bound before stay bound). */
int kvmesh_bind_team(const int64_t *cpus, int64_t n)
{
    int failed = 0;
    #pragma omp parallel num_threads((int)n) reduction(|| : failed)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET((int)cpus[omp_get_thread_num()], &set);
        failed = omp_get_num_threads() != n || sched_setaffinity(0, sizeof set, &set) != 0;
    }
    return failed ? -1 : 0;
}
