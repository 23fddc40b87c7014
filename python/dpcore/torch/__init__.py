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

from typing import Any, Dict, Optional, Tuple

import torch
from torch.utils.data import DataLoader

from .._validate import count
from ..ledger import PrivacyLedger
from ._data import DPDataLoader
from ._distributed import DistributedError, current_communicator, resolve_ledger
from ._engine import FallbackWarning, PerRecordGradients, clip_factors, clip_margin, replace_batchnorm
from ._rules import LayerRule, register_layer
from ._optimizer import DPOptimizer, OverflowSkipWarning

__all__ = [
    "make_private",
    "make_private_with_epsilon",
    "DPOptimizer",
    "DPDataLoader",
    "PerRecordGradients",
    "FallbackWarning",
    "OverflowSkipWarning",
    "DistributedError",
    "register_layer",
    "LayerRule",
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
    poisson_sampling: bool = True,
    mechanism: str = "gaussian",
    granularity: Optional[float] = None,
    grad_scaler: Any = None,
    seed: Optional[int] = None,
) -> Tuple[torch.nn.Module, DPOptimizer, Any]:
    """``(model, optimizer, data_loader)`` ready for DP-SGD, as Opacus's ``make_private``.

    The loader becomes a :class:`DPDataLoader`: Poisson samples at q = batch_size/len(dataset),
    one per logical step, recorded in ``ledger`` (a temporary ledger file when None; see
    ``optimizer.ledger.path``). The optimizer becomes a :class:`DPOptimizer` with
    ``expected_batch_size`` = q·n. The model is returned as is, with its layers' forward
    methods instrumented (``optimizer.engine.remove()`` undoes it). With
    ``poisson_sampling=False`` the loader is kept (its batches, shuffled or not, the last short
    one included) and every batch is recorded as a ``shuffle`` sample: accounted without
    amplification (``get_epsilon`` warns with a ``LedgerWarning``), the average divided by the
    loader's ``batch_size``. ``seed`` is for tests only (no privacy).

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

    ``mechanism="discrete_gaussian"`` (with an optional ``granularity`` γ) makes the noise
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
    ``grad_scaler=scaler``: the clip sees unscaled gradients, and a step whose scaled
    gradients overflowed is skipped (nothing released or recorded; see
    :meth:`DPOptimizer.attach_grad_scaler`).

    **Data-parallel.** When ``torch.distributed`` is initialised (as ``torchrun`` does) with
    more than one rank, run the same script on every rank with a DataLoader over the same full
    dataset: rank r samples the records i ≡ r (mod W) at q = batch_size/len(dataset), so
    ``batch_size`` is the expected *global* batch size and ε is the same as in one process.
    ``model`` may be plain or wrapped in ``DistributedDataParallel``. Pass the ledger's path (the
    same on every rank): rank 0 opens the file and writes it; the other ranks keep an in-memory
    replica, so ``optimizer.get_epsilon`` answers on every rank. Noise is added once, by rank 0.
    """
    if not isinstance(data_loader, DataLoader):
        raise TypeError(f"data_loader must be a torch.utils.data.DataLoader, got {type(data_loader).__name__}")
    comm = current_communicator()
    if comm is not None and not poisson_sampling:
        raise ValueError(
            "poisson_sampling=False is not supported under torch.distributed: the ranks' shuffled batches "
            "would not form one recorded sample; use Poisson sampling"
        )
    ledger = resolve_ledger(ledger, comm)
    if poisson_sampling:
        loader: Any = DPDataLoader.from_data_loader(
            data_loader, ledger=ledger, max_physical_batch_size=max_physical_batch_size, seed=seed
        )
        expected = loader.expected_batch_size
    else:
        if max_physical_batch_size is not None:
            raise ValueError("max_physical_batch_size needs poisson_sampling=True")
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
        mechanism=mechanism,
        granularity=granularity,
        loss_reduction=loss_reduction,
        grad_sample_mode=grad_sample_mode,
        batch_first=batch_first,
        data_loader=loader,
        grad_scaler=grad_scaler,
        seed=seed,
    )
    return model, opt, loader


