"""Allocating the CPU KV pool's pages when the runner starts, in the background.

Why: the CPU pool is a sparse file in /dev/shm (``kv_pool._create_locked``), so the kernel
allocates and zeroes each of its pages the first time a step's K/V write reaches it, inside that
step. A suite's first full-size batch ran 10-15% slower than the next for that reason, the faults
in the K/V writes of the native kernels (docs/benchmarks.md, "Session 28"). vLLM zero-fills its
KV cache at start-up and pays the same cost before its first request.

How: ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14 and later) allocates every page of the mapping
as a write would, without changing a byte, so it is safe while steps already write the pool. It
runs in a daemon thread (ctypes releases the GIL for the call), so start-up does not wait for it:
a step that reaches a page first takes that one fault itself. Where the kernel lacks the advice
the pool stays sparse as before; where /dev/shm cannot hold the pool, the kernel answers EFAULT
(a SIGBUS had a step touched the page) and the log says so, where the step would have died.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time

import torch

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14+); the stdlib's mmap module does not name it on 3.11

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def populate(tensor: torch.Tensor) -> float:
    """Allocates every page under ``tensor``'s storage (a shared file mapping); seconds taken.

    Raises:
        OSError: the advice failed (``EINVAL``: a kernel without it; ``EFAULT``: the file system
            cannot hold the pages; ``ENOMEM``: out of memory).
    """
    start = time.perf_counter()
    addr = tensor.untyped_storage().data_ptr()
    nbytes = tensor.untyped_storage().nbytes()
    base = addr - addr % mmap.PAGESIZE
    if nbytes and _libc.madvise(base, nbytes + (addr - base), MADV_POPULATE_WRITE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return time.perf_counter() - start


def populate_in_background(tensor: torch.Tensor, what: str) -> threading.Thread:
    """Starts :func:`populate` on a daemon thread (which holds ``tensor``, so the mapping outlives
    a pool closed meanwhile) and logs its outcome; returns the started thread."""

    def run() -> None:
        try:
            seconds = populate(tensor)
        except OSError as exc:
            log.warning("%s: could not allocate its pages up front (%s); they are allocated as steps "
                        "first write them", what, exc)  # fmt: skip
            return
        log.info("%s: %d MiB allocated in %.2f s", what, tensor.untyped_storage().nbytes() >> 20, seconds)

    thread = threading.Thread(target=run, name="kvmesh-pool-populate", daemon=True)
    thread.start()
    return thread
