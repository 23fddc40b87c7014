"""The runs that the accounting benches give both libraries (``import _accountants`` from a bench
script): ε of `steps` Poisson-sampled Gaussian steps from a fresh accountant, and dp_accounting's
noise-multiplier calibration for them."""

from __future__ import annotations

import dp_accounting as dpa
from dp_accounting import mechanism_calibration as mc

import dpcore.accounting as A


def dpa_epsilon(make_accountant, q, z, steps, delta):
    """ε from a fresh dp_accounting accountant (`make_accountant()`) after `steps` steps."""
    acc = make_accountant()
    acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps)
    return acc.get_epsilon(delta)


def dpcore_epsilon(make_accountant, q, z, steps, delta):
    """ε from a fresh dpcore.accounting accountant (`make_accountant()`) after `steps` steps."""
    acc = make_accountant()
    acc.compose(A.PoissonSampledEvent(q, A.GaussianEvent(z)), steps)
    return acc.get_epsilon(delta)


def dpa_calibrate(make_accountant, q, steps, eps, delta, lower, tol):
    """dp_accounting's noise multiplier for (eps, delta) after `steps` steps, searched from
    `lower` with a first guess of 1.0, to `tol`."""

    def make(z):
        return dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps)

    return mc.calibrate_dp_mechanism(make_accountant, make, eps, delta, mc.LowerEndpointAndGuess(lower, 1.0), tol=tol)
