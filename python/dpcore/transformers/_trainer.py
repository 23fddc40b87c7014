"""DPTrainer: the Hugging Face ``Trainer`` with DP-SGD (Abadi et al. 2016) through dpcore.torch.

What changes against the plain Trainer, and why:

* **Sampling.** The training loader is :class:`~._data.TrainerBatches`: one Poisson sample per
  optimizer step at q = per_device_train_batch_size × gradient_accumulation_steps / n, split
  into ``gradient_accumulation_steps`` micro-batches; it is not handed to ``accelerator.prepare``.
* **Loss.** ``training_step`` computes each record's own loss (:mod:`._loss`) and backpropagates
  their sum; the Trainer's division by the accumulation steps and by ``num_items_in_batch`` is
  bypassed, since it would tie a record's gradient to the other records' token counts.
* **Release.** The optimizer the Trainer creates is wrapped in a :class:`dpcore.torch.DPOptimizer`
  (``loss_reduction="sum"``): after each micro-batch's backward pass ``accumulate()`` clips its
  records into the logical batch, and the Trainer's one ``optimizer.step()`` per logical batch
  adds the noise, records the release in the ledger and applies the update.
* **Clipping.** ``args.max_grad_norm`` (the Trainer's clipping of the whole batch's gradient) is
  set to 0: the DP ``max_grad_norm`` is the per-record bound C.
* **Accounting.** ε at ``delta`` is added to every log; each checkpoint gets a copy of the ledger
  and ``dp_state.json``.
* **Privacy unit.** ``privacy_unit="user"`` with ``user_id_column=`` (a column of train_dataset,
  read once at construction and removed from every batch) makes a record all the rows of one user:
  ``examples_per_user=k`` samples users (each sampled user's mean gradient over at most k of its
  rows is clipped as one record), ``max_examples_per_user=K`` bounds each user to K rows and
  samples rows; ε is then user-level.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import shutil
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch

import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ..plan import calibrate_noise, steps_for_epochs
from ..ledger import PrivacyLedger
from ..sampling import UserIndex
from ..torch import DPOptimizer
from ..torch._distributed import resolve_ledger
from ._data import TAG, BatchTag, DPRun, TrainerBatches
from ._loss import default_per_record_loss
from ._options import CLIPPING, PRIVACY_UNITS, SAMPLERS, _DPOptions, _dp_options  # noqa: F401 (public here)

__all__ = ["DPTrainer", "DPTrainerMixin", "make_private_trainer", "LEDGER_NAME", "STATE_NAME"]

#: Default ledger file name, in ``args.output_dir``; also the name of its copy in a checkpoint.
LEDGER_NAME = "privacy_ledger.jsonl"
#: The DP state written into each checkpoint.
STATE_NAME = "dp_state.json"
_STATE_FORMAT = "dpcore-trainer-dp-state"

_DEFAULT_TRAINER_CLIP = 1.0  # TrainingArguments.max_grad_norm's default
# Keys of a padding-free batch (TRL's collator): several examples in one row.
_PACKED_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")


def _is_hf_dataset(ds: Any) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(ds, datasets.Dataset)


def _plain_id(v: Any) -> Any:
    """A row's user id as a plain Python value (a 0-d tensor or numpy scalar unwrapped)."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise ValueError(f"a user id must be one value, got a tensor of shape {tuple(v.shape)}")
        return v.item()
    if isinstance(v, np.generic):
        return v.item()
    return v


def _read_user_ids(ds: Any, column: str) -> Any:
    """The ``column`` of every row of ``ds`` (a ``datasets.Dataset``, or a map-style dataset of
    dicts), in row order; a clear error when a row lacks it."""
    if _is_hf_dataset(ds):
        if column not in ds.column_names:
            raise ValueError(
                f"user_id_column={column!r} is not a column of train_dataset (its columns: {ds.column_names})"
            )
        return ds.with_format(None)[column]
    ids: List[Any] = []
    for i in range(len(ds)):
        row = ds[i]
        if not isinstance(row, Mapping):
            raise TypeError(
                f"user_id_column={column!r} needs rows that are dicts (or a datasets.Dataset); row {i} of train_dataset "
                f"is a {type(row).__name__}"
            )
        if column not in row:
            raise ValueError(f"user_id_column={column!r}: row {i} of train_dataset has no such column (its keys: {sorted(row)})")
        ids.append(_plain_id(row[column]))
    return ids


def _user_index(ds: Any, column: str) -> UserIndex:
    """The users of ``ds`` from its ``column`` (checked: one id per row, none missing)."""
    n = len(ds)
    ids = _read_user_ids(ds, column)
    if isinstance(ids, list) and len({isinstance(v, (str, bytes)) for v in ids}) > 1:
        # numpy would turn ints and strings into strings (1 and "1" one user): UserIndex refuses
        # the mix when it sees the values themselves
        ids = np.array(ids, dtype=object)
    try:
        return UserIndex(ids, n)
    except (TypeError, ValueError) as e:
        msg = str(e).replace("user_ids", f"the user ids of column {column!r}")
        raise type(e)(msg) from None


