"""dpcore.torch: DP training of any ``torch.nn.Module`` with any ``torch.optim`` optimizer.

DP-SGD (Abadi et al. 2016, Algorithm 1) through dpcore's queries and privacy ledger (McMahan et
al. 2018)::

    model, optimizer, loader = dpcore.torch.make_private(
        model, optimizer, loader, noise_multiplier=1.1, max_grad_norm=1.0, ledger=PrivacyLedger("run.jsonl"))
    for x, y in loader:                 # Poisson samples from dpcore's ChaCha20 sampler
        optimizer.zero_grad()
        loss_fn(model(x), y).backward() # one backward pass captures the per-record factors
        optimizer.step()                # clip, noise (core), ledger (fsync), then the update
    eps = optimizer.get_epsilon(1e-5)     # PLD accountant (the default), an upper bound

``make_private_with_epsilon(..., target_epsilon=, target_delta=, epochs=)`` picks the noise multiplier
instead, as Opacus's function of the same name.

Correlated noise (DP-FTRL, banded and BLT matrix factorization; Choquette-Choo et al. 2022, arXiv
2211.06530; 2023, arXiv 2306.08153; McMahan et al. 2024, arXiv 2408.08868)::

    model, optimizer, loader = dpcore.torch.make_private(
        model, optimizer, loader, noise_mechanism="blt", epochs=20, noise_multiplier=1.0, max_grad_norm=1.0)

trains over cyclic fixed batches (:class:`CyclicDataLoader`) with the noise of a strategy
optimised for the planned steps; see :func:`make_private`.

Per-record gradients: each layer type has a rule (``_rules.py``; :func:`register_layer` adds
one): factored norms and clipped sums for ``nn.Linear``, ``nn.Embedding``, attention projections
and recurrent weights (Goodfellow 2015; ghost norms of Li et al. 2022, mixed with materialised
ones by shape as Bu et al. 2023), grouped-convolution per-record gradients for conv layers,
g·x̂ for normalisation layers, ``torch.func`` vmap elsewhere. Parameters shared between layers get
the sum over their uses. ``make_private(..., query=...)`` drives any :mod:`dpcore.queries` tree
(adaptive clipping, per-group clipping, microbatches).
Requires the ``torch`` extra (``pip install 'dpcore[torch]'``).
"""

from __future__ import annotations

import warnings

import numpy as np
from typing import Any, Dict, Optional, Tuple

import torch
from torch.utils.data import DataLoader

from .. import _adapters, _names
from ..plan import calibrate_noise, steps_for_epochs
from .._validate import count
from ..ledger import PrivacyLedger
from ._cyclic import CyclicDataLoader, FixedOrderLoader
from ._data import DPDataLoader
from ._samplers import SamplerDataLoader, refuse_distributed
from ._distributed import DistributedError, current_communicator, resolve_ledger
from ._lean import MEMORY, check_memory
from ._engine import FallbackWarning, PerRecordGradients, check_on_nonfinite, clip_factors, clip_margin, replace_batchnorm
from ._rules import EmbeddingRule, LayerRule, register_layer
from ._optimizer import DPOptimizer, GradScalerGrowthWarning, OverflowSkipWarning, PlannedStepsWarning

__all__ = [
    "make_private",
    "make_private_with_epsilon",
    "DPOptimizer",
    "DPDataLoader",
    "SamplerDataLoader",
    "CyclicDataLoader",
    "FixedOrderLoader",
    "PlannedStepsWarning",
    "PerRecordGradients",
    "FallbackWarning",
    "OverflowSkipWarning",
    "GradScalerGrowthWarning",
    "DistributedError",
    "register_layer",
    "LayerRule",
    "EmbeddingRule",
    "replace_batchnorm",
    "clip_factors",
    "clip_margin",
]


