"""Building a :class:`~dpcore.keras.DPModel`: :func:`make_private`, :func:`make_private_with_epsilon`.

:func:`make_private` wraps a Keras model in a :class:`~dpcore.keras.DPModel` (Abadi et al.
2016, Algorithm 1; McMahan et al. 2018); :func:`make_private_with_epsilon` first calibrates its
noise multiplier to a target (ε, δ). ``_mf_config`` is the plan of a DPModel with
matrix-factorization noise (its participation, steps, strategy and fixed denominator), shared by
``DPModel.__init__`` and the calibration. The DPModel itself is in ``_keras.py``.
"""

from __future__ import annotations

from typing import Any, Optional

from .. import _names
from .._names import renamed
from ..ledger import PrivacyLedger
from .. import _adapters
from ..plan import calibrate_noise, steps_for_epochs
from ._data import sampled_batches
from .._validate import count, positive as _number

from ._model import DPModel
from ._mf import _mf_config

__all__ = ["make_private", "make_private_with_epsilon"]


def make_private(
    model: Any,
    optimizer: Any,
    *,
    noise_multiplier: Optional[float] = None,
    max_grad_norm: Any = None,
    expected_batch_size: Optional[float] = None,
    population_size: Optional[int] = None,
    sampling_probability: Optional[float] = None,
    ledger: Optional[PrivacyLedger] = None,
    clipping: str = "flat",
    max_physical_batch_size: Optional[int] = None,
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
    target_epsilon: Optional[float] = None,
    target_delta: Optional[float] = None,
    accountant: Optional[str] = None,
    on_nonfinite: str = "zero",
    privacy_unit: str = "example",
    user_ids: Any = None,
    examples_per_user: Optional[int] = None,
    max_examples_per_user: Optional[int] = None,
) -> DPModel:
    """``model`` wrapped in a :class:`DPModel` whose ``compile``/``fit`` train with DP-SGD
    (Abadi et al. 2016, Algorithm 1; McMahan et al. 2018)::

        dp = make_private(model, keras.optimizers.SGD(0.5), noise_multiplier=1.1, max_grad_norm=1.0,
                          population_size=len(x), sampling_probability=q, ledger=PrivacyLedger("run.jsonl"))
        dp.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        dp.fit(PoissonBatches(x, y, sampling_probability=q), epochs=5)
        eps = dp.get_epsilon(1e-5)

    ``optimizer`` is what ``compile`` uses (any Keras optimizer: the noised average gradient
    goes through its update rule). See :class:`DPModel` for the other parameters. ``model``
    itself is trained in place (the wrapper shares its variables).

    Matrix-factorization noise (``noise_mechanism``, ``strategy``, ``epochs``,
    ``participation``, ``batch_size``; see :class:`DPModel`)::

        dp = make_private(model, keras.optimizers.SGD(0.5), noise_multiplier=1.0, max_grad_norm=1.0,
                          noise_mechanism="blt", epochs=5, population_size=len(x), batch_size=64)
        dp.compile(loss=...)
        dp.fit(CyclicBatches(x, y, batch_size=64), epochs=5)

    Other samplers (``sampler=``, ``max_batch_size``, ``num_selected``; see :class:`DPModel`)::

        dp = make_private(model, keras.optimizers.SGD(0.5), noise_multiplier=1.0, max_grad_norm=1.0,
                          population_size=len(x), expected_batch_size=64, sampler="balls_in_bins")
        dp.compile(loss=...)
        dp.fit(dp.batches(x, y), epochs=5)
        eps = dp.get_epsilon(1e-5)           # RDP: the allocation samplers' certified analysis

    ``noise_multiplier`` σ, or ``target_epsilon`` with ``target_delta`` and ``epochs``: σ then
    calibrated by :func:`make_private_with_epsilon` (under ``accountant``). Exactly one of the two.

    ``on_nonfinite``: ``"zero"`` (the default) gives a record whose per-record gradient holds a
    NaN or ±∞ zero contribution, and the step releases as usual (differentially private);
    ``"raise"`` makes the step raise ``ValueError`` naming it, before anything is recorded (a
    debugging aid whose behaviour depends on the data, not differentially private).

    User-level DP (``privacy_unit="user"``, ``user_ids`` one id per training example; see
    :class:`DPModel`)::

        dp = make_private(model, keras.optimizers.SGD(0.5), noise_multiplier=1.0, max_grad_norm=1.0,
                          privacy_unit="user", user_ids=ids, examples_per_user=4,    # ULS
                          expected_batch_size=32,                                    # users per step
                          ledger=PrivacyLedger("run.jsonl", privacy_unit="user"))
        dp.compile(loss=...)
        dp.fit(dp.batches(x, y), epochs=5)
        eps = dp.get_epsilon(1e-5)           # user-level

    or ``max_examples_per_user=K`` (ELS: each user bounded to K examples, then example-level
    Poisson batches; ``expected_batch_size`` then counts examples).
    """
    clip = renamed("max_grad_norm", max_grad_norm, "l2_norm_clip", l2_norm_clip)
    noise_mechanism = _names.noise_mechanism(noise_mechanism)
    noise_mechanism, strategy = _names.legacy_independent(noise_mechanism, strategy)
    if _adapters.wants_target(noise_multiplier, target_epsilon, target_delta, epochs, "make_private"):
        return make_private_with_epsilon(
            model, optimizer, target_epsilon=target_epsilon, target_delta=target_delta, epochs=epochs,
            max_grad_norm=clip, population_size=population_size, sampling_probability=sampling_probability,
            accountant=accountant, expected_batch_size=expected_batch_size, ledger=ledger, clipping=clipping,
            max_physical_batch_size=max_physical_batch_size, seed=seed, noise_mechanism=noise_mechanism,
            strategy=strategy, participation=participation, batch_size=batch_size, sampler=sampler,
            max_batch_size=max_batch_size, num_selected=num_selected, joint_scales=joint_scales, granularity=granularity,
            on_nonfinite=on_nonfinite, privacy_unit=privacy_unit, user_ids=user_ids, examples_per_user=examples_per_user,
            max_examples_per_user=max_examples_per_user,
        )
    if accountant is not None:
        raise ValueError("accountant= is the calibration's accountant: give it with target_epsilon=")
    _adapters.check_noise_or_target(noise_multiplier, None, None, "make_private")
    return DPModel(
        model,
        noise_multiplier=noise_multiplier,
        max_grad_norm=clip,
        expected_batch_size=expected_batch_size,
        population_size=population_size,
        sampling_probability=sampling_probability,
        ledger=ledger,
        clipping=clipping,
        max_physical_batch_size=max_physical_batch_size,
        optimizer=optimizer,
        seed=seed,
        noise_mechanism=noise_mechanism,
        strategy=strategy,
        epochs=epochs,
        participation=participation,
        batch_size=batch_size,
        sampler=sampler,
        max_batch_size=max_batch_size,
        num_selected=num_selected,
        joint_scales=joint_scales,
        granularity=granularity,
        on_nonfinite=on_nonfinite,
        privacy_unit=privacy_unit,
        user_ids=user_ids,
        examples_per_user=examples_per_user,
        max_examples_per_user=max_examples_per_user,
    )


