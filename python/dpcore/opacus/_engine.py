"""``PrivacyEngine`` over :mod:`dpcore.torch`, with Opacus's keyword arguments."""

from __future__ import annotations

import logging
import warnings
from typing import Any, List, Optional, Tuple

import torch
from torch import nn

from .. import torch as dptorch
from ..ledger import PrivacyLedger
from .validators.module_validator import ModuleValidator

_log = logging.getLogger("dpcore.opacus")

#: Opacus's accountant names -> dpcore's. Opacus's PRV accountant (its default) is a numerical
#: PLD-type analysis and its GDP accountant a CLT approximation (not an upper bound); dpcore's
#: "pld" is the tightest certified bound it has, so both map to it.
ACCOUNTANTS = {"prv": "pld", "gdp": "pld", "pld": "pld", "rdp": "rdp"}
#: Opacus's per-sample gradient modes: all accepted; dpcore picks its own per-layer rules.
GRAD_SAMPLE_MODES = ("hooks", "functorch", "ew", "ghost", "ghost_fsdp", "no_op")


def _accountant(name: str) -> str:
    if name not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {', '.join(map(repr, ACCOUNTANTS))}, got {name!r}")
    return ACCOUNTANTS[name]


class GradSampleModule(nn.Module):
    """The model as ``make_private`` returns it: a thin wrapper whose ``_module`` is the original
    model (as Opacus's ``GradSampleModule``; ``state_dict`` keys gain the ``_module.`` prefix, as
    Opacus's do). The per-record capture is installed on the original model's layers; attributes
    not found on the wrapper are looked up on the model."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._module(*args, **kwargs)

    def __getattr__(self, item: str) -> Any:
        try:
            return super().__getattr__(item)
        except AttributeError:
            if item == "_module":
                raise
            return getattr(super().__getattr__("_module"), item)


class PrivacyLedgerAccountant:
    """``privacy_engine.accountant``: Opacus's accountant interface read from the ledger."""

    def __init__(self, engine: "PrivacyEngine") -> None:
        self._engine = engine

    def mechanism(self) -> str:
        return self._engine.accountant_name

    @property
    def history(self) -> List[Tuple[float, float, int]]:
        """(noise_multiplier, sample_rate, steps) for each run of equal released steps, in order,
        as Opacus's ``accountant.history``; built from the ledger's samples (z by Eq. (1))."""
        ledger = self._engine.ledger
        out: List[Tuple[float, float, int]] = []
        if ledger is None:
            return out
        for s in ledger.samples:
            if not s.released:
                continue
            z = float(s.noise_multiplier()) if not s.non_private else 0.0
            q = float(s.sampling_probability)
            if out and out[-1][0] == z and out[-1][1] == q:
                out[-1] = (z, q, out[-1][2] + 1)
            else:
                out.append((z, q, 1))
        return out

    def get_epsilon(self, delta: float, **kw: Any) -> float:
        return self._engine.get_epsilon(delta, **kw)

    def __len__(self) -> int:
        return len(self.history)