def make_private(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data_loader: DataLoader,
    *,
    noise_multiplier: Optional[float] = None,
    max_grad_norm: Any = None,
    query: Any = None,
    ledger: Any = None,
    clipping: str = "flat",
    joint_scales: Any = None,
    max_physical_batch_size: Optional[int] = None,
    loss_reduction: str = "mean",
    grad_sample_mode: str = "auto",
    batch_first: bool = True,
    poisson_sampling: Optional[bool] = None,
    mechanism: Optional[str] = None,
    granularity: Optional[float] = None,
    grad_scaler: Any = None,
    seed: Optional[int] = None,
    noise_mechanism: Optional[str] = None,
    strategy: Any = None,
    epochs: Optional[int] = None,
    participation: Any = None,
    keep_loader: bool = False,
    sampler: Optional[str] = None,
    max_batch_size: Optional[int] = None,
    num_selected: int = 1,
    target_epsilon: Optional[float] = None,
    target_delta: Optional[float] = None,
    accountant: Optional[str] = None,
    on_nonfinite: str = "zero",
    population_size: Optional[int] = None,
    privacy_unit: str = "example",
    memory: str = "default",
    user_ids: Any = None,
    examples_per_user: Optional[int] = None,
    max_examples_per_user: Optional[int] = None,
    pad_batches: bool = False,
) -> Tuple[torch.nn.Module, DPOptimizer, Any]:
    """``(model, optimizer, data_loader)`` ready for DP-SGD, as Opacus's ``make_private``.

    The loader becomes a :class:`DPDataLoader`: Poisson samples at q = batch_size/len(dataset),
    one per logical step, recorded in ``ledger`` (a temporary ledger file when None; see
    ``optimizer.ledger.path``). The optimizer becomes a :class:`DPOptimizer` with
    ``expected_batch_size`` = q·n. The model is returned as is, with its layers' forward
    methods instrumented (``optimizer.engine.remove()`` undoes it). With
    ``sampler="shuffle"`` the loader is kept (its batches, shuffled or not, the last short
    one included) and every batch is recorded as a ``shuffle`` sample: accounted without
    amplification (``get_epsilon`` warns with a ``LedgerWarning``), the average divided by the
    loader's ``batch_size``. ``seed`` is for tests only (no privacy).

    ``noise_multiplier`` σ, or ``target_epsilon`` with ``target_delta`` and ``epochs`` (σ then
    calibrated by :func:`make_private_with_epsilon`, under ``accountant``): exactly one of the two.

    **Samplers.** ``sampler=`` picks how each logical batch is drawn from the n records, for
    the DataLoader's ``batch_size`` bs (the expected batch); each sample is recorded in the
    ledger with the sampler's own policy, and ``optimizer.get_epsilon(delta)`` is that
    sampler's certified ε (see :mod:`dpcore.accounting.samplers`):

    * ``"poisson"`` (the default): the :class:`DPDataLoader` above.
    * ``"truncated_poisson"``: Poisson at q = bs/n, capped at ``max_batch_size`` B (required;
      a value a few standard deviations above q·n, e.g. ceil(q·n + 4·sqrt(q·n·(1 − q))),
      binds rarely and costs almost no privacy): a step never holds more than B records. ε by
      PLD (``TruncatedPoissonSampledEvent``, arXiv 2508.15089).
    * ``"balls_in_bins"``: each epoch throws every record into one of b = round(n/bs) batches
      (Chua et al. 2025, arXiv 2412.16802): every record is trained on exactly once per epoch.
    * ``"random_allocation"``: every record takes part in exactly ``num_selected`` = k of each
      round's t = round(n·k/bs) steps, a uniformly random k-subset (Feldman & Shenfeld 2025,
      arXiv 2502.08202); ``len(loader)`` is t (k passes over the data).
    * ``"shuffle"``: the DataLoader's own batches, described above.

    The allocation samplers are certified by Rényi DP only (:mod:`dpcore.accounting.allocation`;
    the PLD accountant refuses them), so ``get_epsilon`` uses ``accountant="rdp"`` for them
    directly: the ledger would fall back to RDP anyway, with a warning. The three new samplers
    make the loader a :class:`SamplerDataLoader` (``max_physical_batch_size`` works as for
    Poisson), the optimizer's ``expected_batch_size`` (the average's fixed denominator) is the
    sampler's expected batch (E[min(Bin(n, q), B)], n/b, n·k/t), and a checkpoint holds the
    sampler's state: an allocation sampler restored from it starts a new round (the
    interrupted round's secret assignment is never stored; the ledger counts that round
    whole, so ε never falls below the uninterrupted run's). Not yet under ``torch.distributed``
    or with ``noise_mechanism=`` (ValueError).

    Checkpoint and resume: save ``optimizer.state_dict()`` (the wrapped optimizer's state plus
    the DP state: release count, the queries' global states, the loader's position, the ledger's
    path and length) with the model's; to resume, rebuild with ``make_private`` on the same
    ledger path and call ``optimizer.load_state_dict(state)``. It refuses a ledger that is not
    the checkpoint's or holds fewer releases, and one holding more (a crash after a release was
    recorded, before its checkpoint) unless ``ledger_ahead="keep"`` (see
    :meth:`DPOptimizer.load_state_dict`).

    ``query``: any :class:`dpcore.queries.DPQuery` tree instead of ``noise_multiplier`` and
    ``max_grad_norm``: :class:`~dpcore.queries.GaussianAverageQuery` (flat),
    :class:`~dpcore.queries.NestedQuery` keyed by parameter names or module prefixes (per-layer
    or per-group clipping), :class:`~dpcore.queries.JointClipQuery`,
    :class:`~dpcore.queries.QuantileAdaptiveClipQuery` (adaptive clipping), and a
    :class:`~dpcore.queries.MicrobatchQuery` at the root. Its denominator should be
    ``loader.expected_batch_size`` for an average.

    ``ledger``: a :class:`dpcore.PrivacyLedger`, a path, or None (a temporary file).

    ``noise_mechanism="discrete_gaussian"`` (with an optional ``granularity`` γ) makes the noise
    floating-point safe (Canonne, Kamath & Steinke 2020): each group's clipped sum is rounded
    onto the grid γ·ℤ^d and noised with exact discrete Gaussian integers from ChaCha20 in the
    core, and the ledger records the sensitivity of a rounded sum, C + √d·γ. The clipped sum is
    still formed on the device in floating point (as for the Gaussian); the guarantee covers the
    noise and the rounding, not the device's summation error. Not yet with data-parallel training.

    **Mixed precision.** ``torch.autocast`` (bfloat16 on CPU and CUDA, float16 on CUDA) around
    the forward pass, and models whose parameters are bfloat16 or float16, need nothing more:
    each record's gradient is formed from the factors the forward pass multiplied (in the
    autocast dtype), widened exactly to float32 for its norm (float64) and its clipped
    contribution; noise is added in float32 and the released average is cast to the
    parameters' dtype once. With float16 and ``torch.amp.GradScaler``, pass
    ``grad_scaler=scaler``: the clip sees unscaled gradients; a record whose scaled gradient
    overflowed is a non-finite record (below), no step is skipped and the scale never backs
    off because of the data (prefer a fixed scale, ``growth_interval=2**31 - 1``; see
    :meth:`DPOptimizer.attach_grad_scaler`).

    **The population size.** ``population_size`` N (Poisson sampling): the public number of
    records that q = batch_size/N, the denominator q·N and the ledger are stated for (default:
    ``len(dataset)``, then assumed public, as the report says). Under add-or-remove adjacency
    the dataset's true size is data (Opacus #571): declare N where it is not public.

    **The privacy unit.** ``privacy_unit="example"`` (the default) protects one training
    example. ``privacy_unit="user"`` with ``user_ids`` (one id per example of the dataset:
    integers or strings) protects all the examples of one person (Charles et al. 2024,
    arXiv 2407.07737; docs/privacy-unit.md):

    * ``examples_per_user=k`` (user-level sampling): Poisson sampling draws *users*, the
      DataLoader's ``batch_size`` is the expected number of users per step (q = batch_size/U
      over the U users, or ``population_size`` users when declared), each sampled user gives
      at most k of its examples (ChaCha20 without replacement), and the user's gradient is the
      mean of its examples' gradients, clipped to C as one record; the noised sum is divided by
      q·U. ε is the example-level analysis with users as records.
    * ``max_examples_per_user=K`` (example-level sampling, user-level guarantee): each user is
      bounded once to K examples, examples are Poisson sampled (``batch_size`` is the expected
      number of examples) and clipped one by one; ε is stated for a user, accounted as up to K
      examples each sampled independently (a mixture of Gaussians).

    User-level sampling works with ``sampler=`` (truncated Poisson, balls-in-bins, random
    allocation then draw users); the bound K with Poisson sampling. The ledger records the unit
    (a ledger of another unit is refused), the user population and the bound. Not with
    ``sampler="shuffle"``, matrix-factorization noise or ``query=`` microbatches.

    **Memory.** ``memory="lean"`` (ghost clipping, Li et al. 2022): the per-record norms are taken in a
    first backward pass below the model's outputs and the clipped sums in the ordinary second one,
    each layer's factors dropped as soon as they are used, instead of holding every layer's factors
    from one backward pass to the step (``memory="default"``). Same release, exactly; a second
    backward pass of cost (docs/pytorch.md, "Memory").

    **Static shapes.** ``pad_batches=True`` with ``max_physical_batch_size=m``: every physical
    batch holds exactly m rows (the sample's records first, then copies of record 0 with clip
    factor 0: they add exactly nothing, never enter the denominator, change nothing recorded), so
    that a GPU step keeps one shape (cuDNN plans it once; ``torch.compile`` and CUDA graphs need
    it). A larger sample is split into several padded batches, never cut; an empty one is a batch
    of padding whose release is the noise alone. A DP step never reads a device value back in
    either case (docs/performance.md, "The GPU step").

    **Non-finite records.** ``on_nonfinite="zero"`` (the default): a record whose per-record
    gradient is NaN or infinite (bad data, an overflow) contributes exactly zero, in every
    clipping group, and the step releases as usual; nothing is raised or released about it.
    ``on_nonfinite="raise"`` raises ``ValueError`` naming it instead: a debugging aid whose
    outcome depends on one record, not DP.

    **Data-parallel.** When ``torch.distributed`` is initialised (as ``torchrun`` does) with
    more than one rank, run the same script on every rank with a DataLoader over the same full
    dataset: rank r samples the records i ≡ r (mod W) at q = batch_size/len(dataset), so
    ``batch_size`` is the expected *global* batch size and ε is the same as in one process.
    ``model`` may be plain or wrapped in ``DistributedDataParallel``. Pass the ledger's path (the
    same on every rank): rank 0 opens the file and writes it; the other ranks keep an in-memory
    replica, so ``optimizer.get_epsilon`` answers on every rank. Noise is added once, by rank 0.

    **Correlated noise** (``noise_mechanism="banded"`` or ``"blt"``; the default
    ``noise_mechanism="gaussian"`` is the path above, unchanged). A matrix-factorization (MF) mechanism adds σ·(C⁻¹z)_t at step
    t for a Toeplitz strategy C (:mod:`dpcore.matrix_factorization`); it needs no random
    sampling but a fixed, cyclic data order, and ``epochs`` (required) plans its
    steps = epochs × b:

    * the data order (default, recommended): the loader becomes a :class:`CyclicDataLoader`:
      the dataset is shuffled **once** (ChaCha20) and cut into b = n // batch_size fixed batches
      of the DataLoader's ``batch_size``; the n mod batch_size records left over are **never
      trained on** (``loader.dropped``); step t uses batch t mod b, in the same order every
      epoch. ``participation=Participation.cyclic_poisson(b, p)``: cyclic Poisson sampling
      (amplified banded MF: b groups, each record of group t mod b with probability p at step
      t; the average's denominator is p·n/b).
      ``keep_loader=True``: the DataLoader's own batches, kept, if its order provably repeats
      every epoch (``shuffle=False`` over a map-style dataset); b = len(data_loader).
    * the strategy: ``strategy=`` (a :class:`~dpcore.matrix_factorization.BandedStrategy` or
      :class:`~dpcore.matrix_factorization.BLTStrategy`), else
      :func:`dpcore.matrix_factorization.optimize` for the planned steps and the loader's
      participation schema (``"blt"``: 2 buffers; ``"banded"``: min(b, steps, 64) bands), for
      the workload of the optimizer's updates: with ``torch.optim.SGD(momentum=β)`` (one β for
      all groups) the prefix sums of momentum-filtered steps, else plain prefix sums.
      ``noise_mechanism="banded"`` with ``strategy=dpcore.matrix_factorization.IDENTITY`` is
      C = I: DP-SGD over the cyclic fixed batches, accounted honestly (no amplification: the
      whole run is one Gaussian mechanism at z).
    * ``noise_multiplier`` is the **effective** one: σ = z·C·sens(C) with sens(C) the
      strategy's sensitivity over the planned steps, so ε depends on z (and, for cyclic Poisson
      sampling, on p and the epochs), not on the strategy. Flat clipping only. The optimizer
      (``optimizer.noise_multiplier`` = z) draws each release's correlated noise from the
      stream in float32 (float64 for float64 parameters), holding num_buffers·d values of
      state (``optimizer.noise_state_nbytes``), saved in its ``state_dict`` with the loader's
      cyclic position and permutation key: a resumed run continues the same cycle and stream.
    * refused (ValueError): ``keep_loader=True`` with a loader that reshuffles every epoch (or
      whose order cannot be checked); ``"blt"``, or more bands than b, with cyclic Poisson
      sampling; a ``strategy`` that is not the mechanism's kind, or a ``participation`` that
      does not match the data order; ``query=``, per-layer or joint clipping, the discrete
      Gaussian, a GradScaler, data-parallel training. Training past the planned steps works
      (the ledger accounts what ran) with a :class:`PlannedStepsWarning`, once. Every batch the
      loader yields must be stepped: a skipped batch would shift the cycle against the noise
      stream, and the next release is refused.
    """
    if not isinstance(data_loader, DataLoader):
        raise TypeError(f"data_loader must be a torch.utils.data.DataLoader, got {type(data_loader).__name__}")
    check_on_nonfinite(on_nonfinite)
    check_memory(memory)
    noise_mechanism = _names.noise_mechanism(noise_mechanism, mechanism)
    noise_mechanism, strategy = _names.legacy_independent(noise_mechanism, strategy)
    if _adapters.wants_target(noise_multiplier, target_epsilon, target_delta, epochs, "make_private"):
        return make_private_with_epsilon(
            model, optimizer, data_loader, target_epsilon=target_epsilon, target_delta=target_delta, epochs=epochs,
            max_grad_norm=max_grad_norm, accountant=accountant, query=query, ledger=ledger, clipping=clipping,
            joint_scales=joint_scales, max_physical_batch_size=max_physical_batch_size, loss_reduction=loss_reduction,
            grad_sample_mode=grad_sample_mode, batch_first=batch_first, poisson_sampling=poisson_sampling,
            granularity=granularity, grad_scaler=grad_scaler, seed=seed, noise_mechanism=noise_mechanism,
            strategy=strategy, participation=participation, keep_loader=keep_loader, sampler=sampler,
            max_batch_size=max_batch_size, num_selected=num_selected, on_nonfinite=on_nonfinite, memory=memory,
            population_size=population_size, privacy_unit=privacy_unit, user_ids=user_ids,
            examples_per_user=examples_per_user, max_examples_per_user=max_examples_per_user,
            pad_batches=pad_batches,
        )
    users = _adapters.check_privacy_unit(privacy_unit, user_ids, examples_per_user, max_examples_per_user)
    if users and hasattr(data_loader.dataset, "__len__"):
        from ..sampling import UserIndex

        if not isinstance(user_ids, UserIndex):  # checked before anything is opened or recorded
            user_ids = UserIndex(user_ids, len(data_loader.dataset))  # type: ignore[arg-type]
    if users and (noise_mechanism in _names.MF_NOISE or _adapters.resolve_sampler(sampler, poisson_sampling) == "shuffle"
                  or (max_examples_per_user is not None and _adapters.resolve_sampler(sampler, poisson_sampling) != "poisson")):
        raise ValueError(
            "privacy_unit='user' samples users with the registered samplers (Poisson, truncated Poisson, balls-in-bins, "
            "random allocation) or bounds them with Poisson sampling of examples (max_examples_per_user); it is not "
            "yet available with sampler='shuffle' or matrix-factorization noise"
        )
    if population_size is not None and (noise_mechanism in _names.MF_NOISE or _adapters.resolve_sampler(sampler, poisson_sampling) != "poisson"):
        raise ValueError(
            "population_size= declares the public N of Poisson sampling (q = batch_size/N, denominator q·N); the other "
            "samplers and matrix-factorization noise read N from the dataset (the report states it public)"
        )
    if accountant is not None:
        raise ValueError("accountant= is the calibration's accountant: give it with target_epsilon=")
    if pad_batches and (noise_mechanism in _names.MF_NOISE or _adapters.resolve_sampler(sampler, poisson_sampling) == "shuffle"):
        raise ValueError(
            "pad_batches=True pads sampled batches (Poisson and the registered samplers); it is not yet available "
            "with sampler='shuffle' or matrix-factorization noise"
        )
    if noise_mechanism in _names.MF_NOISE:
        if sampler is not None or max_batch_size is not None or num_selected != 1:
            raise ValueError(
                "sampler, max_batch_size and num_selected choose DP-SGD's sampling; matrix-factorization noise "
                f"(noise_mechanism={noise_mechanism!r}) trains over a cyclic order instead (fixed batches, or cyclic "
                "Poisson sampling with participation=Participation.cyclic_poisson(b, p))"
            )
        if poisson_sampling is not None:
            warnings.warn(
                "poisson_sampling= is deprecated; with matrix-factorization noise participation= chooses the data "
                "order (Participation.cyclic_poisson(b, p): cyclic Poisson sampling; otherwise cyclic fixed batches)",
                DeprecationWarning, stacklevel=2,
            )
        return _make_private_mf(
            model, optimizer, data_loader, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
            query=query, ledger=ledger, clipping=clipping, joint_scales=joint_scales,
            max_physical_batch_size=max_physical_batch_size, loss_reduction=loss_reduction,
            grad_sample_mode=grad_sample_mode, batch_first=batch_first, poisson_sampling=poisson_sampling,
            mechanism="gaussian", granularity=granularity, grad_scaler=grad_scaler, seed=seed,
            noise_mechanism=noise_mechanism, strategy=strategy, epochs=epochs, participation=participation,
            keep_loader=keep_loader, on_nonfinite=on_nonfinite, memory=memory,
        )
    given = [k for k, v in (("strategy", strategy), ("epochs", epochs), ("participation", participation)) if v is not None]
    if keep_loader:
        given.append("keep_loader")
    if given:
        raise ValueError(
            f"{', '.join(given)} configure matrix-factorization noise: give noise_mechanism='banded' or 'blt' with them"
            + (" (epochs= alone goes with target_epsilon=)" if given == ["epochs"] else "")
        )
    kind = _adapters.resolve_sampler(sampler, poisson_sampling)
    n = len(data_loader.dataset) if hasattr(data_loader.dataset, "__len__") else None  # type: ignore[arg-type]
    _adapters.check_options(kind, max_batch_size, num_selected, n, data_loader.batch_size)
    poisson_sampling = kind == "poisson"
    comm = current_communicator()
    if kind in _adapters.DRAWN:
        refuse_distributed(kind)
    if comm is not None and kind == "shuffle":
        raise ValueError(
            "sampler='shuffle' is not supported under torch.distributed: the ranks' shuffled batches "
            "would not form one recorded sample; use Poisson sampling"
        )
    ledger = resolve_ledger(ledger, comm, privacy_unit=privacy_unit)
    if poisson_sampling:
        loader: Any = DPDataLoader.from_data_loader(
            data_loader, ledger=ledger, max_physical_batch_size=max_physical_batch_size, seed=seed,
            population_size=population_size, pad_batches=pad_batches, **({"user_ids": user_ids, "examples_per_user": examples_per_user,
                                                  "max_examples_per_user": max_examples_per_user} if users else {}),
        )
        expected = loader.expected_batch_size
    elif kind in _adapters.DRAWN:
        loader = SamplerDataLoader.from_data_loader(
            data_loader, kind, ledger=ledger, max_batch_size=max_batch_size, num_selected=num_selected,
            max_physical_batch_size=max_physical_batch_size, seed=seed, pad_batches=pad_batches,
            **({"user_ids": user_ids, "examples_per_user": examples_per_user} if users else {}),
        )
        expected = loader.expected_batch_size
    else:
        if max_physical_batch_size is not None:
            raise ValueError("max_physical_batch_size needs sampled batches (any sampler but 'shuffle')")
        loader = _ShuffledLoader(data_loader, ledger)
        expected = loader.expected_batch_size
    opt = DPOptimizer(
        optimizer,
        model=model,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        expected_batch_size=expected,
        query=query,
        ledger=ledger,
        clipping=clipping,
        joint_scales=joint_scales,
        mechanism=noise_mechanism,
        granularity=granularity,
        loss_reduction=loss_reduction,
        grad_sample_mode=grad_sample_mode,
        batch_first=batch_first,
        data_loader=loader,
        grad_scaler=grad_scaler,
        seed=seed,
        on_nonfinite=on_nonfinite,
        memory=memory,
    )
    return model, opt, loader


