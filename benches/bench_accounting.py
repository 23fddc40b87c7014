"""dpcore.accounting vs Google's dp_accounting, side by side in one run (medians).

1. One ε evaluation at (q, z, steps, δ) with the default orders (both libraries use the same
   grid): fresh accountant, compose, get_epsilon.
2. Noise-multiplier calibration to 1e-6 relative: dpcore.accounting.calibrate_noise_multiplier
   vs dp_accounting.mechanism_calibration.calibrate_dp_mechanism (tol = 1e-6 · result).

Run: python benches/bench_accounting.py [--repeats N]
"""

import argparse
import statistics

from dp_accounting.rdp import rdp_privacy_accountant as R

import dpcore.accounting as A
from _accountants import dpa_calibrate, dpa_epsilon, dpcore_epsilon
from _timing import median_time

CASES = [(0.01, 1.1, 1000, 1e-5), (0.04, 1.5, 2250, 1e-5), (0.001, 0.8, 10**5, 1e-6), (1e-4, 5.0, 10**4, 1e-5)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    r = args.repeats
    print("1) one epsilon evaluation, default orders (median ms)")
    print(f"{'q':>8} {'z':>5} {'steps':>7} {'delta':>6} | {'dpcore':>8} {'dp_acc':>8} {'ratio':>6} | eps dpcore / dp_accounting")
    ratios = []
    for q, z, steps, delta in CASES:
        dpcore_epsilon(A.RdpAccountant, q, z, steps, delta)  # warm-up
        t_o = median_time(lambda: dpcore_epsilon(A.RdpAccountant, q, z, steps, delta), r)
        t_t = median_time(lambda: dpa_epsilon(R.RdpAccountant, q, z, steps, delta), max(3, r // 3))
        ratios.append(t_t / t_o)
        print(
            f"{q:>8g} {z:>5g} {steps:>7d} {delta:>6g} | {t_o * 1e3:>8.3f} {t_t * 1e3:>8.2f} {t_t / t_o:>6.1f} | "
            f"{dpcore_epsilon(A.RdpAccountant, q, z, steps, delta):.6f} / {dpa_epsilon(R.RdpAccountant, q, z, steps, delta):.6f}"
        )
    print(f"   median speed-up: {statistics.median(ratios):.1f}x (target >= 30x)")

    print("2) noise-multiplier calibration to 1e-6 relative (median ms)")
    print(f"{'q':>8} {'steps':>7} {'eps':>4} | {'dpcore':>8} {'dp_acc':>9} {'ratio':>6} | z dpcore / dp_accounting")
    ratios = []
    for q, steps, eps, delta in [(0.01, 1000, 2.0, 1e-5), (0.04, 2250, 8.0, 1e-5), (0.001, 10**5, 1.0, 1e-6)]:
        z_o = A.calibrate_noise_multiplier(eps, delta, q, steps, accountant="rdp")
        t_o = median_time(lambda: A.calibrate_noise_multiplier(eps, delta, q, steps, accountant="rdp"), r)
        tol = 1e-6 * z_o
        t_t = median_time(lambda: dpa_calibrate(R.RdpAccountant, q, steps, eps, delta, 0.0, tol), 3)
        z_t = dpa_calibrate(R.RdpAccountant, q, steps, eps, delta, 0.0, tol)
        ratios.append(t_t / t_o)
        print(f"{q:>8g} {steps:>7d} {eps:>4g} | {t_o * 1e3:>8.2f} {t_t * 1e3:>9.1f} {t_t / t_o:>6.1f} | {z_o:.7f} / {z_t:.7f}")
    print(f"   median speed-up: {statistics.median(ratios):.1f}x (target >= 30x)")


if __name__ == "__main__":
    main()
