"""One-run audit of a real :mod:`dpcore.torch` training run: a small MLP on scikit-learn's
digits, trained with :func:`dpcore.torch.make_private`, with m canaries each included with
probability 1/2 (ChaCha20 coins, :func:`dpcore.poisson_sample`), analysed as
:func:`dpcore.audit.one_run_audit` analyses the mechanism (:func:`dpcore.audit.analyze_scores`:
Steinke et al. 2023, the f-DP analysis of Mahloujifar, Melis & Chaudhuri 2025, the Gaussian-DP
fit).

Two kinds of canaries (``kind``):

* ``"gradient"`` (white-box; Nasr et al. 2023, "Tight auditing of differentially private
  machine learning", Dirac canaries): the MLP is wrapped in a model of this module
  (``GradientCanaryMLP``) with an extra parameter, an ``nn.Embedding(m + 1, 1,
  padding_idx=0)`` that only canary records look up (the training records look up the padding
  row, which gets no gradient). Canary i is a record of that dataset whose loss is −2C·w_i, so
  its per-record gradient is −2C·e_i on that parameter and zero elsewhere: norm 2C, clipped to
  C by dpcore's per-record clipping like every record, in the same DP step as the digits. Its
  score is the displacement of w_i over training (the final parameters' displacement projected
  on the canary's direction, summed over the steps). No hook in :mod:`dpcore.torch` is needed.
* ``"input"`` (black-box): canary i is an out-of-distribution input (uniform noise in [0, 1]^64)
  with a random label in the training set; its score is the gain in the final model's
  log-likelihood of that label over the initial model's.

All m canaries are records of the dataset, so its size (the average's denominator, and the
ledger's population) does not depend on the coins; a canary that is out has loss weight 0, a
record with a zero gradient, which the clipped sum cannot tell from its absence.

Every record, canaries included, is in every step (DataLoader ``batch_size`` = the dataset:
Poisson sampling at q = 1), so the claim is μ-GDP with μ = √steps/σ and the f-DP analysis tests
Gaussian curves. The claimed ε is the accountant's for (q = 1, σ, steps, δ); with
``actual_noise_multiplier`` the run adds that noise instead (the claim stays σ's), which a sound
audit must catch when it is much smaller.
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from typing import Any, Callable, Optional

import numpy as np

from .._seeds import derive_seed
from .._validate import count as _int, positive as _positive
from ..sampling import poisson_sample
from ._one_run import AuditResult, audit_result

__all__ = ["audit_torch_training"]

CANARY_KINDS = ("gradient", "input")


@functools.lru_cache(maxsize=None)
def _model_classes() -> Any:
    """The canary model's class, defined on first use (torch is imported only then)."""
    import torch
    from torch import nn

    class GradientCanaryMLP(nn.Module):
        """An MLP for the digits (64 → hidden → 10) and a canary parameter: ``canary.weight[i]``
        (i ≥ 1) receives the gradient of canary record i only; row 0 is the padding row that the
        training records look up, and receives none."""

        def __init__(self, canaries: int, hidden: int = 32) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
            self.canary = nn.Embedding(canaries + 1, 1, padding_idx=0)
            nn.init.zeros_(self.canary.weight)

        def forward(self, x: "torch.Tensor", canary_id: "torch.Tensor") -> Any:
            return self.net(x), self.canary(canary_id).squeeze(-1)

    return GradientCanaryMLP