class _ShuffledLoader:
    """A plain DataLoader whose batches are recorded epoch by epoch, without amplification.

    The policy is the loader's order: ``shuffle`` for a ``RandomSampler`` without replacement (a
    fresh permutation every epoch, ``DataLoader(shuffle=True)``), ``sequential`` for a
    ``SequentialSampler`` (``shuffle=False``, the DataLoader's default: the same order every
    epoch, in which adding or removing a record shifts every later batch). Any other sampler is
    refused: one that may repeat a record within an epoch has no bound here. Each batch is one
    ledger sample over the n records, with ``sample_size`` the batch size and q = batch_size/n,
    carrying its epoch as a round (round_steps = the epoch's batches, round_selected 1), so that
    the accountant reads one Gaussian query per epoch under zero-out, and √5·C per epoch (shuffle,
    at least 5 steps) or 2C per step under add-or-remove (:mod:`dpcore.ledger._events`). The
    last, shorter batch of an epoch is recorded the same way (its denominator stays the batch
    size, as every batch's).

    :meth:`state_dict`/:meth:`load_state_dict` carry the samples drawn and the batches done in
    the current epoch; a resumed iteration skips that many batches of its first epoch (they are
    loaded and dropped, not recorded). The resumed epoch is a new round in the ledger: with
    ``shuffle=True`` its order differs from the interrupted one's, so a record may be in both."""

    def __init__(self, data_loader: DataLoader, ledger: PrivacyLedger) -> None:
        bs = data_loader.batch_size
        if bs is None:
            raise ValueError(
                "sampler='shuffle' needs a DataLoader with a batch_size (the denominator of the average)"
            )
        sampler = data_loader.sampler
        if type(sampler) is torch.utils.data.RandomSampler and not sampler.replacement and sampler._num_samples is None:
            self.policy = "shuffle"
        elif type(sampler) is torch.utils.data.SequentialSampler:
            self.policy = "sequential"
        else:
            raise ValueError(
                f"sampler='shuffle' accounts a DataLoader whose sampler is a RandomSampler without replacement "
                f"(shuffle=True) or a SequentialSampler (shuffle=False), so that every record is in one batch an epoch; "
                f"got {type(sampler).__name__}, which may repeat or leave out records. Use Poisson sampling "
                "(the default) or one of dpcore's samplers (sampler=...)"
            )
        self.data_loader, self.ledger = data_loader, ledger
        self.n = len(data_loader.dataset)  # type: ignore[arg-type]
        if self.n < 1:
            raise ValueError("dataset is empty")
        self.batch_size = int(bs)
        self.sampling_probability = min(1.0, self.batch_size / self.n)
        self.samples_drawn = 0
        self.logical_batch_complete = True
        self._epoch_done = 0
        self._resume_at: Optional[int] = None

    @property
    def expected_batch_size(self) -> float:
        return float(self.batch_size)

    def __len__(self) -> int:
        return len(self.data_loader)

    def __iter__(self) -> Any:
        start, self._resume_at = self._resume_at, None
        total = len(self.data_loader)
        skip = 0 if start is None or start >= total else start
        self._epoch_done = skip
        epoch = None  # the epoch's round in the ledger, fixed at its first recorded batch
        for k, batch in enumerate(self.data_loader):
            if k < skip:
                continue  # done before the checkpoint
            if epoch is None:
                epoch = self.ledger.next_round
            self.ledger.record_sample(
                self.n, self.sampling_probability, self.policy, sample_size=min(self.batch_size, self.n),
                round=epoch, step_in_round=k, round_steps=total, round_selected=1,
            )
            self.samples_drawn += 1
            self._epoch_done += 1
            self._resume_at = None
            yield batch

    def state_dict(self) -> Dict[str, Any]:
        """Samples drawn and batches done in the current epoch (0 after its last batch)."""
        total = len(self.data_loader)
        return {
            "kind": "ShuffledLoader",
            "samples_drawn": int(self.samples_drawn),
            "pass_position": int(self._epoch_done if self._epoch_done < total else 0),
            "steps": int(total),
            "population_size": int(self.n),
            "batch_size": int(self.batch_size),
            "logical_batch_complete": True,
        }

    def check_state_dict(self, state: Any) -> None:
        if not isinstance(state, dict) or state.get("kind") != "ShuffledLoader":
            kind = state.get("kind") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not the state of a sampler='shuffle' loader (kind {kind!r})")
        for key in ("samples_drawn", "pass_position"):
            v = state.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"loader state: {key} must be a non-negative int, got {v!r}")
        if state.get("population_size") != self.n or state.get("batch_size") != self.batch_size:
            raise ValueError(
                f"the loader state is for n={state.get('population_size')}, batch_size={state.get('batch_size')}; "
                f"this loader has n={self.n}, batch_size={self.batch_size}"
            )

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.check_state_dict(state)
        self.samples_drawn = int(state["samples_drawn"])
        self._epoch_done = int(state["pass_position"])
        self._resume_at = self._epoch_done


