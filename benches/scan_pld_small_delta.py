"""dpcore's certified PLD ε in the small-δ, many-step regime against Microsoft's PRV accountant
(prv-accountant, Gopi, Lee, Wutschitz 2021), side by side in one run.

The grid of issue 51: δ ∈ {1e-9, 1e-11, 1e-14}, T ∈ {1e4, 1e5, 1e6}, σ ∈ {0.3, 0.8, 2}, q ∈ {1e-5,
1e-3, 1e-2}; a Latin-square subset of 27 runs by default (--all: all 81). For each: dpcore's ε (an
upper bound, rounding included), PRV's certified lower bound, estimate and upper bound (eps_error
0.01·ε-scale, delta_error δ/1000), the ratio of dpcore to PRV's estimate, and whether dpcore is at or
above PRV's lower bound (it must be). Runs where PRV fails or is refused are reported as such.

Run: pip install ".[bench]" (it holds prv-accountant); python benches/scan_pld_small_delta.py [--all]
"""

import argparse
import itertools
import time

import dpcore.accounting as A

DELTAS = [1e-9, 1e-11, 1e-14]
STEPS = [10_000, 100_000, 1_000_000]
SIGMAS = [0.3, 0.8, 2.0]
QS = [1e-5, 1e-3, 1e-2]


def prv(q, sigma, steps, delta, eps_error):
    from prv_accountant import PRVAccountant
    from prv_accountant.privacy_random_variables import PoissonSubsampledGaussianMechanism

    m = PoissonSubsampledGaussianMechanism(noise_multiplier=sigma, sampling_probability=q)
    acc = PRVAccountant(prvs=[m], max_self_compositions=[steps], eps_error=eps_error, delta_error=delta / 1000)
    return acc.compute_epsilon(delta=delta, num_self_compositions=[steps])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--all", action="store_true")
    runs = list(itertools.product(range(3), repeat=4))
    if not ap.parse_args().all:  # a Latin square: every pair of levels of two axes once per third
        runs = [r for r in runs if (r[0] + r[1] + r[2] + r[3]) % 3 == 0]
    print(f"{'q':>7} {'sigma':>5} {'steps':>8} {'delta':>7} | {'dpcore':>10} {'ms':>7} | {'PRV low':>10} {'PRV est':>10} {'PRV up':>10} {'s':>5} | ratio  >= low")
    worst, below = 0.0, 0
    for i, j, k, l in runs:
        d, t, s, q = DELTAS[i], STEPS[j], SIGMAS[k], QS[l]
        t0 = time.perf_counter()
        e = A.epsilon(q, s, t, d)
        ms = (time.perf_counter() - t0) * 1e3
        t1 = time.perf_counter()
        try:
            lo, est, up = prv(q, s, t, d, max(1e-3, 0.002 * e))
        except Exception as exc:  # noqa: BLE001 (reported, the scan goes on)
            print(f"{q:7.0e} {s:5.1f} {t:8d} {d:7.0e} | {e:10.5f} {ms:7.1f} | PRV failed: {type(exc).__name__}: {exc}")
            continue
        ps = time.perf_counter() - t1
        ok = e >= lo
        below += not ok
        ratio = e / est if est > 0 else float("nan")
        if est > 1e-3:
            worst = max(worst, ratio)
        print(f"{q:7.0e} {s:5.1f} {t:8d} {d:7.0e} | {e:10.5f} {ms:7.1f} | {lo:10.5f} {est:10.5f} {up:10.5f} {ps:5.1f} | {ratio:.5f} {'yes' if ok else 'NO'}")
    print(f"worst ratio dpcore / PRV estimate (where ε > 1e-3): {worst:.5f}; runs below PRV's lower bound: {below}")


if __name__ == "__main__":
    main()
