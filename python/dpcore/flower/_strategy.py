"""``dpcore.flower.DifferentialPrivacy``: user-level DP-FedAvg (and DP-FTRL) around any Flower
strategy of the Message API.

McMahan et al. 2018 (§1 and the DP-FedAvg of McMahan et al. 2018b; survey Algorithm 2 of
Ponomareva et al. 2023): each round the server samples clients (the records; the privacy unit is
the client, all its data), each sampled client trains locally and returns its model, the server
turns every reply into an update Δ_u = w_u − w, clips it to C (flat or per layer, McMahan et al.
2018 §2), sums, adds Gaussian noise of stddev z·C from ChaCha20 and divides by the *fixed*
denominator (the expected number of clients per round; never the clients' example counts,
which would let one client change the weights of the others), then hands the noised average
w + Δ̃ to the wrapped strategy, which only post-processes it (FedAvg returns it; FedAdam,
FedYogi and FedAvgM apply their server optimizer to Δ̃).

Each round's sample is drawn by a :mod:`dpcore.sampling` sampler over a *roster* of the declared
``population_size`` clients (Flower node ids, sorted, fixed at the first round) and recorded in the
ledger before any message is sent; the release is recorded (fsync) before the new model leaves
:meth:`DifferentialPrivacy.aggregate_train`. The query is built by dpcore's front-end builder
(:func:`dpcore.queries._build.clipping_query`), or is :class:`~dpcore.queries.QuantileAdaptiveClipQuery`
(Andrew et al. 2021, Algorithm 1: the clip norm follows a quantile of the update norms, the count
of unclipped updates noised and accounted by Eq. (1)), or a
:class:`~dpcore.queries.MatrixFactorizationQuery` (banded or BLT correlated noise over rounds,
Choquette-Choo et al. 2022/2024; the DP-FTRL family of Kairouz et al. 2021) over cyclic
participation with min-separation b enforced by :class:`~dpcore.sampling.CyclicSampler`.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
import warnings
from logging import INFO, WARNING
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from .. import _adapters
from .._seeds import derive_seed
from .._validate import count, positive, probability
from ..aggregator import PrivateAggregator
from ..ledger import PrivacyLedger
from ..queries import QuantileAdaptiveClipQuery
from ..queries._build import clipping_query
from ..sampling import sampler_class
from ._records import ModelLayout, client_arrays, record_arrays
from ._state import decode_global_state, read_state, write_state

__all__ = [
    "DifferentialPrivacy", "CLIPPING_MODES", "SAMPLERS", "CONFIG_CLIP", "CONFIG_CLIPPING", "METRIC_EPSILON",
    "METRIC_DELTA", "METRIC_RELEASES", "METRIC_CLIP", "METRIC_SAMPLED",
]

#: Where the clipping happens: ``"server"`` (clients send raw updates, the server clips) or
#: ``"client"`` (:func:`dpcore.flower.clipping_mod` clips before sending; the server clips again,
#: which changes nothing for an honest client and bounds a dishonest one).
CLIPPING_MODES = ("server", "client")
#: The client samplers of a federated run.
SAMPLERS = (
    "poisson", "fixed_size_without_replacement", "truncated_poisson", "balls_in_bins", "random_allocation", "cyclic",
)
#: ConfigRecord keys the server sends in client-side mode (read by :func:`dpcore.flower.clipping_mod`).
CONFIG_CLIP = "dpcore.max-grad-norm"
CONFIG_CLIPPING = "dpcore.clipping"
#: Keys of the MetricRecord the wrapper returns each round.
METRIC_EPSILON = "dpcore.epsilon"
METRIC_DELTA = "dpcore.delta"
METRIC_RELEASES = "dpcore.releases"
METRIC_CLIP = "dpcore.max-grad-norm"
METRIC_SAMPLED = "dpcore.sampled-clients"

_OWN_DRAWS = ("poisson", "fixed_size_without_replacement")
_MF = ("banded", "blt")


class _RosterGrid(Grid):
    """The wrapped strategy's view of the grid in ``configure_train``: the nodes dpcore sampled,
    padded with stand-in ids up to the strategy's own minimums, so that its sampling (whose
    messages are discarded: only their content is used) neither waits for nodes that will never
    come nor builds a message for every client of a large roster."""

    def __init__(self, grid: Grid, nodes: Sequence[int], strategy: Any) -> None:
        want = max([len(nodes)] + [int(getattr(strategy, a, 0) or 0)
                                   for a in ("min_available_nodes", "min_train_nodes")])
        self._grid, self._nodes = grid, list(nodes) + [-(k + 1) for k in range(want - len(nodes))]

    def set_run(self, run: Any) -> None:  # pragma: no cover - never called on the proxy
        self._grid.set_run(run)

    @property
    def run(self) -> Any:
        return self._grid.run

    def create_message(self, *args: Any, **kwargs: Any) -> Any:
        return self._grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._nodes)

    def get_nodes(self) -> Iterable[Any]:  # pragma: no cover
        keep = set(self._nodes)
        return [n for n in self._grid.get_nodes() if getattr(n, "node_id", None) in keep]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # pragma: no cover
        raise RuntimeError("the wrapped strategy's messages are not sent: dpcore samples the clients")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # pragma: no cover
        raise RuntimeError("the wrapped strategy's messages are not sent: dpcore samples the clients")

    def send_and_receive(self, messages: Iterable[Message], *, timeout: Optional[float] = None) -> Iterable[Message]:  # pragma: no cover
        raise RuntimeError("the wrapped strategy's messages are not sent: dpcore samples the clients")


class DifferentialPrivacy(Strategy):
    """User-level central DP for any Flower ``Strategy`` of the Message API (``flwr.serverapp``).

    ``DifferentialPrivacy(FedAvg(), population_size=N, sampling_probability=q,
    noise_multiplier=z, max_grad_norm=C)``: every round samples the N clients of the roster with
    probability q each (Poisson, ChaCha20 from the OS), clips each sampled client's update to C,
    adds N(0, (zC)²) to the sum and divides by q·N. The ε of the run is for adding or removing one
    client with all its data (``privacy_unit="user"`` in the ledger and the report).

    **The plan's names.**

    * ``population_size`` N: the number of clients, public. The roster is the N smallest node ids
      connected when the first round is configured (the server waits up to ``wait_for_clients``
      seconds for N to connect), or the N ids of ``node_ids``. Nodes outside the roster are never
      sampled. A roster node that is gone later is a dropped client.
    * ``sampler``: ``"poisson"`` (default; ``sampling_probability`` q, denominator q·N),
      ``"fixed_size_without_replacement"`` (``sample_size`` b clients, denominator b, accounted
      as sampling without replacement under replace-one by RDP), ``"truncated_poisson"``
      (``max_batch_size``), ``"balls_in_bins"``, ``"random_allocation"`` (``num_selected``) with q,
      or ``"cyclic"`` (``sample_size`` clients per round in b = N // sample_size fixed groups
      visited in turn: the participation schema of matrix-factorization noise, min-separation b).
    * ``noise_multiplier`` z, or ``target_epsilon`` with ``target_delta`` and ``num_rounds`` (z is
      then calibrated before the first round by :func:`dpcore.plan.calibrate_noise`, or for
      correlated noise by :func:`dpcore.matrix_factorization.calibrate_noise_multiplier`).
    * ``max_grad_norm`` C (a list of bounds with ``clipping="per_layer"``), ``clipping``
      ``"flat"`` (default) or ``"per_layer"`` (one bound per floating-point array, McMahan et al.
      2018 §2; noise proportional to the bounds so that Eq. (1) gives z for the round).
    * ``adaptive_clipping=True``: C is the initial clip norm, updated every round towards the
      ``target_unclipped_quantile`` (γ, default 0.5) of the update norms at ``clip_learning_rate``
      (η, default 0.2) from a count noised with ``clipped_count_stddev`` (default: the larger of
      expected clients / 20, Andrew et al. 2021, and z, as their Theorem 1 needs it above z/2); z is the noise multiplier of the whole release (sum and
      count, Eq. (1)). Flat clipping, server side, Gaussian noise.
    * ``noise_mechanism``: ``"gaussian"`` (default), ``"discrete_gaussian"`` (exact integer noise
      on a grid, Canonne et al. 2020), or ``"banded"`` / ``"blt"`` (correlated noise across rounds,
      DP-FTRL; needs ``sampler="cyclic"`` and ``num_rounds``; ``mf_strategy`` an optimised
      :class:`~dpcore.matrix_factorization.BandedStrategy` / ``BLTStrategy``, else one is
      optimised for the rounds).
    * ``clipping_mode``: ``"server"`` (default) or ``"client"`` (the clients run
      :func:`dpcore.flower.clipping_mod`, which clips before sending and refuses to run without
      the bound the server sends; the server clips again).
    * ``ledger``: a :class:`~dpcore.PrivacyLedger` of unit ``"user"`` or a path (None: a
      temporary file, see ``.ledger.path``); ``accountant`` ``"pld"`` or ``"rdp"`` (None: the
      sampler's own, PLD but for balls-in-bins and random allocation, certified by RDP only).
      ε in the metrics costs one accounting of the ledger per round (PLD: about 0.1 s here).
    * ``state_path``: a file the server's state (round, query state, sampler, ledger position,
      the released model) is written to after every release; when it exists at construction the
      run resumes from it (:attr:`resume_arrays` is the model to restart ``start`` with). The
      ledger must hold exactly the releases the state saw; ``ledger_ahead="keep"`` accepts a ledger
      ahead of it (a crash between the two writes: those releases stay counted, ε over-counts).
    * ``seed``: tests only (no privacy).

    **Dropped clients.** A sampled client that fails, times out, or sends something that is not
    an update of the model (other keys, shapes or types) contributes zero; the denominator, the
    noise and the ledger do not change, and the round is released and recorded. A non-finite
    update contributes zero too (and counts as clipped for adaptive clipping).

    **Metrics.** ``aggregate_train`` returns only dpcore's metrics (ε at ``target_delta`` so far,
    releases, clip norm, sampled clients): the clients' own training metrics are not private and
    are passed on only with ``client_metrics=True``. Federated evaluation (``configure_evaluate``)
    is the wrapped strategy's, unchanged and not private: prefer a server-side ``evaluate_fn`` on
    public data, or ``fraction_evaluate=0``.
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        population_size: int,
        sampling_probability: Optional[float] = None,
        sample_size: Optional[int] = None,
        sampler: str = "poisson",
        noise_multiplier: Optional[float] = None,
        target_epsilon: Optional[float] = None,
        target_delta: Optional[float] = None,
        num_rounds: Optional[int] = None,
        max_grad_norm: Any = None,
        clipping: str = "flat",
        adaptive_clipping: bool = False,
        target_unclipped_quantile: float = 0.5,
        clip_learning_rate: float = 0.2,
        clipped_count_stddev: Optional[float] = None,
        noise_mechanism: str = "gaussian",
        mf_strategy: Any = None,
        max_batch_size: Optional[int] = None,
        num_selected: int = 1,
        clipping_mode: str = "server",
        ledger: Any = None,
        accountant: Optional[str] = None,
        node_ids: Optional[Sequence[int]] = None,
        wait_for_clients: float = 60.0,
        client_metrics: bool = False,
        state_path: Optional[str] = None,
        ledger_ahead: str = "refuse",
        seed: Optional[int] = None,
    ) -> None:
        super().__init__()
        if not isinstance(strategy, Strategy):
            raise TypeError(
                f"strategy must be a Flower Strategy of the Message API (flwr.serverapp.strategy), got {type(strategy).__name__}"
            )
        if isinstance(strategy, DifferentialPrivacy):
            raise TypeError("the strategy is already wrapped by dpcore.flower.DifferentialPrivacy")
        self.strategy = strategy
        n = count("population_size", population_size, 1)
        if clipping_mode not in CLIPPING_MODES:
            raise ValueError(f"clipping_mode must be one of {CLIPPING_MODES}, got {clipping_mode!r}")
        if sampler not in SAMPLERS:
            raise ValueError(
                f"sampler must be one of {', '.join(map(repr, SAMPLERS))} for a federated run, got {sampler!r}"
            )
        if max_grad_norm is None:
            raise TypeError("max_grad_norm is required (the clip norm C of a client's update; the initial one with "
                            "adaptive_clipping)")
        if clipping not in ("flat", "per_layer"):
            raise ValueError(f"clipping must be 'flat' or 'per_layer' for a federated run, got {clipping!r}")
        if isinstance(max_grad_norm, (list, tuple)):
            if clipping != "per_layer":
                raise ValueError("a list of max_grad_norm values needs clipping='per_layer'")
            max_grad_norm = tuple(positive(f"max_grad_norm[{k}]", c) for k, c in enumerate(max_grad_norm))
        else:
            max_grad_norm = positive("max_grad_norm", max_grad_norm)
        _adapters.check_noise_or_target(noise_multiplier, target_epsilon, target_delta, "DifferentialPrivacy")
        if target_epsilon is not None and num_rounds is None:
            raise TypeError("target_epsilon needs num_rounds (the noise is calibrated for that many rounds)")
        if num_rounds is not None:
            num_rounds = count("num_rounds", num_rounds, 1)
        mf = noise_mechanism in _MF
        if noise_mechanism not in ("gaussian", "discrete_gaussian") + _MF:
            raise ValueError(
                "noise_mechanism must be 'gaussian', 'discrete_gaussian', 'banded' or 'blt', got " f"{noise_mechanism!r}"
            )
        if mf and sampler != "cyclic":
            raise ValueError(
                f"noise_mechanism={noise_mechanism!r} (correlated noise across rounds) holds its sensitivity for cyclic "
                "participation only: give sampler='cyclic' with sample_size (clients per round; min-separation "
                "b = population_size // sample_size)"
            )
        if mf and num_rounds is None:
            raise TypeError(f"noise_mechanism={noise_mechanism!r} needs num_rounds (the noise is planned for them)")
        if mf_strategy is not None and not mf:
            raise ValueError("mf_strategy is the strategy of noise_mechanism='banded' or 'blt'")
        if adaptive_clipping and (clipping != "flat" or noise_mechanism != "gaussian"):
            raise ValueError("adaptive_clipping runs with clipping='flat' and noise_mechanism='gaussian'")
        if adaptive_clipping and clipping_mode == "client":
            raise ValueError(
                "adaptive_clipping runs with clipping_mode='server': its count needs each update's unclipped norm, "
                "which a client-side clip hides from the server"
            )
        if mf and clipping != "flat":
            raise ValueError("matrix-factorization noise supports clipping='flat' only")
        if accountant is None:  # the tightest certified analysis of the sampler (RDP for the allocation samplers)
            accountant = sampler_class(sampler).default_accountant
        if accountant not in ("pld", "rdp"):
            raise ValueError(f"accountant must be 'pld' or 'rdp', got {accountant!r}")
        self._delta = float(target_delta) if target_delta is not None else min(1e-5, 0.1 / n)
        probability("target_delta", self._delta)
        if ledger_ahead not in ("refuse", "keep"):
            raise ValueError(f"ledger_ahead must be 'refuse' or 'keep', got {ledger_ahead!r}")
        if node_ids is not None:
            ids = [int(i) for i in node_ids]
            if len(ids) != n or len(set(ids)) != n:
                raise ValueError(f"node_ids must be {n} distinct node ids (population_size), got {len(set(ids))}")

        # -- the ledger (unit: one client, all its data); closed again if the rest is refused --
        opened = not isinstance(ledger, PrivacyLedger)
        if ledger is None:
            fd, path = tempfile.mkstemp(prefix="dpcore-flower-", suffix=".ledger")
            os.close(fd)
            os.unlink(path)
            ledger = PrivacyLedger(path, privacy_unit="user")
        elif not isinstance(ledger, PrivacyLedger):
            ledger = PrivacyLedger(os.fspath(ledger), privacy_unit="user")
        elif ledger.privacy_unit != "user":
            raise ValueError(
                f"the ledger {ledger.path} records unit {ledger.privacy_unit!r}; a federated run protects one client "
                "(unit 'user'): open it with PrivacyLedger(path, privacy_unit='user')"
            )
        self.ledger = ledger
        try:
            self._plan(
                sampler, n, sampling_probability, sample_size, max_batch_size, num_selected, seed, ledger, mf,
                noise_mechanism, num_rounds, mf_strategy, noise_multiplier, target_epsilon, target_delta, accountant,
            )
        except BaseException:
            if opened:
                ledger.close()
            raise
        self.target_epsilon = None if target_epsilon is None else float(target_epsilon)
        self.target_delta = self._delta
        self.num_rounds = num_rounds
        self.population_size = n
        self.sampler_name = sampler
        self.clipping = clipping
        self.clipping_mode = clipping_mode
        self.noise_mechanism = noise_mechanism
        self.accountant = accountant
        self.client_metrics = bool(client_metrics)
        self._max_grad_norm = max_grad_norm
        self._adaptive = None
        if adaptive_clipping:
            # Andrew et al.'s expected/20, but never at or below z/2 (their Theorem 1 needs 2σ_b > z):
            # small populations get σ_b = z, which costs the sum 15% more noise (z_Δ = z/√(3/4))
            sb = (max(self.denominator / 20.0, self.noise_multiplier) if clipped_count_stddev is None
                  else float(clipped_count_stddev))
            self._adaptive = dict(gamma=float(target_unclipped_quantile), eta=float(clip_learning_rate), sigma_b=sb)
        self._seed = seed
        own = self._sampler_obj is None  # the aggregator draws by name
        self._q, self._b = (sampling_probability, sample_size) if own else (None, None)
        self._wait = float(wait_for_clients)
        self._roster: Optional[List[int]] = None
        self._roster_saved = False  # a roster read from a saved state, not yet seen connected
        if node_ids is not None:
            self._roster = sorted(int(i) for i in node_ids)
        # built at the first round, when the model's layout is known
        self._layout: Optional[ModelLayout] = None
        self._aggregator: Optional[PrivateAggregator] = None
        self._releases = 0
        self._pending: Optional[Tuple[int, List[int], Dict[str, np.ndarray]]] = None
        self._ledger_ahead = ledger_ahead
        self._state_path = None if state_path is None else os.fspath(state_path)
        self._resumed: Optional[Dict[str, Any]] = None
        self.resume_arrays: Optional[ArrayRecord] = None
        if self._state_path is not None and os.path.exists(self._state_path):
            try:
                self._resumed = read_state(self._state_path)
                self._check_resume(self._resumed)
            except BaseException:
                if opened:
                    ledger.close()
                raise
            self.resume_arrays = ArrayRecord(
                {k: Array(np.asarray(v)) for k, v in self._resumed["arrays"].items()}
            )
            if node_ids is None:
                self._roster = list(self._resumed["roster"])
                self._roster_saved = True
            self._releases = int(self._resumed["releases"])

    def _plan(self, sampler: str, n: int, sampling_probability: Any, sample_size: Any, max_batch_size: Any,
              num_selected: Any, seed: Any, ledger: PrivacyLedger, mf: bool, noise_mechanism: str, num_rounds: Any,
              mf_strategy: Any, noise_multiplier: Any, target_epsilon: Any, target_delta: Any, accountant: str) -> None:
        """The sampler, its denominator, the correlated-noise plan and z (calibrated to the target)."""
        samp_obj, denominator, q, cal_options = self._sampler(
            sampler, n, sampling_probability, sample_size, max_batch_size, num_selected, seed, ledger,
        )
        if mf:
            from ..matrix_factorization import Participation, strategy_for
            from ..matrix_factorization import calibrate_noise_multiplier as mf_calibrate

            b = samp_obj.steps_per_epoch
            participation = Participation.cyclic(b, -(-num_rounds // b))
            mf_strat = strategy_for(noise_mechanism, participation, num_rounds, mf_strategy)
            if noise_multiplier is None:
                noise_multiplier = mf_calibrate(target_epsilon, target_delta, participation=participation,
                                                steps=num_rounds, accountant=accountant)
            self._mf = (participation, mf_strat)
        else:
            self._mf = None
            if noise_multiplier is None:
                from ..plan import calibrate_noise

                noise_multiplier = calibrate_noise(
                    target_epsilon, target_delta, sampler=sampler, sampling_probability=q, steps=num_rounds,
                    population_size=n, accountant=accountant, **cal_options,
                )
        z = float(noise_multiplier)
        if not (math.isfinite(z) and z >= 0):
            raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier!r}")
        self.noise_multiplier = z
        self.denominator = float(denominator)
        self._sampler_obj = samp_obj

    # -- construction helpers ------------------------------------------------------------

    @staticmethod
    def _sampler(
        kind: str, n: int, q: Any, b: Any, max_batch_size: Any, num_selected: Any, seed: Any, ledger: PrivacyLedger,
    ) -> Tuple[Any, float, float, Dict[str, Any]]:
        """(sampler object or None for the aggregator's own draws, denominator, q, calibration options)."""
        if kind == "poisson":
            if q is None or b is not None:
                raise ValueError("sampler='poisson' takes sampling_probability (q, each client's rate), not sample_size")
            q = probability("sampling_probability", q)
            if not q > 0:
                raise ValueError("sampling_probability must be > 0")
            return None, q * n, q, {}
        if kind in ("fixed_size_without_replacement", "cyclic"):
            if b is None or q is not None:
                raise ValueError(f"sampler={kind!r} takes sample_size (clients per round), not sampling_probability")
            b = count("sample_size", b, 1)
            if b > n:
                raise ValueError(f"sample_size {b} is larger than population_size {n}")
            if kind == "fixed_size_without_replacement":
                return None, float(b), b / n, {}
            from ..sampling import CyclicSampler

            s = CyclicSampler(n, b, seed=seed, ledger=ledger)
            return s, float(b), b / n, {"steps_per_epoch": s.steps_per_epoch}
        if q is None or b is not None:
            raise ValueError(f"sampler={kind!r} takes sampling_probability (the expected clients are q·N)")
        q = probability("sampling_probability", q)
        s = _adapters.build(kind, n, q * n, max_batch_size=max_batch_size, num_selected=num_selected, seed=seed,
                            ledger=ledger)
        opts = {k: v for k, v in (("max_batch_size", max_batch_size), ("num_selected", num_selected))
                if k in sampler_class(kind).options}
        return s, float(s.expected_batch_size), float(s.sampling_probability), opts

    def _build_query(self, layout: ModelLayout) -> Any:
        z, den, c = self.noise_multiplier, self.denominator, self._max_grad_norm
        if self._adaptive is not None:
            a = self._adaptive
            return QuantileAdaptiveClipQuery(
                float(c), z, a["gamma"], a["eta"], a["sigma_b"], den, denominator=den,
            )
        if self._mf is not None:
            from ..queries import MatrixFactorizationQuery

            participation, strat = self._mf
            return MatrixFactorizationQuery(float(c), z, strategy=strat, participation=participation,
                                            steps=self.num_rounds, denominator=den)
        parts = list(layout.released)
        return clipping_query(
            parts, clipping=self.clipping, max_grad_norm=c, noise_multiplier=z, denominator=den,
            noise_mechanism=self.noise_mechanism, what="floating-point arrays of the model",
        )

    def _setup(self, layout: ModelLayout) -> None:
        query = self._build_query(layout)
        kw: Dict[str, Any] = {"privacy_unit": "user"}
        if self._sampler_obj is not None:
            kw["sampler"] = self._sampler_obj
        elif self.sampler_name == "poisson":
            kw["sampler"], kw["sampling_probability"] = "poisson", self._q
        else:
            kw["sampler"], kw["sample_size"] = "fixed_size_without_replacement", self._b
        self._aggregator = PrivateAggregator(query, self.ledger, self.population_size, **kw)
        self._layout = layout
        if self._resumed is not None:
            self._restore(self._resumed)
            self._resumed = None

    # -- the roster ----------------------------------------------------------------------

    def _fix_roster(self, grid: Grid) -> List[int]:
        if self._roster is not None and self._roster_saved:
            self._roster_saved = False
            if not set(self._roster) & set(int(i) for i in grid.get_node_ids()):
                self._refix_after_restart()
        if self._roster is not None:
            return self._roster
        n = self.population_size
        deadline = time.monotonic() + self._wait
        while True:
            ids = sorted(int(i) for i in grid.get_node_ids())
            if len(ids) >= n or time.monotonic() >= deadline:
                break
            log(INFO, "dpcore: waiting for clients to connect: %d of %d", len(ids), n)
            time.sleep(1.0)
        if len(ids) < n:
            raise RuntimeError(
                f"population_size is {n} but only {len(ids)} clients connected within {self._wait:g} s: the roster "
                "the sampling is stated for cannot be fixed (give node_ids= or wait longer with wait_for_clients=)"
            )
        if len(ids) > n:
            warnings.warn(
                f"{len(ids)} clients are connected but population_size is {n}: only the {n} smallest node ids form the "
                "roster; the others are never sampled", stacklevel=3,
            )
        self._roster = ids[:n]
        return self._roster

    def _refix_after_restart(self) -> None:
        """None of the saved roster's node ids is connected: the engine was restarted and gave
        its nodes new ids (Flower's simulation engine draws them afresh). Rounds of independent
        samples (Poisson, truncated Poisson, fixed size) may draw from a roster fixed again over
        the connected nodes; a schedule over rounds (the cyclic groups of correlated noise, the
        allocation samplers' rounds) ties each client to its place and cannot be re-mapped."""
        if self.sampler_name not in ("poisson", "truncated_poisson", "fixed_size_without_replacement"):
            raise RuntimeError(
                f"none of the saved roster's {len(self._roster or [])} node ids is connected (a restarted engine gives "
                f"its nodes new ids), and sampler={self.sampler_name!r} ties each client to its place in the roster: "
                "give node_ids= with the new id of each saved client, in the saved order"
            )
        warnings.warn(
            "none of the saved roster's node ids is connected (a restarted engine gives its nodes new ids): the roster "
            "is fixed again over the connected clients; each round samples independently, so the accounting holds",
            stacklevel=4,
        )
        self._roster = None

    # -- Strategy ------------------------------------------------------------------------

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Samples the round's clients (recorded in the ledger) and sends each the model."""
        model = record_arrays(arrays)  # views: the global model is decoded once a round
        layout = ModelLayout.of(model)
        if self._aggregator is None:
            self._setup(layout)
        elif layout.keys != self._layout.keys or layout.shapes != self._layout.shapes:  # type: ignore[union-attr]
            raise ValueError("the global model's arrays changed between rounds; the query was built for the first ones")
        if self._pending is not None:
            raise RuntimeError(
                f"round {self._pending[0]} was configured but never aggregated; every sampled round must be released"
            )
        roster = self._fix_roster(grid)
        cfg = ConfigRecord(dict(config))
        if self.clipping_mode == "client":
            clip = self._clip_for_clients()
            cfg[CONFIG_CLIP] = clip
            cfg[CONFIG_CLIPPING] = self.clipping
        seed = derive_seed(self._seed, self._releases, 0) if self._sampler_obj is None else None
        idx = self._aggregator.sample(seed=seed)  # type: ignore[union-attr]
        nodes = [roster[int(i)] for i in idx]
        content = self._content(server_round, arrays, cfg, grid, nodes)
        self._pending = (server_round, nodes, model)
        log(INFO, "dpcore: round %s sampled %d of %d clients", server_round, len(nodes), len(roster))
        connected = set(int(i) for i in grid.get_node_ids())
        return [Message(content=content, dst_node_id=nid, message_type=MessageType.TRAIN)
                for nid in nodes if nid in connected]

    def _clip_for_clients(self) -> Any:
        c = self._max_grad_norm
        if self.clipping == "per_layer":
            from ..queries.strategies import per_layer_clip_norms

            m = len(self._layout.released)  # type: ignore[union-attr]
            clips = list(c) if isinstance(c, (list, tuple)) else per_layer_clip_norms(float(c), m)
            return [float(x) for x in clips]
        return float(c)

    def _content(self, server_round: int, arrays: ArrayRecord, cfg: ConfigRecord, grid: Grid,
                 nodes: List[int]) -> RecordDict:
        """The wrapped strategy's training content (it may add its own config, FedProx's μ, and
        keep state, FedOpt's current arrays), with dpcore's keys; its own choice of nodes is
        discarded."""
        msgs = list(self.strategy.configure_train(server_round, arrays, cfg, _RosterGrid(grid, nodes, self.strategy)))
        if msgs:
            content = msgs[0].content
            for c in content.config_records.values():
                for k in (CONFIG_CLIP, CONFIG_CLIPPING):
                    if k in cfg:
                        c[k] = cfg[k]
            return content
        akey = getattr(self.strategy, "arrayrecord_key", "arrays")
        ckey = getattr(self.strategy, "configrecord_key", "config")
        cfg["server-round"] = server_round
        return RecordDict({akey: arrays, ckey: cfg})

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> Tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        """Clips every sampled client's update, noises the sum, divides by the fixed denominator,
        records the release (fsync), and hands w + Δ̃ to the wrapped strategy."""
        if self._pending is None or self._pending[0] != server_round:
            raise RuntimeError(f"round {server_round} was not configured by this strategy: nothing was sampled for it")
        _, nodes, current = self._pending
        layout = self._layout
        assert layout is not None and self._aggregator is not None
        by_node: Dict[int, Message] = {}
        replies = list(replies)
        for r in replies:
            try:
                src = int(r.metadata.src_node_id)
            except Exception:  # noqa: BLE001
                continue
            by_node.setdefault(src, r)  # the first reply of a node counts; nodes not sampled are ignored
        keys = list(layout.released)
        # Only the clients that delivered an update are records. A dropped or malformed one is
        # missing: it contributes nothing (not even a count term under adaptive clipping), as if
        # it were not in the population, and the denominator and noise stay as planned.
        got_all = [client_arrays(by_node.get(nid), layout) for nid in nodes]
        present = [g for g in got_all if g is not None]
        # Δ_u = w_u − w, written once into the record buffers, in float32 for a float32 model
        # (Flower's own dtype; the query sums in float64)
        dt = layout.record_dtype
        stacked = {}
        for k in keys:
            buf = np.empty((len(present),) + layout.shapes[layout.keys.index(k)], dt)
            with np.errstate(all="ignore"):
                for i, g in enumerate(present):
                    np.subtract(g[k], current[k], out=buf[i], dtype=dt, casting="unsafe")
            stacked[k] = buf
        if len(present) < len(nodes):
            # logged on the (trusted) server only; nothing of it enters the release or the metrics
            log(WARNING, "dpcore: round %s: %d of %d sampled clients delivered no update (dropped, failed or "
                "malformed); they contribute zero", server_round, len(nodes) - len(present), len(nodes))
        records: Any = stacked if self.clipping == "per_layer" else [stacked[k] for k in keys]
        seed = derive_seed(self._seed, self._releases, 1)
        noised = self._aggregator.aggregate(records, seed=seed, missing=len(nodes) - len(present))
        self._releases += 1
        self._pending = None
        mean = noised if isinstance(noised, dict) else dict(zip(keys, noised if isinstance(noised, (list, tuple)) else [noised]))
        new = {}
        for k in layout.keys:
            a = current[k]
            new[k] = (a.astype(np.float64) + np.asarray(mean[k], np.float64)).astype(a.dtype) if k in mean else a
        released = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in new.items()})
        out_arrays, inner_metrics = self._inner_aggregate(server_round, released, replies)
        eps = self.epsilon()
        metrics = MetricRecord({
            METRIC_EPSILON: float(eps), METRIC_DELTA: float(self._delta), METRIC_RELEASES: int(self._releases),
            METRIC_CLIP: float(self.max_grad_norm) if self.clipping == "flat" else float("nan"),
            METRIC_SAMPLED: int(len(nodes)),
        })
        if self.client_metrics and inner_metrics is not None:
            for k, v in inner_metrics.items():
                metrics[k] = v
        log(INFO, "dpcore: round %s released; user-level epsilon=%.4f at delta=%g after %d releases",
            server_round, eps, self._delta, self._releases)
        if self._state_path is not None:
            write_state(self._state_path, self._state(out_arrays if out_arrays is not None else released))
        return out_arrays, metrics

    def _inner_aggregate(
        self, server_round: int, released: ArrayRecord, replies: List[Message]
    ) -> Tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        """The wrapped strategy post-processes the one DP release (as a single reply of weight 1)."""
        wkey = getattr(self.strategy, "weighted_by_key", "num-examples")
        akey = getattr(self.strategy, "arrayrecord_key", "arrays")
        reply = Message(content=RecordDict({akey: released, "metrics": MetricRecord({wkey: 1})}),
                        dst_node_id=0, message_type=MessageType.TRAIN)
        arrays, _ = self.strategy.aggregate_train(server_round, [reply])
        if arrays is not None:
            # the wrapped strategy may change dtypes (FedAvg averages an int buffer into float64):
            # the model keeps the layout the query was built for
            layout = self._layout
            assert layout is not None
            if list(arrays.keys()) != list(layout.keys):
                raise RuntimeError(f"the wrapped strategy {type(self.strategy).__name__} returned other arrays than the model's")
            arrays = ArrayRecord({
                k: Array(np.ascontiguousarray(np.asarray(a).astype(dt, copy=False)))
                for k, a, dt in zip(layout.keys, arrays.to_numpy_ndarrays(), layout.dtypes)
            })
        inner_metrics = None
        if self.client_metrics:
            ok = [r for r in replies if not r.has_error() and r.content.metric_records]
            if ok:
                fn = getattr(self.strategy, "train_metrics_aggr_fn", None)
                try:
                    inner_metrics = fn([r.content for r in ok], wkey) if fn is not None else None
                except Exception:  # noqa: BLE001 - metrics never stop a release
                    inner_metrics = None
        return (arrays if arrays is not None else released), inner_metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's federated evaluation (not private; see the class docs)."""
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> Optional[MetricRecord]:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        log(INFO, "\t├──> dpcore user-level DP (%s-side clipping):", self.clipping_mode)
        log(INFO, "\t│\t├── sampler: %s over %d clients, denominator %.6g", self.sampler_name,
            self.population_size, self.denominator)
        log(INFO, "\t│\t├── noise: %s, noise multiplier %.6g", self.noise_mechanism, self.noise_multiplier)
        log(INFO, "\t│\t├── clipping: %s, max_grad_norm %s%s", self.clipping, self._max_grad_norm,
            " (adaptive)" if self._adaptive is not None else "")
        log(INFO, "\t│\t└── ledger: %s", self.ledger.path)
        self.strategy.summary()

    # -- privacy -------------------------------------------------------------------------

    @property
    def max_grad_norm(self) -> Any:
        """The clip norm of the next round (adaptive clipping's current one)."""
        if self._adaptive is not None and self._aggregator is not None:
            return float(self._aggregator.global_state.l2_norm_clip)
        return self._max_grad_norm

    @property
    def releases(self) -> int:
        return self._releases

    def epsilon(self, delta: Optional[float] = None) -> float:
        """User-level ε at ``delta`` (default ``target_delta``) of everything the ledger holds."""
        if self.ledger.num_releases == 0:
            return 0.0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return float(self.ledger.get_epsilon(self._delta if delta is None else delta, self.accountant,
                                                 neighboring=self.neighboring))

    def close(self) -> None:
        """Closes the ledger (a server restarted in the same process opens it again)."""
        self.ledger.close()

    def report(self, delta: Optional[float] = None) -> Any:
        """The ledger's privacy report (:meth:`dpcore.PrivacyLedger.report`)."""
        return self.ledger.report(self._delta if delta is None else delta, neighboring=self.neighboring,
                                  accountant=self.accountant)

    @property
    def neighboring(self) -> str:
        """The neighbouring relation every ε of this run is stated under: the sampler's own
        (add or remove one client for Poisson and the allocation samplers; replace one client for
        fixed-size sampling; zero out one client's data for the cyclic groups of DP-FTRL)."""
        return sampler_class(self.sampler_name).default_relation

    # -- the server's state across a restart --------------------------------------------

    def _config(self) -> Dict[str, Any]:
        return {
            "population_size": self.population_size, "sampler": self.sampler_name, "denominator": self.denominator,
            "noise_multiplier": self.noise_multiplier, "noise_mechanism": self.noise_mechanism,
            "clipping": self.clipping, "clipping_mode": self.clipping_mode,
            "max_grad_norm": self._max_grad_norm if not isinstance(self._max_grad_norm, tuple) else list(self._max_grad_norm),
            "adaptive": self._adaptive, "num_rounds": self.num_rounds,
        }

    def _state(self, arrays: ArrayRecord) -> Dict[str, Any]:
        agg = self._aggregator
        assert agg is not None and self._layout is not None
        return {
            "config": self._config(),
            "layout": self._layout.signature(),
            "roster": list(self._roster or []),
            "releases": self._releases,
            "global_state": agg.global_state,
            "sampler": None if self._sampler_obj is None else self._sampler_obj.state_dict(),
            "ledger": {"path": os.path.abspath(self.ledger.path), "num_releases": self.ledger.num_releases},
            "arrays": {k: np.asarray(v) for k, v in zip(arrays.keys(), arrays.to_numpy_ndarrays())},
        }

    def _check_resume(self, st: Dict[str, Any]) -> None:
        have = st.get("config")
        mine = json.loads(json.dumps(self._config()))
        if have != mine:
            diff = sorted(k for k in set(mine) | set(have or {}) if (have or {}).get(k) != mine.get(k))
            raise ValueError(f"the saved server state is for another run (differs in {', '.join(diff)}): refused")
        led = st["ledger"]
        if os.path.abspath(self.ledger.path) != led["path"]:
            raise ValueError(f"the saved state is for the ledger {led['path']}, this run writes {self.ledger.path}")
        ahead = self.ledger.num_releases > led["num_releases"]
        if ahead and self._ledger_ahead == "keep" and self._mf is None:
            warnings.warn(
                f"the ledger holds {self.ledger.num_releases - led['num_releases']} release(s) after the saved state "
                "(a crash between the ledger write and the state write): they stay counted in ε, their models are "
                "lost, and the run resumes from the saved model", stacklevel=3,
            )
        elif self.ledger.num_releases != led["num_releases"]:
            raise ValueError(
                f"the ledger holds {self.ledger.num_releases} releases but the saved state saw {led['num_releases']}: "
                "refused (fewer: the ledger was truncated or replaced; more: releases after the last saved state, "
                "whose models are lost: ledger_ahead='keep' resumes anyway and keeps them counted, except for "
                "correlated noise, whose stream cannot replay them)"
            )

    def _restore(self, st: Dict[str, Any]) -> None:
        if [list(x) for x in st["layout"]] != self._layout.signature():  # type: ignore[union-attr]
            raise ValueError("the saved server state is for a model with other arrays")
        agg = self._aggregator
        assert agg is not None
        agg.load_global_state(decode_global_state(st["global_state"], agg.query.initial_global_state()))
        if self._sampler_obj is not None and st["sampler"] is not None:
            self._sampler_obj.load_state_dict(st["sampler"])
        self._releases = int(st["releases"])

