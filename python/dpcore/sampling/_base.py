"""The sampler protocol: one class per sampler, registered by name (McMahan et al. 2018, §5-§6).

Amplification by sampling is a property of the sampler that ran, so everything that depends on
it is asked of the sampler's class, found by its registry name (the ``sampler=`` of every front
end and the ``policy`` of its ledger entries):

* what it is: :attr:`Sampler.name`, the neighbouring relations its guarantee holds under
  (:attr:`~Sampler.relations`, and the one a run is stated under by default), the accountant that
  certifies it best, the sentence the report states (:attr:`~Sampler.guarantee`);
* a run planned before it starts: :meth:`~Sampler.event` (the accountant event of ``steps``
  steps at a noise multiplier, from public parameters) and :meth:`~Sampler.steps_for_epochs`
  (the one formula every front end turns epochs into steps with);
* a run as the ledger recorded it: :meth:`~Sampler.step_event` (one recorded step) and
  :meth:`~Sampler.round_event` (one epoch or allocation round, for samplers whose guarantee rests
  on a round);
* the draw itself: an instance draws step after step (:meth:`~Sampler.draw`), records each
  sample in its ledger, and checkpoints its position (:meth:`~Sampler.state_dict`).

A new sampler is a subclass with a new :attr:`~Sampler.name`, registered with
:func:`register_sampler`; the ledger, the accountants' defaults, the report, the CLI and the
adapters' loaders then accept it by name. This module imports neither the ledger nor the
accountants: events come from :mod:`dpcore.events`, and a ledger is anything with
``record_sample``.
"""

from __future__ import annotations

import math
import os
from typing import Any, ClassVar, Dict, Optional, Tuple, Type

import numpy as np

from .._seeds import derive_seed
from .._validate import count as _count, probability as _probability, real as _real
from ..mechanism import _seed

#: The neighbouring relations (:mod:`dpcore.accounting.samplers` explains each).
NEIGHBORING = ("add_or_remove", "zero_out", "replace_one")

_REGISTRY: Dict[str, Type["Sampler"]] = {}

_REPLACE_ONE = (
    "no replace-one analysis of {sampler} sampling is implemented (its amplification is analysed for a record "
    "added or removed, or zeroed out); use neighboring='add_or_remove' or 'zero_out'"
)


def register_sampler(cls: Type["Sampler"]) -> Type["Sampler"]:
    """Registers ``cls`` under its :attr:`~Sampler.name` (usable as a class decorator). A name
    is taken once: registering another class under a registered name is refused."""
    if not (isinstance(cls, type) and issubclass(cls, Sampler)):
        raise TypeError(f"register_sampler takes a Sampler subclass, got {cls!r}")
    name = cls.__dict__.get("name")
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"{cls.__name__} must declare its registry name as a class attribute name = '...'")
    have = _REGISTRY.get(name)
    if have is not None and have is not cls:
        raise ValueError(f"a sampler named {name!r} is already registered ({have.__module__}.{have.__qualname__})")
    if not cls.relations or any(r not in NEIGHBORING for r in cls.relations):
        raise ValueError(f"{cls.__name__}.relations must be a non-empty subset of {NEIGHBORING}")
    if cls.default_relation not in cls.relations:
        raise ValueError(f"{cls.__name__}.default_relation must be one of its relations {cls.relations}")
    if cls._indices is Sampler._indices and cls.draw is Sampler.draw:
        raise ValueError(f"{cls.__name__} must implement _indices(t) (or draw()): a sampler draws its steps")
    if cls.rounds not in (None, "epoch", "allocation"):
        raise ValueError(f"{cls.__name__}.rounds must be None, 'epoch' or 'allocation'")
    _REGISTRY[name] = cls
    return cls


def sampler_class(name: Any) -> Type["Sampler"]:
    """The registered sampler class named ``name``; ValueError naming the registered ones."""
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"sampler must be one of {', '.join(map(repr, _REGISTRY))}; got {name!r}")
    return cls


