"""The noise stage of a :class:`~dpcore.torch.DPOptimizer`: where each release's noise comes from.

A :class:`NoiseSource` serves the query groups of one mechanism; the optimizer's
:class:`NoiseSources` are chosen once, at construction, from the groups' mechanisms
(``dpcore.torch._optimizer.make_noise``): :class:`GaussianNoise` (independent Gaussian noise
from ChaCha20, drawn by the Rust core or on the parameters' device), :class:`DiscreteGaussianNoise`
(Canonne, Kamath & Steinke 2020), and the matrix-factorization stream
(:class:`dpcore.torch._mf.MFNoise`). A transport calls the hooks around the clipped sums of a
release, in this order::

    before_release(step, drawn, loader)   before the records are clipped (checks)
    start(step, write)                    the ledger write started (draws that can start now)
    before_sums(step, batch)              noise the last micro-batch's sums accumulate onto
    after_sums(step, batch, write)        noise added once the sums are complete
    abort(step)                           a failed release whose ledger entry stands
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..mechanism import discrete_sum_release, gaussian_noise
from .._seeds import derive_seed
from ._amp import work_dtype
from ._clip import QueryGroups
from ._device_noise import device_gaussian_noise_many
from ._workers import Worker

__all__ = ["NoiseSource", "GaussianNoise", "DiscreteGaussianNoise", "NoiseSources"]

NOISE_DEVICES = ("auto", "device", "host")


class NoiseSource:
    """The protocol of a noise source (every hook does nothing by default). ``step`` is the
    release index; ``batch`` holds the accumulators (:class:`dpcore.torch._transport.Batch`);
    ``write`` is the Future of the release's ledger entry."""

    #: Whether the noise is correlated across releases (its state is in the checkpoints).
    correlated = False

    def before_release(self, step: int, drawn: Optional[int], loader: Any) -> None:
        pass

    def start(self, step: int, write: Future) -> None:
        pass

    def before_sums(self, step: int, batch: Any) -> None:
        pass

    def after_sums(self, step: int, batch: Any, write: Future) -> None:
        pass

    def abort(self, step: int) -> None:
        pass

    def quiesce(self) -> None:
        """Before the noise state is read or replaced: nothing pending, nothing drawing."""

    def forget(self) -> None:
        """Drops what was drawn ahead (for a release index of the run before a load)."""

    @property
    def drawn_ahead(self) -> Optional[int]:
        """The release index of a draw made ahead, or None."""
        return None

    @property
    def state_nbytes(self) -> int:
        return 0


class GaussianNoise(NoiseSource):
    """Independent N(0, σ²) noise for each Gaussian group's members, α_j·σ̃/den per member.

    ``shapes``: each parameter's noise shape (under FSDP2 this rank's rows); ``rank``: under
    FSDP2 this rank, whose rows get noise from its own generator (None otherwise)."""

    def __init__(
        self, queries: QueryGroups, params: List[torch.Tensor], seed: Optional[int],
        shapes: Optional[Sequence[Tuple[int, ...]]] = None, rank: Optional[int] = None,
    ) -> None:
        self.queries, self.params, self.seed, self.rank = queries, params, seed, rank
        self.shapes = [tuple(p.shape) for p in params] if shapes is None else [tuple(s) for s in shapes]
        self._mode = "auto"
        # Standard normals for the next release, drawn on a background thread while the training
        # loop runs its forward and backward passes (see noise).
        self._worker = Worker("noise")
        self._next: Optional[Tuple[int, List[List[Optional[float]]], Future]] = None
        #: Whether the next release's noise is drawn ahead, on a background thread. False in the
        #: memory-lean mode: a drawn-ahead noise tensor of every parameter's size would be held
        #: through the next forward and backward passes.
        self.ahead = True

    @property
    def device_mode(self) -> str:
        return self._mode

    @device_mode.setter
    def device_mode(self, mode: str) -> None:
        if mode not in NOISE_DEVICES:
            raise ValueError(f"noise_device must be 'auto', 'device' or 'host', got {mode!r}")
        self._mode = mode
        self._next = None  # a draw made ahead under the old mode is not used

    def forget(self) -> None:
        self._next = None

    @property
    def drawn_ahead(self) -> Optional[int]:
        return None if self._next is None else self._next[0]

    def _on_device(self, p: torch.Tensor) -> bool:
        return self._mode == "device" or (self._mode == "auto" and p.device.type != "cpu")

    def stddevs(self) -> List[List[Optional[float]]]:
        """Per group and member: the stddev of the noise of the released average, α_j·σ̃/den
        (None for a group of another mechanism)."""
        out = []
        for plan in self.queries.plans():
            gaussian = plan.mechanism == "gaussian"
            out.append([sd / plan.denominator if gaussian else None for sd in plan.part_stddevs])
        return out

    def draw(self, step: int, stddevs: List[List[Optional[float]]], parallel: bool = True) -> List[List[Any]]:
        """ChaCha20 N(0, sd²) for release ``step``, one array per group member, from the core
        (keyed from the OS, or derived from the test seed), computed in f64 and rounded once.
        ``parallel=False`` keeps the work on the calling thread (the values are the same).

        Members whose parameters live on an accelerator get their noise there, all of them in
        one :func:`device_gaussian_noise_many` call per device (one key, a part per member): a
        call per parameter costs a dozen kernel launches each, most of a small model's step."""
        out: List[List[Any]] = []
        on_device: Dict[torch.device, List[Tuple[int, int, Tuple[int, ...], float, torch.dtype]]] = {}
        for gi, (g, sds) in enumerate(zip(self.queries.groups, stddevs)):
            row: List[Any] = []
            for j, (k, sd) in enumerate(zip(g.members, sds)):
                if sd is None:
                    row.append(None)
                    continue
                p = self.params[k]
                if self._on_device(p):
                    # Drawn where the parameter lives: no host generation, no copy per step.
                    dt = torch.float64 if p.dtype == torch.float64 else torch.float32
                    on_device.setdefault(p.device, []).append((gi, j, self.shapes[k], sd, dt))
                    row.append(None)
                    continue
                # Sharded: each rank draws its own rows' noise (a test seed gives each rank its own).
                path = (step, gi, j) if self.rank is None else (step, gi, j, self.rank)
                ndt = np.float64 if p.dtype == torch.float64 else np.float32
                z = gaussian_noise(self.shapes[k], sd, dtype=ndt, seed=derive_seed(self.seed, *path), parallel=parallel)
                row.append(torch.from_numpy(z))
            out.append(row)
        for d, (dev, members) in enumerate(on_device.items()):
            # one key per device and release; the 1 << 30 keeps these paths apart from the host's
            path = (step, 1 << 30, d) if self.rank is None else (step, 1 << 30, d, self.rank)
            zs = device_gaussian_noise_many([(shape, sd, dt) for _, _, shape, sd, dt in members], device=dev,
                                            seed=derive_seed(self.seed, *path))
            for (gi, j, _, _, _), zt in zip(members, zs):
                out[gi][j] = zt
        return out

    def noise(self, step: int) -> List[List[Any]]:
        """The noise of release ``step``, and the next release's started in the background.

        Noise does not depend on the data, so drawing it ahead changes nothing in the mechanism;
        it lets the core's generator run while torch computes the next backward pass instead of
        after it. A draw is used only for the step and stddevs it was made for, and only once."""
        sds = self.stddevs()
        pending, self._next = self._next, None
        if pending is not None and pending[0] == step and pending[1] == sds:
            z = pending[2].result()
        else:
            z = self.draw(step, sds)
        if self.ahead:
            self._next = (step + 1, sds, self._worker.submit(self.draw, step + 1, sds, False))
        return z

    @torch.no_grad()
    def before_sums(self, step: int, batch: Any) -> None:
        """Starts each accumulator of the release from its noise: the clipped-sum products of
        the last micro-batch then accumulate onto the noise (``addmm_``), with no extra pass."""
        noise = self.noise(step)
        for g, row in zip(self.queries.groups, noise):
            for k, z in zip(g.members, row):
                if z is None:
                    continue
                p = self.params[k]
                # Shared with torch without a copy on CPU; copied to the device otherwise.
                z = z.to(device=p.device, dtype=work_dtype(p.dtype), non_blocking=True)
                acc = batch.acc[k]
                batch.acc[k] = z if acc is None else acc.add_(z)