def _make_private_mf(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader, *, noise_multiplier: Any,
    max_grad_norm: Any, query: Any, ledger: Any, clipping: str, joint_scales: Any, max_physical_batch_size: Any,
    loss_reduction: str, grad_sample_mode: str, batch_first: bool, poisson_sampling: Optional[bool], mechanism: str,
    granularity: Any, grad_scaler: Any, seed: Any, noise_mechanism: str, strategy: Any, epochs: Any,
    participation: Any, keep_loader: bool, on_nonfinite: str = "zero", memory: str = "default",
) -> Tuple[torch.nn.Module, DPOptimizer, Any]:
    from ..queries import MatrixFactorizationQuery
    from ._mf import choose_strategy, schedule, sgd_momentum

    if query is not None:
        raise ValueError(
            "give either query= or noise_mechanism=: noise_mechanism builds its own MatrixFactorizationQuery (for a "
            "query of your own, pass it with a CyclicDataLoader to DPOptimizer)"
        )
    if clipping != "flat" or joint_scales is not None:
        raise ValueError("matrix-factorization noise supports flat clipping only (clipping='flat')")
    if mechanism != "gaussian" or granularity is not None:
        raise ValueError("matrix-factorization noise is Gaussian: mechanism='discrete_gaussian' cannot be combined with it")
    if grad_scaler is not None:
        raise ValueError(
            "grad_scaler with matrix-factorization noise is not supported yet; train with bfloat16 autocast (no "
            "scaler needed) instead"
        )
    if current_communicator() is not None:
        raise NotImplementedError("matrix-factorization noise is not supported under torch.distributed yet")
    if noise_multiplier is None or max_grad_norm is None:
        raise TypeError("noise_mechanism needs noise_multiplier (the effective one) and max_grad_norm")
    if keep_loader and max_physical_batch_size is not None:
        raise ValueError("max_physical_batch_size needs dpcore's cyclic loader (keep_loader=False)")
    sched = schedule(
        data_loader, noise_mechanism=noise_mechanism, epochs=epochs, participation=participation,
        poisson_sampling=poisson_sampling, keep_loader=keep_loader,
    )
    # A default strategy is optimised for the workload the updates follow: SGD's momentum
    # filters the noise too (prefix sums of momentum-filtered steps).
    strat = choose_strategy(noise_mechanism, strategy, sched, sgd_momentum(optimizer))
    ledger = resolve_ledger(ledger, None)
    loader: Any
    if sched.order == "keep":
        loader = FixedOrderLoader(data_loader, ledger)
    else:
        loader = CyclicDataLoader.from_data_loader(
            data_loader, ledger=ledger, participation=sched.participation if sched.order == "poisson" else None,
            max_physical_batch_size=max_physical_batch_size, seed=seed,
        )
    q = MatrixFactorizationQuery(
        max_grad_norm, noise_multiplier, strategy=strat, participation=sched.participation, steps=sched.steps,
        denominator=loader.expected_batch_size,
    )
    opt = DPOptimizer(
        optimizer, model=model, query=q, expected_batch_size=loader.expected_batch_size, ledger=ledger,
        loss_reduction=loss_reduction, grad_sample_mode=grad_sample_mode, batch_first=batch_first,
        data_loader=loader, seed=seed, on_nonfinite=on_nonfinite, memory=memory,
    )
    return model, opt, loader


