"""Which combinations a :class:`~dpcore.torch.DPOptimizer` supports: every refusal of a
combination of transport (one process, data-parallel, FSDP2), noise (Gaussian, discrete
Gaussian, matrix factorization), grad scaler and data loader is made here, by
:func:`check_combination`, each message saying what is not supported and what to use instead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Tuple

__all__ = ["Setup", "check_combination"]

_MF = "matrix_factorization"


@dataclass(frozen=True)
class Setup:
    """What an optimizer combines: ``distributed`` (torch.distributed with more than one rank),
    ``sharded`` (per trainable parameter, whether it is a DTensor), ``generic_layers`` (layers
    without a per-layer rule), each query group's ``mechanism``, the participation each
    matrix-factorization query declares and the one the data loader follows, and whether a
    GradScaler is attached."""

    distributed: bool
    sharded: Tuple[bool, ...]
    generic_layers: Tuple[str, ...]
    mechanisms: Tuple[str, ...]
    mf_participations: Tuple[Any, ...] = ()
    loader_participation: Any = None
    grad_scaler: bool = False

    @classmethod
    def of(cls, engine: Any, queries: Any, comm: Any, sharded: Tuple[bool, ...], loader: Any, grad_scaler: Any) -> "Setup":
        """The setup of an optimizer (``loader``: a :class:`~dpcore.torch._loader.LoaderView`)."""
        from ._rules import GenericRule

        mf = queries.groups_of(_MF)
        return cls(
            distributed=comm is not None,
            sharded=tuple(sharded),
            generic_layers=tuple(r.name or "<root>" for r in engine.rules if isinstance(r, GenericRule)),
            mechanisms=tuple(queries.mechanisms),
            mf_participations=tuple(getattr(queries.groups[gi].query, "participation", None) for gi in mf),
            loader_participation=loader.participation,
            grad_scaler=grad_scaler is not None,
        )

    def with_grad_scaler(self) -> "Setup":
        return replace(self, grad_scaler=True)


def check_combination(s: Setup, operation: Optional[str] = None) -> None:
    """Raises if ``s`` (or ``operation`` on it: ``"accumulate"``) is not supported."""
    if any(s.sharded):
        if not s.distributed:
            raise ValueError(
                "the model's parameters are sharded (DTensor, FSDP2's fully_shard) but torch.distributed is not "
                "initialised with more than one rank: launch the run on several ranks (torchrun) and initialise the "
                "process group before wrapping, or train the unsharded model in one process"
            )
        if not all(s.sharded):
            raise ValueError(
                "some trainable parameters are sharded by fully_shard and others are not: call fully_shard on the "
                "root module too (after its blocks), so that every parameter is sharded"
            )
        if s.generic_layers:
            raise NotImplementedError(
                f"layers without a per-layer rule ({list(s.generic_layers[:4])}) under FSDP2: their torch.func "
                "fallback needs the gathered weights; register a rule for them (dpcore.torch.register_layer)"
            )
    for mechanism in s.mechanisms:
        if mechanism == _MF and s.distributed:
            raise NotImplementedError(
                "matrix-factorization (correlated) noise is not supported with data-parallel training yet: train in "
                "one process, or use independent noise (noise_mechanism=None) for data-parallel training"
            )
        if mechanism != "gaussian" and s.distributed:
            raise NotImplementedError(
                "mechanism='discrete_gaussian' is not supported with data-parallel training yet: the ranks' sums "
                "would have to be rounded and noised after the all-reduce; use mechanism='gaussian' for "
                "data-parallel training, or train in one process"
            )
    lp = s.loader_participation
    for qp in s.mf_participations:
        if lp is None or qp is None:
            continue
        if (qp.kind, qp.min_separation, qp.sampling_probability) != (lp.kind, lp.min_separation, lp.sampling_probability):
            raise ValueError(
                f"the matrix-factorization query declares {qp.describe()}, but the data loader follows "
                f"{lp.describe()}: the noise's sensitivity would not hold for the batches trained on; give the query "
                "the loader's participation (make_private(..., noise_mechanism=...) plans both from one schedule)"
            )
    if s.grad_scaler:
        if s.distributed:
            raise NotImplementedError(
                "grad_scaler with data-parallel training is not supported yet: train with bfloat16 autocast (no "
                "scaler needed) instead"
            )
        if _MF in s.mechanisms:
            raise ValueError(
                "grad_scaler with matrix-factorization noise is not supported yet (untested with the noise stream): "
                "train with bfloat16 autocast (no scaler needed) instead"
            )
    if operation == "accumulate" and s.distributed:
        raise NotImplementedError(
            "accumulate() under torch.distributed: give the DPDataLoader max_physical_batch_size instead"
        )
