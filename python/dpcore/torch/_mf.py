"""``make_private(..., noise_mechanism=...)``: DP training with matrix-factorization noise.

The pieces (see :mod:`dpcore.matrix_factorization`): a data order that follows a participation
schema (:mod:`._cyclic`), a Toeplitz strategy C optimised for the planned steps
(:func:`dpcore.matrix_factorization.optimize`), and a
:class:`~dpcore.queries.MatrixFactorizationQuery` whose noise the DPOptimizer draws from the
stream at each release. ``noise_multiplier`` is the *effective* one, z = σ/(C·sens(C)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch.utils.data import DataLoader

from .._validate import count
from ..matrix_factorization._participation import CYCLIC_POISSON, Participation
from ..matrix_factorization._strategies import ToeplitzStrategy

NOISE_MECHANISMS = ("independent", "banded", "blt")


@dataclass(frozen=True)
class Schedule:
    """What the data order will be: ``order`` is "fixed" (dpcore's cyclic fixed batches),
    "poisson" (cyclic Poisson sampling) or "keep" (the caller's loader, checked to repeat);
    ``participation`` has max_participations = epochs; ``steps`` = epochs·b."""

    order: str
    participation: Participation
    steps: int


def schedule(
    data_loader: DataLoader,
    *,
    noise_mechanism: Any,
    epochs: Any,
    participation: Any,
    poisson_sampling: Optional[bool],
    keep_loader: bool,
) -> Schedule:
    """Checks the data-order arguments of an MF run and derives its schedule (no side effect)."""
    from ._cyclic import check_fixed_order

    if noise_mechanism not in NOISE_MECHANISMS:
        raise ValueError(f"noise_mechanism must be one of {NOISE_MECHANISMS} (or None for DP-SGD), got {noise_mechanism!r}")
    if not isinstance(data_loader, DataLoader):
        raise TypeError(f"data_loader must be a torch.utils.data.DataLoader, got {type(data_loader).__name__}")
    if epochs is None:
        raise TypeError(
            f"noise_mechanism={noise_mechanism!r} needs epochs=: the correlated noise and its strategy are planned for "
            "epochs × batches-per-epoch steps"
        )
    epochs = count("epochs", epochs, 1)
    if participation is not None and not isinstance(participation, Participation):
        raise TypeError(f"participation must be a dpcore.matrix_factorization.Participation, got {type(participation).__name__}")
    if not isinstance(keep_loader, bool):
        raise TypeError(f"keep_loader must be a bool, got {type(keep_loader).__name__}")
    wants_poisson = participation is not None and participation.kind == CYCLIC_POISSON
    if poisson_sampling is None:
        poisson_sampling = wants_poisson
    if poisson_sampling and keep_loader:
        raise ValueError("keep_loader=True keeps the DataLoader's fixed batches; it cannot be combined with poisson_sampling=True")
    n = len(data_loader.dataset)  # type: ignore[arg-type]
    if n < 1:
        raise ValueError("dataset is empty")
    if poisson_sampling:
        if not wants_poisson:
            raise ValueError(
                "poisson_sampling=True with matrix-factorization noise is cyclic Poisson sampling (amplified banded MF, "
                "Choquette-Choo et al. 2023): give participation=Participation.cyclic_poisson(b, p) (b groups, each "
                "record of group t mod b sampled with probability p at step t; the expected batch is p·n/b). The "
                "recommended default is poisson_sampling=False: cyclic fixed batches"
            )
        b = participation.min_separation  # type: ignore[union-attr]
        if b > n:
            raise ValueError(f"participation has {b} groups but the dataset only {n} records")
        part = Participation(b, epochs, participation.sampling_probability)  # type: ignore[union-attr]
        return Schedule("poisson", part, epochs * b)
    if wants_poisson:
        raise ValueError(
            "participation is cyclic Poisson but poisson_sampling=False: give poisson_sampling=True (or leave it out) "
            "for cyclic Poisson sampling, or a cyclic participation for fixed batches"
        )
    if keep_loader:
        check_fixed_order(data_loader)
        b = len(data_loader)
        order = "keep"
    else:
        bs = data_loader.batch_size
        if bs is None:
            raise ValueError("data_loader has no batch_size: the fixed batches' size")
        if bs > n:
            raise ValueError(f"batch_size {bs} is larger than the dataset ({n} records): not even one fixed batch")
        b = n // bs
        order = "fixed"
    if participation is not None and participation.min_separation != b:
        raise ValueError(
            f"participation declares {participation.min_separation} batches per epoch, but the data order has {b} "
            f"({'len(data_loader)' if keep_loader else 'n // batch_size'}): the strategy and the data must agree"
        )
    return Schedule(order, Participation(b, epochs), epochs * b)


def sgd_momentum(optimizer: Any) -> float:
    """The heavy-ball β of a ``torch.optim.SGD`` whose parameter groups all share it (0 for any
    other optimizer, or when the groups differ): the workload a default strategy is optimised
    for. Adaptive optimizers (Adam) rescale per coordinate, which no Toeplitz workload models."""
    import torch

    if not isinstance(optimizer, torch.optim.SGD):
        return 0.0
    betas = {float(g.get("momentum", 0.0) or 0.0) for g in optimizer.param_groups}
    beta = betas.pop() if len(betas) == 1 else 0.0
    return beta if 0.0 < beta < 1.0 else 0.0


def choose_strategy(noise_mechanism: str, strategy: Any, sched: Schedule, momentum: float = 0.0) -> ToeplitzStrategy:
    """The strategy of an MF run: checked against the mechanism and schedule, or optimised
    (:func:`dpcore.matrix_factorization.strategy_for`) for SGD's ``momentum``."""
    from ..matrix_factorization import strategy_for

    return strategy_for(noise_mechanism, sched.participation, sched.steps, strategy, momentum=momentum)