class _WithoutColumn:
    """A collator that drops ``column`` from each row first: the user ids never reach the model."""

    def __init__(self, collate_fn: Callable[[List[Any]], Any], column: str) -> None:
        self.collate_fn, self.column = collate_fn, column

    def __call__(self, rows: List[Any]) -> Any:
        c = self.column
        return self.collate_fn([{k: v for k, v in r.items() if k != c} if isinstance(r, Mapping) else r for r in rows])


class _TrainerDPOptimizer(DPOptimizer):
    """The DPOptimizer of a DP trainer: checks, before each release, that the logical batch
    was trained on whole (every micro-batch, in order) and that its sample is in the ledger."""

    _dp_run: DPRun

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        run = self._dp_run
        run.before_release()
        try:
            out = super().step(closure)
        except BaseException:
            run.abandon()
            raise
        run.after_release()
        return out


def _find_dp(opt: Any) -> Optional[DPOptimizer]:
    """The DPOptimizer inside accelerate's (or anyone's) ``.optimizer`` wrappers, if any."""
    seen = 0
    while opt is not None and seen < 8:
        if isinstance(opt, DPOptimizer):
            return opt
        opt = getattr(opt, "optimizer", None)
        seen += 1
    return None


class _DPEpoch(transformers.TrainerCallback):
    """Sets ``state.epoch`` (what the Trainer logs and saves) from the global step: the Trainer
    computes it from the micro-batches seen in the current iteration of the loader, but a
    resumed run's loader (:class:`TrainerBatches`) starts at the step where it stopped, not at
    the start of the epoch (``ignore_data_skip``: no batch is drawn to be skipped), so the
    Trainer's count restarts at 0 and its epoch with it."""

    def __init__(self, run: DPRun) -> None:
        self.run = run

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        spe = self.run.steps_per_epoch
        if spe > 0:
            state.epoch = state.global_step / spe


