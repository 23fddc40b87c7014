"""dpcore.accounting vs Google's dp_accounting, side by side in one run (medians).

1. One ε evaluation at (q, z, steps, δ) with the default orders (both libraries use the same
   grid): fresh accountant, compose, get_epsilon.
2. Noise-multiplier calibration to 1e-6 relative: dpcore.accounting.calibrate_noise_multiplier
   vs dp_accounting.mechanism_calibration.calibrate_dp_mechanism (tol = 1e-6 · result).
3. The samplers' and tuning events: time per ε and per noise calibration (1e-5 relative), with
   dp_accounting beside where it analyses the same event (truncated Poisson under PLD,
   repeat-and-select under RDP); balls-in-bins and random allocation have no anchor there (the
   authors' `random_allocation` package pins numpy < 2.2), so Poisson's PLD time is the row
   they are compared with.

Run: python benches/bench_accounting.py [--repeats N]
"""

import argparse
import math
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
    samplers(max(3, r // 3))


def samplers(r):
    import dp_accounting as dpa
    from dp_accounting.pld import pld_privacy_accountant as P

    n, q, z, steps, delta, eps = 60000, 0.01, 1.0, 1000, 1e-5, 2.0
    print(f"3) samplers and tuning: n = {n}, q = {q}, z = {z}, {steps} steps, δ = {delta} (median ms; calibration to ε = {eps})")
    print(f"{'event':<42} | {'eps':>9} {'ms/eps':>8} {'ms/calib':>9} | {'dp_acc eps':>10} {'ms/eps':>8} {'ratio':>6}")

    def row(name, acct, event_at, dpa_event=None, dpa_acct=None, **kw):
        ev = event_at(z)
        e = A.make_accountant(acct).compose(ev).get_epsilon(delta)
        t = median_time(lambda: A.make_accountant(acct).compose(event_at(z)).get_epsilon(delta), r)
        tc = median_time(lambda: A.calibrate_sampler_noise(eps, delta, kw["sampler"], steps, accountant=acct, **kw["skw"]), max(1, r // 3)) if "sampler" in kw else math.nan
        line = f"{name:<42} | {e:>9.5f} {t * 1e3:>8.1f} {tc * 1e3:>9.0f} |"
        if dpa_event is not None:
            def dpa_eps():
                a = dpa_acct()
                a.compose(dpa_event)
                return a.get_epsilon(delta)
            e2 = dpa_eps()
            t2 = median_time(dpa_eps, max(1, r // 3))
            line += f" {e2:>10.5f} {t2 * 1e3:>8.1f} {t2 / t:>6.1f}"
        print(line)

    poisson_kw = dict(sampler="poisson", skw=dict(sampling_probability=q))
    row("Poisson (reference)", "pld", lambda zz: A.sampler_event("poisson", zz, steps, sampling_probability=q),
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps), P.PLDAccountant, **poisson_kw)
    for cap in (700, 620):
        skw = dict(sampling_probability=q, population_size=n, max_batch_size=cap)
        row(f"truncated Poisson, cap {cap}", "pld", lambda zz: A.sampler_event("truncated_poisson", zz, steps, **skw),
            dpa.SelfComposedDpEvent(dpa.TruncatedSubsampledGaussianDpEvent(n, q, cap, z), steps), P.PLDAccountant,
            sampler="truncated_poisson", skw=skw)
    row("balls-in-bins, b = 100 (10 epochs)", "rdp", lambda zz: A.sampler_event("balls_in_bins", zz, steps, sampling_probability=q),
        sampler="balls_in_bins", skw=dict(sampling_probability=q))
    row("random allocation, k = 4 of t = 400", "rdp",
        lambda zz: A.sampler_event("random_allocation", zz, steps, sampling_probability=q, num_selected=4),
        sampler="random_allocation", skw=dict(sampling_probability=q, num_selected=4))
    for mean, shape in ((10.0, 1.0), (10.0, math.inf)):
        inner = A.sampler_event("poisson", z, steps, sampling_probability=q)
        dinner = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps)
        row(f"repeat-and-select, E[K] = {mean:g}, shape {shape:g}", "rdp",
            lambda zz: A.RepeatAndSelectEvent(A.sampler_event("poisson", zz, steps, sampling_probability=q), mean, shape),
            dpa.dp_event.RepeatAndSelectDpEvent(dinner, mean, shape), R.RdpAccountant)


if __name__ == "__main__":
    main()
