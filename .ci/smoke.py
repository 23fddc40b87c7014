"""Smoke test of an installed dpcore wheel (run by .ci/wheel from outside the source tree).

Checks that the installed package (not the checkout) imports in under 0.3 s without importing a
framework, that `clip_noise` and `accounting.epsilon` work, that the kernels dispatch to the
widest SIMD tier the CPU has, and that the demo trains. Exits non-zero on any failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np

# import time: the fastest of five fresh interpreters (the first one also warms the disk cache)
code = "import sys, time; t = time.perf_counter(); import dpcore; dt = time.perf_counter() - t; " \
       "print(dt, any(m in sys.modules for m in ('torch', 'tensorflow', 'jax')))"
runs = []
for _ in range(5):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    runs.append(float(out[0]))
    assert out[1] == "False", "import dpcore imported a framework"
best = min(runs)
print(f"import dpcore: {best * 1e3:.0f} ms (best of 5; all: {', '.join(f'{r * 1e3:.0f}' for r in runs)} ms)")
assert best < 0.3, f"import dpcore took {best:.3f} s (limit 0.3 s)"

import dpcore  # noqa: E402
from dpcore import _core, accounting  # noqa: E402

here = os.path.dirname(os.path.abspath(dpcore.__file__))
assert "site-packages" in here, f"dpcore imported from {here}, not from the installed wheel"
print(f"dpcore {dpcore.__version__} from {here}")

# clip_noise: shapes, dtypes, and the clip bound with the noise switched off
rng = np.random.default_rng(0)
grads = [rng.standard_normal((64, 300, 20)).astype(np.float32), rng.standard_normal((64, 20)).astype(np.float32)]
out = dpcore.clip_noise(grads, l2_norm_clip=1.0, noise_multiplier=1.1, denominator=64.0)
assert [o.shape for o in out] == [(300, 20), (20,)] and all(o.dtype == np.float32 for o in out)
clipped, norms = dpcore.clip_sum(grads, 1.0)
total = np.sqrt(sum(float(np.sum(c.astype(np.float64) ** 2)) for c in clipped))
assert total <= 64.0 * (1 + 1e-6) and norms.shape == (64,), (total, norms.shape)
# a NaN record contributes zero by default (no crash that reveals it); "raise" names it
bad = np.ones((2, 3), np.float32)
bad[0, 1] = np.nan
(s,), _ = dpcore.clip_sum([bad], 1.0)
(ref,), _ = dpcore.clip_sum([bad[1:]], 1.0)
assert np.array_equal(s, ref), (s, ref)
try:
    dpcore.clip_noise([bad], 1.0, 1.0, on_nonfinite="raise")
except ValueError as e:
    assert "record 0" in str(e)
else:
    raise AssertionError("on_nonfinite='raise' accepted a NaN record")

# accounting: PLD ε against the value this release prints (q = 0.01, z = 1.1, 1000 steps)
eps = accounting.epsilon(0.01, 1.1, 1000, 1e-5)
assert 1.0 < eps < 1.8, eps
print(f"accounting.epsilon(q=0.01, z=1.1, 1000 steps, 1e-5) = {eps:.5f}")

# SIMD dispatch: the widest tier the CPU reports
flags = set()
with open("/proc/cpuinfo") as f:
    for line in f:
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
want = "avx512" if {"avx512f", "fma"} <= flags else "avx2" if {"avx2", "fma"} <= flags else "baseline"
tier = _core.simd_tier()
print(f"SIMD tier: {tier} (CPU flags say {want})")
assert tier == want, (tier, want)
t0 = time.perf_counter()
z = dpcore.gaussian_noise((10_000_000,), 1.0, dtype=np.float32)
dt = time.perf_counter() - t0
assert abs(float(z.std()) - 1.0) < 1e-3
print(f"gaussian_noise 1e7 float32: {dt * 1e3:.1f} ms")

# the demo (scikit-learn's digits)
r = subprocess.run([sys.executable, "-m", "dpcore", "demo"], capture_output=True, text=True, timeout=600)
print(r.stdout.strip())
assert r.returncode == 0, r.stderr[-2000:]
assert "test accuracy" in r.stdout and "DP" in r.stdout
print("smoke test passed")