class _ShuffledLoader:
    """A plain DataLoader whose batches are recorded as ``shuffle`` samples (no amplification).

    Each batch is one ledger sample with policy ``shuffle`` over the n records of the dataset,
    recorded with q = batch_size/n for information only: the accountant gives a shuffled batch
    no amplification (a full Gaussian query on the whole dataset, with a :class:`LedgerWarning`).
    The last, shorter batch of an epoch is recorded the same way (its denominator stays the
    batch size, as every batch's).

    :meth:`state_dict`/:meth:`load_state_dict` carry the samples drawn and the batches done in
    the current epoch; a resumed iteration skips that many batches of its first epoch (they are
    loaded and dropped, not recorded). With ``shuffle=True`` the resumed epoch's order differs
    from the interrupted one's, which the no-amplification accounting does not depend on."""

    def __init__(self, data_loader: DataLoader, ledger: PrivacyLedger) -> None:
        bs = data_loader.batch_size
        if bs is None:
            raise ValueError(
                "poisson_sampling=False needs a DataLoader with a batch_size (the denominator of the average)"
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
        for k, batch in enumerate(self.data_loader):
            if k < skip:
                continue  # done before the checkpoint
            self.ledger.record_sample(self.n, self.sampling_probability, "shuffle")
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
            raise ValueError(f"not the state of a poisson_sampling=False loader (kind {kind!r})")
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


def _calibrated_noise(target_epsilon: Any, target_delta: Any, epochs: Any, q: float, accountant: str) -> Tuple[float, int]:
    """(σ, steps) for ``epochs`` expected passes of round(1/q) Poisson steps each."""
    from .. import accounting

    epochs = count("epochs", epochs, 1)
    steps = int(epochs) * max(1, round(1.0 / q))
    z = accounting.calibrate_noise_multiplier(target_epsilon, target_delta, q, steps, accountant=accountant)
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
    accountant: str = "pld",
    **kwargs: Any,
) -> Tuple[torch.nn.Module, DPOptimizer, Any]:
    """:func:`make_private` with the noise multiplier σ calibrated so that ``epochs`` epochs of
    DP-SGD (Abadi et al. 2016, Algorithm 1; round(1/q) Poisson steps per epoch at q =
    batch_size/len(dataset), as the DP loader draws them) are (``target_epsilon``,
    ``target_delta``)-DP under ``accountant`` (default "pld", the tightest:
    :func:`dpcore.accounting.calibrate_noise_multiplier`, which never overshoots the target).
    The chosen σ is ``optimizer.noise_multiplier``. Training longer than ``epochs`` spends more
    than the target; ``optimizer.get_epsilon(delta)`` always reports what was spent."""
    if kwargs.get("mechanism", "gaussian") != "gaussian":
        # The calibration solves the Gaussian's accounting; the discrete Gaussian's (a looser RDP
        # bound, and a larger sensitivity after rounding) would overshoot the target.
        raise ValueError(
            "make_private_with_epsilon calibrates for mechanism='gaussian' only; for the discrete Gaussian give "
            "noise_multiplier to make_private and read optimizer.get_epsilon(delta)"
        )
    if not isinstance(data_loader, DataLoader):
        raise TypeError(f"data_loader must be a torch.utils.data.DataLoader, got {type(data_loader).__name__}")
    if data_loader.batch_size is None:
        raise ValueError("data_loader has no batch_size to derive the sampling probability from")
    q = min(1.0, data_loader.batch_size / len(data_loader.dataset))  # type: ignore[arg-type]
    z, _ = _calibrated_noise(target_epsilon, target_delta, epochs, q, accountant)
    return make_private(model, optimizer, data_loader, noise_multiplier=z, max_grad_norm=max_grad_norm, **kwargs)