def audit_torch_training(
    epsilon: Optional[float] = None,
    *,
    noise_multiplier: Optional[float] = None,
    actual_noise_multiplier: Optional[float] = None,
    canaries: int = 10_000,
    kind: str = "gradient",
    steps: int = 10,
    delta: float = 1e-5,
    confidence: float = 0.95,
    max_grad_norm: float = 1.0,
    hidden: int = 32,
    learning_rate: float = 2.0,
    seed: Optional[int] = None,
    progress: Optional[Callable[[int, int], None]] = None,
) -> AuditResult:
    """Trains an MLP on the digits with :func:`dpcore.torch.make_private` and ``canaries``
    canaries of ``kind`` (``"gradient"`` or ``"input"``; see the module docstring), and audits the
    run's claim in one run. Give the claim as ``epsilon`` (σ calibrated for it by
    :func:`dpcore.plan.calibrate_noise` at q = 1 over ``steps``) or as ``noise_multiplier``.

    ``actual_noise_multiplier``: train with this noise instead (the claim is unchanged).
    ``learning_rate``: SGD's, for the MLP (divided by the share of training records in the
    batch, so that the canaries do not slow it down). ``seed``: tests only (seeds the coins,
    the model, the data split and dpcore's noise). The result is an :class:`AuditResult` with
    ``target="torch"``, ``canary_kind`` and ``test_accuracy`` (on 20% of the digits held out).
    At the defaults (10 000 gradient canaries, 10 steps) it takes 1–3 s on a 2-core machine once
    torch is imported.
    Needs torch and scikit-learn."""
    t0 = time.perf_counter()
    import torch
    from torch import nn

    from .. import accounting
    from ..plan import calibrate_noise
    from ..torch import make_private

    if kind not in CANARY_KINDS:
        raise ValueError(f"kind must be one of {CANARY_KINDS}, got {kind!r}")
    if (epsilon is None) == (noise_multiplier is None):
        raise ValueError("give exactly one of epsilon (the claim, σ calibrated for it) and noise_multiplier")
    steps = _int("steps", steps, 1)
    m = _int("canaries", canaries, 10)
    c = _positive("max_grad_norm", max_grad_norm)
    hidden = _int("hidden", hidden, 1)
    lr = _positive("learning_rate", learning_rate)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    if noise_multiplier is None:
        z = calibrate_noise(_positive("epsilon", epsilon), delta, sampler="poisson", sampling_probability=1.0, steps=steps)
    else:
        z = _positive("noise_multiplier", noise_multiplier)
    z_act = z if actual_noise_multiplier is None else _positive("actual_noise_multiplier", actual_noise_multiplier)
    claimed = accounting.epsilon(1.0, z, steps, delta)

    x_tr, y_tr, x_te, y_te = _digits(seed)
    included = np.sort(poisson_sample(m, 0.5, seed=derive_seed(seed, 0)))
    member = np.zeros(m, dtype=bool)
    member[included] = True
    n_real = len(x_tr)

    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(int(derive_seed(seed, 4) or 0) % (1 << 63))
        model: Any
        # Every canary is a record of the dataset, so its size n_real + m (the average's
        # denominator) is public; canary i counts (weight 1) when it is in, and is a record with a
        # zero gradient (weight 0) when it is out: its removal, as far as the sum can tell.
        weight = torch.cat([torch.ones(n_real), torch.as_tensor(member, dtype=torch.float32)])
        if kind == "gradient":
            model = _model_classes()(m, hidden)
            ds = torch.utils.data.TensorDataset(
                torch.cat([x_tr, torch.zeros(m, 64)]),
                torch.cat([torch.zeros(n_real, dtype=torch.long), torch.arange(1, m + 1)]),
                torch.cat([y_tr, torch.zeros(m, dtype=torch.long)]),
                weight,
            )
            groups = [{"params": model.net.parameters(), "lr": lr * len(ds) / n_real},
                      {"params": model.canary.parameters(), "lr": 1.0}]
            start = model.canary.weight.detach().clone()
        else:
            model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
            rng = np.random.default_rng(None if seed is None else derive_seed(seed, 5))
            cx = torch.as_tensor(rng.random((m, 64)), dtype=torch.float32)
            cy = torch.as_tensor(rng.integers(0, 10, m), dtype=torch.long)
            ds = torch.utils.data.TensorDataset(torch.cat([x_tr, cx]), torch.cat([y_tr, cy]), weight)
            groups = [{"params": model.parameters(), "lr": lr * len(ds) / n_real}]
            with torch.no_grad():
                start = torch.log_softmax(model(cx), 1)[torch.arange(m), cy]
        loader = torch.utils.data.DataLoader(ds, batch_size=len(ds))
        model, opt, dl = make_private(model, torch.optim.SGD(groups, lr=lr), loader, noise_multiplier=z_act,
                                      max_grad_norm=c, seed=seed)
        for t in range(steps):
            for batch in dl:  # q = 1: one batch, every record
                opt.zero_grad()
                if kind == "gradient":
                    x, cid, y, wt = batch
                    logits, w = model(x, cid)
                    real = (cid == 0).to(logits.dtype)
                    # training records: cross-entropy; canary i: −2C·w_i (gradient −2C·e_i) if in
                    per = nn.functional.cross_entropy(logits, y, reduction="none") * real - 2.0 * c * w * (1.0 - real)
                else:
                    x, y, wt = batch
                    per = nn.functional.cross_entropy(model(x), y, reduction="none")
                (per * wt).mean().backward()
                opt.step()
            if progress is not None:
                progress(t + 1, steps)
        with torch.no_grad():
            if kind == "gradient":
                scores = (model.canary.weight.detach() - start)[1:, 0].double().numpy()
                acc = float((model.net(x_te).argmax(1) == y_te).double().mean())
            else:
                scores = (torch.log_softmax(model(cx), 1)[torch.arange(m), cy] - start).double().numpy()
                acc = float((model(x_te).argmax(1) == y_te).double().mean())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a seeded run's ledger warns about its seed
            eps_ledger = opt.get_epsilon(delta)
        opt.engine.remove()

    return audit_result(
        scores, member, claimed, delta=delta, confidence=confidence, mu_claimed=math.sqrt(steps) / z,
        noise_multiplier=z, actual_noise_multiplier=z_act, steps=steps, sampling_probability=1.0, canaries=m,
        seconds=time.perf_counter() - t0, target="torch", canary_kind=kind, test_accuracy=acc,
        extra={"epsilon_ledger": eps_ledger, "training_records": n_real, "model": f"MLP 64-{hidden}-10 (digits)"},
    )


def _digits(seed: Optional[int]) -> Any:
    """The digits, scaled to [0, 1], split 80/20 (train/test) at random."""
    import torch

    try:
        from sklearn.datasets import load_digits
    except ImportError:  # pragma: no cover - the test extra installs it
        raise ImportError("audit_torch_training needs scikit-learn (pip install 'dpcore[demo]')") from None
    x, y = load_digits(return_X_y=True)
    perm = np.random.default_rng(None if seed is None else derive_seed(seed, 3)).permutation(len(x))
    cut = int(0.8 * len(x))
    xt = torch.as_tensor(x / 16.0, dtype=torch.float32)
    yt = torch.as_tensor(y, dtype=torch.long)
    tr, te = torch.as_tensor(perm[:cut]), torch.as_tensor(perm[cut:])
    return xt[tr], yt[tr], xt[te], yt[te]
