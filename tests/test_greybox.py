"""The grey-box neighbour harness (dpcore.audit.neighbour_audit) on the numpy release paths, and
the planted bugs it must catch and name (Cebere et al., PETS 2026). The torch, Keras and HF
trainer paths are in tests/test_greybox_adapters.py."""

from __future__ import annotations

import numpy as np
import pytest

from dpcore.audit import NEIGHBOUR_KINDS, Neighbour, neighbour_audit, neighbours, users_last
from dpcore.queries import (
    GaussianAverageQuery,
    GaussianSumQuery,
    JointClipQuery,
    NestedQuery,
    QuantileAdaptiveClipQuery,
)

from greybox_cases import KINDS, HandQuery, aggregator_train, features

PUBLIC_N = ("population_size",)  # the aggregator is given len(x): the tests state it public


def _audit(train, data=None, kinds=KINDS, **kw):
    return neighbour_audit(train, (features(),) if data is None else data, kinds, assume_public=PUBLIC_N, **kw)


# -- every numpy release path passes, on every neighbour kind --------------------------------

PATHS = {
    "average": (lambda: GaussianAverageQuery(1.0, 1.0, denominator=20.0), False),
    "sum": (lambda: GaussianSumQuery(0.5, 0.7), False),
    "joint": (lambda: JointClipQuery([1.0, 0.25], 1.0, 1.0, denominator=20.0), True),
    "nested": (lambda: NestedQuery([GaussianSumQuery(1.0, 1.0), GaussianAverageQuery(0.3, 0.5, denominator=20.0)]), True),
    "adaptive": (lambda: QuantileAdaptiveClipQuery(0.5, 1.0, 0.5, 0.2, 2.0, 20.0, denominator=20.0), False),
    "discrete": (lambda: GaussianSumQuery(1.0, 1.0, mechanism="discrete_gaussian"), False),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_numpy_release_paths_pass_every_neighbour(path):
    factory, split = PATHS[path]
    if path == "nested":
        train = aggregator_train(factory, split=True)
    else:
        train = aggregator_train(factory, split=split)
    res = _audit(train)
    res.raise_for_findings()
    assert [r.neighbour for r in res.runs] == list(KINDS)
    for r in res.runs:
        # every run released and recorded as on D (4 samples, each with its releases)
        assert r.releases >= 4 and r.ledger_entries >= 8, r
        assert (r.releases, r.ledger_entries) == (res.runs[0].releases, res.runs[0].ledger_entries)
        assert r.max_ratio <= 1.0 + 1e-3
        assert r.public in ([], ["population_size"])
    # the neighbour that adds an ordinary record was sampled at least once: the bound is met
    assert max(r.max_ratio for r in res.runs if r.neighbour in ("add", "remove", "replace")) > 0.1


def test_clip_noise_passes_every_neighbour():
    import dpcore

    def train(cols, seed):
        x = cols[0]
        for t in range(4):
            idx = dpcore.poisson_sample(len(x), 0.5, seed=seed * 100 + t)
            dpcore.clip_noise(x[idx], 1.0, 1.0, denominator=20.0, seed=seed * 100 + 50 + t)
            dpcore.clip_noise([x[idx, :3], x[idx, 3:]], 1.0, 1.0, scales=[1.0, 0.5], seed=seed * 100 + 70 + t)

    res = _audit(train)
    res.raise_for_findings()
    assert all(r.releases == 8 for r in res.runs)
    assert max(r.max_ratio for r in res.runs) > 0.5
    for r in res.runs:
        if r.neighbour in ("nan", "inf", "-inf"):
            assert r.max_ratio == 0.0


def test_bad_records_contribute_nothing_on_the_numpy_path():
    res = _audit(aggregator_train(PATHS["average"][0]), kinds=("nan", "inf", "-inf"))
    res.raise_for_findings()
    for r in res.runs:
        assert r.max_ratio == 0.0  # the bad record's contribution is exactly zero


# -- the planted bugs: caught and named -----------------------------------------------------


def _kinds_of(res):
    return {f.kind for f in res.findings}


def test_planted_unclipped_sum_is_caught():
    res = _audit(aggregator_train(lambda: HandQuery(clip=1e9, declared=1.0, stddev=1.0)), kinds=("add", "replace", "huge"))
    assert not res.passed
    assert "sensitivity exceeded" in _kinds_of(res)
    f = next(f for f in res.findings if f.kind == "sensitivity exceeded")
    assert f.where.startswith("release ") and "queries.noise_releases" in f.where


def test_a_wrong_hand_given_sensitivity_names_the_release():
    # a user's own query that clips to 2 but declares 1: the first release where the
    # neighbour's record is sampled is named
    res = _audit(aggregator_train(lambda: HandQuery(clip=2.0, declared=1.0, stddev=1.0)), kinds=("add",))
    (run,) = res.runs
    bad = [f for f in run.findings if f.kind == "sensitivity exceeded"]
    assert bad and all("group 0" in f.where for f in bad)
    assert 1.0 < run.max_ratio <= 2.0 + 1e-9
    # the same query declaring its true bound passes
    _audit(aggregator_train(lambda: HandQuery(clip=2.0, declared=2.0, stddev=1.0)), kinds=("add", "replace")).raise_for_findings()


def test_planted_denominator_from_the_batch_is_caught():
    res = _audit(aggregator_train(lambda: HandQuery(1.0, 1.0, 1.0, denominator="batch")), kinds=("add", "remove"))
    assert "denominator" in _kinds_of(res)


def test_planted_noise_scale_from_the_data_is_caught():
    res = _audit(aggregator_train(lambda: HandQuery(1.0, 1.0, 0.5, noise_from_data=True)), kinds=("huge", "add"))
    kinds = _kinds_of(res)
    assert "noise" in kinds and "ledger" in kinds


def test_planted_raise_on_nan_is_caught():
    def train(cols, seed):
        if not np.all(np.isfinite(cols[0])):
            raise ValueError("a record is not finite")
        aggregator_train(PATHS["average"][0])(cols, seed)

    res = _audit(train, kinds=("nan", "add"))
    assert [r.passed for r in res.runs] == [False, True]
    assert res.runs[0].findings[0].kind == "control flow" and "raised ValueError" in res.runs[0].findings[0].detail


def test_planted_skip_is_caught():
    # a loop that skips a release when a record looks extreme (the old GradScaler skip)
    def train(cols, seed):
        extreme = float(np.abs(cols[0]).max()) > 1e6
        aggregator_train(PATHS["average"][0], steps=2 if extreme else 3)(cols, seed)

    res = _audit(train, kinds=("huge",))
    assert "control flow" in _kinds_of(res) or "ledger" in _kinds_of(res)


def test_population_size_read_from_the_data_is_a_finding_unless_declared_public():
    train = aggregator_train(PATHS["average"][0])
    res = neighbour_audit(train, (features(),), ("add",))
    (f,) = {f.detail.split(":")[0] for f in res.findings}
    assert f == "population_size" and all(x.kind == "ledger" for x in res.findings)
    assert "declare it public" in res.findings[0].detail
    ok = neighbour_audit(train, (features(),), ("add",), assume_public=PUBLIC_N)
    assert ok.passed and ok.runs[0].public == ["population_size"]


# -- the harness itself ---------------------------------------------------------------------


def test_neighbour_kinds_build_what_they_say():
    x = features(10, 3)
    y = np.arange(10)
    cols = (x, y)
    for nb in neighbours(sorted(set(NEIGHBOUR_KINDS) - {"largest_user", "smallest_user"})):
        out = nb.make(cols)
        n = len(out[0])
        assert n == (9 if nb.name == "remove" else 10 if nb.relation == "replace" else 11), nb
        np.testing.assert_array_equal(out[0][:9], x[:9])  # the shared records keep their places
        assert out[1].dtype == y.dtype
    assert np.isnan(neighbours(["nan"])[0].make(cols)[0][-1]).all()
    assert (neighbours(["huge"])[0].make(cols)[0][-1] == np.float32(1e30)).all()
    sub = neighbours(["subnormal"])[0].make(cols)[0][-1]
    assert (sub > 0).all() and (sub < np.finfo(np.float32).tiny).all()


def test_user_neighbours_remove_a_whole_user_at_the_end():
    x = features(12, 2)
    users = np.array([0, 1, 1, 2, 2, 2, 0, 1, 2, 2, 3, 3])
    cols = users_last((x, users), 1, "largest_user")
    assert (cols[1][-5:] == 2).all()
    (nb,) = neighbours(["largest_user"], user_column=1)
    out = nb.make(cols)
    assert len(out[0]) == 7 and not (out[1] == 2).any()
    np.testing.assert_array_equal(out[0], cols[0][:7])
    (small,) = neighbours(["smallest_user"], user_column=1)
    assert len(small.make(users_last((x, users), 1, "smallest_user"))[0]) == 10
    with pytest.raises(ValueError, match="user_column"):
        neighbours(["largest_user"])


def test_harness_refuses_bad_input():
    with pytest.raises(ValueError, match="unknown neighbour"):
        neighbours(["delete"])
    with pytest.raises(ValueError, match="one length"):
        neighbour_audit(lambda c, s: None, (np.zeros((3, 2)), np.zeros(4)))
    # a custom neighbour object is accepted
    nb = Neighbour("half", "replace", lambda cols: (cols[0] * 0.5,))
    res = neighbour_audit(aggregator_train(PATHS["sum"][0]), (features(),), [nb], assume_public=PUBLIC_N)
    assert res.runs[0].neighbour == "half"


def test_table_lists_every_neighbour():
    res = _audit(aggregator_train(PATHS["average"][0]), kinds=("add", "zero"))
    t = res.table()
    assert t.count("\n") == 3 and "| add | add_or_remove |" in t and "| zero |" in t