def registered_samplers(**flags: bool) -> Tuple[str, ...]:
    """The registered names, in registration order; ``flags`` keep those whose class attributes
    equal them (``registered_samplers(selectable=True)``: the ``sampler=`` choices)."""
    return tuple(n for n, c in _REGISTRY.items() if all(getattr(c, k) == v for k, v in flags.items()))


def ledger_of(ledger: Any) -> Any:
    """``ledger`` if it can record samples (``record_sample``), None for None; TypeError otherwise."""
    if ledger is None:
        return None
    if not callable(getattr(ledger, "record_sample", None)):
        raise TypeError(f"ledger must be a dpcore.ledger.PrivacyLedger or None, got {type(ledger).__name__}")
    return ledger


def os_key() -> int:
    """A 64-bit key from the OS (a step's draws are keyed afresh unless a test seed is given)."""
    return int.from_bytes(os.urandom(8), "little")


def derive(seed: Optional[int], *path: int) -> Optional[int]:
    """The seed of a seeded sampler's draw at ``path`` (None, the OS, when unseeded)."""
    return derive_seed(seed, *path)


def composed(wrap: Any, noise_multiplier: Any, count: int) -> Any:
    """``SelfComposedEvent(wrap(GaussianEvent(z)), count)``, or ``NonPrivateEvent`` for z = 0
    (as the ledger turns a non-private release)."""
    from ..events import GaussianEvent, NonPrivateEvent, SelfComposedEvent

    z = _real("noise_multiplier", noise_multiplier)
    if not z >= 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {z}")
    if z == 0.0 and count > 0:
        return NonPrivateEvent()
    return SelfComposedEvent(wrap(GaussianEvent(z)), count)


def check_state(kind: str, config: dict, state: Any, why: str) -> None:
    if not isinstance(state, dict) or state.get("kind") != kind:
        got = state.get("kind") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"not the state of a {kind!r} sampler (kind {got!r})")
    for k, v in config.items():
        if state.get(k) != v:
            raise ValueError(f"the sampler state has {k}={state.get(k)!r}, this sampler {k}={v!r}: a resumed run must use {why}")


def state_int(state: dict, key: str, lo: int, hi: Optional[int] = None) -> int:
    v = state.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"
        raise ValueError(f"sampler state: {key} must be {bound}, got {v!r}")
    return v


