"""dpcore's PLD accountant vs dp_accounting's PLD accountant, side by side in one run (medians).

1. ε for the four runs of the tight-accounting issue (dp_accounting: PLDAccountant with
   value_discretization_interval 1e-4, pessimistic, connect the dots), with both ε values and
   dpcore's lower bound beside them.
2. Calibrating σ to ε = 1, δ = 1e-5, q = 0.004, 250 steps: dpcore.accounting.calibrate_noise_multiplier
   vs dp_accounting.mechanism_calibration.calibrate_dp_mechanism with its PLD accountant.
3. A ledger of 10⁵ steps in 100 distinct (q, σ) segments: its ε.
Prints the peak resident memory of the process at the end.

Run: python benches/bench_pld.py [--repeats N]
"""

import argparse
import functools
import resource
import statistics

from dp_accounting.pld import pld_privacy_accountant as P

import dpcore.accounting as A
from _accountants import dpa_calibrate, dpa_epsilon, dpcore_epsilon
from _timing import median_time_and_result

CASES = [(256 / 60000, 1.1, 2340, 1e-5), (0.001, 0.8, 1000, 1e-5), (0.01, 4.0, 10000, 1e-5), (1e-4, 0.8, 100000, 1e-6)]


# dp_accounting's PLD accountant as the comparison uses it
DPA_PLD = functools.partial(P.PLDAccountant, value_discretization_interval=1e-4)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    r = ap.parse_args().repeats
    print("1. epsilon, PLD (dp_accounting 1e-4 pessimistic vs dpcore default)")
    print(f"{'q':>10} {'z':>5} {'steps':>7} {'delta':>6} | {'RDP eps':>8} {'dpa eps':>8} {'dpcore':>8} {'lower':>8} | {'dpa ms':>8} {'ours ms':>8} {'ratio':>6}")
    ratios = []
    for q, z, t, d in CASES:
        ta, ea = median_time_and_result(lambda: dpa_epsilon(DPA_PLD, q, z, t, d), max(1, r // 2))
        to, eo = median_time_and_result(lambda: dpcore_epsilon(A.PldAccountant, q, z, t, d), r)
        a = A.PldAccountant().compose(A.PoissonSampledEvent(q, A.GaussianEvent(z)), t)
        lo, _ = a.get_epsilon_bounds(d)
        rdp = A.epsilon(q, z, t, d, accountant="rdp")
        ratios.append(ta / to)
        print(f"{q:10.3g} {z:5.2f} {t:7d} {d:6.0e} | {rdp:8.4f} {ea:8.4f} {eo:8.4f} {lo:8.4f} | {ta*1e3:8.1f} {to*1e3:8.1f} {ta/to:6.1f}"
              f"  (ours/dpa = {eo/ea:.5f})")
    print(f"median speed ratio: {statistics.median(ratios):.1f}x (target >= 20x)")

    print("\n2. calibrate sigma: eps=1, delta=1e-5, q=0.004, 250 steps")
    to, zo = median_time_and_result(lambda: A.calibrate_noise_multiplier(1.0, 1e-5, 0.004, 250), r)

    ta, za = median_time_and_result(lambda: dpa_calibrate(DPA_PLD, 0.004, 250, 1.0, 1e-5, 0.3, 1e-5), 1)
    print(f"dpcore z={zo:.5f} in {to:.3f} s; dp_accounting z={za:.5f} in {ta:.2f} s; ratio {ta/to:.1f}x "
          f"(targets: <= 0.5 s, >= 20x); RDP z={A.calibrate_noise_multiplier(1.0, 1e-5, 0.004, 250, accountant='rdp'):.5f}")

    print("\n3. ledger of 1e5 steps in 100 distinct (q, sigma) segments")

    def ledger():
        a = A.PldAccountant()
        for i in range(100):
            a.compose(A.PoissonSampledEvent(0.002 + 0.0001 * i, A.GaussianEvent(0.9 + 0.005 * i)), 1000)
        return a.get_epsilon(1e-5)

    tl, el = median_time_and_result(ledger, max(1, r // 2))
    print(f"eps={el:.4f} in {tl:.2f} s (target <= 2 s)")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\npeak resident memory of this process: {peak:.0f} MiB (includes dp_accounting and numpy)")


if __name__ == "__main__":
    main()
