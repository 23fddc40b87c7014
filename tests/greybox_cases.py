"""Training functions for the grey-box neighbour harness (tests/test_greybox*.py): each builds
its model, optimizer, loader and ledger afresh from the columns it is given and passes the
harness's seed wherever dpcore takes a test seed (dpcore.audit.neighbour_audit)."""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any, Optional

import numpy as np

from dpcore.events import SumQueryEvent
from dpcore.queries import DPQuery, SumState
from dpcore.queries.base import GaussianRelease, noise_releases

#: The neighbour kinds every release path is checked on (add/remove and replace, the bad values).
KINDS = ("remove", "add", "replace", "duplicate", "nan", "inf", "-inf", "huge", "subnormal", "zero")
#: The slow paths (Keras, the HF trainer, two processes): a subset that still has the five kinds.
FEW = ("remove", "replace", "nan", "inf", "huge", "zero")


def ledger_path() -> str:
    return os.path.join(tempfile.mkdtemp(prefix="dpcore-greybox-"), "ledger.jsonl")


def features(n: int = 40, d: int = 6, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32)


def classification(n: int = 48, d: int = 8, classes: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).astype(np.float32), rng.integers(0, classes, size=n).astype(np.int64)


class HandQuery(DPQuery):
    """A user's own sum query whose sensitivity is given by hand: records clipped to ``clip``,
    the event declaring ``declared``. The planted bugs: ``declared < clip`` (a wrong hand-given
    sensitivity, or a sum of unclipped records when ``clip`` is huge), ``denominator="batch"``
    (the actual batch size as the denominator), ``noise_from_data`` (a stddev from the records'
    largest norm)."""

    def __init__(self, clip: float, declared: float, stddev: float, denominator: Any = 1.0, noise_from_data: bool = False):
        self.clip, self.declared, self.stddev = clip, declared, stddev
        self.denominator, self.noise_from_data = denominator, noise_from_data

    def initial_global_state(self) -> Any:
        return {"batch": 0, "max_norm": 0.0}

    def derive_sample_params(self, global_state: Any) -> Any:
        return None

    def initial_sample_state(self, template: Any) -> Any:
        return SumState.from_template(template), {"batch": 0, "max_norm": 0.0}

    def accumulate_records(self, params: Any, sample_state: Any, records: Any) -> Any:
        st, info = sample_state
        x = np.asarray(records, dtype=np.float64)
        norms = np.linalg.norm(x.reshape(len(x), -1), axis=1)
        with np.errstate(all="ignore"):
            f = np.where(np.isfinite(norms), np.minimum(1.0, self.clip / np.maximum(norms, 1e-300)), 0.0)
            x = np.where(np.isfinite(norms)[:, None], x * f[:, None], 0.0)
        info = {"batch": info["batch"] + len(x), "max_norm": max(info["max_norm"], float(np.max(np.where(np.isfinite(norms), norms, 0.0), initial=0.0)))}
        return st.added([x.sum(0)], self.clip), info

    def merge_sample_states(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def get_noised_result(self, sample_state: Any, global_state: Any, *, seed: Optional[int] = None):
        st, info = sample_state
        sd = self.stddev * (info["max_norm"] if self.noise_from_data else 1.0)
        den = max(1, info["batch"]) if self.denominator == "batch" else self.denominator
        rel = GaussianRelease(st.sums, (sd,), float(den), st.dtypes, st.kind, SumQueryEvent(self.declared, sd), global_state)
        return noise_releases([rel], seed)[0], global_state, rel.event


def aggregator_train(query_factory, steps: int = 4, q: float = 0.5, split: bool = False):
    """Releases ``steps`` Poisson samples of the records through a PrivateAggregator (``split``:
    each record given as two arrays, its first three features and the rest)."""
    from dpcore.aggregator import PrivateAggregator
    from dpcore.ledger import PrivacyLedger

    def train(cols, seed):
        x = cols[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            agg = PrivateAggregator(query_factory(), PrivacyLedger(ledger_path()), population_size=len(x), sampling_probability=q)
            for t in range(steps):
                idx = agg.sample(seed=seed * 1000 + t)
                recs = x[idx]
                agg.aggregate([recs[:, :3], recs[:, 3:]] if split else recs, seed=seed * 1000 + 500 + t)

    return train


def check_ranks(launch, load, out, physical) -> None:
    """The two-rank harness run (tests/dist_worker.py ``greybox``, started by ``launch``): no
    finding on either rank, three releases on D and each of the seven neighbours, and the
    neighbour's record sampled in some step."""
    opts = {} if physical is None else {"physical": physical}
    codes = launch("greybox", out, timeout=400, **opts)
    assert codes == [0, 0], (out / "log0").read_text()[-3000:] + (out / "log1").read_text()[-3000:]
    for r in (0, 1):
        res = load(out, r)
        assert res["findings"] == [], res["table"]
        assert res["releases"] == [3] * 7
    assert max(load(out, 0)["ratios"]) > 0.05
