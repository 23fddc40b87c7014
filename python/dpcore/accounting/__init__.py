"""Privacy accounting: (ε, δ) of what a training run did; concern (c) of McMahan et al. 2018.

Describe the run with events (:mod:`dpcore.events`), compose them into an accountant
(:class:`PrivacyAccountant`: :class:`PldAccountant`, the tightest and the default everywhere,
or :class:`RdpAccountant`), ask for ε (or δ). Calibration helpers find the noise, sampling rate
or steps for a target ε under either. A user-level guarantee for example-level sampling is the
mixture-of-Gaussians event (:func:`example_level_sampling_event`, PLD only), with
:func:`group_privacy_epsilon` as the looser cross-check. See :mod:`dpcore.accounting.pld` and
:mod:`dpcore.accounting.rdp` for the papers and equations behind every number.
"""

from .base import (
    ACCOUNTANTS,
    DEFAULT_ACCOUNTANT,
    PrivacyAccountant,
    UnsupportedEventError,
    make_accountant,
    register_accountant,
)

# Importing an implementation registers it in ACCOUNTANTS, under its name: these two imports
# are what make "pld" and "rdp" valid `accountant=` values everywhere.
from .pld import PldAccountant
from .rdp import (
    DEFAULT_ORDERS,
    OrderRangeWarning,
    RdpAccountant,
    epsilon,
    epsilon_from_rdp,
    rdp_poisson_subsampled_gaussian,
)

from .calibration import calibrate_noise_multiplier, calibrate_sampling_probability, calibrate_steps
from .group import group_privacy_epsilon
from .events import *  # noqa: F401,F403 (the accountant events, ACCOUNTANT_EVENTS)
from ..events import ACCOUNTANT_EVENTS
from .interop import from_dp_accounting, to_dp_accounting
from .tuning import draw_num_runs, rdp_repeat_and_select
from .allocation import rdp_random_allocation
from .samplers import (
    SAMPLERS,  # the registry's selectable samplers when imported (dpcore.sampling.registered_samplers)
    calibrate_sampler_noise,
    calibrate_sampler_steps,
    sampler_epsilon,
    sampler_event,
)

__all__ = [
    "PrivacyAccountant",
    "PldAccountant",
    "UnsupportedEventError",
    "make_accountant",
    "register_accountant",
    "ACCOUNTANTS",
    "DEFAULT_ACCOUNTANT",
    *ACCOUNTANT_EVENTS,
    "RdpAccountant",
    "OrderRangeWarning",
    "DEFAULT_ORDERS",
    "epsilon",
    "epsilon_from_rdp",
    "rdp_poisson_subsampled_gaussian",
    "calibrate_noise_multiplier",
    "calibrate_sampling_probability",
    "calibrate_steps",
    "group_privacy_epsilon",
    "rdp_repeat_and_select",
    "rdp_random_allocation",
    "draw_num_runs",
    "sampler_event",
    "sampler_epsilon",
    "calibrate_sampler_noise",
    "calibrate_sampler_steps",
    "to_dp_accounting",
    "from_dp_accounting",
]
