"""limit_blas_spin: OpenBLAS's idle-spin shortened at run time (see dpcore._threads)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import dpcore


def test_limit_blas_spin_keeps_blas_results_and_the_environment():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((300, 200)), rng.standard_normal((200, 250))
    before = a @ b
    env = os.environ.get("OPENBLAS_THREAD_TIMEOUT")
    changed = dpcore.limit_blas_spin()
    assert isinstance(changed, list) and all(isinstance(p, str) for p in changed)
    assert os.environ.get("OPENBLAS_THREAD_TIMEOUT") == env  # left as it was found
    # The workers were stopped; the next calls restart them and compute the same products.
    for _ in range(3):
        np.testing.assert_array_equal(a @ b, before)
    assert dpcore.limit_blas_spin(4) == changed  # the same libraries, again


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_limit_blas_spin_finds_numpys_openblas_when_it_is_a_pthreads_build():
    from dpcore._threads import _loaded_openblas, _pthreads_openblas

    np.ones((64, 64)) @ np.ones((64, 64))
    pthreads = [p for p in _loaded_openblas() if _pthreads_openblas(p) is not None]
    assert dpcore.limit_blas_spin() == pthreads


@pytest.mark.parametrize("bad", [3, 31, -1])
def test_limit_blas_spin_refuses_exponents_outside_openblas_range(bad):
    with pytest.raises(ValueError, match=r"\[4, 30\]"):
        dpcore.limit_blas_spin(bad)