class DiscreteGaussianNoise(NoiseSource):
    """The discrete Gaussian groups' release (Canonne, Kamath & Steinke 2020): each part's
    clipped sum, complete now, is rounded onto its grid and noised with N_ℤ in the core, then
    divided by the denominator (see :class:`ReleasePlan`). The sum itself was formed on the
    device in the parameters' float type, like the Gaussian one; the recorded sensitivity
    c + √d grid steps covers rounding it, not that float summation."""

    def __init__(self, queries: QueryGroups, params: List[torch.Tensor], seed: Optional[int]) -> None:
        self.queries, self.params, self.seed = queries, params, seed

    @torch.no_grad()
    def after_sums(self, step: int, batch: Any, write: Future) -> None:
        for gi, (g, plan) in enumerate(zip(self.queries.groups, self.queries.plans())):
            if plan.mechanism != "discrete_gaussian":
                continue
            sums = []
            for k in g.members:
                acc = batch.acc[k]
                shape = tuple(self.params[k].shape)
                sums.append(np.zeros(shape) if acc is None else acc.detach().to("cpu", torch.float64).numpy())
            outs = discrete_sum_release(
                sums,
                l2_norm_clip=plan.l2_norm_clip,
                noise_multiplier=plan.noise_multiplier or 0.0,
                granularity=plan.granularity,
                part_scales=plan.part_scales,
                denominator=plan.denominator,
                seed=derive_seed(self.seed, step, gi, 0xD15C),
            )
            for k, o in zip(g.members, outs):
                p = self.params[k]
                batch.acc[k] = torch.from_numpy(o).to(device=p.device, dtype=work_dtype(p.dtype))


class NoiseSources:
    """The noise sources of an optimizer, called in order: the Gaussian one (always: the
    transports draw from it), then those of the other mechanisms present."""

    def __init__(self, gaussian: GaussianNoise, others: Sequence[NoiseSource] = ()) -> None:
        self.gaussian = gaussian
        self.sources: List[NoiseSource] = [gaussian, *others]

    @property
    def correlated(self) -> bool:
        return any(s.correlated for s in self.sources)

    @property
    def state_nbytes(self) -> int:
        return sum(s.state_nbytes for s in self.sources)

    @property
    def drawn_ahead(self) -> List[Optional[int]]:
        return [s.drawn_ahead for s in self.sources]

    def before_release(self, step: int, drawn: Optional[int], loader: Any) -> None:
        for s in self.sources:
            s.before_release(step, drawn, loader)

    def start(self, step: int, write: Future) -> None:
        for s in self.sources:
            s.start(step, write)

    def before_sums(self, step: int, batch: Any) -> None:
        for s in self.sources:
            s.before_sums(step, batch)

    def after_sums(self, step: int, batch: Any, write: Future) -> None:
        for s in self.sources:
            s.after_sums(step, batch, write)

    def abort(self, step: int) -> None:
        for s in self.sources:
            s.abort(step)

    def quiesce(self) -> None:
        for s in self.sources:
            s.quiesce()

    def forget(self) -> None:
        for s in self.sources:
            s.forget()

