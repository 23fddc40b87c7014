"""DP-SGD inside Keras's own ``model.fit`` on every Keras 3 backend: :class:`DPModel`.

Each step is Abadi et al. 2016, Algorithm 1, in the query/ledger architecture of McMahan et al.
2018: per-record gradients of the per-record loss and their clipped sum in one compiled call of
the backend (``_backends``: ``jax.vmap`` in ``jax.jit``, ``tf.vectorized_map`` or a per-record
loop in ``tf.function``, ``torch.func.vmap``; the arithmetic of ``_step.clipped_sums``, ghost
norms from ``_ghost`` on JAX), then on the host the sample and release written durably to the
:class:`~dpcore.PrivacyLedger` and Gaussian noise drawn by the core's ChaCha20 generator
(``_step.HostRelease``), and only then the compiled update. Queries that release otherwise (the
discrete Gaussian, matrix-factorization noise) and user-level sampling take the host path: the
compiled call returns the per-record gradients and the query clips them in the core.
(:func:`make_private` and :func:`make_private_with_epsilon`, which build a :class:`DPModel`, are
in ``_make_private.py``, and the plan of matrix-factorization noise in ``_mf.py``.)

A record whose per-record gradient has a NaN or ±∞ value contributes zero to the step's sum and
the step releases as usual (``on_nonfinite="zero"``, the default: differentially private, see
:mod:`dpcore.mechanism`). With ``on_nonfinite="raise"`` a ``ValueError`` leaves ``fit`` before
anything reaches the ledger or the weights (a debugging aid, not DP).
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import keras

from .._names import renamed
from ..ledger import LedgerWarning, PrivacyLedger
from .. import _names
from ..queries._build import CLIPPING, clipping_query
from .._seeds import derive_seed
from .. import _adapters
from ._data import CyclicBatches, PoissonBatches, SampledBatches, UserPoissonBatches, sampled_batches
from ._users import bind_users, user_config, user_means
from ._mf import _mf_config
from .._validate import positive as _number
from ..mechanism import check_on_nonfinite
from . import _backends
from ._step import ClipSpec, HostRelease, padded

__all__ = ["DPModel", "CLIPPING"]

if not str(getattr(keras, "__version__", "0")).startswith("3."):  # pragma: no cover - legacy Keras 2
    raise ImportError(f"dpcore.keras needs Keras 3 (keras is {getattr(keras, '__version__', '?')})")



@dataclass(frozen=True)
class _Sampling:
    """How the batches of the running ``fit`` were drawn: what each release's sample entry says."""

    population_size: int
    sampling_probability: float
    policy: str
    seeded: bool = False
    sample_size: Optional[int] = None
    #: The SampledBatches that draws (and records) each step's batch in the train step.
    source: Any = None
    #: Batches of an epoch of in-memory arrays (⌈n/b⌉): each batch is recorded with its epoch
    #: as a round, so the accountant reads one query per epoch (None: per step).
    epoch_steps: Optional[int] = None
    #: privacy_unit="user": the bound each sample records (examples_per_user=k for ULS,
    #: max_examples_per_user=K for ELS); None at the example level.
    user_bounds: Optional[Dict[str, int]] = None

    @property
    def records_itself(self) -> bool:
        """Whether the train step records each sample (all but the samplers' own draws)."""
        return self.source is None or isinstance(self.source, UserPoissonBatches)


class _EpochMark(keras.callbacks.Callback):
    """Tells the DP train step that a Keras epoch (a fresh order of the arrays) begins."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self._dp = model

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        object.__setattr__(self._dp, "_epoch_at", None)


class _Spec:
    """Shape and dtype of one record's part (a query template without allocating arrays)."""

    def __init__(self, shape: Sequence[int], dtype: Any) -> None:
        self.shape, self.dtype = tuple(int(d) for d in shape), np.dtype(dtype)


def _incompatible_layers(model: Any) -> List[str]:
    # Batch statistics mix records inside a batch: one record's gradient then depends on the
    # others, and per-record clipping no longer bounds its contribution.
    # A frozen one (trainable=False) runs in inference mode in Keras 3, on its moving statistics:
    # each record's output is its own, so it is allowed.
    flat = model._flatten_layers() if hasattr(model, "_flatten_layers") else []
    return [l.name for l in flat if isinstance(l, keras.layers.BatchNormalization) and l.trainable]