class Sampler:
    """A sampler: which records each step uses, and what that is worth to the accountant.

    Subclasses set the class attributes below, implement :meth:`_indices` (the records of step t)
    and :meth:`_planned_event`, and are registered with :func:`register_sampler`. The defaults
    describe a sampler that draws each step independently at rate q (Poisson-like): its ledger
    entries are one event per step, ``ceil(epochs · round(1/q))`` steps make ``epochs`` passes, and
    ``for_batch_size`` builds it at q = batch_size/n.
    """

    #: The registry name: the ``sampler=`` of every front end and the ledger ``policy``.
    name: ClassVar[str] = ""
    #: The neighbouring relations its guarantee holds under (others are refused with the reason).
    relations: ClassVar[Tuple[str, ...]] = ("add_or_remove", "zero_out")
    #: The relation a run of it is stated under by default.
    default_relation: ClassVar[str] = "add_or_remove"
    #: The tightest certified accountant of it (``"pld"`` or ``"rdp"``).
    default_accountant: ClassVar[str] = "pld"
    #: What it guarantees, in a sentence (the report and the CLI state it).
    guarantee: ClassVar[str] = ""
    #: What the report says of it: (what it assumes of the data pipeline, the amplification it
    #: gets, the event and accountant it is analysed with); empty: its :attr:`guarantee`.
    report_text: ClassVar[Tuple[str, ...]] = ()
    #: False for batch schedules without amplification by sampling (a run using one is stated
    #: under zero-out by default).
    amplified: ClassVar[bool] = True
    #: How the ledger groups its samples: None (each step its own event), ``"epoch"`` (the epoch
    #: recorded as a round, one event per epoch) or ``"allocation"`` (one event per round).
    rounds: ClassVar[Optional[str]] = None
    #: Parameters besides the sampling probability q and the population n that its accounting
    #: takes (``max_batch_size``, ``num_selected``), each with its default.
    options: ClassVar[Dict[str, Any]] = {}
    #: Whether it needs the population size n to be accounted.
    needs_population: ClassVar[bool] = False
    #: Whether a front end's ``sampler=`` may name it (built by :meth:`for_batch_size`).
    selectable: ClassVar[bool] = True
    #: Whether the adapters draw its batches through :meth:`draw` (False: the framework's own
    #: loader draws them, as for Poisson sampling and shuffled batches).
    drawn: ClassVar[bool] = True
    #: Whether a run of it can be planned from public parameters (:meth:`event`; the CLI's
    #: ``--sampler`` choices).
    planned: ClassVar[bool] = True

    # -- what a sampler is ---------------------------------------------------------------

    @classmethod
    def check_relation(cls, neighboring: Any) -> str:
        """``neighboring`` if the guarantee holds under it; ValueError with the reason otherwise."""
        if neighboring not in NEIGHBORING:
            raise ValueError(f"neighboring must be one of {', '.join(NEIGHBORING)}, got {neighboring!r}")
        if neighboring not in cls.relations:
            raise ValueError(_REPLACE_ONE.format(sampler=cls.name) if neighboring == "replace_one" else
                             f"{cls.name} sampling is not analysed under neighboring={neighboring!r}; use one of "
                             f"{', '.join(map(repr, cls.relations))}")
        return neighboring

    @classmethod
    def check_options(cls, options: Dict[str, Any]) -> Dict[str, Any]:
        """The options of this sampler, defaults filled in; ValueError naming an option that
        belongs to another sampler."""
        out = dict(cls.options)
        for k, v in options.items():
            if k not in cls.options:
                if k == "max_batch_size" and v is not None:
                    raise ValueError(f"max_batch_size is the cap of truncated_poisson; {cls.name} has none")
                if k == "num_selected" and v not in (None, 1):
                    raise ValueError(f"num_selected is the k of random_allocation; {cls.name} takes none")
                if k not in ("max_batch_size", "num_selected"):
                    raise TypeError(f"{cls.name} takes no option {k!r}")
                continue
            if v is not None:
                out[k] = v
        return out

    # -- a planned run -------------------------------------------------------------------

    @classmethod
    def event(
        cls,
        noise_multiplier: float,
        steps: int,
        *,
        sampling_probability: float,
        population_size: Optional[int] = None,
        neighboring: Optional[str] = None,
        steps_per_epoch: Optional[int] = None,
        **options: Any,
    ) -> Any:
        """The accountant event of ``steps`` steps with the Gaussian mechanism at
        ``noise_multiplier``, under ``neighboring`` (None: :attr:`default_relation`)."""
        rel = cls.check_relation(cls.default_relation if neighboring is None else neighboring)
        z = _real("noise_multiplier", noise_multiplier)
        if not z >= 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {z}")
        s = _count("steps", steps)
        q = _probability("sampling_probability", sampling_probability)
        opts = cls.check_options(options)
        if cls.needs_population and population_size is None:
            raise ValueError(f"{cls.name} needs population_size")
        if steps_per_epoch is not None and cls.rounds != "epoch" and cls.name != "cyclic":
            raise ValueError(f"steps_per_epoch is for shuffle, sequential and cyclic; {cls.name} takes none")
        return cls._planned_event(z, s, q, population_size, rel, steps_per_epoch, **opts)

    @classmethod
    def _planned_event(cls, z: float, steps: int, q: float, n: Optional[int], neighboring: str,
                       steps_per_epoch: Optional[int], **options: Any) -> Any:
        raise NotImplementedError(f"{cls.__name__} cannot be planned from public parameters")

    @classmethod
    def epoch_length(cls, sampling_probability: float, *, steps_per_epoch: Optional[int] = None, **options: Any) -> int:
        """The steps of one pass over the data: round(1/q) by default (each record then takes part
        about once; the length of the adapters' loaders)."""
        if steps_per_epoch is not None:
            return _count("steps_per_epoch", steps_per_epoch, 1)
        q = _probability("sampling_probability", sampling_probability)
        if not q > 0:
            raise ValueError(f"sampling_probability must be > 0 for {cls.name}, got {q}")
        return max(1, round(1.0 / q))

    @classmethod
    def steps_for_epochs(cls, epochs: Any, sampling_probability: float, *, steps_per_epoch: Optional[int] = None,
                         **options: Any) -> int:
        """The steps of ``epochs`` passes: ⌈epochs · :meth:`epoch_length`⌉ (``epochs`` may be a
        fraction). The one formula every front end plans with, so that ``dpcore calibrate`` and
        each ``target_epsilon=`` give the same noise for the same run."""
        e = _real("epochs", epochs)
        if not (math.isfinite(e) and e > 0):
            raise ValueError(f"epochs must be finite and > 0, got {epochs!r}")
        k = cls.epoch_length(sampling_probability, steps_per_epoch=steps_per_epoch, **cls.check_options(options))
        return max(1, math.ceil(e * k - 1e-9))

    # -- a recorded run (the ledger) -----------------------------------------------------

    @classmethod
    def step_event(cls, sample: Any, z: float, neighboring: str, gaussian: Any, acc: Any) -> Any:
        """The event of one recorded step of this sampler (a ledger sample with the noise
        multiplier z of Eq. (1)); ``gaussian(z)`` makes the step's Gaussian (continuous or
        discrete), ``acc`` holds the event classes."""
        raise NotImplementedError(f"{cls.__name__} has no per-step event")

    @classmethod
    def round_event(cls, first: Any, z_min: float, steps: int, neighboring: str, gaussian: Any, acc: Any) -> Any:
        """``(event, count)``: the event of one recorded round (its ``steps`` released steps, the
        smallest noise multiplier ``z_min``); ``first`` is its first ledger sample."""
        raise NotImplementedError(f"{cls.__name__} has no rounds")

    @classmethod
    def ledger_rate(cls, population_size: int, sampling_probability: Any, sample_size: Optional[int]) -> float:
        """The q a recorded sample of this sampler carries: as given, else sample_size/n."""
        if sampling_probability is None:
            if sample_size is None:
                raise ValueError(f"policy {cls.name} needs sampling_probability or sample_size")
            return sample_size / population_size
        return _probability("sampling_probability", sampling_probability)

    # -- the adapters --------------------------------------------------------------------

    @classmethod
    def for_batch_size(cls, population_size: int, batch_size: float, *, seed: Optional[int] = None,
                       ledger: Any = None, **options: Any) -> "Sampler":
        """The sampler over ``population_size`` records whose expected batch is ``batch_size``
        (q = batch_size/n by default)."""
        cls.check_options(options)
        n = _count("population_size", population_size, 1)
        return cls(n, min(1.0, float(batch_size) / n), seed=seed, ledger=ledger)  # type: ignore[call-arg]

    # -- an instance: the draw -----------------------------------------------------------

    def _setup(self, population_size: int, steps_per_epoch: int, seed: Optional[int], ledger: Any) -> None:
        self._ledger = ledger_of(ledger)
        self._seed = _seed(seed)
        self._n = population_size
        self._len = steps_per_epoch
        self._position = 0

    @property
    def kind(self) -> str:
        """The registry name (the ``kind`` of its state dicts)."""
        return type(self).name

    @property
    def policy(self) -> str:
        """The ledger policy of its samples: its registry name."""
        return type(self).name

    @property
    def population_size(self) -> int:
        return self._n

    @property
    def sampling_probability(self) -> float:
        return self._q  # type: ignore[attr-defined]

    @property
    def expected_batch_size(self) -> float:
        return self.sampling_probability * self._n

    @property
    def max_batch_size(self) -> Optional[int]:
        """The cap on a batch (None: a batch may hold up to all n records)."""
        return None

    @property
    def steps_per_epoch(self) -> int:
        return self._len

    @property
    def position(self) -> int:
        """The next step t (steps drawn so far, from the start of the run)."""
        return self._position

    @property
    def epoch(self) -> int:
        return self._position // self._len

    @property
    def seeded(self) -> bool:
        return self._seed is not None

    @property
    def ledger(self) -> Any:
        return self._ledger

    def parameters(self) -> Dict[str, Any]:
        """What :meth:`event` takes to account this sampler's steps: q, n and its options."""
        return {"sampling_probability": float(self.sampling_probability), "population_size": int(self._n),
                **{k: getattr(self, k) for k in type(self).options}}

    def config(self) -> Dict[str, Any]:
        """What identifies its mechanism: the policy, the population and its arguments."""
        return {"policy": self.policy, **self._config()}

    def steps_for(self, epochs: Any) -> int:
        """:meth:`steps_for_epochs` of this sampler's parameters."""
        p = self.parameters()
        p.pop("population_size")
        return type(self).steps_for_epochs(epochs, p.pop("sampling_probability"), **p)

    def accountant_event(self, noise_multiplier: float, steps: int) -> Any:
        """The event of ``steps`` steps of this sampler at ``noise_multiplier``, as its ledger
        entries become (``NonPrivateEvent`` for z = 0)."""
        from ..events import NonPrivateEvent

        if float(noise_multiplier) == 0.0 and int(steps) > 0:
            return NonPrivateEvent()
        return type(self).event(noise_multiplier, steps, **self.parameters())

    def draw(self) -> np.ndarray:
        """The sorted record indices (int64) of step t = :attr:`position`, recorded in the
        ledger (when one was given); then t ← t + 1."""
        idx = self._indices(self._position)
        if self._ledger is not None:
            self._record(self._ledger, idx)
        self._position += 1
        return idx

    def __iter__(self) -> Any:
        """The rest of the current epoch: steps :attr:`position` … up to the next multiple of
        ``len(self)`` (a full epoch when a new one begins). Each is drawn as it is yielded."""
        end = (self._position // self._len + 1) * self._len
        while self._position < end:
            yield self.draw()

    def __len__(self) -> int:
        return self._len

    def _indices(self, t: int) -> np.ndarray:
        raise NotImplementedError(f"{type(self).__name__} must implement _indices(t), the records of step t")

    def _record(self, ledger: Any, idx: np.ndarray) -> None:
        ledger.record_sample(self._n, self.sampling_probability, self.policy, seeded=self.seeded)

    # -- checkpoints ---------------------------------------------------------------------

    def _config(self) -> Dict[str, Any]:
        return {"population_size": self._n, "sampling_probability": self.sampling_probability}

    def state_dict(self) -> dict:
        """The configuration and the position (plain Python values)."""
        return {"kind": self.kind, **self._config(), "position": int(self._position), "seeded": self.seeded}

    def check_state_dict(self, state: Any) -> None:
        """Raises ValueError if :meth:`load_state_dict` would refuse ``state``; changes nothing."""
        check_state(self.kind, self._config(), state, "the same sampling (the accountant reads the recorded one)")
        state_int(state, "position", 0)

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict`'s position (a seeded sampler then continues its stream)."""
        self.check_state_dict(state)
        self._position = int(state["position"])

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self._config().items())
        return f"{type(self).__name__}({args}, position={self._position})"
