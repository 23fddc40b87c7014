"""What a :class:`~dpcore.torch.DPOptimizer` may use of its ``data_loader``: the loader protocol.

Every member is optional; a loader that lacks one gets the default below, so that any object
(or None: no loader) can be given. dpcore's loaders (:class:`~dpcore.torch.DPDataLoader`,
:class:`~dpcore.torch.SamplerDataLoader`, :class:`~dpcore.torch.CyclicDataLoader`, the fixed-order
and shuffled loaders of ``make_private``, the Hugging Face trainer's run) implement the members
that apply to them. :class:`LoaderView` is the only code that looks at a loader for the optimizer
(and its checkpoints); the optimizer never sets anything on it.

=============================  ==============================================================
member                         used for (default when absent)
=============================  ==============================================================
``ledger``                     the optimizer's ledger when none is given (a PrivacyLedger only)
``samples_drawn``              refusing a second release on one sample (None: not checked)
``logical_batch_complete``     whether this step releases (True: every step releases)
``participation``              a matrix-factorization stream's schema and alignment (None)
``accountant``                 :meth:`DPOptimizer.get_epsilon`'s default accountant (None)
``record_groups``              the privacy unit "user": each user's number of examples in the
                               batch just yielded, user-major (None: a record is an example)
``record_mask``                padded batches: which rows of the batch just yielded are real
                               records (numpy bool; None: every row is one)
``use_equal_micro_batches()``  under FSDP2: every rank cuts a logical batch into as many
                               micro-batches (not called when absent)
``state_dict()``,              checkpoints: the loader's position (not saved / not restored,
``check_state_dict(state)``,   with a warning, when absent; ``check_state_dict`` is the check
``load_state_dict(state)``     made before anything loads)
=============================  ==============================================================
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Protocol

from ..ledger import PrivacyLedger

__all__ = ["DPLoader", "LoaderView"]


class DPLoader(Protocol):
    """The members a DPOptimizer may use on its data loader (all optional: see the module)."""

    ledger: PrivacyLedger
    samples_drawn: int
    logical_batch_complete: bool
    participation: Any
    accountant: Optional[str]
    record_groups: Any

    def use_equal_micro_batches(self) -> None: ...
    def state_dict(self) -> Dict[str, Any]: ...
    def check_state_dict(self, state: Any) -> None: ...
    def load_state_dict(self, state: Any) -> None: ...


def _member(loader: Any, name: str) -> Any:
    return getattr(loader, name, None)


class LoaderView:
    """The loader protocol over ``loader`` (any object, or None), with the documented defaults."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    @property
    def ledger(self) -> Optional[PrivacyLedger]:
        led = _member(self.loader, "ledger")
        return led if isinstance(led, PrivacyLedger) else None

    @property
    def samples_drawn(self) -> Optional[int]:
        return _member(self.loader, "samples_drawn")

    @property
    def logical_batch_complete(self) -> bool:
        if self.loader is None:
            return True
        return bool(getattr(self.loader, "logical_batch_complete", True))

    @property
    def participation(self) -> Any:
        return _member(self.loader, "participation")

    @property
    def accountant(self) -> Optional[str]:
        acct = _member(self.loader, "accountant")
        return acct if isinstance(acct, str) else None

    @property
    def record_groups(self) -> Any:
        return _member(self.loader, "record_groups")

    @property
    def record_mask(self) -> Any:
        """The real records of the batch just yielded (numpy bool; None: every row is one)."""
        return _member(self.loader, "record_mask")

    def use_equal_micro_batches(self) -> None:
        fn = _member(self.loader, "use_equal_micro_batches")
        if callable(fn):
            fn()

    # -- checkpoints --------------------------------------------------------------------

    @property
    def has_state(self) -> bool:
        return self.loader is not None and callable(_member(self.loader, "state_dict"))

    @property
    def can_restore(self) -> bool:
        return callable(_member(self.loader, "load_state_dict"))

    def state_dict(self) -> Optional[Dict[str, Any]]:
        return self.loader.state_dict() if self.has_state else None

    def check_state_dict(self, state: Any) -> None:
        check = _member(self.loader, "check_state_dict")
        if callable(check):
            check(state)

    def load_state_dict(self, state: Any) -> None:
        self.loader.load_state_dict(state)