def _calibrated_noise(target_epsilon: Any, target_delta: Any, epochs: Any, q: float, accountant: str) -> Tuple[float, int]:
    """(σ, steps) for ``epochs`` passes of Poisson sampling at q (:func:`dpcore.plan.steps_for_epochs`:
    round(1/q) steps an epoch, the DP loader's length), by the one calibration path."""
    count("epochs", epochs, 1)
    steps = steps_for_epochs("poisson", epochs, q)
    z = calibrate_noise(target_epsilon, target_delta, sampler="poisson", sampling_probability=q, steps=steps,
                        accountant=accountant)
    return z, steps


def make_private_with_epsilon(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data_loader: DataLoader,
    *,
    target_epsilon: float,
    target_delta: float,
    epochs: int,
    max_grad_norm: Any,
    accountant: Optional[str] = None,
    **kwargs: Any,
) -> Tuple[torch.nn.Module, DPOptimizer, Any]:
    """:func:`make_private` with the noise multiplier σ calibrated so that ``epochs`` epochs of
    DP-SGD (Abadi et al. 2016, Algorithm 1; round(1/q) Poisson steps per epoch at q =
    batch_size/len(dataset), as the DP loader draws them) are (``target_epsilon``,
    ``target_delta``)-DP under ``accountant`` (default "pld", the tightest:
    :func:`dpcore.accounting.calibrate_noise_multiplier`, which never overshoots the target).
    The chosen σ is ``optimizer.noise_multiplier``. Training longer than ``epochs`` spends more
    than the target; ``optimizer.get_epsilon(delta)`` always reports what was spent.

    With ``sampler=`` (see :func:`make_private`) σ is calibrated with that sampler's own
    accounting: the smallest z (to 1e-5 relative, from above: :func:`dpcore.plan.calibrate_noise`)
    whose ``loader.sampler.accountant_event(z, steps)`` meets the target under the sampler's
    accountant (default: PLD for ``"truncated_poisson"``, RDP for the allocation samplers, which
    have no certified PLD analysis: ``accountant="pld"`` is refused for them). ``steps`` is
    ``epochs`` × round(1/q) truncated-Poisson steps, ``epochs`` balls-in-bins epochs of b
    batches, or for random allocation ⌈epochs/k⌉ rounds of t steps (a round is k passes over
    the data, and the ledger counts a round cut short as a whole one). ``"shuffle"`` is
    calibrated as ``epochs`` × len(data_loader) full-batch Gaussian steps (no amplification).

    With ``noise_mechanism=`` (see :func:`make_private`) the *effective* noise multiplier is
    calibrated for the planned epochs × b steps of the data order
    (:func:`dpcore.matrix_factorization.calibrate_noise_multiplier`: one Gaussian mechanism for
    cyclic fixed batches; ⌈steps/b⌉ Poisson-subsampled Gaussian steps at p for cyclic Poisson
    sampling)."""
    nm = _names.noise_mechanism(kwargs.pop("noise_mechanism", None), kwargs.pop("mechanism", None))
    if nm == "discrete_gaussian":
        # The calibration solves the Gaussian's accounting; the discrete Gaussian's (a looser RDP
        # bound, and a larger sensitivity after rounding) would overshoot the target.
        raise ValueError(
            "make_private_with_epsilon calibrates for noise_mechanism='gaussian' only (and 'banded', 'blt'); for the "
            "discrete Gaussian give noise_multiplier to make_private and read optimizer.get_epsilon(delta)"
        )
    if not isinstance(data_loader, DataLoader):
        raise TypeError(f"data_loader must be a torch.utils.data.DataLoader, got {type(data_loader).__name__}")
    if "noise_multiplier" in kwargs:
        raise TypeError("make_private_with_epsilon chooses noise_multiplier; do not give it")
    nm, strategy = _names.legacy_independent(nm, kwargs.get("strategy"))
    if strategy is not None:
        kwargs["strategy"] = strategy
    kwargs["noise_mechanism"] = nm
    if nm in _names.MF_NOISE:
        from ..matrix_factorization import calibrate_noise_multiplier as mf_calibrate
        from ._mf import schedule

        accountant = "pld" if accountant is None else accountant
        sched = schedule(
            data_loader, noise_mechanism=nm, epochs=epochs,
            participation=kwargs.get("participation"), poisson_sampling=kwargs.get("poisson_sampling"),
            keep_loader=kwargs.get("keep_loader", False),
        )
        z = mf_calibrate(
            target_epsilon, target_delta, participation=sched.participation, steps=sched.steps, accountant=accountant
        )
        return make_private(
            model, optimizer, data_loader, noise_multiplier=z, max_grad_norm=max_grad_norm, epochs=epochs, **kwargs
        )
    if data_loader.batch_size is None:
        raise ValueError("data_loader has no batch_size to derive the sampling probability from")
    kind = _adapters.resolve_sampler(kwargs.pop("sampler", None), kwargs.pop("poisson_sampling", None))
    kwargs["sampler"] = kind
    if kind in _adapters.DRAWN:
        return _with_epsilon_sampled(
            model, optimizer, data_loader, kind, target_epsilon=target_epsilon, target_delta=target_delta,
            epochs=epochs, max_grad_norm=max_grad_norm, accountant=accountant, **kwargs,
        )
    if kind == "shuffle":
        z = _calibrated_shuffle_noise(target_epsilon, target_delta, epochs, len(data_loader), accountant)
        return make_private(model, optimizer, data_loader, noise_multiplier=z, max_grad_norm=max_grad_norm, **kwargs)
    n = kwargs.get("population_size")
    users = _adapters.check_privacy_unit(kwargs.get("privacy_unit", "example"), kwargs.get("user_ids"),
                                         kwargs.get("examples_per_user"), kwargs.get("max_examples_per_user"))
    if users:
        from ..sampling import UserIndex

        index = kwargs["user_ids"]
        if not isinstance(index, UserIndex):
            index = UserIndex(index, len(data_loader.dataset))  # type: ignore[arg-type]
        kwargs["user_ids"] = index  # checked once
        K = kwargs.get("max_examples_per_user")
        if n is None:
            n = index.num_users if K is None else int(np.minimum(index.counts, K).sum())
        q = min(1.0, data_loader.batch_size / n)
        count("epochs", epochs, 1)
        steps = steps_for_epochs("poisson", epochs, q)
        z = calibrate_noise(target_epsilon, target_delta, sampler="poisson", sampling_probability=q, steps=steps,
                            accountant="pld" if accountant is None else accountant,
                            **({} if K is None else {"max_examples_per_user": K}))
        return make_private(model, optimizer, data_loader, noise_multiplier=z, max_grad_norm=max_grad_norm, **kwargs)
    q = min(1.0, data_loader.batch_size / (len(data_loader.dataset) if n is None else n))  # type: ignore[arg-type]
    z, _ = _calibrated_noise(target_epsilon, target_delta, epochs, q, "pld" if accountant is None else accountant)
    return make_private(model, optimizer, data_loader, noise_multiplier=z, max_grad_norm=max_grad_norm, **kwargs)


