"""Privacy audits of dpcore's own code.

* :mod:`dpcore.audit._one_run`: one-run audits of the mechanism with white-box gradient canaries,
  lower bounds on ε to set against the claim: Steinke, Nasr & Jagielski (NeurIPS 2023) and the
  f-DP analysis of Mahloujifar, Melis & Chaudhuri (ICML 2025), with a Gaussian-DP fit
  (:mod:`dpcore.audit._fdp`);
* :mod:`dpcore.audit._canaries`: the same audits of a real torch training run (gradient or input
  canaries in an MLP trained on scikit-learn's digits);
* :mod:`dpcore.audit._greybox`: the grey-box neighbour harness (Cebere et al. 2026): a training
  function run twice on neighbouring datasets with identical randomness, every release compared.
"""

from ._greybox import (
    NEIGHBOUR_KINDS,
    Finding,
    Neighbour,
    NeighbourAuditResult,
    NeighbourRun,
    neighbour_audit,
    neighbours,
    users_last,
)
from ._canaries import audit_torch_training
from ._fdp import (
    epsilon_delta_tradeoff,
    fdp_epsilon_lower_bound,
    fdp_rejects,
    gaussian_tradeoff,
    gdp_delta,
    gdp_epsilon,
    gdp_fit,
    gdp_mu_lower_bound,
    guess_counts,
    steinke_epsilon_lower_bound,
    steinke_p_value,
)
from ._one_run import AuditResult, analyze_scores, epsilon_lower_bound, one_run_audit, p_value

__all__ = [
    "neighbour_audit", "neighbours", "users_last", "Neighbour", "NeighbourRun", "NeighbourAuditResult", "Finding",
    "NEIGHBOUR_KINDS",
    "AuditResult", "one_run_audit", "epsilon_lower_bound", "p_value",
    "analyze_scores", "audit_torch_training", "steinke_p_value", "steinke_epsilon_lower_bound", "fdp_rejects",
    "gdp_mu_lower_bound", "fdp_epsilon_lower_bound", "gaussian_tradeoff", "epsilon_delta_tradeoff", "gdp_delta",
    "gdp_epsilon", "gdp_fit", "guess_counts",
]
