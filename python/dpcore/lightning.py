"""dpcore.lightning: DP-SGD for a PyTorch Lightning ``LightningModule`` with one callback.

::

    import lightning.pytorch as L
    from dpcore.lightning import DPCallback

    dp = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, ledger="run.jsonl")
    trainer = L.Trainer(max_epochs=10, callbacks=[dp])
    trainer.fit(model, datamodule=dm)          # ε logged as "epsilon" every epoch
    trainer.fit(model, datamodule=dm, ckpt_path="last.ckpt")   # resumes the same ledger

The callback does, at ``on_fit_start`` (after Lightning's ``strategy.setup`` built the optimizer
from ``configure_optimizers``, before it restores a checkpoint's optimizer state), what a plain
torch loop does with :func:`dpcore.torch.make_private`: the module's optimizer becomes a
:class:`dpcore.torch.DPOptimizer` and the training DataLoader (from the datamodule, the
module's ``train_dataloader`` or ``fit(train_dataloaders=...)``) a Poisson-sampling
:class:`dpcore.torch.DPDataLoader`; both replace Lightning's own (``trainer.strategy.optimizers``
and the fit loop's data source). The rest is Lightning's machinery, unchanged:

* **One DP step per batch.** In automatic optimization Lightning calls
  ``optimizer.step(closure)`` once per batch through its precision plugin
  (``Precision.optimizer_step``); :meth:`DPOptimizer.step` runs the closure (``training_step``,
  ``zero_grad``, ``backward``: the per-record factors are captured in the backward pass, so the
  ``zero_grad`` between forward and backward loses nothing), then clips each record, adds the
  noise, writes the release to the ledger and applies the update. An empty Poisson batch skips
  ``training_step`` (it returns ``None``; Lightning still steps the optimizer, which releases
  pure noise: skipping the release would reveal that no record was sampled). After every batch
  the callback checks that the releases equal the samples drawn, so that a configuration that
  skips or repeats a step fails at once instead of mis-accounting.
* **Data.** The DP loader is not a ``torch.utils.data.DataLoader``, so Lightning injects no
  ``DistributedSampler`` and re-requesting the train dataloader
  (``reload_dataloaders_every_n_epochs``) returns the same loader. It has a length (its
  logical batches per pass), so Lightning's ``_PrefetchDataFetcher`` does not prefetch: the
  sample in the ledger is always the batch being trained on.
* **Accounting.** ε at ``delta`` (:meth:`DPOptimizer.get_epsilon`, the ledger's PLD bound) is
  logged with ``pl_module.log(log_name, ...)`` at the end of every training epoch, and every
  ``log_every_n_steps`` steps if given, so it reaches all of the Trainer's loggers.
* **Checkpoints.** Lightning saves each optimizer's ``state_dict()``: the DPOptimizer's holds
  the DP state (release count, query states, the loader's position, the ledger's path and
  length). ``trainer.fit(ckpt_path=...)`` restores it through ``optimizer.load_state_dict``,
  which checks the ledger (:meth:`DPOptimizer.load_state_dict`); the resumed run continues the
  same ledger, and a seeded run ends where the uninterrupted one ends. The callback's own state
  (the ledger's path, releases and ε at the checkpoint) is saved too, and a callback given no
  ``ledger`` resumes the checkpoint's.

Refused before anything is recorded (``ValueError``): more than one process or device, or any
strategy but a single-device one (DDP, FSDP, DeepSpeed: dpcore's data-parallel path needs its
own sampling per rank, not wired here); ``accumulate_grad_batches`` > 1 (the accumulated batches
would be separate Poisson samples, one release for several recorded samples); Lightning's
``gradient_clip_val`` (dpcore clips each record; clipping the released average would not change
the guarantee but hides a misconfiguration); precision plugins other than ``32-true``,
``64-true``, ``bf16-mixed``, ``bf16-true`` and ``16-true`` (``16-mixed``'s GradScaler skips
``optimizer.step`` when ``training_step`` returns ``None``, which an empty batch does);
``overfit_batches``; a ``training_step`` taking ``dataloader_iter``; manual optimization;
several optimizers; an optimizer already made private.

Requires the ``lightning`` extra (``pip install 'dpcore[lightning]'``); ``lightning.pytorch``
is used when installed, else the standalone ``pytorch_lightning`` package.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
from typing import Any, Dict, Optional

from torch.utils.data import DataLoader

try:  # the maintained package first; the standalone one has the same API under another name
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - depends on what is installed
    import pytorch_lightning as pl  # type: ignore[no-redef]

from ._validate import positive as _positive
from . import _names
from ._adapters import check_noise_or_target, resolve_sampler
from .ledger import PrivacyLedger
from .torch import DPOptimizer, make_private, make_private_with_epsilon

__all__ = ["DPCallback", "check_trainer"]

# make_private options that the Lightning loop cannot honour, and why.
_REFUSED_KW = {
    "max_physical_batch_size": (
        "micro-batches make the loader yield more batches than its length (its logical batches), and Lightning ends "
        "the epoch after len(loader) batches, in the middle of a logical batch"
    ),
    "grad_scaler": "the GradScaler is Lightning's (precision='16-mixed'), which DPCallback refuses",
    "keep_loader": "keep_loader configures matrix-factorization noise",
    "strategy": "strategy= configures matrix-factorization noise",
    "participation": "participation= configures matrix-factorization noise",
}
_SUPPORTED_PRECISION = ("32-true", "64-true", "bf16-mixed", "bf16-true", "16-true")


def _lightning_root(obj: Any) -> Optional[str]:
    """'lightning.pytorch' or 'pytorch_lightning': the package a trainer's class comes from
    (found along its MRO, so that a user's Trainer subclass counts as its base's)."""
    for cls in type(obj).__mro__:
        mod = cls.__module__ or ""
        if mod.startswith("lightning.pytorch"):
            return "lightning.pytorch"
        if mod.startswith("pytorch_lightning"):
            return "pytorch_lightning"
    return None


def check_trainer(trainer: Any, pl_module: Any = None) -> None:
    """Raises ``ValueError`` (``TypeError`` for a trainer of the other Lightning package) if
    :class:`DPCallback` cannot train privately under ``trainer``'s configuration; changes
    nothing. :class:`DPCallback` calls it in ``setup`` (before any checkpoint is restored or
    any sample drawn) and again in ``on_fit_start``. Checked: a single process on a single
    device (``SingleDeviceStrategy``), ``accumulate_grad_batches`` = 1, no
    ``gradient_clip_val``, a supported precision, no ``overfit_batches``; with ``pl_module``:
    automatic optimization and a ``training_step`` without ``dataloader_iter``."""
    root = _lightning_root(trainer)
    if root is not None and root != pl.__name__:
        raise TypeError(
            f"this trainer is from {root}, but dpcore.lightning was imported with {pl.__name__}: a callback must "
            f"subclass the Callback of the trainer's package. Use one package (lightning.pytorch is preferred)"
        )
    strategy = trainer.strategy
    world = int(getattr(trainer, "world_size", 1))
    devices = int(getattr(trainer, "num_devices", 1))
    nodes = int(getattr(trainer, "num_nodes", 1))
    if not isinstance(strategy, pl.strategies.SingleDeviceStrategy) or world > 1 or devices > 1 or nodes > 1:
        raise ValueError(
            f"DPCallback trains in one process on one device; got {type(strategy).__name__} with world size {world} "
            f"({nodes} node(s), {devices} device(s)). DDP, FSDP and DeepSpeed are not supported by dpcore.lightning: "
            "each rank would draw its own sample and noise and the ranks' releases would not be one accounted "
            "mechanism. Use Trainer(devices=1) (strategy 'auto'), or dpcore.torch.make_private in a torchrun script "
            "for data-parallel DP training"
        )
    acc = trainer.accumulate_grad_batches
    if acc != 1:
        raise ValueError(
            f"accumulate_grad_batches={acc}: each of the accumulated batches is its own Poisson sample, recorded in the "
            "ledger, while one release would cover them; set the DataLoader's batch_size to the logical batch you "
            "want instead (accumulate_grad_batches=1)"
        )
    clip = trainer.gradient_clip_val
    if clip is not None and float(clip) != 0.0:
        raise ValueError(
            f"gradient_clip_val={clip}: dpcore clips each record's gradient to max_grad_norm before the noise; "
            "Lightning's clipping of the batch gradient would only run on empty .grad tensors. Remove gradient_clip_val"
        )
    prec = trainer.precision
    plugin = trainer.precision_plugin
    if str(prec) not in _SUPPORTED_PRECISION or getattr(plugin, "scaler", None) is not None:
        raise ValueError(
            f"precision={prec!r} ({type(plugin).__name__}) is not supported by DPCallback; use one of "
            f"{', '.join(_SUPPORTED_PRECISION)}. ('16-mixed' uses a GradScaler, whose step Lightning skips when "
            "training_step returns None, as an empty Poisson batch does: use 'bf16-mixed', which needs no scaler)"
        )
    allowed = (
        pl.plugins.precision.Precision, pl.plugins.precision.MixedPrecision, pl.plugins.precision.HalfPrecision,
        pl.plugins.precision.DoublePrecision,
    )
    if type(plugin) not in allowed:
        raise ValueError(f"the precision plugin {type(plugin).__name__} is not supported by DPCallback")
    if trainer.overfit_batches:
        raise ValueError(
            f"overfit_batches={trainer.overfit_batches}: DPCallback replaces the training DataLoader by Poisson samples "
            "of the whole dataset; train on a subset dataset instead"
        )
    if pl_module is not None:
        if not pl_module.automatic_optimization:
            raise ValueError(
                "manual optimization is not supported by DPCallback: it relies on Lightning calling optimizer.step once "
                "per batch, empty Poisson batches included; use automatic optimization"
            )
        if "dataloader_iter" in inspect.signature(pl_module.training_step).parameters:
            raise ValueError(
                "a training_step that takes dataloader_iter fetches its own batches; DPCallback needs one training step "
                "per Poisson sample"
            )


def _empty(loader: Any) -> bool:
    """Whether the batch being trained on has no record: the DP loaders keep the records of
    the batch they yielded last in ``last_indices`` (Lightning does not prefetch from a loader
    with a length, so it is this batch's)."""
    idx = getattr(loader, "last_indices", None)
    return idx is not None and len(idx) == 0


class DPCallback(pl.Callback):
    """Trains the ``LightningModule`` with DP-SGD (Abadi et al. 2016) through
    :func:`dpcore.torch.make_private`; see :mod:`dpcore.lightning` for what it changes in the
    Lightning loop, what it refuses, and why.

    * ``noise_multiplier`` z and ``max_grad_norm`` C, or ``target_epsilon`` and
      ``target_delta`` (and ``epochs``, default the Trainer's ``max_epochs``) to calibrate z by
      :func:`dpcore.torch.make_private_with_epsilon`.
    * ``delta``: the δ at which ε is logged (default ``target_delta``; one of them is required).
    * ``ledger``: a path or a :class:`dpcore.PrivacyLedger` (None: the checkpoint's ledger when
      resuming, else a temporary file; give a path to keep the record of the run).
    * ``log_name`` (default ``"epsilon"``), ``log_every_n_steps`` (also log ε every n optimizer
      steps; default only at each epoch's end), ``prog_bar`` (show ε in the progress bar).
    * ``ledger_ahead``: ``"refuse"`` (default) or ``"keep"``: what resuming does when the ledger
      holds releases after the checkpoint (a run that went on after its last checkpoint, as a
      Lightning run usually does): see :meth:`dpcore.torch.DPOptimizer.load_state_dict`.
      ``"keep"`` resumes from the checkpoint with those releases still counted in ε.
    * ``seed``: tests and reproductions only (the sampling and the noise become predictable).
    * Further keywords go to :func:`dpcore.torch.make_private` (``clipping``, ``joint_scales``,
      ``loss_reduction``, ``sampler``, ``query``, ``noise_mechanism`` ``"gaussian"`` or
      ``"discrete_gaussian"``, ...); ``max_physical_batch_size`` and the matrix-factorization
      options (``noise_mechanism="banded"`` or ``"blt"``, ``strategy``, ``participation``) are
      refused (ValueError, saying why).

    After ``on_fit_start``: :attr:`optimizer` (the :class:`~dpcore.torch.DPOptimizer`),
    :attr:`data_loader` (the DP loader), :attr:`ledger`; :meth:`get_epsilon` at any time after.
    At the end of ``fit`` (``teardown``) the module's layers are restored (the per-record
    instrumentation removed) and a ledger opened from a path is closed (its content stays
    readable: :meth:`get_epsilon` still works).
    """

    def __init__(
        self,
        *,
        noise_multiplier: Optional[float] = None,
        max_grad_norm: Any = None,
        delta: Optional[float] = None,
        ledger: Any = None,
        target_epsilon: Optional[float] = None,
        target_delta: Optional[float] = None,
        epochs: Optional[int] = None,
        log_name: str = "epsilon",
        log_every_n_steps: Optional[int] = None,
        prog_bar: bool = False,
        ledger_ahead: str = "refuse",
        seed: Optional[int] = None,
        **make_private_kwargs: Any,
    ) -> None:
        super().__init__()
        check_noise_or_target(noise_multiplier, target_epsilon, target_delta, "DPCallback")
        if max_grad_norm is None and make_private_kwargs.get("query") is None:
            raise TypeError("DPCallback needs max_grad_norm= (the per-record clipping bound C)")
        delta = target_delta if delta is None else delta
        if delta is None:
            raise TypeError("DPCallback needs delta= (the δ at which ε is logged)")
        for name, d in (("delta", delta), ("target_delta", target_delta)):
            if d is not None and not 0.0 < _positive(name, d) < 1.0:
                raise ValueError(f"{name} must be in (0, 1), got {d}")
        if log_every_n_steps is not None and (isinstance(log_every_n_steps, bool) or int(log_every_n_steps) < 1):
            raise ValueError(f"log_every_n_steps must be a positive int or None, got {log_every_n_steps!r}")
        if ledger_ahead not in ("refuse", "keep"):
            raise ValueError(f"ledger_ahead must be 'refuse' or 'keep', got {ledger_ahead!r}")
        if ledger is not None and not isinstance(ledger, (PrivacyLedger, str, os.PathLike)):
            raise TypeError(f"ledger must be a dpcore.PrivacyLedger, a path or None, got {type(ledger).__name__}")
        for k in make_private_kwargs:
            if k in _REFUSED_KW:
                raise ValueError(f"DPCallback does not support {k}=: {_REFUSED_KW[k]}")
            if k in ("noise_multiplier", "ledger", "seed", "target_epsilon", "target_delta"):
                raise TypeError(f"{k} is a DPCallback argument of its own")
        # the old names (mechanism=, poisson_sampling=) mapped here, so that they warn once, now
        make_private_kwargs = dict(make_private_kwargs)
        if "mechanism" in make_private_kwargs or "noise_mechanism" in make_private_kwargs:
            nm = _names.noise_mechanism(make_private_kwargs.pop("noise_mechanism", None),
                                        make_private_kwargs.pop("mechanism", None))
            if nm in _names.MF_NOISE:
                raise ValueError(
                    f"DPCallback does not support noise_mechanism={nm!r}: matrix-factorization noise needs dpcore's "
                    "cyclic loader and its planned steps, not wired to Lightning yet; use dpcore.torch.make_private in a "
                    "torch loop"
                )
            make_private_kwargs["noise_mechanism"] = nm
        if "poisson_sampling" in make_private_kwargs:
            make_private_kwargs["sampler"] = resolve_sampler(
                make_private_kwargs.get("sampler"), make_private_kwargs.pop("poisson_sampling")
            )
        self.noise_multiplier = noise_multiplier
        self.max_grad_norm = max_grad_norm
        self.delta = float(delta)
        self.target_epsilon = target_epsilon
        self.target_delta = target_delta
        self.epochs = epochs
        self.ledger_arg = ledger
        self.log_name = log_name
        self.log_every_n_steps = None if log_every_n_steps is None else int(log_every_n_steps)
        self.prog_bar = bool(prog_bar)
        self.ledger_ahead = ledger_ahead
        self.seed = seed
        self.make_private_kwargs = dict(make_private_kwargs)
        #: Set by on_fit_start.
        self.optimizer: Optional[DPOptimizer] = None
        self.data_loader: Any = None
        self.ledger: Optional[PrivacyLedger] = None
        self._ckpt_ledger: Optional[str] = None  # the ledger path of the checkpoint being resumed
        self._saved: Dict[str, Any] = {}  # what teardown restores

    # -- state of the callback in Lightning checkpoints ---------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """Saved by Lightning in each checkpoint (beside the DPOptimizer's state, which holds
        what resuming needs): the ledger's path, its releases and ε at ``delta`` then, for
        whoever reads the checkpoint."""
        dp = self.optimizer
        if dp is None:
            return {}
        return {
            "ledger": os.path.abspath(dp.ledger.path),
            "num_releases": int(dp.ledger.num_releases),
            "delta": self.delta,
            "epsilon": self.get_epsilon(),
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        # Called by trainer.fit(ckpt_path=...) before on_fit_start: a callback given no ledger
        # continues the checkpoint's (a fresh temporary file would be refused on load).
        self._ckpt_ledger = state_dict.get("ledger") if isinstance(state_dict, dict) else None

    # -- Lightning hooks -------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            check_trainer(trainer, pl_module)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        check_trainer(trainer, pl_module)
        opts = list(trainer.strategy.optimizers)
        if len(opts) != 1:
            raise ValueError(f"DPCallback needs exactly one optimizer from configure_optimizers, got {len(opts)}")
        if isinstance(opts[0], DPOptimizer):
            raise ValueError(
                "the optimizer is already a DPOptimizer: with DPCallback, configure_optimizers returns a plain "
                "torch.optim optimizer (the callback makes it private)"
            )
        # The fit loop's data source (Lightning ≥ 2.0: trainer.fit_loop._data_source, a
        # _DataLoaderSource): the module, the datamodule or the train_dataloaders given to fit.
        source = trainer.fit_loop._data_source
        loader = source.dataloader()
        if not isinstance(loader, DataLoader):
            raise TypeError(
                f"DPCallback needs the training data as one torch.utils.data.DataLoader (its dataset and batch_size "
                f"define the Poisson sampling), got {type(loader).__name__}"
            )
        ledger = self.ledger_arg if self.ledger_arg is not None else self._ckpt_ledger
        kw = dict(self.make_private_kwargs, ledger=ledger, seed=self.seed)
        if self.noise_multiplier is not None:
            _, dp, dp_loader = make_private(
                pl_module, opts[0], loader, noise_multiplier=self.noise_multiplier, max_grad_norm=self.max_grad_norm, **kw
            )
        else:
            epochs = self.epochs
            if epochs is None:
                epochs = trainer.max_epochs
                if epochs is None or epochs < 1:
                    raise ValueError("target_epsilon needs epochs= (or a Trainer with max_epochs) to calibrate for")
            _, dp, dp_loader = make_private_with_epsilon(
                pl_module, opts[0], loader, target_epsilon=self.target_epsilon, target_delta=self.target_delta,
                epochs=epochs, max_grad_norm=self.max_grad_norm, **kw,
            )
        dp.ledger_ahead = self.ledger_ahead  # read by the load_state_dict that Lightning calls next
        self.optimizer, self.data_loader, self.ledger = dp, dp_loader, dp.ledger
        self._saved = {"source": source.instance, "owns_ledger": not isinstance(ledger, PrivacyLedger)}
        # Lightning's LightningOptimizer wrappers are rebuilt by this setter; the LR schedulers
        # keep the wrapped optimizer, whose param_groups the DPOptimizer shares.
        trainer.strategy.optimizers = [dp]
        source.instance = dp_loader  # setup_data (and any reload) now gets the DP loader itself
        orig = pl_module.training_step

        @functools.wraps(orig)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            if _empty(dp_loader):
                return None  # no forward/backward; the optimizer step still releases (noise only)
            return orig(*args, **kwargs)

        pl_module.training_step = training_step  # an instance attribute, removed at teardown

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        dp, loader = self.optimizer, self.data_loader
        if dp is None:
            return
        drawn = getattr(loader, "samples_drawn", None)
        if drawn is not None and drawn != dp._releases:
            raise RuntimeError(
                f"{drawn} sample(s) drawn but {dp._releases} released: a training batch was not stepped exactly once "
                "(a callback or hook skipped or repeated optimizer.step); the ledger records every sample"
            )
        n = self.log_every_n_steps
        if n is not None and trainer.global_step % n == 0:
            pl_module.log(self.log_name, self.get_epsilon(), on_step=True, on_epoch=False, prog_bar=self.prog_bar)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.optimizer is not None:
            pl_module.log(self.log_name, self.get_epsilon(), on_step=False, on_epoch=True, prog_bar=self.prog_bar)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._restore(trainer, pl_module)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning does not call teardown after an exception: release the ledger's file lock.
        self._restore(trainer, pl_module)

    def _restore(self, trainer: Any, pl_module: Any) -> None:
        pl_module.__dict__.pop("training_step", None)
        saved, self._saved = self._saved, {}
        if "source" in saved:
            trainer.fit_loop._data_source.instance = saved["source"]
        dp = self.optimizer
        if dp is not None and saved:
            dp.engine.remove()  # the module's layers, as they were before fit
            if saved.get("owns_ledger"):
                dp.ledger.close()

    # -- accounting ----------------------------------------------------------------------

    def get_epsilon(self, delta: Optional[float] = None) -> float:
        """ε at ``delta`` (default: the callback's) of everything the ledger holds
        (:meth:`dpcore.torch.DPOptimizer.get_epsilon`); ``inf`` at noise 0."""
        if self.optimizer is None:
            raise RuntimeError("no DP training has started: fit a Trainer with this callback first")
        eps = float(self.optimizer.get_epsilon(self.delta if delta is None else delta))
        return eps if not math.isnan(eps) else float("inf")