def _calibrated_shuffle_noise(target_epsilon: Any, target_delta: Any, epochs: Any, batches: int, accountant: Any) -> float:
    """σ for ``epochs`` epochs of ``batches`` steps of a shuffled or fixed-order loader as the
    ledger states them by default (zero-out: each epoch one Gaussian query of sensitivity C, no
    amplification), by the one calibration path."""
    e = count("epochs", epochs, 1)
    q = 1.0 / batches
    steps = steps_for_epochs("shuffle", e, q, steps_per_epoch=batches)
    return calibrate_noise(target_epsilon, target_delta, sampler="shuffle", sampling_probability=q, steps=steps,
                           steps_per_epoch=batches, accountant=accountant)


def _with_epsilon_sampled(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader, kind: str, *,
    target_epsilon: Any, target_delta: Any, epochs: Any, max_grad_norm: Any, accountant: Optional[str], **kwargs: Any,
) -> Tuple[torch.nn.Module, DPOptimizer, Any]:
    """make_private_with_epsilon for the samplers of :mod:`dpcore.sampling`: the sampler that
    make_private will build, built alone (no ledger: nothing drawn or recorded) for its
    ``accountant_event``, calibrated, then make_private with the calibrated σ."""
    acct = _adapters.calibration_accountant(kind, accountant)
    count("epochs", epochs, 1)
    ds = data_loader.dataset
    n = len(ds)  # type: ignore[arg-type]
    if _adapters.check_privacy_unit(kwargs.get("privacy_unit", "example"), kwargs.get("user_ids"),
                                    kwargs.get("examples_per_user"), kwargs.get("max_examples_per_user")):
        from ..sampling import UserIndex

        index = kwargs["user_ids"]
        kwargs["user_ids"] = index = index if isinstance(index, UserIndex) else UserIndex(index, n)
        n = index.num_users  # the sampler draws users
    probe = _adapters.build(
        kind, n, data_loader.batch_size,  # type: ignore[arg-type]
        max_batch_size=kwargs.get("max_batch_size"), num_selected=kwargs.get("num_selected", 1),
    )
    params = probe.parameters()
    z = calibrate_noise(target_epsilon, target_delta, sampler=kind, steps=probe.steps_for(epochs), accountant=acct,
                        **params)
    return make_private(model, optimizer, data_loader, noise_multiplier=z, max_grad_norm=max_grad_norm, **kwargs)
