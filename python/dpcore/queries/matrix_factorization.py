"""A sum query with correlated noise: the matrix-factorization mechanism as a stateful DP query.

McMahan et al. 2018 (§2 and §7) let a query's global state carry history across samples; here it
carries the noise buffers of a matrix-factorization (MF) mechanism (Choquette-Choo et al. 2022,
arXiv 2211.06530, Eq. (1); Denisov et al. 2022): the release of step t is

    (Σ_i π_S(x_i) + σ·(C⁻¹z)_t) / denominator,   z_t ~ N(0, I),

for a Toeplitz strategy C (:mod:`dpcore.matrix_factorization`). The records are clipped in the
Rust core exactly as for :class:`~dpcore.queries.GaussianSumQuery`; only the noise differs.

**Noise multiplier.** ``noise_multiplier`` z is the mechanism's *effective* one: σ =
z·S·sens(C) with sens(C) the strategy's exact sensitivity over the planned ``steps`` under the
``participation`` schema. With fixed batches the whole run is then one Gaussian mechanism with
noise multiplier z (ε as for a single Gaussian release at z, Balle & Wang 2018), and with cyclic
Poisson sampling ε is that of ⌈steps/b⌉ Poisson-subsampled Gaussian steps at z (amplified banded
MF, Choquette-Choo et al. 2023, arXiv 2306.08153). ``BandedStrategy([1.0])`` (C = I) is DP-SGD.

Each release's event is ``SumQueryEvent(S, σ, "matrix_factorization", stream, declaration)``:
the ledger records the strategy and schema once per stream and its accountant recomputes the
sensitivity from them for the steps actually run, never from this query's numbers.

The global state is not a pure value, unlike the other queries': its noise buffers advance in
place at each release (copying (buffers)·d values per step would cost more than the noise).
Each global state knows its step, and a stale one (an older state used again) is refused.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..events import SumQueryEvent
from ..matrix_factorization._accounting import stddev_for
from ..matrix_factorization._noise import CorrelatedNoise
from ..matrix_factorization._participation import Participation, canonical_json
from ..matrix_factorization._strategies import BandedStrategy, BLTStrategy, ToeplitzStrategy
from .._validate import count
from .. import _trace
from .._seeds import derive_seed
from .base import DPQuery, ReleasePlan, SumState, check_parts, nonnegative, positive
from .gaussian import GaussianSumQuery

__all__ = ["MatrixFactorizationQuery", "MatrixFactorizationGlobalState", "NoiseStream"]

MECHANISM = "matrix_factorization"


class NoiseStream:
    """The noise buffers of one MF stream: a :class:`CorrelatedNoise` per part (created at the
    first release, when the parts' sizes and dtypes are known), all at the same step."""

    def __init__(self, strategy: ToeplitzStrategy) -> None:
        self.strategy = strategy
        self.parts: Dict[int, CorrelatedNoise] = {}
        self.step = 0

    def generator(self, part: int, size: int, dtype: Any) -> CorrelatedNoise:
        g = self.parts.get(part)
        if g is None:
            if self.step:
                raise ValueError(f"part {part} of the noise stream appears only at step {self.step}")
            g = self.parts[part] = CorrelatedNoise(self.strategy, size, dtype)
        elif g.size != size or g.dtype != np.dtype(dtype):
            raise ValueError(
                f"part {part} of the noise stream has {g.size} values of {g.dtype}, this release {size} of {np.dtype(dtype)}"
            )
        return g

    def draw(
        self, step: int, part: int, size: int, dtype: Any, stddev: float, *, sum: Optional[np.ndarray] = None,
        denominator: float = 1.0, seed: Optional[int] = None, fresh: Optional[np.ndarray] = None,
        parallel: bool = True,
    ) -> np.ndarray:
        """Part ``part``'s release at ``step`` (which must be the stream's current step);
        ``fresh``: its z drawn ahead (see :meth:`CorrelatedNoise.next`)."""
        if step != self.step:
            raise ValueError(f"the noise stream is at step {self.step}, not {step}: a stale global state was used")
        g = self.generator(part, size, dtype)
        if g.step != step:
            raise ValueError(f"part {part} of the noise stream was already drawn at step {step}")
        return g.next(stddev, sum=sum, denominator=denominator, seed=seed, fresh=fresh, parallel=parallel)

    def draw_unit(
        self, step: int, part: int, size: int, dtype: Any, *, seed: Optional[int] = None,
        fresh: Optional[np.ndarray] = None, parallel: bool = True,
    ) -> np.ndarray:
        """Part ``part``'s unit noise w at ``step`` without advancing its buffers
        (:meth:`CorrelatedNoise.draw`); :meth:`commit` advances them once the release is recorded."""
        if step != self.step:
            raise ValueError(f"the noise stream is at step {self.step}, not {step}: a stale global state was used")
        g = self.generator(part, size, dtype)
        if g.step != step:
            raise ValueError(f"part {part} of the noise stream was already released at step {step}")
        return g.draw(seed=seed, fresh=fresh, parallel=parallel)

    def commit(
        self, step: int, part: int, *, draw_next: bool = False, seed: Optional[int] = None, parallel: bool = True
    ) -> Optional[np.ndarray]:
        """Advances part ``part``'s buffers past ``step`` with the w drawn for it (and, with
        ``draw_next``, returns the next step's w drawn in the same pass)."""
        if step != self.step or part not in self.parts:
            raise ValueError(f"part {part} of the noise stream has no draw at step {step}")
        return self.parts[part].commit(draw_next=draw_next, seed=seed, parallel=parallel)

    def advance(self, step: int) -> None:
        """Closes ``step``: every part must have been drawn exactly once."""
        if step != self.step or any(g.step != step + 1 for g in self.parts.values()):
            raise ValueError(f"step {step} of the noise stream was not drawn for every part")
        self.step = step + 1

    @property
    def state_nbytes(self) -> int:
        return sum(g.state_nbytes for g in self.parts.values())

    def state_dict(self) -> Dict[str, Any]:
        return {"step": self.step, "parts": {int(k): g.state_dict() for k, g in self.parts.items()}}

    def load_state_dict(self, d: Dict[str, Any]) -> None:
        parts = {int(k): CorrelatedNoise.from_state_dict(v) for k, v in d["parts"].items()}
        step = count("step", d["step"], 0)
        for k, g in parts.items():
            if g.strategy != self.strategy:
                raise ValueError(f"part {k} of the stored noise stream has strategy {g.strategy!r}, this query {self.strategy!r}")
            if g.step != step:
                raise ValueError(f"part {k} of the stored noise stream is at step {g.step}, the stream at {step}")
        self.parts, self.step = parts, step


@dataclass(frozen=True)
class MatrixFactorizationGlobalState:
    """The clip norm S, the noise stddev σ of z, the stream's id (set at its first release),
    the next step, and the noise buffers."""

    l2_norm_clip: float
    stddev: float
    step: int
    stream: Optional[str]
    noise: NoiseStream


def _global(gs: Any) -> MatrixFactorizationGlobalState:
    if not isinstance(gs, MatrixFactorizationGlobalState):
        raise TypeError(
            f"global_state must come from initial_global_state (a MatrixFactorizationGlobalState), got {type(gs).__name__}"
        )
    return gs


class MatrixFactorizationQuery(GaussianSumQuery):
    """Σ_i π_S(x_i) + σ·(C⁻¹z)_t (then / ``denominator``): see the module docstring.

    ``strategy``: a :class:`~dpcore.matrix_factorization.BandedStrategy` or
    :class:`~dpcore.matrix_factorization.BLTStrategy` (e.g. from
    :func:`dpcore.matrix_factorization.optimize`); ``participation``: the data pipeline's
    :class:`~dpcore.matrix_factorization.Participation`; ``steps``: the planned releases.
    ``stddev`` may be given instead of ``noise_multiplier`` (σ of z directly). ``on_nonfinite``:
    what a record with a NaN or infinite value gets, as for :class:`GaussianSumQuery` (``"zero"``,
    the default: zero contribution; ``"raise"``: ``ValueError``, debugging only).
    """

    def __init__(
        self,
        l2_norm_clip: float,
        noise_multiplier: Optional[float] = None,
        *,
        strategy: ToeplitzStrategy,
        participation: Participation,
        steps: int,
        denominator: Optional[float] = None,
        stddev: Optional[float] = None,
        on_nonfinite: str = "zero",
    ) -> None:
        if not isinstance(strategy, (BandedStrategy, BLTStrategy)):
            raise TypeError(f"strategy must be a BandedStrategy or BLTStrategy, got {type(strategy).__name__}")
        if not isinstance(participation, Participation):
            raise TypeError(f"participation must be a Participation, got {type(participation).__name__}")
        self._steps = count("steps", steps, 1)
        self._strategy, self._participation = strategy, participation
        clip = positive("l2_norm_clip", l2_norm_clip)
        self._sensitivity = strategy.sensitivity(self._steps, participation)
        if (noise_multiplier is None) == (stddev is None):
            raise ValueError("give exactly one of noise_multiplier and stddev")
        if stddev is None:
            self._z = nonnegative("noise_multiplier", noise_multiplier)
            # rounded up, so that the ledger's z = σ/(S·sens) is never below the one asked for
            sd = stddev_for(self._z, clip, strategy, participation, self._steps)
        else:
            sd = nonnegative("stddev", stddev)
            self._z = sd / (clip * self._sensitivity)
        super().__init__(clip, sd, on_nonfinite=on_nonfinite)
        self._den = 1.0 if denominator is None else positive("denominator", denominator)
        self._declaration = canonical_json(
            {"strategy": strategy.to_dict(), "participation": participation.to_dict(), "steps": self._steps}
        )

    def __repr__(self) -> str:
        return (
            f"MatrixFactorizationQuery(l2_norm_clip={self._clip}, noise_multiplier={self._z}, "
            f"strategy={self._strategy!r}, participation={self._participation!r}, steps={self._steps})"
        )

    @property
    def strategy(self) -> ToeplitzStrategy:
        return self._strategy

    @property
    def participation(self) -> Participation:
        return self._participation

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def noise_multiplier(self) -> float:
        """The effective noise multiplier z = σ/(S·sens(C))."""
        return self._z

    @property
    def sensitivity(self) -> float:
        """sens(C) over the planned steps and schema (per unit of clip norm)."""
        return self._sensitivity

    @property
    def declaration(self) -> str:
        return self._declaration

    def _denominator(self) -> float:
        return self._den

    def initial_global_state(self) -> MatrixFactorizationGlobalState:
        return MatrixFactorizationGlobalState(self._clip, self._stddev, 0, None, NoiseStream(self._strategy))

    def derive_sample_params(self, global_state: Any) -> float:
        return _global(global_state).l2_norm_clip

    def gaussian_release(self, sample_state: Any, global_state: Any, *, seed: Optional[int] = None) -> None:
        return None  # correlated noise: released on its own, never batched with independent noise

    def _event(self, gs: MatrixFactorizationGlobalState, clip: float, stream: str) -> SumQueryEvent:
        return SumQueryEvent(clip, gs.stddev, MECHANISM, stream=stream, declaration=self._declaration)

    def _open(self, gs: MatrixFactorizationGlobalState) -> Tuple[MatrixFactorizationGlobalState, str]:
        if gs.noise.strategy != self._strategy:
            raise ValueError("the global state belongs to a query with another strategy")
        if gs.noise.step != gs.step:
            raise ValueError(
                f"stale global state: it is at step {gs.step} but its noise stream has advanced to step {gs.noise.step}; "
                "use the global state returned by the last release"
            )
        stream = gs.stream or uuid.uuid4().hex
        return gs, stream

    def get_noised_result(
        self, sample_state: Any, global_state: Any, *, seed: Optional[int] = None
    ) -> Tuple[Any, MatrixFactorizationGlobalState, SumQueryEvent]:
        """The step's release with its correlated noise; the noise buffers advance. ``seed``:
        tests only (one seed per step is derived from it)."""
        if not isinstance(sample_state, SumState):
            raise TypeError(f"sample_state must come from initial_sample_state, got {type(sample_state).__name__}")
        gs, stream = self._open(_global(global_state))
        st = sample_state
        clip = st.l2_norm_clip if st.l2_norm_clip is not None else gs.l2_norm_clip
        event = self._event(gs, clip, stream)  # validated before any noise is drawn
        for k, s in enumerate(st.sums):
            if not np.all(np.isfinite(s)):
                raise ValueError(f"the sum of part {k} holds a NaN or infinite value")
        # Every part's generator exists (or is created) before the first draw, so a refusal
        # leaves no part advanced.
        for k, (s, dt) in enumerate(zip(st.sums, st.dtypes)):
            gs.noise.generator(k, int(s.size), dt)
        if _trace.active():  # the grey-box harness: this step's pre-noise sums and one record's bound C
            _trace.release(
                "queries.matrix_factorization", [{"sums": list(st.sums), "sensitivity": clip}],
                denominator=self._den, noise={"part_stddevs": [gs.stddev] * len(st.sums), "mechanism": MECHANISM},
                event=event,
            )
        outs: List[np.ndarray] = []
        for k, (s, dt) in enumerate(zip(st.sums, st.dtypes)):
            o = gs.noise.draw(
                gs.step, k, int(s.size), dt, gs.stddev, sum=s, denominator=self._den,
                seed=derive_seed(seed, gs.step, k),
            )
            outs.append(o.reshape(s.shape))
        gs.noise.advance(gs.step)
        if _trace.active():  # a neighbour run releases the first run's values
            outs = _trace.output("queries.matrix_factorization", outs)
        result = outs[0] if st.kind is np.ndarray else st.kind(outs)
        return result, replace(gs, step=gs.step + 1, stream=stream), event

    # -- sums formed by the caller (framework adapters) ---------------------------------------

    def release_plan(self, global_state: Any, num_parts: int, *, dim: Optional[int] = None) -> ReleasePlan:
        """The plan of the next release for a caller that forms the clipped sum: it must add
        ``plan.part_stddevs[j]``·w_t from :meth:`draw_noise` (never independent noise) to part j."""
        gs = _global(global_state)
        return self._plan(gs, num_parts, gs.stream or "unassigned")

    def _plan(self, gs: MatrixFactorizationGlobalState, num_parts: int, stream: str) -> ReleasePlan:
        check_parts(num_parts)
        return ReleasePlan(
            l2_norm_clip=gs.l2_norm_clip,
            part_scales=(1.0,) * num_parts,
            part_stddevs=(gs.stddev,) * num_parts,
            denominator=self._den,
            event=self._event(gs, gs.l2_norm_clip, stream),
            mechanism=MECHANISM,
            noise_multiplier=self._z,
        )

    plan_from_global_state = False  # the stream id is drawn at the first release

    def get_noised_plan(
        self, norm_state: Any, global_state: Any, num_parts: int, *, seed: Optional[int] = None,
        dim: Optional[int] = None,
    ) -> Tuple[ReleasePlan, MatrixFactorizationGlobalState]:
        """The plan of this step's release and the global state after it. The caller draws each
        part's noise with :meth:`draw_noise` (the global state passed here, parts 0…num_parts−1,
        each once) and then calls :meth:`finish_release`."""
        gs, stream = self._open(_global(global_state))
        return self._plan(gs, num_parts, stream), replace(gs, stream=stream)

    def draw_noise(
        self, global_state: Any, part: int, size: int, dtype: Any, stddev: float, *, seed: Optional[int] = None,
        fresh: Optional[np.ndarray] = None, parallel: bool = True,
    ) -> np.ndarray:
        """stddev·w_t for part ``part`` (flat, ``size`` values of ``dtype``) at the global
        state's step. ``fresh``: the step's standard normal z for this part, drawn ahead of the
        release (z does not depend on the data; only the buffers must advance at the release)."""
        gs = _global(global_state)
        return gs.noise.draw(gs.step, part, size, dtype, stddev, seed=seed, fresh=fresh, parallel=parallel)

    def draw_unit_noise(
        self, global_state: Any, part: int, size: int, dtype: Any, *, seed: Optional[int] = None,
        fresh: Optional[np.ndarray] = None, parallel: bool = True,
    ) -> np.ndarray:
        """The unit noise w_t of part ``part`` (the release adds stddev·w_t), computed without
        advancing the noise buffers: it depends on no data, so it may be drawn ahead of the
        release. :meth:`commit_noise` advances the buffers once the release is recorded; a draw
        never committed is dropped (its noise is never used)."""
        gs = _global(global_state)
        return gs.noise.draw_unit(gs.step, part, size, dtype, seed=seed, fresh=fresh, parallel=parallel)

    def commit_noise(
        self, global_state: Any, part: int, *, draw_next: bool = False, seed: Optional[int] = None,
        parallel: bool = True,
    ) -> Optional[np.ndarray]:
        """Advances part ``part``'s buffers with the w of :meth:`draw_unit_noise` (after the
        release that used it is recorded). With ``draw_next`` it also returns the next step's w,
        drawn in the same pass over the buffers (the next release then needs no draw)."""
        gs = _global(global_state)
        return gs.noise.commit(gs.step, part, draw_next=draw_next, seed=seed, parallel=parallel)

    def finish_release(self, global_state: Any) -> MatrixFactorizationGlobalState:
        """The global state after a release whose parts were all drawn (:meth:`draw_noise`, or
        :meth:`draw_unit_noise` then :meth:`commit_noise`): :meth:`close_step` then
        :meth:`released_state`."""
        self.close_step(global_state)
        return self.released_state(global_state)

    def close_step(self, global_state: Any) -> None:
        """Closes the global state's step in its noise stream: every part must have been
        released (drawn and committed) exactly once."""
        gs = _global(global_state)
        gs.noise.advance(gs.step)

    def released_state(self, global_state: Any) -> MatrixFactorizationGlobalState:
        """The global state of the next step. Its stream must be closed (:meth:`close_step`)
        before it is used; a caller that updates the buffers in the background takes this one
        at once and waits for the update before the next release."""
        gs = _global(global_state)
        return replace(gs, step=gs.step + 1)
