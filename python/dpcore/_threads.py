"""Keep OpenBLAS's idle worker threads off the cores that dpcore's threads need.

Why: OpenBLAS built with its own pthreads server (numpy's and scipy's wheels are) does not put a
worker to sleep when a BLAS call ends. The worker busy-waits for a new job for 2**28 timestamp
cycles (``THREAD_TIMEOUT`` in OpenBLAS's ``driver/others/blas_server.c``): about 0.1 s at 2.6
GHz, measured here as 95-105 ms of CPU burned after every call. In a numpy training loop that
calls ``clip_noise`` right after a matrix product, those spinning workers hold cores that
dpcore's rayon threads need, and the clip (whose threads meet at a barrier every few rows) runs
1.5-2× slower (``benches/bench_blas.py``).

The spin is set by ``OPENBLAS_THREAD_TIMEOUT=n`` (a spin of 2**n cycles, n clamped to 4..30),
which OpenBLAS reads when it is loaded, i.e. at ``import numpy``. Setting it in the environment
before Python starts is the cleanest remedy. :func:`limit_blas_spin` applies the same setting
to an OpenBLAS that is already loaded: it sets the variable, has OpenBLAS re-read its
environment (``openblas_read_env``) and stops its worker threads (``blas_thread_shutdown_``, the
routine OpenBLAS itself runs around ``fork``); the next BLAS call starts them again with the new
timeout. The thread count, and any limits set with threadpoolctl, are kept.

The price of a short spin is a wake-up (a futex signal, ~10-15 µs measured here) at the start
of each multithreaded BLAS call that finds its workers asleep; for BLAS calls of a millisecond
or more it is lost in the noise.

Not covered: OpenBLAS built with OpenMP, and torch's OpenMP pool (libgomp), whose threads spin
for ``GOMP_SPINCOUNT`` iterations (300 000 by default) after each parallel region. libgomp reads
that only when it is loaded, so no call can change it afterwards: set ``GOMP_SPINCOUNT=10000``
before importing torch (``OMP_WAIT_POLICY=passive`` works as well but costs every torch
parallel region a wake-up, ~80-100 µs measured here).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from typing import List, Optional

__all__ = ["limit_blas_spin"]

# openblas_get_parallel: 0 sequential, 1 pthreads server, 2 OpenMP. Its name carries the build's
# symbol prefix and suffix (numpy's wheels: scipy_openblas_get_parallel64_).
_GET_PARALLEL = [
    "openblas_get_parallel",
    "openblas_get_parallel64_",
    "openblas_get_parallel_64_",
    "scipy_openblas_get_parallel64_",
    "scipy_openblas_get_parallel_64_",
    "scipy_openblas_get_parallel",
]
_lock = threading.Lock()


def _loaded_openblas() -> List[str]:
    """Paths of the OpenBLAS libraries mapped into this process (Linux: /proc/self/maps)."""
    paths: List[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split(maxsplit=5)
                if len(p) == 6:
                    path = p[5].strip()
                    if "openblas" in os.path.basename(path).lower() and ".so" in path and path not in paths:
                        paths.append(path)
    except OSError:
        pass
    return paths


def _pthreads_openblas(path: str) -> Optional[ctypes.CDLL]:
    """The loaded library at ``path`` when it is a pthreads OpenBLAS with the entry points used."""
    try:
        # RTLD_NOLOAD: a handle to the copy already loaded, never a second load.
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None
    for name in ("openblas_read_env", "blas_thread_shutdown_"):
        if not hasattr(lib, name):
            return None
    for name in _GET_PARALLEL:
        if hasattr(lib, name):
            get = getattr(lib, name)
            get.restype = ctypes.c_int
            return lib if get() == 1 else None
    return None


def limit_blas_spin(exponent: int = 20) -> List[str]:
    """Make OpenBLAS's idle workers sleep 2**exponent cycles after a call instead of 2**28.

    Returns the paths of the OpenBLAS libraries changed (pthreads builds only; an empty list on
    other platforms, or when numpy's BLAS is not OpenBLAS). Equivalent to starting Python with
    ``OPENBLAS_THREAD_TIMEOUT=<exponent>``, and without effect on OpenBLAS libraries loaded
    later (those read the environment variable, which this call leaves as it found it).

    ``exponent`` is clamped by OpenBLAS to 4..30. The default, 20, is about 0.4 ms at 2.6 GHz:
    back-to-back BLAS calls keep their workers awake, and a worker is asleep a fraction of a
    millisecond into a following ``clip_noise``. 4 parks at once (at a wake-up per BLAS call).

    Call it once, at start-up: it stops and restarts OpenBLAS's worker threads, so no other
    thread may be inside a BLAS call while it runs (numpy releases the GIL during BLAS).
    """
    n = int(exponent)
    if not 4 <= n <= 30:
        raise ValueError(f"exponent must be in [4, 30] (OpenBLAS's range), got {exponent}")
    if not sys.platform.startswith("linux"):
        return []
    changed: List[str] = []
    with _lock:
        old = os.environ.get("OPENBLAS_THREAD_TIMEOUT")
        os.environ["OPENBLAS_THREAD_TIMEOUT"] = str(n)
        try:
            for path in _loaded_openblas():
                lib = _pthreads_openblas(path)
                if lib is None:
                    continue
                lib.openblas_read_env()  # caches OPENBLAS_THREAD_TIMEOUT (and the thread-count variables, unchanged)
                lib.blas_thread_shutdown_()  # the next BLAS call restarts the workers with the new timeout
                changed.append(path)
        finally:
            if old is None:
                del os.environ["OPENBLAS_THREAD_TIMEOUT"]
            else:
                os.environ["OPENBLAS_THREAD_TIMEOUT"] = old
    return changed
