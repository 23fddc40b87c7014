"""dpcore.flower: user-level DP on Flower's Message API (issue 41).

Exactness at noise 0 against the brute force Σ_u clip(Δ_u, C)/denominator (server- and
client-side, flat and per layer, with dropped and malformed clients), the noise's std at noise >
0, the samplers (Poisson, fixed size, cyclic for DP-FTRL), adaptive clipping, the ledger and the
report against the metrics, resume across a server restart, and the grey-box harness with
clients as neighbours. The runs use ``LocalGrid`` (in-process clients); the simulation engine
is run once at the end."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp.strategy import FedAdam, FedAvg  # noqa: E402

import dpcore  # noqa: E402
import dpcore.flower as dpf  # noqa: E402
from dpcore.flower.testing import LocalGrid  # noqa: E402
from dpcore.ledger import PrivacyLedger  # noqa: E402

from flower_cases import (  # noqa: E402
    ERROR, NORMAL, SHAPES, SILENT, TWO_RECORDS, WRONG_SHAPE, arrays_of, brute_force, client, config, initial, targets,
)

N = 10
IDS = [1000 + 7 * i for i in range(N)]  # node ids (not 0..N-1: the roster maps them)


@pytest.fixture(autouse=True)
def _quiet_flower():
    import logging

    logging.getLogger("flwr").setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def grid_of(tg, modes=None, ids=IDS, drop=None, wrap=None):
    modes = modes if modes is not None else [NORMAL] * len(tg)
    apps = {}
    for i, (t, m) in enumerate(zip(tg, modes)):
        fn = client(t, m)
        apps[ids[i]] = wrap(fn) if wrap is not None else fn
    drop = set(drop or ()) | {ids[i] for i, m in enumerate(modes) if m == SILENT}
    return LocalGrid(apps, drop=drop)


def run_rounds(dp, grid, rounds, init=None):
    arrays = initial() if init is None else init
    history = []
    for r in range(1, rounds + 1):
        msgs = list(dp.configure_train(r, arrays, config(), grid))
        replies = grid.send_and_receive(msgs)
        out, metrics = dp.aggregate_train(r, replies)
        history.append((arrays_of(arrays), out, metrics, msgs))
        arrays = out
    return arrays, history


def make(tmp_path, **kw):
    opts = dict(population_size=N, sampling_probability=1.0, noise_multiplier=0.0, max_grad_norm=1.0,
                ledger=tmp_path / "fl.ledger", seed=3)
    opts.update(kw)
    if not isinstance(opts["ledger"], PrivacyLedger):
        os.makedirs(os.path.dirname(os.fspath(opts["ledger"])), exist_ok=True)
    return dpf.DifferentialPrivacy(FedAvg(fraction_evaluate=0.0), **opts)


def close(out, want, rtol=1e-5):
    got = arrays_of(out)
    for k in SHAPES:
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=1e-6)


# -- exactness ---------------------------------------------------------------------------


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_server_side_release_equals_brute_force(tmp_path, clipping):
    tg = targets(N)
    dp = make(tmp_path, clipping=clipping)
    _, hist = run_rounds(dp, grid_of(tg), 3)
    for w0, out, metrics, msgs in hist:
        assert len(msgs) == N
        close(out, brute_force(w0, tg, range(N), 1.0, N, clipping))
        # the int buffer is the server's, never a client's
        assert arrays_of(out)["steps"].tolist() == [7]
    # some clients were clipped and some were not: the bound binds
    norms = [np.linalg.norm(0.5 * (t - np.concatenate([hist[0][0]["w"].ravel(), hist[0][0]["b"].ravel()]))) for t in tg]
    assert min(norms) < 1.0 < max(norms)


def test_client_side_release_equals_brute_force_and_the_server_never_sees_raw_updates(tmp_path):
    tg = targets(N)
    seen = []

    def with_mod(fn):
        app = ClientApp(mods=[dpf.clipping_mod])

        @app.train()
        def train(msg, ctx):
            return fn(msg, ctx)

        return app

    grid = grid_of(tg, wrap=with_mod)
    dp = make(tmp_path, clipping_mode="client")
    arrays = initial()
    msgs = list(dp.configure_train(1, arrays, config(), grid))
    assert msgs[0].content["config"][dpf.CONFIG_CLIP] == 1.0
    replies = list(grid.send_and_receive(msgs))
    w0 = arrays_of(arrays)
    for r in replies:
        got = arrays_of(r.content["arrays"])
        d = np.concatenate([(got[k].astype(np.float64) - w0[k]).ravel() for k in SHAPES])
        seen.append(np.linalg.norm(d))
    assert max(seen) <= 1.0 + 1e-5  # clipped on the client
    out, _ = dp.aggregate_train(1, replies)
    close(out, brute_force(w0, tg, range(N), 1.0, N))


def test_client_side_per_layer(tmp_path):
    tg = targets(N)

    def with_mod(fn):
        return lambda msg, ctx: dpf.clipping_mod(msg, ctx, fn)

    dp = make(tmp_path, clipping_mode="client", clipping="per_layer")
    _, hist = run_rounds(dp, grid_of(tg, wrap=with_mod), 2)
    for w0, out, _, _ in hist:
        close(out, brute_force(w0, tg, range(N), 1.0, N, "per_layer"))


def test_local_grid_push_and_pull_match_send_and_receive():
    grid = grid_of(targets(3), ids=[1, 2, 3], drop={2})
    msgs = [Message(content=RecordDict({"arrays": initial(), "config": config()}), dst_node_id=n,
                    message_type=MessageType.TRAIN) for n in (1, 2, 3, 9)]
    ids = list(grid.push_messages(msgs))
    assert len(ids) == 4 and len(set(ids)) == 4
    got = grid.pull_messages(ids)
    assert sorted(r.metadata.src_node_id for r in got) == [1, 3]  # node 2 dropped, node 9 unknown
    assert grid.pull_messages(ids) == []  # each reply handed out once


def test_clipping_mod_refuses_without_the_servers_bound():
    called = []

    def inner(msg, ctx):
        called.append(1)
        return Message(RecordDict({"arrays": msg.content["arrays"]}), reply_to=msg)

    from flwr.supercore.task_identity import TaskIdentity

    LocalGrid({})  # sets the task identity of this process
    msg = Message(content=RecordDict({"arrays": initial(), "config": ConfigRecord({"lr": 0.1})}), dst_node_id=5,
                  message_type=MessageType.TRAIN)
    out = dpf.clipping_mod(msg, None, inner)
    assert out.has_error() and "no clip bound" in out.error.reason
    assert called == []  # the client did not even train
    assert TaskIdentity.run_id == 1


def test_aggregator_missing_participants_contribute_nothing(tmp_path):
    from dpcore.aggregator import PrivateAggregator
    from dpcore.queries import GaussianAverageQuery

    agg = PrivateAggregator(GaussianAverageQuery(1.0, 0.0, 4.0), PrivacyLedger(tmp_path / "m.ledger"), 4,
                            sampling_probability=1.0)
    idx = agg.sample(seed=1)
    assert len(idx) == 4
    with pytest.raises(ValueError, match=r"has 3 records but the sample has 4"):
        agg.aggregate(np.ones((3, 2)))
    with pytest.raises(ValueError, match="missing must be an int"):
        agg.aggregate(np.ones((3, 2)), missing=5)
    out = agg.aggregate(np.full((3, 2), 0.5), missing=1)
    np.testing.assert_allclose(out, [3 * 0.5 / 4] * 2)


@pytest.mark.parametrize("a", [
    np.arange(12, dtype=np.float32).reshape(3, 4), np.asfortranarray(np.ones((3, 4))), np.array(5, np.int64),
    np.zeros((0, 3)), np.arange(3, dtype=">f8"), np.ones(70_000, np.float16),
])
def test_array_view_reads_what_flower_wrote_without_a_copy(a):
    from dpcore.flower._records import array_view

    arr = Array(a)
    v = array_view(arr)
    assert v.shape == a.shape and v.dtype == a.dtype and np.array_equal(v, a)
    if not a.flags.f_contiguous or a.ndim < 2:
        assert not v.flags.owndata  # a view of the message's bytes


def test_a_truncated_array_is_a_missing_client(tmp_path):
    from dpcore.flower._records import ModelLayout, client_arrays

    model = initial()
    lay = ModelLayout.of(arrays_of(model))
    w = Array(np.zeros(5, np.float32))
    bad = Array(dtype=w.dtype, shape=w.shape, stype=w.stype, data=w.data[:-4])
    good = {k: model[k] for k in model.keys()}
    reply = Message(RecordDict({"arrays": ArrayRecord({**good, "w": bad})}), dst_node_id=1, message_type=MessageType.TRAIN)
    assert client_arrays(reply, lay) is None
    ok = Message(RecordDict({"arrays": ArrayRecord(good)}), dst_node_id=1, message_type=MessageType.TRAIN)
    assert set(client_arrays(ok, lay)) == {"w", "b"}


def test_clip_update_zeroes_a_nonfinite_update():
    old = [np.zeros(3, np.float32), np.array([1], np.int64)]
    new = [np.array([np.nan, 1, 1], np.float32), np.array([9], np.int64)]
    out = dpf.clip_update(new, old, 1.0, "flat")
    assert out[0].tolist() == [0, 0, 0] and out[1].tolist() == [1]
    out = dpf.clip_update([np.array([3.0, 4.0, 0.0], np.float32), old[1]], old, 1.0, "flat")
    np.testing.assert_allclose(out[0], [0.6, 0.8, 0.0], rtol=1e-6)


# -- dropped and malformed clients -----------------------------------------------------------


def test_dropped_and_malformed_clients_contribute_zero_and_the_round_is_released(tmp_path):
    tg = targets(N)
    tg[9] = 1e30  # a huge update: clipped like any other
    modes = [NORMAL, SILENT, ERROR, WRONG_SHAPE, TWO_RECORDS, NORMAL, NORMAL, NORMAL, NORMAL, NORMAL]
    tg_nan = tg.copy()
    tg_nan[5] = np.nan  # a NaN update: zero contribution
    dp = make(tmp_path)
    _, hist = run_rounds(dp, grid_of(tg_nan, modes), 2)
    for w0, out, metrics, msgs in hist:
        assert metrics["dpcore.sampled-clients"] == N
        close(out, brute_force(w0, tg, [0, 6, 7, 8, 9], 1.0, N))  # denominator N: dropouts change nothing
    led = PrivacyLedger.load(tmp_path / "fl.ledger")
    assert led.num_releases == 2 and len(led.samples) == 2


def test_a_node_gone_after_the_roster_is_fixed_is_a_dropped_client(tmp_path):
    tg = targets(N)
    grid = grid_of(tg)
    dp = make(tmp_path)
    arrays = initial()
    msgs = list(dp.configure_train(1, arrays, config(), grid))
    arrays, _ = dp.aggregate_train(1, grid.send_and_receive(msgs))
    del grid.clients[IDS[4]]  # the SuperNode is gone: not connected any more
    msgs = list(dp.configure_train(2, arrays, config(), grid))
    assert len(msgs) == N - 1 and IDS[4] not in [m.metadata.dst_node_id for m in msgs]
    out, _ = dp.aggregate_train(2, grid.send_and_receive(msgs))
    close(out, brute_force(arrays_of(arrays), tg, [u for u in range(N) if u != 4], 1.0, N))


def test_roster_is_fixed_and_extra_nodes_are_never_sampled(tmp_path):
    tg = targets(N + 3)
    ids = IDS + [5, 6, 2000]
    grid = grid_of(tg, ids=ids)
    dp = make(tmp_path)
    with pytest.warns(UserWarning, match="only the 10 smallest node ids"):
        msgs = list(dp.configure_train(1, initial(), config(), grid))
    assert sorted(m.metadata.dst_node_id for m in msgs) == sorted(ids)[:N]
    dp2 = make(tmp_path / "b", population_size=N + 10, wait_for_clients=0)
    with pytest.raises(RuntimeError, match="only 13 clients connected"):
        dp2.configure_train(1, initial(), config(), grid)


def test_a_round_must_be_configured_by_the_wrapper_before_it_is_aggregated(tmp_path):
    dp = make(tmp_path)
    with pytest.raises(RuntimeError, match="not configured"):
        dp.aggregate_train(1, [])


# -- the noise ---------------------------------------------------------------------------


@pytest.mark.parametrize("sampler,kw,den", [
    ("poisson", dict(sampling_probability=0.5), 0.5 * 40),
    ("fixed_size_without_replacement", dict(sample_size=8), 8.0),
])
def test_noise_std_is_sigma_c_over_the_denominator(tmp_path, sampler, kw, den):
    """Clients that return the model unchanged: the release is pure noise, N(0, (zC/den)²) per
    coordinate; a χ² interval at a fixed seed (40 000 coordinates, 4 rounds)."""
    from scipy import stats

    n, d = 40, 20_000
    init = ArrayRecord({"w": Array(np.zeros(d, np.float32))})

    def same(msg, ctx):
        return Message(RecordDict({"arrays": msg.content["arrays"], "metrics": dpf_metrics()}), reply_to=msg)

    grid = LocalGrid({i + 1: same for i in range(n)})
    z, c = 1.3, 0.7
    dp = dpf.DifferentialPrivacy(FedAvg(fraction_evaluate=0.0), population_size=n, sampler=sampler,
                                 noise_multiplier=z, max_grad_norm=c, ledger=tmp_path / "n.ledger", seed=11, **kw)
    assert dp.denominator == den
    vals = []
    arrays = init
    for r in range(1, 5):
        prev = arrays_of(arrays)["w"].astype(np.float64)
        msgs = list(dp.configure_train(r, arrays, config(), grid))
        arrays, _ = dp.aggregate_train(r, grid.send_and_receive(msgs))
        vals.append(arrays_of(arrays)["w"].astype(np.float64) - prev)
    v = np.concatenate(vals)
    sd = z * c / den
    k = v.size
    lo, hi = stats.chi2.ppf([1e-4, 1 - 1e-4], k)
    assert lo <= np.sum((v / sd) ** 2) <= hi
    assert abs(v.mean()) < 5 * sd / math.sqrt(k)


def dpf_metrics():
    from flwr.app import MetricRecord

    return MetricRecord({"num-examples": 1})


def test_poisson_client_sampling_is_recorded_and_varies(tmp_path):
    n = 30
    tg = targets(n)
    ids = list(range(1, n + 1))
    dp = dpf.DifferentialPrivacy(FedAvg(fraction_evaluate=0.0), population_size=n, sampling_probability=0.3,
                                 noise_multiplier=1.0, max_grad_norm=1.0, ledger=tmp_path / "p.ledger", seed=5)
    _, hist = run_rounds(dp, grid_of(tg, ids=ids), 6)
    sizes = [len(h[3]) for h in hist]
    assert len(set(sizes)) > 1 and all(0 < s < n for s in sizes)
    led = PrivacyLedger.load(tmp_path / "p.ledger")
    assert led.privacy_unit == "user"
    assert [s.policy for s in led.samples] == ["poisson"] * 6
    assert {s.population_size for s in led.samples} == {n}
    assert [h[2]["dpcore.sampled-clients"] for h in hist] == sizes


# -- accounting: metrics, ledger, report, calibration -------------------------------------


def test_metrics_epsilon_equals_the_ledger_and_the_cli_report(tmp_path):
    tg = targets(N)
    dp = make(tmp_path, sampling_probability=0.5, noise_multiplier=1.1, target_delta=1e-4)
    _, hist = run_rounds(dp, grid_of(tg), 4)
    eps = [h[2]["dpcore.epsilon"] for h in hist]
    assert all(a < b for a, b in zip(eps, eps[1:]))
    led = PrivacyLedger.load(tmp_path / "fl.ledger")
    assert eps[-1] == led.get_epsilon(1e-4)
    out = subprocess.run([sys.executable, "-m", "dpcore", "report", str(tmp_path / "fl.ledger"), "--delta", "1e-4",
                          "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert math.isclose(rep["epsilon"], eps[-1], rel_tol=1e-9), rep
    assert rep["privacy_unit"] == "user"
    assert any("Dropouts" in a for a in rep["assumptions"])  # the report says how dropouts are treated


def test_target_epsilon_is_calibrated_before_the_first_round(tmp_path):
    tg = targets(N)
    dp = make(tmp_path, sampling_probability=0.5, noise_multiplier=None, target_epsilon=3.0, target_delta=1e-5,
              num_rounds=5)
    z_want = dpcore.plan.calibrate_noise(3.0, 1e-5, sampler="poisson", sampling_probability=0.5, steps=5)
    assert dp.noise_multiplier == z_want
    _, hist = run_rounds(dp, grid_of(tg), 5)
    assert 2.9 < hist[-1][2]["dpcore.epsilon"] <= 3.0


@pytest.mark.parametrize("kw", [
    dict(sampler="truncated_poisson", sampling_probability=0.5, max_batch_size=7),
    dict(sampler="balls_in_bins", sampling_probability=0.25),
    dict(sampler="random_allocation", sampling_probability=0.25, num_selected=2),
])
def test_the_other_registered_samplers_draw_the_clients_and_meet_the_target(tmp_path, kw):
    dp = make(tmp_path, noise_multiplier=None, target_epsilon=4.0, target_delta=1e-5, num_rounds=8, **kw)
    _, hist = run_rounds(dp, grid_of(targets(N)), 8)
    sizes = [len(h[3]) for h in hist]
    assert len(set(sizes)) > 1 and max(sizes) <= kw.get("max_batch_size", N)
    led = PrivacyLedger.load(tmp_path / "fl.ledger")
    assert {s.policy for s in led.samples} == {kw["sampler"]}
    assert 3.9 < hist[-1][2]["dpcore.epsilon"] <= 4.0


def test_refusals(tmp_path):
    with pytest.raises(TypeError, match="Flower Strategy"):
        dpf.DifferentialPrivacy(object(), population_size=3, sampling_probability=1, noise_multiplier=1,
                                max_grad_norm=1)
    with pytest.raises(TypeError, match="num_rounds"):
        make(tmp_path, noise_multiplier=None, target_epsilon=1.0, target_delta=1e-5)
    with pytest.raises(ValueError, match="cyclic"):
        make(tmp_path, noise_mechanism="blt", num_rounds=4)
    with pytest.raises(ValueError, match="clipping_mode='server'"):
        make(tmp_path, adaptive_clipping=True, clipping_mode="client")
    with pytest.raises(ValueError, match="sampler must be one of"):
        make(tmp_path, sampler="shuffle")
    with pytest.raises(ValueError, match="sample_size"):
        make(tmp_path, sampler="fixed_size_without_replacement")
    led = PrivacyLedger(tmp_path / "ex.ledger", privacy_unit="example")
    with pytest.raises(ValueError, match="unit 'user'"):
        make(tmp_path, ledger=led)
    # bad input is refused before a ledger file exists
    with pytest.raises(ValueError, match="max_grad_norm"):
        make(tmp_path, ledger=tmp_path / "never.ledger", max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="node_ids"):
        make(tmp_path, ledger=tmp_path / "never.ledger", node_ids=[1, 2])
    assert not (tmp_path / "never.ledger").exists()
    # a refusal after the ledger was opened closes it again: the same path opens at once
    with pytest.raises(ValueError, match="sample_size"):
        make(tmp_path, ledger=tmp_path / "again.ledger", sampler="cyclic")
    make(tmp_path, ledger=tmp_path / "again.ledger").close()


def test_discrete_gaussian_noise_is_recorded_as_such(tmp_path):
    tg = targets(N)
    dp = make(tmp_path, noise_mechanism="discrete_gaussian", noise_multiplier=1.0)
    out, hist = run_rounds(dp, grid_of(tg), 2)
    led = PrivacyLedger.load(tmp_path / "fl.ledger")
    assert [q.mechanism for s in led.samples for q in s.queries] == ["discrete_gaussian"] * 2
    assert all(np.isfinite(v).all() for v in arrays_of(out).values())
    assert hist[-1][2]["dpcore.epsilon"] == led.get_epsilon(1e-5)


# -- adaptive clipping ---------------------------------------------------------------------


def test_adaptive_clipping_tracks_the_quantile_and_its_count_is_accounted(tmp_path):
    tg = targets(N, scale=0.5)  # every update's norm is well below the initial clip
    dp = make(tmp_path, adaptive_clipping=True, max_grad_norm=10.0, noise_multiplier=1.0, sampling_probability=1.0,
              clip_learning_rate=0.5)
    _, hist = run_rounds(dp, grid_of(tg), 5)
    clips = [h[2]["dpcore.max-grad-norm"] for h in hist]
    assert clips[-1] < clips[0] < 10.0  # moves down towards the median norm
    # the release's z covers the sum and the count together (Eq. (1)): the same ε as plain DP-FedAvg at z
    plain = make(tmp_path / "plain", noise_multiplier=1.0, sampling_probability=1.0)
    run_rounds(plain, grid_of(tg), 5)
    assert math.isclose(dp.epsilon(), plain.epsilon(), rel_tol=1e-6)
    led = PrivacyLedger.load(tmp_path / "fl.ledger")
    assert led.num_releases == 5


# -- correlated noise (DP-FTRL) ------------------------------------------------------------


def test_blt_cyclic_participation_and_exactness(tmp_path):
    tg = targets(N)
    dp = make(tmp_path, sampler="cyclic", sample_size=2, sampling_probability=None, noise_mechanism="blt",
              num_rounds=10, noise_multiplier=0.0)
    assert dp.denominator == 2.0
    _, hist = run_rounds(dp, grid_of(tg), 10)
    groups = [tuple(sorted(m.metadata.dst_node_id for m in h[3])) for h in hist]
    assert len(set(groups[:5])) == 5 and groups[:5] == groups[5:]  # b = 5 groups, each every 5th round
    for (w0, out, _, msgs) in hist:
        present = [IDS.index(m.metadata.dst_node_id) for m in msgs]
        close(out, brute_force(w0, tg, present, 1.0, 2.0))


def test_blt_epsilon_and_the_ledger_stream(tmp_path):
    from dpcore.matrix_factorization import calibrate_noise_multiplier

    tg = targets(N)
    dp = make(tmp_path, sampler="cyclic", sample_size=2, sampling_probability=None, noise_mechanism="blt",
              num_rounds=10, noise_multiplier=None, target_epsilon=4.0, target_delta=1e-5)
    part = dp._mf[0]
    assert dp.noise_multiplier == calibrate_noise_multiplier(4.0, 1e-5, participation=part, steps=10)
    _, hist = run_rounds(dp, grid_of(tg), 10)
    led = PrivacyLedger.load(tmp_path / "fl.ledger")
    assert len(led.streams) == 1 and led.num_releases == 10
    assert hist[-1][2]["dpcore.epsilon"] <= 4.0 + 1e-9


# -- server restart ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["poisson", "adaptive", "blt"])
def test_a_restarted_server_continues_bit_identically(tmp_path, kind):
    tg = targets(N)
    kw = dict(noise_multiplier=0.8, sampling_probability=0.6)
    if kind == "adaptive":
        kw.update(adaptive_clipping=True)
    if kind == "blt":
        kw = dict(noise_multiplier=0.8, sampler="cyclic", sample_size=2, sampling_probability=None,
                  noise_mechanism="blt", num_rounds=6)
    one = make(tmp_path / "one", ledger=tmp_path / "one.ledger", **kw)
    want, _ = run_rounds(one, grid_of(tg), 6)

    state = tmp_path / "server.state"
    a = make(tmp_path / "two", ledger=tmp_path / "two.ledger", state_path=state, **kw)
    mid, _ = run_rounds(a, grid_of(tg), 3)
    a.ledger.close()
    del a
    b = make(tmp_path / "two", ledger=tmp_path / "two.ledger", state_path=state, **kw)
    assert b.resume_arrays is not None
    for k in SHAPES:
        np.testing.assert_array_equal(arrays_of(b.resume_arrays)[k], arrays_of(mid)[k])
    got, _ = run_rounds(b, grid_of(tg), 3, init=b.resume_arrays)
    for k in SHAPES:
        np.testing.assert_array_equal(arrays_of(got)[k], arrays_of(want)[k])
    assert b.releases == 6 and PrivacyLedger.load(tmp_path / "two.ledger").num_releases == 6
    assert math.isclose(b.epsilon(), one.epsilon(), rel_tol=1e-12)


def test_a_restarted_engine_with_new_node_ids(tmp_path):
    """Flower's simulation engine gives its nodes new ids at every start: independent rounds fix
    the roster again (warned); a cyclic schedule needs node_ids= in the saved order."""
    tg = targets(N)
    new_ids = [5000 + i for i in range(N)]
    for kw in (dict(noise_multiplier=0.5, sampling_probability=0.5),
               dict(noise_multiplier=0.5, sampler="cyclic", sample_size=2, sampling_probability=None)):
        d = tmp_path / kw.get("sampler", "poisson")
        a = make(d, state_path=d / "s.state", **kw)
        run_rounds(a, grid_of(tg), 2)
        a.close()
        b = make(d, state_path=d / "s.state", **kw)
        assert b.releases == 2  # restored at construction
        if "sampler" not in kw:
            with pytest.warns(UserWarning, match="fixed again over the connected clients"):
                _, hist = run_rounds(b, grid_of(tg, ids=new_ids), 2, init=b.resume_arrays)
            assert all(m.metadata.dst_node_id in new_ids for h in hist for m in h[3])
            assert sum(len(h[3]) for h in hist) > 0
        else:
            with pytest.raises(RuntimeError, match="give node_ids= with the new id of each saved client"):
                run_rounds(b, grid_of(tg, ids=new_ids), 1, init=b.resume_arrays)
            b.close()
            c = make(d, state_path=d / "s.state", node_ids=new_ids, **kw)
            _, hist = run_rounds(c, grid_of(tg, ids=new_ids), 1, init=c.resume_arrays)
            assert len(hist[0][3]) == 2


def test_missing_clients_are_logged_on_the_server(tmp_path, caplog):
    import logging

    modes = [NORMAL] * (N - 2) + [ERROR, SILENT]
    with caplog.at_level(logging.WARNING, logger="flwr"):
        run_rounds(make(tmp_path), grid_of(targets(N), modes), 1)
    assert "2 of 10 sampled clients delivered no update" in caplog.text


def test_resume_refuses_another_run_or_a_ledger_that_moved(tmp_path):
    tg = targets(N)
    state = tmp_path / "server.state"
    a = make(tmp_path, state_path=state, noise_multiplier=1.0)
    run_rounds(a, grid_of(tg), 2)
    a.ledger.close()
    with pytest.raises(ValueError, match="another run"):
        make(tmp_path, state_path=state, noise_multiplier=2.0)
    # one more release in the ledger than the state saw (a crash after the ledger write)
    led = PrivacyLedger(tmp_path / "fl.ledger", privacy_unit="user")
    led.record_sample(N, 1.0, "poisson")
    from dpcore.events import SumQueryEvent

    led.record_release(SumQueryEvent(1.0, 1.0))
    led.close()
    with pytest.raises(ValueError, match="holds 3 releases but the saved state saw 2"):
        make(tmp_path, state_path=state, noise_multiplier=1.0)
    with pytest.warns(UserWarning, match="stay counted"):
        b = make(tmp_path, state_path=state, noise_multiplier=1.0, ledger_ahead="keep")
    assert b.resume_arrays is not None and b.ledger.num_releases == 3


# -- wrapped strategies ---------------------------------------------------------------------


def test_a_server_optimizer_post_processes_the_release(tmp_path):
    """FedAdam applies its optimizer to the one DP release (w + Δ̃ as a single reply)."""
    tg = targets(N)
    dp = dpf.DifferentialPrivacy(FedAdam(fraction_evaluate=0.0, eta=0.1), population_size=N, sampling_probability=1.0,
                                 noise_multiplier=0.0, max_grad_norm=1.0, ledger=tmp_path / "a.ledger", seed=1)
    arrays, hist = run_rounds(dp, grid_of(tg), 2)
    w0, out, _, _ = hist[0]
    bf = brute_force(w0, tg, range(N), 1.0, N)
    step = arrays_of(out)["w"] - w0["w"]
    want = bf["w"] - w0["w"]
    # Adam's first step moves each coordinate by ~eta in the direction of the pseudo-gradient
    assert np.all(np.sign(step) == np.sign(want))
    assert np.all(np.isfinite(arrays_of(arrays)["w"]))


def test_the_wrapped_strategys_config_reaches_the_clients_and_its_minimums_never_block(tmp_path):
    from flwr.serverapp.strategy import FedProx

    seen = []

    def spy(msg, ctx):
        seen.append(dict(msg.content["config"]))
        return client(targets(1)[0])(msg, ctx)

    # one client, below FedProx's own min_train_nodes/min_available_nodes: dpcore samples, FedProx never waits
    dp = dpf.DifferentialPrivacy(FedProx(proximal_mu=0.3, fraction_evaluate=0.0, min_available_nodes=5),
                                 population_size=1, sampling_probability=1.0, noise_multiplier=0.0, max_grad_norm=1.0,
                                 ledger=tmp_path / "x.ledger", clipping_mode="client")
    run_rounds(dp, LocalGrid({42: spy}), 1)
    assert seen[0]["proximal-mu"] == 0.3 and seen[0][dpf.CONFIG_CLIP] == 1.0 and seen[0]["server-round"] == 1


def test_an_empty_poisson_sample_releases_pure_noise_and_is_recorded(tmp_path):
    n = 5
    dp = dpf.DifferentialPrivacy(FedAvg(fraction_evaluate=0.0), population_size=n, sampling_probability=0.05,
                                 noise_multiplier=1.0, max_grad_norm=1.0, ledger=tmp_path / "e.ledger", seed=2)
    _, hist = run_rounds(dp, grid_of(targets(n), ids=list(range(1, n + 1))), 8)
    empty = [h for h in hist if not h[3]]
    assert empty, "the seed draws no empty round: pick another"
    w0, out, metrics, _ = empty[0]
    assert metrics["dpcore.sampled-clients"] == 0
    assert not np.array_equal(arrays_of(out)["w"], w0["w"])  # noise only, still released
    assert PrivacyLedger.load(tmp_path / "e.ledger").num_releases == 8


def test_client_metrics_are_dropped_unless_asked_for(tmp_path):
    tg = targets(N)
    _, hist = run_rounds(make(tmp_path), grid_of(tg), 1)
    assert "train-loss" not in hist[0][2]
    _, hist = run_rounds(make(tmp_path / "m", client_metrics=True), grid_of(tg), 1)
    assert hist[0][2]["train-loss"] == pytest.approx(0.5)


def test_start_runs_the_whole_loop(tmp_path):
    tg = targets(N)
    dp = make(tmp_path, noise_multiplier=0.5, sampling_probability=0.5)
    res = dp.start(grid_of(tg), initial(), num_rounds=3, timeout=5)
    assert sorted(res.train_metrics_clientapp) == [1, 2, 3]
    assert res.train_metrics_clientapp[3]["dpcore.epsilon"] == dp.epsilon()


# -- grey-box: clients as neighbours -----------------------------------------------------------


def _greybox_train(n_declared, **kw):
    def train(cols, seed):
        tg, modes = cols
        ids = [1 + i for i in range(n_declared)]
        apps = {ids[i]: client(tg[i], int(modes[i])) for i in range(len(tg))}
        drop = {ids[i] for i in range(len(tg)) if modes[i] == SILENT}
        import tempfile

        d = tempfile.mkdtemp()
        dp = dpf.DifferentialPrivacy(FedAvg(fraction_evaluate=0.0), population_size=n_declared, node_ids=ids,
                                     ledger=os.path.join(d, "g.ledger"), seed=seed, max_grad_norm=1.0, **kw)
        run_rounds(dp, LocalGrid(apps, drop=drop), 3)

    return train


@pytest.mark.parametrize("kw", [
    dict(sampling_probability=0.6, noise_multiplier=1.0),
    dict(sampling_probability=0.6, noise_multiplier=1.0, clipping="per_layer"),
    dict(sampling_probability=1.0, noise_multiplier=1.0, adaptive_clipping=True),
    dict(sampler="cyclic", sample_size=3, noise_mechanism="blt", num_rounds=3, noise_multiplier=1.0),
])
def test_greybox_clients_as_neighbours(kw):
    from dpcore.audit import Neighbour, neighbour_audit, neighbours

    n_declared = 12
    tg = targets(11)
    modes = np.zeros(11, np.int64)

    def add(mode, value=None):
        def make(cols):
            t, m = cols
            row = t[:1] * 0 + (t[0] if value is None else value)
            return np.concatenate([t, row]), np.concatenate([m, [mode]])
        return make

    custom = [Neighbour(f"add_{name}", "add_or_remove", add(mode, value)) for name, mode, value in [
        ("silent", SILENT, None), ("error", ERROR, None), ("wrong_shape", WRONG_SHAPE, None),
        ("two_records", TWO_RECORDS, None), ("nan", NORMAL, np.nan), ("huge", NORMAL, 1e30), ("inf", NORMAL, np.inf),
    ]]
    kinds = neighbours(["remove", "add", "replace"], poison_columns=[0]) + custom
    if kw.get("sampler") == "cyclic":
        # fixed groups: the neighbours keep the population (a replaced client)
        kinds = neighbours(["replace", "replace_nan", "replace_huge"], poison_columns=[0])
    res = neighbour_audit(_greybox_train(n_declared, **kw), (tg, modes), kinds)
    res.raise_for_findings()
    # 3 rounds on D and on every neighbour (a per-layer or adaptive round releases several sums)
    assert len({r.releases for r in res.runs}) == 1 and res.runs[0].releases >= 3
    assert max(r.max_ratio for r in res.runs if not math.isnan(r.max_ratio)) > 0.05


def test_greybox_catches_weighting_by_example_counts(tmp_path, monkeypatch):
    """A planted bug: the denominator taken from the replies that arrived (a data-dependent
    denominator) is flagged."""
    from dpcore.audit import neighbour_audit, neighbours
    from dpcore.aggregator import PrivateAggregator

    orig = PrivateAggregator.aggregate

    def by_arrivals(self, records, *, seed=None, missing=0):
        arr = records[0] if isinstance(records, list) else next(iter(records.values()))
        alive = int(np.sum(np.any(arr.reshape(len(arr), -1) != 0, axis=1)))
        self._query._den = float(max(1, alive))
        return orig(self, records, seed=seed, missing=missing)

    monkeypatch.setattr(PrivateAggregator, "aggregate", by_arrivals)
    tg = targets(11)
    res = neighbour_audit(_greybox_train(12, sampling_probability=1.0, noise_multiplier=1.0), (tg, np.zeros(11, np.int64)),
                          neighbours(["add"], poison_columns=[0]))
    assert not res.passed and {f.kind for f in res.findings} & {"denominator", "noise"}


# -- the simulation engine ------------------------------------------------------------------


def test_simulation_engine(tmp_path):
    """Flower's simulation engine (Ray) runs the wrapper end to end: 4 SuperNodes, 2 rounds."""
    out = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "flower_sim_run.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads((tmp_path / "result.json").read_text())
    led = PrivacyLedger.load(tmp_path / "sim.ledger")
    assert led.num_releases == 2 and len(led.samples) == 2
    assert res["epsilon"] == pytest.approx(led.get_epsilon(1e-5), rel=1e-12)
    assert np.all(np.isfinite(res["w"])) and res["moved"] > 0