def make_private_with_epsilon(
    model: Any,
    optimizer: Any,
    *,
    target_epsilon: float,
    target_delta: float,
    epochs: int,
    max_grad_norm: Any = None,
    population_size: Optional[int] = None,
    sampling_probability: Optional[float] = None,
    accountant: Optional[str] = None,
    l2_norm_clip: Any = None,
    **kwargs: Any,
) -> "DPModel":
    """:func:`make_private` with the noise multiplier calibrated so that ``epochs`` epochs of
    round(1/q) Poisson batches (as :class:`PoissonBatches` draws them by default) are
    (``target_epsilon``, ``target_delta``)-DP under ``accountant`` (default "pld";
    :func:`dpcore.accounting.calibrate_noise_multiplier`, Abadi et al. 2016 Algorithm 1). The
    chosen σ is ``dp_model.noise_multiplier`` when the model exposes it, and is always the one
    the ledger records.

    With ``noise_mechanism="banded"`` or ``"blt"`` (and ``batch_size`` or ``participation``; no
    ``sampling_probability``) the *effective* noise multiplier of the matrix-factorization run
    is calibrated for its epochs·b planned steps
    (:func:`dpcore.matrix_factorization.calibrate_noise_multiplier`).

    With ``sampler=`` (see :class:`DPModel`; ``sampling_probability`` or ``expected_batch_size``
    gives the batch size) σ is calibrated with that sampler's own accounting: the smallest z
    (to 1e-5 relative, from above: :func:`dpcore.plan.calibrate_noise`) whose
    ``sampler.accountant_event(z, steps)`` meets the target under its accountant (default PLD for truncated Poisson, RDP for the allocation
    samplers, for which ``accountant="pld"`` is refused), for ``epochs`` × round(1/q)
    truncated-Poisson steps, ``epochs`` balls-in-bins epochs, or ⌈epochs/k⌉ allocation rounds
    (a round is k passes; a round cut short counts whole). ``sampler="shuffle"``: ``epochs`` ×
    ⌈n/round(q·n)⌉ full-batch Gaussian steps (no amplification), as ``fit`` on arrays records.

    With ``privacy_unit="user"`` (``user_ids`` and ``examples_per_user`` or
    ``max_examples_per_user``; see :class:`DPModel`) σ comes from the plan of the user-level run
    (:func:`dpcore.plan.make_plan` with the same unit and bound: ULS is accounted as Poisson
    sampling of users at q over U = ``population_size`` users, by default the distinct ids; ELS
    as the mixture of Gaussians of a user's up to K examples, each sampled at q, over the
    Σ_u min(count_u, K) kept examples), for ``epochs`` × round(1/q) steps. ``population_size``
    is required at the example level only."""
    clip = renamed("max_grad_norm", max_grad_norm, "l2_norm_clip", l2_norm_clip)
    epochs = count("epochs", epochs, 1)
    if "noise_multiplier" in kwargs:
        raise TypeError("make_private_with_epsilon chooses noise_multiplier; do not give it")
    if kwargs.get("privacy_unit", "example") != "example":
        return _user_with_epsilon(model, optimizer, target_epsilon, target_delta, epochs, clip, population_size,
                                  sampling_probability, accountant, kwargs)
    if population_size is None:
        raise TypeError("make_private_with_epsilon() missing required keyword argument: 'population_size'")
    nm = _names.noise_mechanism(kwargs.pop("noise_mechanism", None))
    if nm == "discrete_gaussian":
        raise ValueError(
            "make_private_with_epsilon calibrates for noise_mechanism='gaussian' only (and 'banded', 'blt'); for the "
            "discrete Gaussian give noise_multiplier to make_private and read dp_model.get_epsilon(delta)"
        )
    nm, strategy = _names.legacy_independent(nm, kwargs.get("strategy"))
    if strategy is not None:
        kwargs["strategy"] = strategy
    mf = nm in _names.MF_NOISE
    kwargs["noise_mechanism"] = nm
    kind = kwargs.get("sampler")
    if kind is not None and not mf:
        kind = _adapters.resolve_sampler(kind, None)
        n = count("population_size", population_size, 1)
        ebs = kwargs.get("expected_batch_size")
        if (sampling_probability is None) == (ebs is None):
            raise TypeError(f"make_private_with_epsilon with sampler={kind!r} needs sampling_probability or expected_batch_size")
        bs = _number("expected_batch_size", ebs) if sampling_probability is None else (
            _number("sampling_probability", sampling_probability) * n
        )
        if kind in _adapters.DRAWN:
            args = _adapters.shape(kind, n, bs, kwargs.get("max_batch_size"), kwargs.get("num_selected", 1))
            probe = sampled_batches(kind)._probe(n, args)
            acct = _adapters.calibration_accountant(kind, accountant)
            z = calibrate_noise(target_epsilon, target_delta, sampler=kind, steps=probe.steps_for(epochs),
                                accountant=acct, **probe.parameters())
        else:
            q = min(1.0, bs / n)
            spe = -(-n // max(1, round(bs))) if kind == "shuffle" else None
            z = calibrate_noise(
                target_epsilon, target_delta, sampler=kind, sampling_probability=q, steps_per_epoch=spe,
                steps=steps_for_epochs(kind, epochs, q, steps_per_epoch=spe), accountant=accountant,
            )
        return make_private(
            model, optimizer, noise_multiplier=z, max_grad_norm=clip, population_size=n,
            sampling_probability=sampling_probability, **kwargs,
        )
    accountant = "pld" if accountant is None else accountant
    if mf:
        from ..matrix_factorization import calibrate_noise_multiplier as mf_calibrate

        plan = _mf_config(
            nm, strategy=kwargs.get("strategy"), epochs=epochs,
            participation=kwargs.get("participation"), batch_size=kwargs.get("batch_size"),
            population_size=population_size, sampling_probability=sampling_probability,
            expected_batch_size=kwargs.get("expected_batch_size"), clipping=kwargs.get("clipping", "flat"),
        )
        z = mf_calibrate(
            target_epsilon, target_delta, participation=plan["participation"], steps=plan["steps"], accountant=accountant
        )
        kwargs["strategy"] = plan["strategy"]  # optimised once
        return make_private(
            model, optimizer, noise_multiplier=z, max_grad_norm=clip, population_size=population_size, epochs=epochs,
            **kwargs,
        )
    if sampling_probability is None:
        raise TypeError("make_private_with_epsilon needs sampling_probability (or noise_mechanism='banded' / 'blt')")
    q = float(sampling_probability)
    if not 0.0 < q <= 1.0:
        raise ValueError(f"sampling_probability must be in (0, 1], got {sampling_probability}")
    z = calibrate_noise(target_epsilon, target_delta, sampler="poisson", sampling_probability=q,
                        steps=steps_for_epochs("poisson", epochs, q), accountant=accountant)
    return make_private(
        model,
        optimizer,
        noise_multiplier=z,
        max_grad_norm=clip,
        population_size=population_size,
        sampling_probability=q,
        **kwargs,
    )


def _user_with_epsilon(model: Any, optimizer: Any, target_epsilon: float, target_delta: float, epochs: int, clip: Any,
                       population_size: Optional[int], sampling_probability: Optional[float], accountant: Optional[str],
                       kwargs: dict) -> "DPModel":
    """make_private_with_epsilon for ``privacy_unit="user"``: σ from the plan of the user-level
    run (one calibration path: :func:`dpcore.plan.make_plan`)."""
    from ..plan import make_plan
    from ._users import user_config

    users = user_config(kwargs.get("privacy_unit"), kwargs.get("user_ids"), kwargs.get("examples_per_user"),
                        kwargs.get("max_examples_per_user"))
    if _names.noise_mechanism(kwargs.get("noise_mechanism")) != "gaussian":
        raise ValueError("make_private_with_epsilon with privacy_unit='user' calibrates the Gaussian mechanism only")
    if kwargs.get("sampler") not in (None, "poisson"):
        raise ValueError("privacy_unit='user' samples with Poisson sampling; sampler= is not supported with it")
    n = users.population if population_size is None else count("population_size", population_size, 1)
    ebs = kwargs.get("expected_batch_size")
    if (sampling_probability is None) == (ebs is None):
        raise TypeError("make_private_with_epsilon with privacy_unit='user' needs sampling_probability or expected_batch_size")
    q = _number("sampling_probability", sampling_probability) if ebs is None else _number("expected_batch_size", ebs) / n
    if not 0.0 < q <= 1.0:
        raise ValueError(f"sampling_probability must be in (0, 1], got {q}")
    plan = make_plan(
        sampling_probability=q, target_epsilon=target_epsilon, target_delta=target_delta, epochs=epochs,
        population_size=n, accountant=accountant, privacy_unit="user", **users.ledger_bounds,
    )
    kwargs = dict(kwargs)
    kwargs["user_ids"] = users.users  # checked once
    if ebs is None:
        kwargs["sampling_probability"] = q
    return make_private(model, optimizer, noise_multiplier=plan.noise_multiplier, max_grad_norm=clip,
                        population_size=population_size, **kwargs)