class DPTrainerMixin:
    """DP-SGD for a ``transformers.Trainer`` (or any subclass of it, e.g. TRL's ``SFTTrainer``).

    Put it first among the bases, as :class:`DPTrainer` does, or let :func:`make_private_trainer`
    do it for an existing trainer. Public attributes once set up: :attr:`ledger`,
    :attr:`noise_multiplier`, :attr:`max_grad_norm` (C), :attr:`sampling_probability`,
    :attr:`delta` (the δ of the logged ε), :attr:`dp_optimizer` (after training starts) and
    :meth:`get_epsilon`."""

    _dp_run: Optional[DPRun] = None
    #: What a record whose gradient is not finite does (``on_nonfinite=``, see DPOptimizer).
    _dp_on_nonfinite: str = "zero"
    #: The per-record gradients' memory mode (``memory=``, see DPOptimizer).
    _dp_memory: str = "default"
    #: The train_dataset column of the user ids (privacy unit "user"), else None.
    _dp_user_id_column: Optional[str] = None

    # -- set-up -----------------------------------------------------------------------------

    def _dp_setup(self, options: Optional[_DPOptions] = None, **dp_kwargs: Any) -> None:
        """Sets up DP training: with ``options`` checked by :func:`_dp_options` (as
        :class:`DPTrainer` and :func:`make_private_trainer` do), else from :class:`DPTrainer`'s
        keyword arguments ``dp_kwargs``, checked here."""
        o = options if options is not None else _dp_options(**dp_kwargs)
        noise_multiplier, target_epsilon, target_delta = o.noise_multiplier, o.target_epsilon, o.target_delta
        ledger, delta, per_record_loss, seed = o.ledger, o.delta, o.per_record_loss, o.seed
        poisson_sampling = o.sampler == "poisson"
        args = self.args
        self._dp_refuse_unsupported(args)
        ds = self.train_dataset
        if ds is None:
            raise ValueError("the DP trainer needs train_dataset (the population the Poisson samples are drawn from)")
        if isinstance(ds, torch.utils.data.IterableDataset) or not hasattr(ds, "__len__"):
            raise TypeError(
                "train_dataset must be a map-style dataset with a length (Poisson sampling draws records by index); "
                f"got {type(ds).__name__}"
            )
        n = len(ds)
        if n < 1:
            raise ValueError("train_dataset is empty")
        bs, ga = int(args.per_device_train_batch_size), int(args.gradient_accumulation_steps)
        declared = o.population_size
        # the privacy unit "user": the ids read (and checked) once, before anything is opened
        users = _user_index(ds, o.user_id_column) if o.privacy_unit == "user" else None  # type: ignore[arg-type]
        if users is None:
            drawn, what = n, "records of train_dataset"
        elif o.examples_per_user is not None:
            drawn, what = users.num_users, "users of train_dataset"
        else:
            drawn = int(np.minimum(users.counts, int(o.max_examples_per_user)).sum())  # type: ignore[arg-type]
            what = f"rows train_dataset keeps with at most {o.max_examples_per_user} per user"
        if bs * ga > (drawn if declared is None else declared):
            raise ValueError(
                f"per_device_train_batch_size × gradient_accumulation_steps = {bs * ga} exceeds the "
                f"{drawn if declared is None else declared} {what if declared is None else '(population_size)'}: the "
                "sampling probability would exceed 1"
            )
        seeded = seed is not None
        if seeded:
            warnings.warn(
                "DP trainer seed= is for tests only: seeded sampling and noise give no privacy",
                UserWarning,
                stacklevel=3,
            )
        run = DPRun(
            ledger=None,
            population_size=n,
            batch_size=bs,
            accumulation=ga,
            poisson=poisson_sampling,
            seed=seed,
            declared_population=declared,
            users=users,
            examples_per_user=o.examples_per_user,
            max_examples_per_user=o.max_examples_per_user,
        )
        self._dp_user_id_column = o.user_id_column
        # -- σ: given, or calibrated for the planned number of steps
        q = min(1.0, run.sampling_probability)
        spe = None if poisson_sampling else run.steps_per_epoch
        steps = int(args.max_steps) if args.max_steps and args.max_steps > 0 else steps_for_epochs(
            run.sampler, float(args.num_train_epochs), q, steps_per_epoch=spe
        )
        bound: Dict[str, Any] = {} if o.max_examples_per_user is None else {"max_examples_per_user": o.max_examples_per_user}
        if noise_multiplier is None:
            # shuffled batches: no amplification, one Gaussian query per epoch begun, as the
            # ledger states them under the run's relation (zero-out)
            # ELS: a user is up to K rows each sampled independently (the mixture-of-Gaussians
            # analysis); ULS: the example-level analysis with users as records
            noise_multiplier = calibrate_noise(
                float(target_epsilon), float(target_delta), sampler=run.sampler, sampling_probability=q,  # type: ignore[arg-type]
                steps=max(1, steps), steps_per_epoch=spe, accountant=o.accountant,
                **bound,
            )
        run.noise_multiplier = float(noise_multiplier)
        run.max_grad_norm = o.max_grad_norm
        run.clipping = o.clipping
        run.joint_scales = o.joint_scales
        run.noise_mechanism = o.noise_mechanism
        run.planned_steps = steps
        run.delta = float(delta if delta is not None else target_delta if target_delta is not None else 1.0 / (10.0 * run.population))
        run.accountant = o.accountant
        run.pad_to(o.pad_batches)
        model = getattr(self, "model", None)
        if o.joint_scales is not None and model is not None:
            m = sum(1 for p in model.parameters() if p.requires_grad)
            if len(o.joint_scales) != m:
                raise ValueError(
                    f"clipping='joint' needs joint_scales with one scale per trainable parameter tensor ({m}), "
                    f"got {len(o.joint_scales)}"
                )
        loss_fn = per_record_loss
        if loss_fn is None and model is not None:
            loss_fn = default_per_record_loss(model)
            if loss_fn is None:
                raise ValueError(
                    f"no per-record loss is built in for {type(model).__name__} (causal language models and sequence "
                    "classifiers are): pass per_record_loss=fn, fn(model, inputs) -> (B,) tensor of each record's loss"
                )
        if float(getattr(args, "label_smoothing_factor", 0.0) or 0.0) > 0 and per_record_loss is None:
            raise ValueError("label_smoothing_factor is not applied by the built-in per-record losses; pass per_record_loss=")
        run.loss_fn = loss_fn
        run.ledger_ahead = o.ledger_ahead
        self._dp_on_nonfinite = o.on_nonfinite
        self._dp_memory = o.memory
        # -- the Trainer's own batch clipping and data skipping are off (see the module docstring)
        old = float(args.max_grad_norm or 0.0)
        if old not in (0.0, _DEFAULT_TRAINER_CLIP):
            warnings.warn(
                f"args.max_grad_norm={old} is ignored: the Trainer's clipping of the batch gradient is off under DP; "
                "the DP max_grad_norm bounds each record's gradient",
                UserWarning,
                stacklevel=3,
            )
        # -- the ledger (default: <output_dir>/privacy_ledger.jsonl, continued if it exists), opened
        # last, once every argument passed its checks
        if ledger is None:
            ledger = os.path.join(args.output_dir, LEDGER_NAME)
            logging.getLogger("dpcore").info(
                "no ledger= given: the privacy ledger is %s (continued if it exists; trainer.ledger.path gives it)",
                os.path.abspath(ledger),
            )
        if not isinstance(ledger, PrivacyLedger):
            os.makedirs(os.path.dirname(os.path.abspath(os.fspath(ledger))), exist_ok=True)
        # one ledger holds one unit: a ledger of the other unit is refused
        ledger = resolve_ledger(ledger, None, privacy_unit=run.privacy_unit)
        run.ledger = ledger
        if users is not None:
            logging.getLogger("dpcore").info(
                "user-level DP: a record is a user (column %r: %d users, %d rows, at most %d rows per user); %s; the "
                "logged epsilon is user-level (epsilon, delta=%g)",
                o.user_id_column, users.num_users, users.num_examples, int(users.counts.max()),
                f"each step samples users at q={run.sampling_probability:.4g}, each sampled user gives the mean of at "
                f"most {o.examples_per_user} of its rows" if o.examples_per_user is not None else
                f"each user bounded to {o.max_examples_per_user} rows ({run.n} kept), rows sampled at "
                f"q={run.sampling_probability:.4g}", run.delta,
            )
        args.max_grad_norm = 0.0
        args.ignore_data_skip = True  # a resumed run restarts the sampler at its step, drawing nothing to skip
        self._dp_run = run
        # first, so that every other callback sees the corrected epoch
        self.callback_handler.callbacks.insert(0, _DPEpoch(run))

    @staticmethod
    def _dp_refuse_unsupported(args: Any) -> None:
        why = None
        if getattr(args, "deepspeed", None):
            why = "DeepSpeed"
        elif getattr(args, "fsdp", None) and str(getattr(args, "fsdp", "")).strip() not in ("", "[]", "False"):
            why = "FSDP"
        elif int(getattr(args, "world_size", 1) or 1) > 1:
            why = f"distributed training (world_size={args.world_size})"
        elif int(getattr(args, "n_gpu", 1) or 0) > 1:
            why = f"torch.nn.DataParallel over {args.n_gpu} GPUs (set CUDA_VISIBLE_DEVICES to one GPU)"
        elif getattr(args, "auto_find_batch_size", False):
            why = "auto_find_batch_size=True (it would change the batch size, and so q, during the run)"
        if why is not None:
            raise NotImplementedError(f"the DP trainer does not support {why}; it trains in one process on one device")

    # -- public --------------------------------------------------------------------------------

    def _dp(self) -> DPRun:
        run = self._dp_run
        if run is None:
            raise RuntimeError("this trainer has no DP state (use DPTrainer or make_private_trainer)")
        return run

    @property
    def ledger(self) -> PrivacyLedger:
        """The privacy ledger every sample and release of this trainer is recorded in."""
        return self._dp().ledger

    @property
    def noise_multiplier(self) -> float:
        """σ (given, or calibrated to ``target_epsilon`` at construction)."""
        return self._dp().noise_multiplier

    @property
    def max_grad_norm(self) -> Any:
        """The per-record clipping bound C (not ``args.max_grad_norm``, which is off)."""
        return self._dp().max_grad_norm

    @property
    def sampling_probability(self) -> float:
        """q = per_device_train_batch_size × gradient_accumulation_steps / N: N the rows of
        train_dataset, or its users (``examples_per_user``), or the rows kept per user
        (``max_examples_per_user``), unless ``population_size`` declared it."""
        return self._dp().sampling_probability

    @property
    def privacy_unit(self) -> str:
        """``"example"`` (one row of train_dataset) or ``"user"``: what the logged ε protects."""
        return self._dp().privacy_unit

    @property
    def user_index(self) -> Optional[UserIndex]:
        """The users of train_dataset (``privacy_unit="user"``), read from ``user_id_column``."""
        return self._dp().users

    @property
    def kept_examples(self) -> Optional[np.ndarray]:
        """With ``max_examples_per_user=K``: the rows of train_dataset kept (at most K per user,
        chosen once by ChaCha20), sorted; the sampler draws from these only. Else None."""
        return self._dp().kept

    @property
    def delta(self) -> float:
        """The δ of the ε that is logged."""
        return self._dp().delta

    @property
    def dp_optimizer(self) -> Optional[DPOptimizer]:
        """The DPOptimizer (once ``train()`` has created the optimizer)."""
        return _find_dp(getattr(self, "optimizer", None))

    def get_epsilon(self, delta: Optional[float] = None, **kw: Any) -> float:
        """ε of everything recorded in the ledger, at ``delta`` (default :attr:`delta`); for a
        ledger of the privacy unit "user" a user-level ε."""
        run = self._dp()
        kw.setdefault("accountant", run.accountant)
        return run.ledger.get_epsilon(run.delta if delta is None else delta, **kw)

    def _dp_epsilon(self) -> float:
        """ε at :attr:`delta` for the logs, computed once per release count. The ledger's
        warnings (shuffled batches, test seeds) are shown once per kind, not at every log."""
        run = self._dp()
        key = (run.ledger.num_releases, len(run.ledger.samples))
        if run.eps_cache[0] != key:
            eps = 0.0
            if key[0]:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    eps = float(self.get_epsilon())
                for w in caught:
                    kind = (w.category, re.sub(r"\d+", "#", str(w.message)))
                    if kind not in run.warned:
                        run.warned.add(kind)
                        warnings.warn(w.message, stacklevel=2)
            run.eps_cache = (key, eps)
        return run.eps_cache[1]

    # -- Trainer overrides -----------------------------------------------------------------------

    def get_train_dataloader(self) -> Any:
        run = self._dp()
        ds = self.train_dataset
        if ds is None or len(ds) != run.rows:
            raise ValueError(
                f"train_dataset changed after the DP trainer was set up ({run.rows} records then, "
                f"{None if ds is None else len(ds)} now): build a new trainer"
            )
        collator = self.data_collator
        is_hf = _is_hf_dataset(ds)
        col = self._dp_user_id_column
        if run.users is not None and col is not None:
            # the ids are read again: a dataset whose users changed since set-up is refused
            now = _user_index(ds, col)
            if now.fingerprint != run.users.fingerprint:
                raise ValueError(
                    f"the user ids of column {col!r} changed after the DP trainer was set up: the sampling (and the "
                    "ledger's user population) is that of the ids read then; build a new trainer"
                )
            if is_hf:
                ds = ds.remove_columns([col])  # before the Trainer's own column removal
        if is_hf:
            ds = self._remove_unused_columns(ds, description="Training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="Training")
        if col is not None and not is_hf:
            collator = _WithoutColumn(collator, col)
        return TrainerBatches(ds, collator, run, position=lambda: self.state.global_step)

    def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        run = self._dp()
        if _find_dp(getattr(self, "optimizer", None)) is not None:
            return self.optimizer
        opt = super().create_optimizer(*args, **kwargs)  # type: ignore[misc]
        if _find_dp(opt) is not None:
            return opt
        model = self.model
        if run.loss_fn is None:
            run.loss_fn = default_per_record_loss(model)
            if run.loss_fn is None:
                raise ValueError(f"no per-record loss is built in for {type(model).__name__}: pass per_record_loss=")
        dp = _TrainerDPOptimizer(
            opt,
            model=model,
            noise_multiplier=run.noise_multiplier,
            max_grad_norm=run.max_grad_norm,
            expected_batch_size=run.expected_batch_size,
            ledger=run.ledger,
            clipping=run.clipping,
            joint_scales=None if run.joint_scales is None else list(run.joint_scales),
            mechanism=run.noise_mechanism,
            loss_reduction="sum",
            data_loader=run,
            # fp16 on CUDA: accelerate's GradScaler. The DP optimizer divides the per-record
            # gradients by its scale before clipping; a record whose scaled gradient overflowed
            # contributes zero (on_nonfinite="zero"), every step releases and the scaler is told
            # of no overflow (its scale never backs off, so accelerate never reports a skipped
            # step); training_step scales the loss with it.
            grad_scaler=getattr(getattr(self, "accelerator", None), "scaler", None),
            seed=run.seed,
            on_nonfinite=self._dp_on_nonfinite,
            memory=self._dp_memory,
        )
        dp._dp_run = run
        dp.ledger_ahead = run.ledger_ahead  # what load_state_dict does with releases after the checkpoint
        # the error's hint names the keyword of the API this trainer was made with
        api = "DPTrainer(..., ledger_ahead=\"keep\")" if isinstance(self, DPTrainer) else (
            "make_private_trainer(trainer, ..., ledger_ahead=\"keep\")")
        dp.ledger_ahead_hint = f"build the trainer with {api} and resume again"
        self.optimizer = dp
        return dp

    def training_step(self, model: torch.nn.Module, inputs: Dict[str, Any], *args: Any, **kwargs: Any) -> torch.Tensor:
        """One micro-batch: each record's loss, the backward pass of their sum, and the records
        clipped into the logical batch (``DPOptimizer.accumulate``). Returns this micro-batch's
        share of the logical batch's mean loss per record (for logging)."""
        run = self._dp()
        tag: BatchTag = run.begin(inputs.pop(TAG, None))
        run.set_groups(tag)  # the privacy unit "user": which rows are whose, for the clip
        if self._dp_user_id_column is not None:
            inputs.pop(self._dp_user_id_column, None)
        device = self.args.device
        dp = self.dp_optimizer
        if dp is None:
            raise RuntimeError("the DP trainer's optimizer is not a DPOptimizer (was create_optimizer overridden?)")
        model.train()
        rows = tag.records if tag.rows is None else tag.rows
        if rows == 0:
            # An empty micro-batch has no record: nothing to compute. The logical batch is still
            # released (pure noise if every micro-batch is empty): skipping it would show that
            # no record was sampled.
            return torch.zeros((), device=device)
        if any(k in inputs for k in _PACKED_KEYS):
            raise ValueError(
                "this batch is padding-free (its examples concatenated into one row): a record would not be one "
                "example; use a padding collator"
            )
        try:
            inputs = self._prepare_inputs(inputs)
            with self.compute_loss_context_manager():
                losses = run.loss_fn(model, inputs)
            if not isinstance(losses, torch.Tensor) or losses.dim() != 1 or losses.shape[0] != rows:
                got = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
                raise ValueError(
                    f"per_record_loss must return one loss per record, a tensor of shape ({rows},); got {got}"
                )
            if tag.rows is not None:
                # padding adds nothing to the loss logged (its clip factor is 0 in the release)
                mask = torch.from_numpy(run.record_mask).to(losses.device, non_blocking=True)  # type: ignore[arg-type]
                losses = torch.where(mask, losses, torch.zeros((), dtype=losses.dtype, device=losses.device))
            total = losses.sum()
            scaler = dp.grad_scaler
            (total if scaler is None else scaler.scale(total)).backward()
            dp.accumulate()
        except BaseException:
            # Nothing of this logical batch may reach a later release: drop the records held from
            # its earlier micro-batches too (its sample was never written: it had no release).
            run.abandon()
            dp.zero_grad()
            dp.discard()
            raise
        # the mean loss per row of the logical batch (per example, also under privacy_unit="user")
        return (total.detach() / tag.size).to(device)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        # The Trainer would report the norm of the .grad left by the backward pass: under DP
        # those are empty (the records are held by the DPOptimizer until the release).
        return None

    def log(self, logs: Dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self._dp_run is not None and "epsilon" not in logs:
            logs["epsilon"] = self._dp_epsilon()
        return super().log(logs, *args, **kwargs)  # type: ignore[misc]

    def _save_checkpoint(self, model: Any, trial: Any, *args: Any, **kwargs: Any) -> None:
        super()._save_checkpoint(model, trial, *args, **kwargs)  # type: ignore[misc]
        if self._dp_run is None or not self.args.should_save:
            return
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if os.path.isdir(folder):
            self._dp_save(folder)

    def _dp_save(self, folder: str) -> None:
        """Writes the ledger's copy and ``dp_state.json`` into a checkpoint folder."""
        run = self._dp()
        led = run.ledger
        tmp = os.path.join(folder, LEDGER_NAME + ".tmp")
        shutil.copyfile(led.path, tmp)  # every entry is fsynced when written
        os.replace(tmp, os.path.join(folder, LEDGER_NAME))
        state = {
            "format": _STATE_FORMAT,
            "version": 1,
            "releases": led.num_releases,
            "samples": len(led.samples),
            "samples_drawn": run.samples_drawn,
            "global_step": int(self.state.global_step),
            "epsilon": self._dp_epsilon(),
            "delta": run.delta,
            "accountant": run.accountant,
            "noise_multiplier": run.noise_multiplier,
            "max_grad_norm": run.max_grad_norm,
            "clipping": run.clipping,
            "noise_mechanism": run.noise_mechanism,
            "sampling_probability": run.sampling_probability,
            "population_size": run.n,
            "policy": run.policy,
            "expected_batch_size": run.expected_batch_size,
            "gradient_accumulation_steps": run.accumulation,
            "steps_per_epoch": run.steps_per_epoch,
            "seeded": run.seed is not None,
            "ledger_path": os.path.abspath(led.path),
            # the privacy unit, the users' fingerprint and the bounds: a resume is refused with others
            **run.unit_state(),
            **({} if run.users is None else {"user_id_column": self._dp_user_id_column,
                                             "num_users": run.users.num_users}),
        }
        with open(os.path.join(folder, STATE_NAME), "w", encoding="utf-8") as f:
            json.dump(state, f, indent=1)
            f.write("\n")

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        self._dp()
        ckpt = resume_from_checkpoint
        if isinstance(ckpt, bool):
            if ckpt:
                ckpt = get_last_checkpoint(self.args.output_dir)
                if ckpt is None:
                    raise ValueError(f"no checkpoint found in output_dir ({self.args.output_dir})")
            else:
                ckpt = None
        if ckpt is not None:
            self._dp_resume(os.fspath(ckpt))
        return super().train(ckpt, *args, **kwargs)  # type: ignore[misc]

    def _dp_resume(self, ckpt: str) -> None:
        """Checks that the live ledger is this run's (it holds at least the releases the
        checkpoint was saved after) and restores the sampler's counters."""
        run = self._dp()
        path = os.path.join(ckpt, STATE_NAME)
        if not os.path.isfile(path):
            raise ValueError(
                f"{ckpt} has no {STATE_NAME}: it was not written by a DP trainer. To start DP training from its "
                "weights, load the model from it instead of resuming"
            )
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(f"{path}: not a DP trainer state file")
        run.check_unit_state(state, ckpt)  # another unit, other user ids or bounds: refused
        saved, live = int(state["releases"]), run.ledger.num_releases
        if live < saved:
            raise ValueError(
                f"the ledger {run.ledger.path} holds {live} release(s) but {ckpt} was saved after {saved}: it is not "
                f"this run's ledger. The checkpoint holds a copy ({os.path.join(ckpt, LEDGER_NAME)}): copy it to "
                f"{run.ledger.path} to continue from it"
            )
        for key, mine in (
            ("noise_multiplier", run.noise_multiplier),
            ("sampling_probability", run.sampling_probability),
            ("population_size", run.n),
        ):
            if key in state and not math.isclose(float(state[key]), float(mine), rel_tol=1e-9):
                warnings.warn(
                    f"resuming from {ckpt} with {key}={mine}, saved with {state[key]}: the ledger records what each "
                    "step used, but a calibrated target ε no longer holds",
                    UserWarning,
                    stacklevel=4,
                )
        run.load_state_dict(state)
        run.abandon()


class DPTrainer(DPTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with DP-SGD: Poisson-sampled logical batches, per-record clipping
    and Gaussian noise through :class:`dpcore.torch.DPOptimizer`, every release in a privacy ledger.

    ``DPTrainer(model=..., args=TrainingArguments(...), train_dataset=..., data_collator=...,
    noise_multiplier=σ | target_epsilon=ε with target_delta=δ, max_grad_norm=C, ...)``; every other
    keyword goes to ``transformers.Trainer``.

    * ``noise_multiplier`` σ, or ``target_epsilon``/``target_delta``: σ calibrated (PLD accountant
      by default, ``accountant="rdp"`` too) so that the planned steps (``args.max_steps`` if > 0,
      else ``num_train_epochs × round(1/q)``) are (ε, δ)-DP. Exactly one of the two.
    * ``max_grad_norm`` C: each record's gradient is clipped to norm C (``clipping="flat"``; or
      ``"per_layer"``, C/√m per parameter tensor, or a list of bounds; or ``"joint"`` with
      ``joint_scales``, one scale α_p per trainable parameter tensor in the model's order, as
      :class:`dpcore.torch.DPOptimizer`). ``args.max_grad_norm``, the Trainer's batch clipping,
      is switched off.
    * ``ledger``: a :class:`dpcore.PrivacyLedger` or a path; default
      ``<args.output_dir>/privacy_ledger.jsonl`` (continued if it exists).
    * ``sampler``: ``"poisson"`` (the default; q = per_device_train_batch_size ×
      gradient_accumulation_steps / n) or ``"shuffle"`` (shuffled fixed batches, recorded as
      ``shuffle``: accounted without amplification). The other samplers of
      :mod:`dpcore.sampling` are refused: the Trainer's own dataloader draws the batches (use
      :func:`dpcore.torch.make_private` with ``sampler=`` in a torch loop for them).
    * ``noise_mechanism``: ``"gaussian"`` (the default) or ``"discrete_gaussian"`` (with
      ``noise_multiplier``; see :func:`dpcore.torch.make_private`). ``"banded"`` and ``"blt"``
      are refused: matrix-factorization noise needs a fixed cyclic data order, not the
      Trainer's fresh sample every step.
    * ``delta``: the δ of the ε added to the logs; default ``target_delta``, else 1/(10·n).
    * ``per_record_loss``: ``fn(model, inputs) -> (B,)`` tensor, each record's loss; default by
      the model's class: :func:`causal_lm_per_record_loss` or
      :func:`sequence_classification_per_record_loss`.
    * ``on_nonfinite``: ``"zero"`` (the default): a record whose gradient is NaN or infinite
      (bad data; with ``fp16=True``, a scaled gradient that overflowed) contributes zero and the
      step releases as usual, nothing raised or logged about it; ``"raise"``: ``ValueError``
      naming it (a debugging aid whose outcome depends on the data, not DP).
    * ``population_size``: N, the public number of records that q = batch/N, the denominator
      q·N and the ledger are stated for (Poisson; default: ``len(train_dataset)``, then assumed
      public, as the report says). Under add-or-remove adjacency the dataset's true size is
      data (Opacus #571): declare N where it is not public. With ``privacy_unit="user"`` N is
      the number of users (``examples_per_user``) or of rows kept per user
      (``max_examples_per_user``).
    * ``privacy_unit``: ``"example"`` (the default; a record is one row of train_dataset) or
      ``"user"``, with ``user_id_column`` (the name of the train_dataset column holding each
      row's user id, ints or strings; read once here, checked, and removed from every batch) and
      exactly one of:

      - ``examples_per_user=k`` (user-level sampling): each step is a Poisson sample of *users*
        at q = per_device_train_batch_size × gradient_accumulation_steps / U (the batch size is
        then the expected number of users per step); each sampled user gives at most k of its
        rows (ChaCha20), the mean of their gradients is clipped to C as one record, and the
        noised sum is divided by the expected users per step. A micro-batch holds whole users
        (it may hold up to per_device_train_batch_size × k rows and more: size it for that).
      - ``max_examples_per_user=K`` (example-level sampling, user-level guarantee): each user is
        bounded once to at most K of its rows (ChaCha20), and rows are Poisson sampled and clipped
        as now, q over the rows kept; the accountant takes a user as up to K rows.

      The ledger's unit is then ``"user"``, each sample carries its bound, and the logged ε is
      user-level. Resuming with other user ids (or bounds) is refused. Poisson sampling only.
    * ``seed``: tests only (sampling and noise become predictable: no privacy).

    Refused at construction: DeepSpeed, FSDP, more than one process or GPU,
    ``auto_find_batch_size``."""

    def __init__(
        self,
        model: Any = None,
        args: Any = None,
        *trainer_args: Any,
        noise_multiplier: Optional[float] = None,
        target_epsilon: Optional[float] = None,
        target_delta: Optional[float] = None,
        max_grad_norm: Any = None,
        ledger: Any = None,
        sampler: Optional[str] = None,
        clipping: str = "flat",
        joint_scales: Any = None,
        noise_mechanism: Optional[str] = None,
        delta: Optional[float] = None,
        per_record_loss: Optional[Callable[[Any, Dict[str, Any]], torch.Tensor]] = None,
        accountant: str = "pld",
        ledger_ahead: str = "refuse",
        seed: Optional[int] = None,
        poisson_sampling: Optional[bool] = None,
        on_nonfinite: str = "zero",
        population_size: Optional[int] = None,
        privacy_unit: str = "example",
        user_id_column: Optional[str] = None,
        examples_per_user: Optional[int] = None,
        max_examples_per_user: Optional[int] = None,
        memory: str = "default",
        pad_batches: Any = False,
        **trainer_kwargs: Any,
    ) -> None:
        # checked once, before the Trainer is built
        options = _dp_options(
            noise_multiplier=noise_multiplier, target_epsilon=target_epsilon, target_delta=target_delta,
            max_grad_norm=max_grad_norm, ledger=ledger, sampler=sampler, clipping=clipping, joint_scales=joint_scales,
            noise_mechanism=noise_mechanism, delta=delta, per_record_loss=per_record_loss, accountant=accountant,
            ledger_ahead=ledger_ahead, seed=seed, poisson_sampling=poisson_sampling, on_nonfinite=on_nonfinite,
            population_size=population_size, privacy_unit=privacy_unit, user_id_column=user_id_column,
            examples_per_user=examples_per_user, max_examples_per_user=max_examples_per_user, memory=memory,
            pad_batches=pad_batches,
        )
        super().__init__(model, args, *trainer_args, **trainer_kwargs)
        self._dp_setup(options)


@functools.lru_cache(maxsize=None)
def _private_class(base: type) -> type:
    return type(f"DP{base.__name__}", (DPTrainerMixin, base), {"__module__": __name__, "__doc__": DPTrainerMixin.__doc__})


def make_private_trainer(trainer: Any, **dp_kwargs: Any) -> Any:
    """Turns an existing, not yet trained ``transformers.Trainer`` (or subclass instance, such
    as TRL's ``SFTTrainer``) into a DP one, in place, and returns it.

    Its class becomes a subclass of (:class:`DPTrainerMixin`, its class); ``dp_kwargs`` are
    :class:`DPTrainer`'s (``noise_multiplier`` or ``target_epsilon``/``target_delta``,
    ``max_grad_norm``, ``ledger``, ...). Training uses the per-record loss, not the trainer's
    ``compute_loss`` (which evaluation still uses). Packed or padding-free batches (several
    examples in one row) are refused: a record must be one example."""
    if not isinstance(trainer, transformers.Trainer):
        raise TypeError(f"make_private_trainer needs a transformers.Trainer, got {type(trainer).__name__}")
    if isinstance(trainer, DPTrainerMixin):
        raise ValueError("this trainer is already private")
    state = getattr(trainer, "state", None)
    prepared = type(getattr(trainer, "optimizer", None)).__name__ == "AcceleratedOptimizer"
    if prepared or (state is not None and getattr(state, "global_step", 0) > 0):
        raise ValueError("make_private_trainer needs a trainer that has not trained yet")
    args = trainer.args
    if getattr(args, "packing", False):
        raise ValueError(
            "packing=True puts several examples into one sequence: a record would no longer be one example; "
            "set packing=False"
        )
    if getattr(args, "padding_free", False):
        raise ValueError("padding_free=True concatenates a batch's examples into one row; set padding_free=False")
    options = _dp_options(**dp_kwargs)  # checked once, before the trainer is changed
    base = type(trainer)
    trainer.__class__ = _private_class(base)
    try:
        trainer._dp_setup(options)
    except BaseException:
        trainer.__class__ = base
        raise
    return trainer