class DPModel(keras.Model):
    """A Keras model whose ``fit`` trains with DP-SGD (Abadi et al. 2016, Algorithm 1).

    ``DPModel(model, ...)`` wraps ``model``: it shares its variables (training the wrapper trains
    ``model``), its ``call`` is ``model``'s, and ``evaluate``/``predict`` are unchanged. Only
    :meth:`train_step` differs. Parameters:

    * ``noise_multiplier`` z and ``max_grad_norm`` C (the clip norm; :attr:`max_grad_norm`).
    * ``expected_batch_size`` q·n, the fixed denominator of the noised average (McMahan et al.
      2018, §3), or ``population_size`` n and ``sampling_probability`` q. A
      :class:`PoissonBatches` given to ``fit`` must have the same q·n.
    * ``clipping``: ``"flat"`` — each record's gradient over all variables jointly clipped to C,
      noise stddev z·C on the sum (a :class:`~dpcore.GaussianAverageQuery`); ``"per_layer"`` —
      each variable clipped to C_v = C/√m of m variables (or to the values of a list
      ``max_grad_norm``), noise z·√m·C_v per variable (a :class:`~dpcore.NestedQuery`; Eq. (1)
      of McMahan et al. 2018 gives z for the whole release); ``"joint"`` with ``joint_scales``
      (one scale α_v per trainable variable) — each variable scaled by 1/α_v, the record
      clipped jointly to C, noise α_v·z·C per variable, scaled back (a
      :class:`~dpcore.JointClipQuery`, McMahan et al. 2018 §2). The query is built by
      :func:`dpcore.queries._build.clipping_query`, as for the torch optimizer.
    * ``noise_mechanism``: ``"gaussian"`` (the default) or ``"discrete_gaussian"`` (each
      release's clipped sum rounded onto the grid ``granularity``·ℤ^d and noised with exact
      discrete Gaussian integers in the core; Canonne, Kamath & Steinke 2020), or a
      matrix-factorization mechanism (below).
    * ``ledger``: a :class:`~dpcore.PrivacyLedger` (a temporary file when None; see
      ``.ledger.path``). Every release is written (fsync) before its update is applied.
    * ``max_physical_batch_size``: virtual batches. Per-record gradients of a logical (Poisson)
      batch are computed and clipped in micro-batches of at most this many records, summed,
      and noised and recorded once: memory for B×P per-record gradients becomes
      ``max_physical_batch_size``×P, the mechanism is unchanged.
    * ``optimizer``: used by :meth:`compile` when it is given none.
    * ``seed``: tests only (release k's noise comes from ``derive_seed(seed, k)``; no privacy).
    * ``on_nonfinite``: a record whose per-record gradient holds a NaN or ±∞ contributes zero to
      the release (``"zero"``, the default: zero has norm 0 ≤ C, and the step goes ahead whatever
      the record holds, so nothing shows whether it was sampled; Cebere et al., PETS 2026), or
      the step raises ``ValueError`` naming it before anything is recorded or applied
      (``"raise"``: a debugging aid whose behaviour depends on the data, not differentially
      private). The ``loss`` that ``fit`` logs is the raw batch's and may then be NaN.

    Matrix-factorization (correlated) noise: ``noise_mechanism="blt"`` or ``"banded"``
    with ``epochs`` (the planned epochs), ``population_size`` n and
    ``batch_size`` (b = n // batch_size fixed batches) or ``participation`` (a cyclic Poisson
    :class:`~dpcore.matrix_factorization.Participation`), and optionally ``strategy``
    (otherwise :func:`dpcore.matrix_factorization.strategy_for` optimises one for epochs·b
    steps). ``noise_multiplier`` is then the *effective* one (σ = z·C·sens(C)); flat clipping
    only. ``fit`` must be given a :class:`CyclicBatches` of the same partition parameters, runs
    its b batches in order (``shuffle`` is forced off; ``steps_per_epoch`` must be b), and a
    ``fit`` stopped in the middle of an epoch cannot be continued (the cycle and the noise
    stream would no longer be aligned). Each release is recorded as a ``"cyclic"`` (or
    ``"cyclic_poisson"``) sample and the ledger holds the stream.

    Sampling, recorded per release from what ``fit`` is given: a :class:`PoissonBatches` →
    policy ``poisson`` (n, q), amplified by sampling; in-memory arrays with ``batch_size`` (its
    default: round(q·n)) → policy ``shuffle``, accounted without amplification (a shuffled
    epoch is not a random sample, §5) and warned about; any other source (``tf.data``,
    generators) → ``shuffle`` if ``population_size`` was given, else a ``TypeError``. Batches
    must hold each record at most once. Calling :meth:`train_step` outside ``fit``
    (``train_on_batch``) raises: its sampling is unknown.

    ``sampler=`` fixes the sampling instead (:mod:`dpcore.accounting.samplers`; n =
    ``population_size``, bs = ``expected_batch_size`` or q·n as requested):
    ``"truncated_poisson"`` (q = bs/n, capped at ``max_batch_size`` B, required; ε by PLD),
    ``"balls_in_bins"`` (b = round(n/bs) batches per epoch; Chua et al. 2025, arXiv
    2412.16802) or ``"random_allocation"`` (each record in ``num_selected`` = k of every
    round's t = round(n·k/bs) steps; Feldman & Shenfeld 2025, arXiv 2502.08202). The
    denominator and :attr:`sampling_probability` become the sampler's (E[min(Bin(n, q), B)]
    and q; n/b and 1/b; n·k/t and k/t, for the nearest whole b or t). ``fit`` then takes the
    sampler's batches, :meth:`batches` ``(x, y)`` (a :class:`~dpcore.keras.SampledBatches`):
    each step's records are drawn in the train step right before the release and recorded with
    the sampler's policy, whatever Keras reads ahead. The allocation samplers have a certified Rényi-DP analysis only, so
    :meth:`get_epsilon` uses ``accountant="rdp"`` for them (the ledger would fall back to it,
    with a warning). ``"poisson"`` requires :class:`PoissonBatches` in ``fit``; ``"shuffle"``
    any other source (recorded as ``shuffle``, as above). Not with ``noise_mechanism``.

    The privacy unit (``privacy_unit``; issue 40): ``"example"`` (the default) protects one
    training example; ``"user"`` protects all the examples of one user, given by ``user_ids``
    (one id per training example, integers or strings, aligned with the arrays ``fit`` trains
    on), in one of two ways:

    * ``examples_per_user=k``: user-level sampling (ULS). ``fit`` takes
      :meth:`batches` ``(x, y)`` (a :class:`~dpcore.keras.UserPoissonBatches`): each step
      samples users (Poisson, each of the U users with probability q), each sampled user
      contributes at most k of its examples (ChaCha20, without replacement), and the **mean** of
      their per-example gradients is clipped to C as one record (flat or per layer). The fixed
      denominator is q·U, the expected number of users per step (``expected_batch_size``, or
      ``sampling_probability`` q with ``population_size`` U: by default the number of distinct
      ids). Each sample is recorded over the users with ``examples_per_user=k``.
    * ``max_examples_per_user=K``: example-level sampling with a user-level guarantee (ELS).
      Before training each user is bounded to at most K examples in total (ChaCha20, drawn once:
      :meth:`dpcore.sampling.UserIndex.bound`); ``fit`` takes :meth:`batches` ``(x, y)``, the
      :class:`PoissonBatches` of the kept examples, clipped one by one (q per example; the
      population, by default, the Σ_u min(count_u, K) kept examples). Each sample is recorded
      with ``max_examples_per_user=K`` and the ε the ledger gives is for one user.

    The ledger must be one of unit ``"user"`` (``PrivacyLedger(path, privacy_unit="user")``;
    the temporary one is), and the users are bound to it by a side file
    ``<ledger>.users.npz`` (their ids' fingerprint and, for ELS, the kept examples): a later
    DPModel that continues the ledger must give the same ids and bound, and reuses the kept
    examples. Poisson sampling and Gaussian (or discrete Gaussian) noise only; no ``sampler=``
    or matrix-factorization noise.

    The ``loss``/metrics that ``fit`` logs are computed on the raw batch, for monitoring; they
    are not privatized and must not be published as DP outputs. Layers with batch statistics
    (a trainable ``BatchNormalization``) are rejected; a frozen one (``trainable=False``: inference
    mode, each record's output its own) is allowed. Save the wrapped model (``.inner``), not the
    wrapper; a DPModel built later on the reloaded weights and the same ledger path continues the
    ledger.

    The step is compiled by the Keras backend (``KERAS_BACKEND``: JAX, TensorFlow or torch; see
    the module docstring): batches are padded to a multiple of 8 records (padding has clip factor
    0), so a Poisson batch compiles once per few sizes. ``steps_per_execution`` must be 1.
    """

    def __init__(
        self,
        model: Any,
        *,
        noise_multiplier: float,
        max_grad_norm: Any = None,
        expected_batch_size: Optional[float] = None,
        population_size: Optional[int] = None,
        sampling_probability: Optional[float] = None,
        ledger: Optional[PrivacyLedger] = None,
        clipping: str = "flat",
        max_physical_batch_size: Optional[int] = None,
        optimizer: Any = None,
        seed: Optional[int] = None,
        l2_norm_clip: Any = None,
        noise_mechanism: Optional[str] = None,
        strategy: Any = None,
        epochs: Optional[int] = None,
        participation: Any = None,
        batch_size: Optional[int] = None,
        sampler: Optional[str] = None,
        max_batch_size: Optional[int] = None,
        num_selected: int = 1,
        joint_scales: Any = None,
        granularity: Optional[float] = None,
        on_nonfinite: str = "zero",
        privacy_unit: str = "example",
        user_ids: Any = None,
        examples_per_user: Optional[int] = None,
        max_examples_per_user: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        on_nonfinite = check_on_nonfinite(on_nonfinite)
        users = user_config(privacy_unit, user_ids, examples_per_user, max_examples_per_user)
        l2_norm_clip = renamed("max_grad_norm", max_grad_norm, "l2_norm_clip", l2_norm_clip)
        noise_mechanism = _names.noise_mechanism(noise_mechanism)
        noise_mechanism, strategy = _names.legacy_independent(noise_mechanism, strategy)
        mf = noise_mechanism in _names.MF_NOISE
        mf_cfg = None
        if users is not None:
            if mf:
                raise ValueError(
                    f"privacy_unit='user' trains with Poisson sampling; noise_mechanism={noise_mechanism!r} "
                    "(matrix-factorization noise over cyclic batches) has no user-level version here"
                )
            if sampler not in (None, "poisson"):
                raise ValueError(
                    f"privacy_unit='user' samples with Poisson sampling (users for examples_per_user, kept examples for "
                    f"max_examples_per_user); sampler={sampler!r} is not supported with it"
                )
            if population_size is None:
                population_size = users.population  # U users (ULS) or the kept examples (ELS)
        if mf and (sampler is not None or max_batch_size is not None or num_selected != 1):
            raise ValueError(
                "sampler, max_batch_size and num_selected choose DP-SGD's sampling; matrix-factorization noise "
                f"(noise_mechanism={noise_mechanism!r}) trains over CyclicBatches instead"
            )
        kind = None if sampler is None else _adapters.resolve_sampler(sampler, None)
        if kind is not None and kind not in _adapters.DRAWN:  # (the drawn ones: in _adapters.shape below)
            _adapters.check_options(kind, max_batch_size, num_selected)
        elif kind is None and (max_batch_size is not None or num_selected != 1):
            raise ValueError("max_batch_size and num_selected configure sampler='truncated_poisson' / 'random_allocation'")
        drawn = None
        if kind in _adapters.DRAWN:
            if population_size is None:
                raise ValueError(f"sampler={kind!r} needs population_size (the records it draws from)")
            if isinstance(population_size, bool) or not isinstance(population_size, numbers.Integral) or population_size < 1:
                raise ValueError(f"population_size must be an int >= 1, got {population_size!r}")
            if (sampling_probability is None) == (expected_batch_size is None):
                raise ValueError(f"sampler={kind!r} needs exactly one of sampling_probability and expected_batch_size")
            bs = (
                _number("expected_batch_size", expected_batch_size) if sampling_probability is None
                else _number("sampling_probability", sampling_probability) * int(population_size)
            )
            drawn = _adapters.shape(kind, int(population_size), bs, max_batch_size, num_selected)
            probe = sampled_batches(kind)._probe(int(population_size), drawn)
            # The denominator and rate are the sampler's own (n/b, k/t: the nearest whole b or t).
            sampling_probability, expected_batch_size = float(probe.sampling_probability), None
        if mf:
            mf_cfg = _mf_config(
                noise_mechanism, strategy=strategy, epochs=epochs, participation=participation, batch_size=batch_size,
                population_size=population_size, sampling_probability=sampling_probability,
                expected_batch_size=expected_batch_size, clipping=clipping,
            )
            expected_batch_size = mf_cfg["denominator"]
        elif any(v is not None for v in (strategy, epochs, participation, batch_size)):
            raise ValueError(
                "strategy, epochs, participation and batch_size configure matrix-factorization noise: give "
                "noise_mechanism='banded' or 'blt' with them"
            )
        if not isinstance(model, keras.Model):
            raise TypeError(f"model must be a keras.Model, got {type(model).__name__}")
        if clipping not in CLIPPING:
            raise ValueError(f"clipping must be one of {CLIPPING}, got {clipping!r}")
        if clipping == "joint":
            if joint_scales is None or isinstance(joint_scales, (str, bytes)) or not hasattr(joint_scales, "__len__"):
                raise ValueError("clipping='joint' needs joint_scales: one scale α_v per trainable variable")
            joint_scales = [_number(f"joint_scales[{k}]", a) for k, a in enumerate(joint_scales)]
        elif joint_scales is not None:
            raise ValueError("joint_scales are the scales of clipping='joint'")
        if granularity is not None and noise_mechanism != "discrete_gaussian":
            raise ValueError("granularity is the rounding grid of noise_mechanism='discrete_gaussian'")
        bad = _incompatible_layers(model)
        if bad:
            raise TypeError(f"layers with batch statistics mix records and break per-record clipping: {bad}")
        z = _number("noise_multiplier", noise_multiplier, allow_zero=True)
        if isinstance(l2_norm_clip, (list, tuple)):
            if clipping != "per_layer":
                raise ValueError("a list of l2_norm_clip values needs clipping='per_layer'")
            clips: Any = [_number(f"l2_norm_clip[{k}]", c) for k, c in enumerate(l2_norm_clip)]
        else:
            clips = _number("l2_norm_clip", l2_norm_clip)
        n = None
        if population_size is not None:
            if isinstance(population_size, bool) or not isinstance(population_size, numbers.Integral) or population_size < 1:
                raise ValueError(f"population_size must be an int >= 1, got {population_size!r}")
            n = int(population_size)
        q = None
        if sampling_probability is not None:
            q = _number("sampling_probability", sampling_probability)
            if q > 1:
                raise ValueError(f"sampling_probability must be in (0, 1], got {q}")
            if n is None:
                raise ValueError("sampling_probability needs population_size")
        if expected_batch_size is None:
            if n is None or q is None:
                raise ValueError("give expected_batch_size, or population_size and sampling_probability")
            den = q * n
        else:
            den = _number("expected_batch_size", expected_batch_size)
            if n is not None and q is not None and not math.isclose(den, q * n, rel_tol=1e-9):
                raise ValueError(f"expected_batch_size {den} differs from sampling_probability·population_size = {q * n}")
        mpb = max_physical_batch_size
        if mpb is not None and (isinstance(mpb, bool) or not isinstance(mpb, numbers.Integral) or mpb < 1):
            raise ValueError(f"max_physical_batch_size must be an int >= 1, got {mpb!r}")
        if ledger is None:
            path = os.path.join(tempfile.mkdtemp(prefix="dpcore-keras-"), "ledger.jsonl")
            ledger = PrivacyLedger(path) if users is None else PrivacyLedger(path, privacy_unit="user")
        if not isinstance(ledger, PrivacyLedger):
            raise TypeError(f"ledger must be a dpcore.PrivacyLedger or None, got {type(ledger).__name__}")
        if users is not None and ledger.privacy_unit != "user":
            raise ValueError(
                f"privacy_unit='user' needs a ledger of unit 'user' ({ledger.path} records unit "
                f"{ledger.privacy_unit!r}): open it with PrivacyLedger(path, privacy_unit='user')"
            )
        if users is None and ledger.privacy_unit == "user":
            raise ValueError(
                f"{ledger.path} records user-level samples (privacy unit 'user'); an example-level DPModel cannot "
                "add to it (mixing units in one ledger is refused): give privacy_unit='user' with user_ids, or "
                "another ledger"
            )
        derive_seed(seed, 0)  # validates the seed
        if users is not None:
            bind_users(users, ledger, seed)  # the users (and ELS's kept examples) bound to this ledger
        super().__init__(**kwargs)
        self.inner = model
        # Plain attributes, kept out of Keras's tracking (they are not model state to save).
        for k, v in dict(
            noise_multiplier=z, l2_norm_clip=clips, expected_batch_size=den, population_size=n,
            sampling_probability=q, ledger=ledger, clipping=clipping, max_physical_batch_size=mpb,
            joint_scales=joint_scales, noise_mechanism=noise_mechanism, granularity=granularity,
            on_nonfinite=on_nonfinite, _dp_optimizer=optimizer, _seed=seed, _releases=0, _sampling=None, _query=None,
            _global_state=None, _template=None, _host=None, _dp_spec=None, _dp_ghost=True, _mf=mf_cfg,
            sampler=kind, _drawn=drawn, _accountant=None if kind is None else _adapters.default_accountant(kind),
            privacy_unit="example" if users is None else "user", _users=users,
        ).items():
            object.__setattr__(self, k, v)
        if drawn is not None:
            # the sampler's expected batch, exactly (E[min(Bin(n, q), B)], n/b or n·k/t)
            object.__setattr__(self, "expected_batch_size", float(probe.expected_batch_size))

    # -- Keras plumbing -------------------------------------------------------------------

    def call(self, inputs: Any, training: Any = None) -> Any:
        return self.inner(inputs, training=training)

    def compile(self, optimizer: Any = None, loss: Any = None, **kwargs: Any) -> None:
        """``keras.Model.compile`` with the DP step's requirements: no loss scaling (the
        per-record gradients must be the true ones; a loss-scaling optimizer would rescale the
        noised sum). The DP step is compiled by the backend (``jax.jit``, ``tf.function``,
        ``torch.func``) whatever ``jit_compile`` says; ``run_eagerly`` applies to evaluate and
        predict only."""
        if kwargs.get("auto_scale_loss") is True:
            raise ValueError("auto_scale_loss=True would rescale the noised gradient; DPModel needs it off")
        if kwargs.get("steps_per_execution", 1) != 1:
            raise ValueError("steps_per_execution must be 1: every step is a release, recorded on the host before its update")
        kwargs.update(auto_scale_loss=False)
        optimizer = self._dp_optimizer if optimizer is None else optimizer
        if optimizer is None:
            raise ValueError("no optimizer: give one to compile() or to make_private()")
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError("a LossScaleOptimizer would rescale the noised gradient; give its inner optimizer")
        super().compile(optimizer=optimizer, loss=loss, **kwargs)
        self.train_function = None
        # Trainable flags may have changed: rebuild the per-record pass and the query's template
        # (the Gaussian queries' global state is constant, so nothing is lost). A matrix-
        # factorization stream is not rebuilt once it has released: its noise buffers are its history.
        if self._mf is not None and self._releases:
            return
        for k in ("_query", "_global_state", "_template", "_host", "_dp_spec"):
            object.__setattr__(self, k, None)

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        """``keras.Model.fit`` that first fixes how the batches are sampled (see the class)."""
        bound = inspect.signature(keras.Model.fit).bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        x = a["x"]
        if self._users is not None:
            sampling = self._user_sampling(x)
        elif isinstance(x, UserPoissonBatches):
            raise TypeError(
                "UserPoissonBatches sample users: build the DPModel with privacy_unit='user', user_ids=... and "
                "examples_per_user=k"
            )
        elif self._mf is not None:
            sampling = self._mf_sampling(x, a, kwargs)
            bound.arguments["shuffle"] = False  # the cycle's order: batch i of every epoch is batch i
        elif isinstance(x, SampledBatches) or self.sampler in _adapters.DRAWN:
            sampling = self._drawn_sampling(x)
        elif self.sampler == "poisson" and not isinstance(x, PoissonBatches):
            raise TypeError(f"this DPModel was made with sampler='poisson': fit() takes PoissonBatches, got {type(x).__name__}")
        elif self.sampler == "shuffle" and isinstance(x, PoissonBatches):
            raise TypeError("this DPModel was made with sampler='shuffle': fit() takes arrays or a dataset, not PoissonBatches")
        elif isinstance(x, CyclicBatches):
            raise TypeError("CyclicBatches are for matrix-factorization noise: build the DPModel with noise_mechanism=")
        elif isinstance(x, PoissonBatches):
            if self.population_size is not None:
                # N declared public on the model: q·N is the denominator and N is what the ledger
                # records, whatever the arrays' length (under add-or-remove adjacency that length
                # is data; Opacus #571), so only q must agree
                q = self.expected_batch_size / self.population_size
                if not math.isclose(x.sampling_probability, q, rel_tol=1e-9):
                    raise ValueError(
                        f"PoissonBatches samples at q = {x.sampling_probability} but this DPModel divides by "
                        f"expected_batch_size = {self.expected_batch_size} = q·N with N = population_size = "
                        f"{self.population_size}, so q = {q}"
                    )
                sampling = _Sampling(self.population_size, x.sampling_probability, "poisson", x.seeded)
            else:
                if not math.isclose(x.expected_batch_size, self.expected_batch_size, rel_tol=1e-9):
                    raise ValueError(
                        f"PoissonBatches has q·n = {x.expected_batch_size} but this DPModel divides by "
                        f"expected_batch_size = {self.expected_batch_size} (the fixed denominator must be q·n)"
                    )
                sampling = _Sampling(x.population_size, x.sampling_probability, "poisson", x.seeded)
        elif _is_dataset(x) or inspect.isgenerator(x) or hasattr(x, "__next__"):
            if self.population_size is None:
                raise TypeError(
                    f"fit() got a {type(x).__name__}, whose sampling dpcore cannot see. Give a dpcore.keras."
                    "PoissonBatches (Poisson sampling, amplified), or in-memory arrays, or set population_size "
                    "to have each batch recorded as a 'shuffle' sample (no amplification)"
                )
            n = self.population_size
            sampling = _Sampling(n, min(1.0, self.expected_batch_size / n), "shuffle")
            self._warn_shuffle(type(x).__name__)
        else:
            n = _num_records(x)
            if a["validation_split"]:
                n = int(math.floor(n * (1.0 - a["validation_split"])))  # as Keras splits
            if n < 1:
                raise ValueError("fit() got no training record")
            if a["batch_size"] is None:
                a["batch_size"] = max(1, round(self.expected_batch_size))
            # fit(shuffle=False) keeps the order, shuffle="batch" keeps each batch's records
            # together: recorded as sequential (under add-or-remove a record shifts the batches)
            policy = "shuffle" if a.get("shuffle", True) is True else "sequential"
            bs = int(a["batch_size"])
            # an epoch is ⌈n/b⌉ batches, one order of the arrays; with steps_per_epoch the epochs
            # cut the data elsewhere, so those steps are recorded one by one
            k = -(-n // bs) if a.get("steps_per_epoch") is None else None
            sampling = _Sampling(n, min(1.0, bs / n), policy, sample_size=min(bs, n), epoch_steps=k)
            if k is not None:
                a["callbacks"] = list(a.get("callbacks") or []) + [_EpochMark(self)]
                object.__setattr__(self, "_epoch_at", None)
            self._warn_shuffle("arrays with batch_size")
        object.__setattr__(self, "_sampling", sampling)
        src = sampling.source
        if src is not None:
            src._in_fit = True
        try:
            return super().fit(*bound.args[1:], **bound.kwargs)
        finally:
            object.__setattr__(self, "_sampling", None)
            if src is not None:
                src._in_fit = False

    def _user_sampling(self, x: Any) -> "_Sampling":
        """The sampling of a fit with ``privacy_unit="user"``: the model's own :meth:`batches`
        (ULS: a UserPoissonBatches over the same users and k; ELS: the PoissonBatches of the
        kept examples), at the model's rate."""
        cfg = self._users
        assert cfg is not None
        bounds = cfg.ledger_bounds  # what each sample records: k (ULS) or K (ELS)
        q = self.expected_batch_size / self.population_size
        if cfg.uls:
            if not isinstance(x, UserPoissonBatches):
                raise TypeError(
                    "this DPModel samples users (privacy_unit='user', examples_per_user): fit() takes model.batches(x, y) "
                    f"(a dpcore.keras.UserPoissonBatches), got {type(x).__name__}"
                )
            if x.users.fingerprint != cfg.users.fingerprint:
                raise ValueError(
                    "the UserPoissonBatches' user_ids are not this DPModel's: the users must stay the same over the run "
                    "(use model.batches(x, y))"
                )
            if x.examples_per_user != cfg.examples_per_user:
                raise ValueError(
                    f"the UserPoissonBatches take up to {x.examples_per_user} examples per user, this DPModel was made "
                    f"with examples_per_user={cfg.examples_per_user}"
                )
            if not math.isclose(x.sampling_probability, q, rel_tol=1e-9):
                raise ValueError(
                    f"the UserPoissonBatches sample users at q = {x.sampling_probability}, but this DPModel divides by "
                    f"expected_batch_size = {self.expected_batch_size} = q·U with U = {self.population_size} users, so "
                    f"q = {q}"
                )
            return _Sampling(self.population_size, x.sampling_probability, "poisson", x.seeded, source=x,
                             user_bounds=bounds)
        if not (isinstance(x, PoissonBatches) and getattr(x, "_user_bound", None) is cfg):
            raise TypeError(
                "this DPModel bounds each user to max_examples_per_user examples: fit() takes model.batches(x, y) (the "
                f"PoissonBatches of the kept examples), got {type(x).__name__}"
            )
        if not math.isclose(x.sampling_probability, q, rel_tol=1e-9):
            raise ValueError(f"the batches sample at q = {x.sampling_probability}, this DPModel at q = {q}")
        return _Sampling(self.population_size, x.sampling_probability, "poisson", x.seeded, user_bounds=bounds)

    def _drawn_sampling(self, x: Any) -> "_Sampling":
        """The sampling of a fit on :class:`SampledBatches`: checked against this model (its
        sampler, or with none given its denominator), bound to the ledger."""
        if not isinstance(x, SampledBatches):
            raise TypeError(
                f"this DPModel was made with sampler={self.sampler!r}: fit() takes its batches, model.batches(x, y) "
                f"(a dpcore.keras.{sampled_batches(self.sampler).__name__}), got {type(x).__name__}"
            )
        if self.sampler is not None and self._drawn is None:
            raise TypeError(f"this DPModel was made with sampler={self.sampler!r}; fit() got {type(x).__name__}")
        if self.population_size is not None and x.population_size != self.population_size:
            raise ValueError(
                f"the {type(x).__name__} sample from {x.population_size} records, this DPModel from "
                f"population_size={self.population_size}"
            )
        if self._drawn is not None:
            want = {"policy": self.sampler, "population_size": self.population_size, **self._drawn}
            got = {"policy": x.policy, "population_size": x.population_size, **x._args}
            if got != want:
                raise ValueError(
                    f"the batches follow {got}, but this DPModel was made for {want}: use model.batches(x, y)"
                )
        if not math.isclose(x.expected_batch_size, self.expected_batch_size, rel_tol=1e-9):
            raise ValueError(
                f"the {type(x).__name__} have an expected batch of {x.expected_batch_size} but this DPModel divides by "
                f"expected_batch_size = {self.expected_batch_size} (the fixed denominator must be the sampler's)"
            )
        x._bind(self.ledger)
        if x.policy in _adapters.ALLOCATION:
            object.__setattr__(self, "_accountant", "rdp")
        return _Sampling(x.population_size, x.sampling_probability, x.policy, x.seeded, source=x)

    def batches(self, x: Any, y: Any = None, sample_weight: Any = None, *, seed: Optional[int] = None, **kwargs: Any) -> Any:
        """The :class:`~dpcore.keras.SampledBatches` of this model's ``sampler`` over
        ``(x, y[, sample_weight])`` (``len(x)`` must be ``population_size``), for :meth:`fit`.
        ``seed``: tests only (a seeded sample is predictable: no privacy). ``kwargs``: the
        ``PyDataset`` options (``workers``, ...).

        With ``privacy_unit="user"``: ``len(x)`` must be the number of ``user_ids``; ULS gives
        a :class:`~dpcore.keras.UserPoissonBatches` over the users, ELS the
        :class:`~dpcore.keras.PoissonBatches` of the examples the bound kept (``steps``
        in ``kwargs``: batches per epoch, default round(1/q))."""
        if self._users is not None:
            return self._user_batches(x, y, sample_weight, seed=seed, **kwargs)
        if self._drawn is None:
            raise ValueError(
                "batches() builds the batches of sampler='truncated_poisson', 'balls_in_bins' or 'random_allocation'; "
                f"this DPModel has sampler={self.sampler!r} (use PoissonBatches)"
            )
        out = sampled_batches(self.sampler)._with(x, y, sample_weight, self._drawn, seed, **kwargs)
        if out.population_size != self.population_size:
            raise ValueError(f"x has {out.population_size} records, this DPModel samples from population_size={self.population_size}")
        return out

    def _user_batches(self, x: Any, y: Any, sample_weight: Any, *, seed: Optional[int], **kwargs: Any) -> Any:
        from ._data import _records

        cfg = self._users
        assert cfg is not None
        x, y, sample_weight, n = _records(x, y, sample_weight)
        if n != cfg.users.num_examples:
            raise ValueError(f"x has {n} examples but user_ids has {cfg.users.num_examples} ids: give one id per example")
        q = self.expected_batch_size / self.population_size
        if cfg.uls:
            return UserPoissonBatches(x, y, sample_weight, user_ids=cfg.users, examples_per_user=cfg.examples_per_user,
                                      sampling_probability=q, seed=seed, **kwargs)
        take = lambda a: a[cfg.kept]  # noqa: E731
        sub = [None if part is None else keras.tree.map_structure(take, part) for part in (x, y, sample_weight)]
        out = PoissonBatches(sub[0], sub[1], sub[2], sampling_probability=q, seed=seed, **kwargs)
        out._user_bound = cfg  # made for this model's bound: fit() takes only these
        return out

    @property
    def user_index(self) -> Any:
        """The :class:`~dpcore.sampling.UserIndex` of ``user_ids`` (None at the example level)."""
        return None if self._users is None else self._users.users

    @property
    def examples_per_user(self) -> Optional[int]:
        """k of user-level sampling (None otherwise)."""
        return None if self._users is None else self._users.examples_per_user

    @property
    def max_examples_per_user(self) -> Optional[int]:
        """K of example-level sampling with a user-level bound (None otherwise)."""
        return None if self._users is None else self._users.max_examples_per_user

    @property
    def kept_examples(self) -> Optional[np.ndarray]:
        """ELS: the sorted indices of the examples the bound kept (None otherwise)."""
        return None if self._users is None or self._users.kept is None else self._users.kept.copy()

    def _mf_sampling(self, x: Any, a: Any, kwargs: Any) -> "_Sampling":
        cfg = self._mf
        part = cfg["participation"]
        if not isinstance(x, CyclicBatches):
            raise TypeError(
                f"fit() got a {type(x).__name__}; a DPModel with matrix-factorization noise trains on a "
                "dpcore.keras.CyclicBatches (the fixed cyclic order its noise's sensitivity assumes)"
            )
        xp = x.participation
        if (xp.kind, xp.min_separation, xp.sampling_probability) != (part.kind, part.min_separation, part.sampling_probability) or (
            x.population_size != cfg["population_size"]
        ):
            raise ValueError(
                f"the CyclicBatches follow {xp.describe()} over {x.population_size} records, but this DPModel's noise "
                f"was planned for {part.describe()} over {cfg['population_size']}"
            )
        if kwargs.get("shuffle") is True:
            raise ValueError("shuffle=True would reorder the cyclic batches every epoch; leave it out")
        b = part.min_separation
        if a.get("steps_per_epoch") not in (None, b):
            raise ValueError(f"steps_per_epoch must be the {b} batches of the cycle (or None)")
        if self._releases % b:
            raise RuntimeError(
                f"a previous fit() stopped after {self._releases} releases, in the middle of an epoch of {b} batches: "
                "the cycle and the matrix-factorization noise stream are no longer aligned; start a new DPModel "
                "(with a new ledger or the same one) instead"
            )
        if self._releases >= cfg["steps"] or self._releases + b * (int(a.get("epochs") or 1) - int(a.get("initial_epoch") or 0)) > cfg["steps"]:
            warnings.warn(
                f"this fit() runs past the {cfg['steps']} steps the matrix-factorization noise was planned for: the "
                "ledger accounts the steps actually run (ε grows faster than planned)",
                UserWarning,
                stacklevel=3,
            )
        if x.policy == "cyclic":
            return _Sampling(x.population_size, x.sampling_probability, "cyclic", x.seeded, x.batch_size)
        return _Sampling(x.population_size, x.sampling_probability, "cyclic_poisson", x.seeded)

    def _warn_shuffle(self, what: str) -> None:
        warnings.warn(
            f"DPModel.fit on {what}: the batches are not Poisson samples, so each release is recorded with "
            "policy 'shuffle' (or 'sequential' with shuffle=False) and accounted without sampling amplification, "
            "one Gaussian query per step (McMahan et al. 2018, §5). "
            "Use dpcore.keras.PoissonBatches for amplified accounting.",
            LedgerWarning,
            stacklevel=3,
        )

    # -- accounting -----------------------------------------------------------------------

    @property
    def max_grad_norm(self) -> Any:
        """The clip norm C (or the list of per-variable bounds) given as ``max_grad_norm``."""
        return self.l2_norm_clip

    @property
    def releases(self) -> int:
        """Noised releases (applied updates) made by this model so far."""
        return self._releases

    def get_epsilon(self, delta: float, **kw: Any) -> float:
        """ε of everything recorded in the ledger at ``delta`` (an upper bound). The accountant
        defaults to the sampler's (``"rdp"`` for the allocation samplers, their only certified
        analysis), else the ledger's default (PLD)."""
        if self._accountant is not None and "accountant" not in kw:
            kw["accountant"] = self._accountant
        return self.ledger.get_epsilon(delta, **kw)

    # -- the DP step ----------------------------------------------------------------------

    @property
    def query(self) -> Any:
        """The query that clips and noises (built on first use, once the variables exist)."""
        self._setup()
        return self._query

    def _setup(self) -> None:
        if self._query is not None:
            return
        if not self.built and self.inner.built:
            self.built = True  # the wrapper has no variables of its own
        bad = _incompatible_layers(self.inner)
        if bad:  # a BatchNormalization unfrozen after wrapping
            raise TypeError(f"layers with batch statistics mix records and break per-record clipping: {bad}")
        variables = self.trainable_variables
        if not variables:
            raise ValueError("the model has no trainable variable (build it first, e.g. with keras.Input)")
        m, z, den = len(variables), self.noise_multiplier, self.expected_batch_size
        if self._mf is not None:
            from ..queries import MatrixFactorizationQuery

            cfg = self._mf
            query: Any = MatrixFactorizationQuery(
                self.l2_norm_clip, z, strategy=cfg["strategy"], participation=cfg["participation"], steps=cfg["steps"],
                denominator=den, on_nonfinite=self.on_nonfinite,
            )
        else:
            # flat, per-layer (a list in the variables' order) or joint: the one builder of the front ends
            query = clipping_query(
                m, clipping=self.clipping, max_grad_norm=self.l2_norm_clip, noise_multiplier=z, denominator=den,
                noise_mechanism=self.noise_mechanism, granularity=self.granularity, joint_scales=self.joint_scales,
                what="trainable variables", on_nonfinite=self.on_nonfinite,
            )
        template = [_Spec(v.shape, v.dtype) for v in variables]
        host = None
        if self._mf is None and (self._users is None or not self._users.uls):
            host = HostRelease(query, [t.shape for t in template])
            if not host.compiled:
                host = None
        if host is not None:
            spec = host.spec
        else:
            # the host path clips in the core; the compiled call only forms per-record gradients
            spec = ClipSpec([list(range(m))], [[1.0] * m], [t.shape for t in template])
        for k, v in dict(_query=query, _global_state=query.initial_global_state(), _template=template, _host=host,
                         _dp_spec=spec).items():
            object.__setattr__(self, k, v)

    def make_train_function(self, force: bool = False) -> Any:
        """The DP step of this Keras backend (``_backends``), in the form its ``fit`` calls."""
        if getattr(self, "train_function", None) is not None and not force:
            return self.train_function
        self._setup()
        fn = _backends.backend_module().make_train_function(self)
        self.train_function = fn
        return fn

    # -- the host's part of a step (called by the backend's train function) --------------

    def _dp_begin(self, data: Any) -> "_Batch":
        """The step's batch: drawn by the sampler where it draws in the step, as numpy, cut into
        micro-batches of at most ``max_physical_batch_size`` records, each padded to a multiple of
        :data:`~dpcore.keras._step.PAD` records with its mask of real records."""
        sampling = self._sampling
        if sampling is None:
            raise RuntimeError(
                "DPModel's train step runs inside fit() only, where the batches' sampling is known: use "
                "fit(PoissonBatches(...)) (or dpcore.tensorflow.CustomLoopTrainer for a hand-written loop)"
            )
        self._setup()
        if sampling.source is not None:
            # Drawn now, right before the release, and recorded in the ledger by the sampler
            # (Keras's ``data`` holds the record structure only: see SampledBatches); user-level
            # batches are recorded at the release, with their bound.
            data = sampling.source.draw()
        means = None
        if isinstance(sampling.source, UserPoissonBatches):
            # ULS: the examples are user-major; each user's mean gradient is one record
            means = user_means(sampling.source.last_slots, sampling.source.last_counts)
        x, y, sw = keras.utils.unpack_x_y_sample_weight(data)
        tonp = lambda t: None if t is None else keras.tree.map_structure(_to_numpy, t)  # noqa: E731
        x, y, sw = tonp(x), tonp(y), tonp(sw)
        b = int(np.shape(keras.tree.flatten(x)[0])[0])
        chunk = self.max_physical_batch_size or max(b, 1)
        chunks, sizes = [], []
        for start in range(0, max(b, 1), chunk):
            part = [None if t is None else keras.tree.map_structure(lambda a: a[start : start + chunk], t) for t in (x, y, sw)]
            n = max(0, min(chunk, b - start))
            mask = None
            for j, t in enumerate(part):
                if t is not None:
                    part[j], mask = padded(t, n, keras.tree)
            chunks.append((part[0], part[1], part[2], mask))
            sizes.append(n)
        return _Batch(chunks=chunks, sizes=sizes, b=b, compiled=self._host is not None, means=means)

    def _dp_clip_args(self) -> Any:
        return self._host.clip_args()

    def _record_sample(self) -> None:
        sampling = self._sampling
        if not sampling.records_itself:
            return
        rounds: Dict[str, Any] = {}
        if sampling.epoch_steps is not None:
            at = getattr(self, "_epoch_at", None)  # (round, batch index) of the last batch
            at = (self.ledger.next_round, 0) if at is None else (at[0], at[1] + 1)
            object.__setattr__(self, "_epoch_at", at)
            rounds = dict(round=at[0], step_in_round=at[1], round_steps=sampling.epoch_steps, round_selected=1)
        if sampling.user_bounds is not None:
            rounds.update(sampling.user_bounds)  # examples_per_user=k (ULS) or max_examples_per_user=K (ELS)
        self.ledger.record_sample(
            sampling.population_size, sampling.sampling_probability, sampling.policy, seeded=sampling.seeded,
            sample_size=sampling.sample_size, **rounds,
        )

    def _dp_release(self, batch: "_Batch", sq_norms: List[Any], bad: List[Any], sums: Any) -> Any:
        """The compiled path's release (McMahan et al. 2018, §1 step 3 and §6): the sample and the
        release written to the ledger, and ``(noise, None)``: the noise of the clipped sums (one
        float32 array per variable, already divided by the denominator), or ``(None, values)``
        under the grey-box harness (see :meth:`HostRelease.release`). ``on_nonfinite="raise"`` first looks at
        which records were not finite (a debugging aid: it reads the data); the default never
        does, and adaptive clipping's count is the only thing read from the norms."""
        host = self._host
        norms = None
        if self.on_nonfinite == "raise" or host.needs_norms:
            flags = np.concatenate([np.asarray(f)[:n] for f, n in zip(bad, batch.sizes)])
            if self.on_nonfinite == "raise" and flags.any():
                host.forget()
                raise ValueError(
                    f"record {int(np.flatnonzero(flags)[0])} of the batch has a non-finite (NaN or infinite) per-record "
                    "gradient; nothing was released (on_nonfinite='raise': a debugging aid whose outcome depends on the "
                    "data, not DP; the default on_nonfinite='zero' gives such a record a zero contribution)"
                )
            if host.needs_norms:
                sq = np.concatenate([np.asarray(s, np.float64)[:, :n] for s, n in zip(sq_norms, batch.sizes)], axis=1)
                sq[:, flags] = np.inf
                norms = sq
        self._record_sample()
        out = host.release(self.ledger, self._releases, norms, sums, seed=derive_seed(self._seed, self._releases))
        object.__setattr__(self, "_releases", self._releases + 1)
        return out

    def _dp_host_release(self, batch: "_Batch", records: List[List[Any]]) -> List[np.ndarray]:
        """The host path's release: the query clips the per-record gradients in the core (or the
        means of each user's, for user-level sampling), noises their sum and the ledger records it."""
        q, gs = self._query, self._global_state
        params = q.derive_sample_params(gs)
        state = q.initial_sample_state(self._template)
        start = 0
        for grads, n in zip(records, batch.sizes):
            arrays = [np.asarray(g)[:n] for g in grads]
            if batch.means is None:
                recs = arrays
            else:
                # the users complete by the end of this micro-batch: the mean of each user's
                # per-example gradients (a user cut by the micro-batch is carried over)
                recs = batch.means.add(start, arrays, [t.dtype for t in self._template]) if n else None
            if recs is not None and n:
                state = q.accumulate_records(params, state, recs)  # core clip; NaN/inf records add zero
            start += n
        self._record_sample()
        result, new_gs, event = q.get_noised_result(state, gs, seed=derive_seed(self._seed, self._releases))
        self.ledger.record_release(event)  # durable before the update (McMahan et al. 2018, §6)
        object.__setattr__(self, "_global_state", new_gs)
        object.__setattr__(self, "_releases", self._releases + 1)
        return [np.asarray(r, dtype=t.dtype) for r, t in zip(result, self._template)]

    def train_step(self, *args: Any) -> Any:
        raise RuntimeError(
            "DPModel's train step runs inside fit() only, where the batches' sampling is known: use "
            "fit(PoissonBatches(...)) (or dpcore.tensorflow.CustomLoopTrainer for a hand-written loop)"
        )


@dataclass
class _Batch:
    """A step's batch as the backends take it: padded micro-batches (x, y, sw, mask) and the
    number of real records in each."""

    chunks: List[Any]
    sizes: List[int]
    b: int
    compiled: bool
    means: Any = None


def _to_numpy(t: Any) -> np.ndarray:
    if hasattr(t, "detach"):  # a torch tensor
        t = t.detach().cpu()
    return np.asarray(t)


def _num_records(x: Any) -> int:
    leaves = keras.tree.flatten(x)
    if not leaves or any(np.ndim(a) < 1 for a in leaves):
        raise TypeError(f"fit() got {type(x).__name__}, which is neither PoissonBatches nor arrays with a record axis")
    return int(np.shape(leaves[0])[0])


def _is_dataset(x: Any) -> bool:
    if isinstance(x, keras.utils.PyDataset):
        return True
    tf = sys.modules.get("tensorflow")  # a tf.data pipeline exists only where TensorFlow was imported
    return tf is not None and hasattr(tf, "data") and isinstance(x, tf.data.Dataset)