class PrivacyEngine:
    """Opacus's ``PrivacyEngine(accountant="prv", secure_mode=False)``.

    * ``accountant``: ``"prv"`` (Opacus's default) and ``"gdp"`` are dpcore's PLD accountant
      (the tightest certified bound), ``"rdp"`` is RDP; ``"pld"`` is accepted too.
    * ``secure_mode``: accepted; dpcore always samples and noises from ChaCha20 seeded by the OS,
      which is what ``secure_mode=True`` asks of Opacus.
    * ``ledger`` (dpcore only): where samples and releases are recorded (a path or a
      :class:`dpcore.PrivacyLedger`); default a fresh ``dpcore-*/ledger.jsonl`` under the
      system's temporary directory (``privacy_engine.ledger.path``), shared by every
      ``make_private`` of this engine.
    """

    def __init__(self, *, accountant: str = "prv", secure_mode: bool = False, ledger: Any = None) -> None:
        self.accountant_name = accountant
        self._acct = _accountant(accountant)
        self.secure_mode = bool(secure_mode)
        self._ledger_arg = ledger
        self.ledger: Optional[PrivacyLedger] = None
        self.accountant = PrivacyLedgerAccountant(self)
        self.optimizers: List[Any] = []

    # -- the ledger ------------------------------------------------------------------------

    def _the_ledger(self) -> PrivacyLedger:
        if self.ledger is None:
            if isinstance(self._ledger_arg, PrivacyLedger):
                self.ledger = self._ledger_arg
            else:
                import os
                import tempfile

                path = self._ledger_arg or os.path.join(tempfile.mkdtemp(prefix="dpcore-"), "ledger.jsonl")
                self.ledger = PrivacyLedger(path)
            _log.info("dpcore.opacus: privacy ledger at %s", self.ledger.path)
        return self.ledger

    # -- make_private ----------------------------------------------------------------------

    def _options(self, module: nn.Module, data_loader: Any, *, batch_first: bool, loss_reduction: str,
                 poisson_sampling: bool, clipping: str, noise_generator: Any, grad_sample_mode: str,
                 kwargs: dict) -> dict:
        if grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise ValueError(f"grad_sample_mode must be one of {', '.join(map(repr, GRAD_SAMPLE_MODES))}, "
                             f"got {grad_sample_mode!r}")
        if noise_generator is not None:
            warnings.warn("noise_generator is ignored: dpcore draws its noise from ChaCha20 seeded by the OS",
                          UserWarning, stacklevel=3)
        if clipping not in ("flat", "per_layer"):
            raise ValueError(f"clipping={clipping!r}: dpcore.opacus supports 'flat' and 'per_layer' "
                             "(adaptive clipping: dpcore.torch.make_private(query=QuantileAdaptiveClipQuery(...)))")
        for k in ("wrap_model", "rand_on_empty"):
            kwargs.pop(k, None)
        if isinstance(module, GradSampleModule):
            module = module._module
        ModuleValidator.validate(module, strict=True)
        if grad_sample_mode == "ghost":
            # Opacus's ghost clipping is two backward passes for memory: dpcore's memory-lean mode
            # (the criterion stays the user's own: the two passes run inside loss.backward()).
            kwargs.setdefault("memory", "lean")
        opts = dict(
            ledger=self._the_ledger(), clipping=clipping, loss_reduction=loss_reduction, batch_first=batch_first,
            sampler="poisson" if poisson_sampling else "shuffle", **kwargs,
        )
        return opts

    def _wrap(self, model: nn.Module, optimizer: Any, loader: Any, criterion: Any, grad_sample_mode: str) -> Any:
        self.optimizers.append(optimizer)
        wrapped = GradSampleModule(model)
        if grad_sample_mode in ("ghost", "ghost_fsdp"):
            return wrapped, optimizer, criterion, loader
        return wrapped, optimizer, loader

    def make_private(
        self, *, module: nn.Module, optimizer: torch.optim.Optimizer, data_loader: Any,
        noise_multiplier: Optional[float] = None, max_grad_norm: Any, criterion: Any = None,
        batch_first: bool = True, loss_reduction: str = "mean", poisson_sampling: bool = True,
        clipping: str = "flat", noise_generator: Any = None, grad_sample_mode: str = "hooks",
        target_epsilon: Optional[float] = None, target_delta: Optional[float] = None, epochs: Optional[int] = None,
        **kwargs: Any,
    ) -> Any:
        """``(module, optimizer, data_loader)`` (``(module, optimizer, criterion, data_loader)`` with
        ``grad_sample_mode="ghost"``, as Opacus) ready for DP-SGD: :func:`dpcore.torch.make_private`
        with Opacus's keywords. ``target_epsilon``/``target_delta``/``epochs`` instead of
        ``noise_multiplier`` calibrate σ as :meth:`make_private_with_epsilon`. Other keywords
        (``population_size=``, ``seed=``, ...) go to :func:`dpcore.torch.make_private`."""
        if target_epsilon is not None:
            return self.make_private_with_epsilon(
                module=module, optimizer=optimizer, data_loader=data_loader, criterion=criterion,
                target_epsilon=target_epsilon, target_delta=target_delta, epochs=epochs, max_grad_norm=max_grad_norm,
                batch_first=batch_first, loss_reduction=loss_reduction, poisson_sampling=poisson_sampling,
                clipping=clipping, noise_generator=noise_generator, grad_sample_mode=grad_sample_mode, **kwargs,
            )
        if noise_multiplier is None:
            raise TypeError("make_private needs noise_multiplier= (or target_epsilon=, target_delta=, epochs=)")
        if isinstance(module, GradSampleModule):
            module = module._module
        opts = self._options(module, data_loader, batch_first=batch_first, loss_reduction=loss_reduction,
                             poisson_sampling=poisson_sampling, clipping=clipping, noise_generator=noise_generator,
                             grad_sample_mode=grad_sample_mode, kwargs=kwargs)
        model, opt, loader = dptorch.make_private(
            module, optimizer, data_loader, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, **opts
        )
        return self._wrap(model, opt, loader, criterion, grad_sample_mode)

    def make_private_with_epsilon(
        self, *, module: nn.Module, optimizer: torch.optim.Optimizer, data_loader: Any,
        target_epsilon: float, target_delta: float, epochs: int, max_grad_norm: Any, criterion: Any = None,
        batch_first: bool = True, loss_reduction: str = "mean", poisson_sampling: bool = True,
        clipping: str = "flat", noise_generator: Any = None, grad_sample_mode: str = "hooks", **kwargs: Any,
    ) -> Any:
        """As Opacus's: σ calibrated so that ``epochs`` epochs meet (``target_epsilon``,
        ``target_delta``) under this engine's accountant (dpcore's calibration never overshoots).
        With ``poisson_sampling=False`` the calibration is for shuffled batches (no amplification),
        so σ is much larger than Opacus's."""
        if isinstance(module, GradSampleModule):
            module = module._module
        opts = self._options(module, data_loader, batch_first=batch_first, loss_reduction=loss_reduction,
                             poisson_sampling=poisson_sampling, clipping=clipping, noise_generator=noise_generator,
                             grad_sample_mode=grad_sample_mode, kwargs=kwargs)
        model, opt, loader = dptorch.make_private_with_epsilon(
            module, optimizer, data_loader, target_epsilon=target_epsilon, target_delta=target_delta, epochs=epochs,
            max_grad_norm=max_grad_norm, accountant=self._acct, **opts,
        )
        return self._wrap(model, opt, loader, criterion, grad_sample_mode)

    # -- accounting and checks -------------------------------------------------------------

    def get_epsilon(self, delta: float, **kw: Any) -> float:
        """ε of everything this engine's optimizers released, at ``delta``, from the ledger under
        this engine's accountant (0 before the first release)."""
        if self.ledger is None or self.ledger.num_releases == 0:
            return 0.0
        kw.setdefault("accountant", self._acct)
        return float(self.ledger.get_epsilon(delta, **kw))

    @staticmethod
    def is_compatible(*, module: nn.Module, optimizer: Any = None, data_loader: Any = None) -> bool:
        return ModuleValidator.is_valid(module)

    @staticmethod
    def validate(*, module: nn.Module, optimizer: Any = None, data_loader: Any = None) -> None:
        ModuleValidator.validate(module, strict=True)
