"""User-level DP in the Keras adapter (issue 40), run by tests/test_user_level_keras.py in a fresh
process (TensorFlow and the CUDA build of torch abort when loaded into one process).

ULS (``examples_per_user``): at noise 0, every user sampled (q = 1) and k ≥ every user's count,
the update equals the brute force Σ_u clip(mean of u's example gradients, C) / (q·U), each
example's gradient taken by its own GradientTape; with a smaller k, the same over the examples
drawn. ELS (``max_examples_per_user``): the bound keeps ≤ K of each user, the batches come from
the kept examples only. The ledger's unit and bounds, ε against the plan, every bad input, and
the grey-box harness with users as the neighbouring unit."""

from __future__ import annotations

import json
import os
import tempfile
import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import dpcore  # noqa: E402
from dpcore import PrivacyLedger  # noqa: E402
from dpcore.audit import Neighbour, neighbour_audit, users_last  # noqa: E402
from dpcore.tensorflow import PoissonBatches, UserPoissonBatches, make_private, make_private_with_epsilon  # noqa: E402

SCE = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
DELTA = 1e-5


def user_ledger(unit="user"):
    return PrivacyLedger(os.path.join(tempfile.mkdtemp(prefix="dpcore-ul-"), "l.jsonl"), privacy_unit=unit)


def entries(ledger, kind="sample"):
    with open(ledger.path) as f:
        return [e for e in map(json.loads, f) if e.get("type") == kind]


def dense_model(d=5, k=3):
    return tf.keras.Sequential([tf.keras.Input((d,)), tf.keras.layers.Dense(4, activation="tanh"), tf.keras.layers.Dense(k)])


def conv_model(k=3):
    return tf.keras.Sequential([
        tf.keras.Input((6, 6, 1)), tf.keras.layers.Conv2D(2, 3, activation="tanh"), tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(k),
    ])


MODELS = {"dense": (dense_model, (5,)), "conv": (conv_model, (6, 6, 1))}


def population(shape, n=26, users=7, seed=0, scale=4.0):
    """n examples of `users` users with unequal counts (user 0 has one example, every user at least
    one; ids are not sorted, nor in the users' order)."""
    rng = np.random.default_rng(seed)
    ids = np.concatenate([np.arange(users), rng.integers(1, users, n - users)])
    rng.shuffle(ids)
    x = (rng.normal(size=(n, *shape)) * scale).astype(np.float32)
    y = rng.integers(0, 3, n)
    return x, y, (users - ids) * 10 + 3  # ids are any integers


def example_grads(model, x, y):
    """Brute force: each example's gradient by its own tape (float64 copies)."""
    out = []
    for i in range(len(y)):
        with tf.GradientTape() as tape:
            loss = SCE(y[i : i + 1], model(x[i : i + 1], training=True))
        out.append([g.numpy().astype(np.float64) for g in tape.gradient(loss, model.trainable_variables)])
    return out


def clip(parts, c, per_layer):
    if per_layer:
        cv = c / np.sqrt(len(parts))
        return [p * min(1.0, cv / max(np.linalg.norm(p), 1e-300)) for p in parts], [np.linalg.norm(p) / cv for p in parts]
    nrm = np.sqrt(sum(float((p**2).sum()) for p in parts))
    return [p * min(1.0, c / max(nrm, 1e-300)) for p in parts], [nrm / c]


def user_release(grads, groups, c, den, per_layer=False):
    """Σ_u clip(mean of u's example gradients, C) / den, and the largest norm/C."""
    tot = [np.zeros_like(g) for g in grads[0]]
    ratios = []
    for sel in groups:
        mean = [np.mean([grads[i][v] for i in sel], axis=0) for v in range(len(tot))]
        clipped, r = clip(mean, c, per_layer)
        ratios += r
        tot = [t + p for t, p in zip(tot, clipped)]
    return [t / den for t in tot], max(ratios)


def build(model_fn, ledger=None, lr=1.0, **kw):
    tf.keras.utils.set_random_seed(0)
    m = model_fn()
    dp = make_private(m, tf.keras.optimizers.SGD(lr), ledger=user_ledger() if ledger is None else ledger, **kw)
    dp.compile(loss=SCE)
    return m, dp


def weights(m):
    return [v.numpy().astype(np.float64).copy() for v in m.trainable_variables]


# -- ULS: the release against brute force -----------------------------------------------------


@pytest.mark.parametrize("kind,clipping,micro", [
    ("dense", "flat", None), ("dense", "per_layer", None), ("dense", "flat", 3), ("conv", "flat", None),
    ("conv", "per_layer", 4),
])
def test_uls_release_equals_brute_force(kind, clipping, micro):
    model_fn, shape = MODELS[kind]
    x, y, ids = population(shape)
    counts = np.unique(ids, return_counts=True)[1]
    assert counts.max() >= 5 and counts.min() == 1
    C = 0.3
    m, dp = build(model_fn, noise_multiplier=0.0, max_grad_norm=C, clipping=clipping, privacy_unit="user", user_ids=ids,
                  examples_per_user=int(counts.max()), sampling_probability=1.0, max_physical_batch_size=micro)
    assert dp.population_size == 7 and dp.expected_batch_size == 7.0
    w0 = weights(m)
    grads = example_grads(m, x, y)
    src = dp.batches(x, y, steps=1, seed=5)
    begin, sizes = dp._dp_begin, []
    object.__setattr__(dp, "_dp_begin", lambda data: (lambda b: (sizes.extend(b.sizes), b)[1])(begin(data)))
    dp.fit(src, epochs=1, verbose=0)
    # every user sampled, all its examples, user-major
    assert sorted(src.last_users.tolist()) == list(range(7)) and sorted(src.last_indices.tolist()) == list(range(len(y)))
    assert sum(sizes) == len(y) and max(sizes) == (micro or len(y))
    groups = [np.flatnonzero(ids == u) for u in np.unique(ids)]
    ref, ratio = user_release(grads, groups, C, 7.0, per_layer=clipping == "per_layer")
    assert ratio > 1.5  # clipping is active
    for a, b, r in zip(w0, weights(m), ref):
        np.testing.assert_allclose(a - b, r, rtol=2e-4, atol=1e-6)
    # not the example-level release: per-example clipping over the same examples differs
    ex, _ = user_release(grads, [[i] for i in range(len(y))], C, 7.0, per_layer=clipping == "per_layer")
    assert max(np.abs(e - r).max() for e, r in zip(ex, ref)) > 1e-3


def test_uls_takes_at_most_k_examples_of_each_user():
    x, y, ids = population((5,), n=40, users=6, seed=1)
    counts = np.unique(ids, return_counts=True)[1]
    k, C = 2, 0.25
    assert counts.max() > k
    m, dp = build(dense_model, noise_multiplier=0.0, max_grad_norm=C, privacy_unit="user", user_ids=ids,
                  examples_per_user=k, sampling_probability=1.0, max_physical_batch_size=3)
    w0, grads = weights(m), example_grads(m, x, y)
    src = dp.batches(x, y, steps=1, seed=9)
    dp.fit(src, epochs=1, verbose=0)
    uid = dp.user_index.ids  # user u's id (users numbered by their first example)
    got = np.split(src.last_indices, np.cumsum(src.last_counts)[:-1])
    assert [len(g) for g in got] == [min(k, int(counts[u])) for u in src.last_users]
    for u, sel in zip(src.last_users, got):
        assert len(set(sel.tolist())) == len(sel) and np.all(ids[sel] == uid[u])
    assert np.array_equal(src.last_slots, np.repeat(np.arange(len(got)), src.last_counts))
    ref, _ = user_release(grads, got, C, 6.0)
    for a, b, r in zip(w0, weights(m), ref):
        np.testing.assert_allclose(a - b, r, rtol=2e-4, atol=1e-6)
    # a seeded choice is reproducible; an unseeded one draws from the OS
    again = dp.batches(x, y, steps=1, seed=9)
    again.draw()
    assert np.array_equal(again.last_indices, src.last_indices)


def test_uls_ledger_unit_bounds_and_epsilon():
    x, y, ids = population((5,), n=60, users=20, seed=2)
    q, z, k = 0.25, 1.2, 3
    led = user_ledger()
    m, dp = build(dense_model, ledger=led, lr=0.1, noise_multiplier=z, max_grad_norm=1.0, privacy_unit="user",
                  user_ids=ids, examples_per_user=k, sampling_probability=q)
    assert dp.privacy_unit == "user" and dp.examples_per_user == k and dp.user_index.num_users == 20
    dp.fit(dp.batches(x, y), epochs=2, verbose=0)
    steps = 2 * round(1 / q)
    assert led.privacy_unit == "user" and led.num_releases == steps == dp.releases
    samples = entries(led)
    assert len(samples) == steps
    for s in samples:
        assert (s["population_size"], s["sampling_probability"], s["policy"]) == (20, q, "poisson")
        assert s["examples_per_user"] == k and "max_examples_per_user" not in s
    eps = dp.get_epsilon(DELTA)
    # users are the records: the example-level analysis over the user population
    assert eps == pytest.approx(dpcore.accounting.epsilon(q, z, steps, DELTA), rel=1e-9)
    from dpcore.plan import make_plan

    plan = make_plan(sampling_probability=q, noise_multiplier=z, steps=steps, population_size=20, privacy_unit="user",
                     examples_per_user=k)
    assert eps == pytest.approx(plan.epsilon(DELTA), rel=1e-9)
    # the report states the unit
    assert "user" in led.report(DELTA).to_markdown()


def test_uls_empty_sample_releases_noise():
    x, y, ids = population((5,), n=20, users=10, seed=3)
    from dpcore._seeds import derive_seed

    q = 0.02
    seed = next(s for s in range(2000) if len(dpcore.poisson_sample(10, q, seed=derive_seed(s, 0))) == 0)
    led = user_ledger()
    m, dp = build(dense_model, ledger=led, noise_multiplier=2.0, max_grad_norm=0.5, privacy_unit="user", user_ids=ids,
                  examples_per_user=2, sampling_probability=q, seed=1)
    w0 = weights(m)
    src = dp.batches(x, y, steps=1, seed=seed)
    dp.fit(src, epochs=1, verbose=0)
    assert len(src.last_indices) == 0 and led.num_releases == 1
    assert all(np.abs(a - b).max() > 0.1 for a, b in zip(w0, weights(m)))  # pure noise / (q·U)


# -- ELS ------------------------------------------------------------------------------------------


def test_els_bound_keeps_at_most_K_per_user_and_trains_on_them_only():
    x, y, ids = population((5,), n=40, users=6, seed=4)
    counts = dict(zip(*np.unique(ids, return_counts=True)))
    K, C = 3, 0.3
    led = user_ledger()
    m, dp = build(dense_model, ledger=led, noise_multiplier=0.0, max_grad_norm=C, privacy_unit="user", user_ids=ids,
                  max_examples_per_user=K, sampling_probability=1.0, seed=7)
    kept = dp.kept_examples
    assert dp.max_examples_per_user == K and dp.examples_per_user is None
    kept_ids, kept_counts = np.unique(ids[kept], return_counts=True)
    assert all(c == min(K, counts[u]) for u, c in zip(kept_ids, kept_counts)) and set(kept_ids) == set(counts)
    assert len(kept) == dp.population_size == sum(min(K, c) for c in counts.values()) < len(y)
    w0, grads = weights(m), example_grads(m, x, y)
    src = dp.batches(x, y, steps=1)
    assert isinstance(src, PoissonBatches) and src.population_size == len(kept)
    dp.fit(src, epochs=1, verbose=0)
    # q = 1: every kept example, clipped one by one, over q·n_kept
    ref, ratio = user_release(grads, [[i] for i in kept], C, float(len(kept)))
    assert ratio > 1.5
    for a, b, r in zip(w0, weights(m), ref):
        np.testing.assert_allclose(a - b, r, rtol=2e-4, atol=1e-6)
    (s,) = entries(led)
    assert s["max_examples_per_user"] == K and s["population_size"] == len(kept) and "examples_per_user" not in s
    # a DPModel that continues the ledger reuses the bound (not a fresh draw: a user would give
    # other examples); other ids or another K are refused before anything is recorded
    _, dp2 = build(dense_model, ledger=led, noise_multiplier=0.0, max_grad_norm=C, privacy_unit="user", user_ids=ids,
                   max_examples_per_user=K, sampling_probability=1.0)
    assert np.array_equal(dp2.kept_examples, kept)
    other = ids.copy()
    other[0] = ids.max() + 10  # one example moved to a new user
    for kw in (dict(user_ids=other, max_examples_per_user=K), dict(user_ids=ids, max_examples_per_user=K + 1),
               dict(user_ids=ids, examples_per_user=K)):
        with pytest.raises(ValueError, match="resumed user-level run"):
            build(dense_model, ledger=led, noise_multiplier=0.0, max_grad_norm=C, privacy_unit="user",
                  sampling_probability=1.0, **kw)
    assert led.num_releases == 1


def test_els_epsilon_is_the_plans_and_above_example_level():
    x, y, ids = population((5,), n=48, users=8, seed=5)
    q, z, K = 0.2, 1.5, 4
    led = user_ledger()
    _, dp = build(dense_model, ledger=led, lr=0.1, noise_multiplier=z, max_grad_norm=1.0, privacy_unit="user",
                  user_ids=ids, max_examples_per_user=K, sampling_probability=q)
    dp.fit(dp.batches(x, y), epochs=1, verbose=0)
    steps = round(1 / q)
    from dpcore.plan import make_plan

    plan = make_plan(sampling_probability=q, noise_multiplier=z, steps=steps, population_size=dp.population_size,
                     privacy_unit="user", max_examples_per_user=K)
    eps = dp.get_epsilon(DELTA)
    assert eps == pytest.approx(plan.epsilon(DELTA), rel=1e-6)
    assert eps > dpcore.accounting.epsilon(q, z, steps, DELTA)  # a user is up to K examples


def test_make_private_with_epsilon_user_level():
    from dpcore.plan import calibrate_noise, make_plan, steps_for_epochs

    x, y, ids = population((5,), n=48, users=12, seed=6)
    q, epochs = 0.25, 2
    tf.keras.utils.set_random_seed(0)
    dp = make_private_with_epsilon(dense_model(), tf.keras.optimizers.SGD(0.1), target_epsilon=3.0, target_delta=DELTA,
                                   epochs=epochs, max_grad_norm=1.0, sampling_probability=q, privacy_unit="user",
                                   user_ids=ids, examples_per_user=2, ledger=user_ledger())
    steps = steps_for_epochs("poisson", epochs, q)
    # ULS is the example-level calibration with users as records
    assert dp.noise_multiplier == pytest.approx(
        calibrate_noise(3.0, DELTA, sampler="poisson", sampling_probability=q, steps=steps), rel=1e-12)
    dp.compile(loss=SCE)
    dp.fit(dp.batches(x, y), epochs=epochs, verbose=0)
    assert dp.releases == steps and dp.get_epsilon(DELTA) <= 3.0
    # ELS: the plan's mixture-of-Gaussians calibration, more noise than one example needs
    tf.keras.utils.set_random_seed(0)
    els = make_private_with_epsilon(dense_model(), tf.keras.optimizers.SGD(0.1), target_epsilon=3.0, target_delta=DELTA,
                                    epochs=epochs, max_grad_norm=1.0, sampling_probability=q, privacy_unit="user",
                                    user_ids=ids, max_examples_per_user=3, ledger=user_ledger())
    plan = make_plan(sampling_probability=q, target_epsilon=3.0, target_delta=DELTA, epochs=epochs,
                     population_size=els.population_size, privacy_unit="user", max_examples_per_user=3)
    assert els.noise_multiplier == pytest.approx(plan.noise_multiplier, rel=1e-12)
    assert els.noise_multiplier > dp.noise_multiplier


# -- bad input: a clear error, nothing recorded ---------------------------------------------------


def _ids(n=26):
    return population((5,), n=n)[2]


BAD = [
    (dict(privacy_unit="person"), ValueError, "privacy_unit"),
    (dict(privacy_unit="user", examples_per_user=2), TypeError, "user_ids"),
    (dict(privacy_unit="user", user_ids=_ids(), examples_per_user=0), ValueError, "examples_per_user"),
    (dict(privacy_unit="user", user_ids=_ids(), examples_per_user=-1), ValueError, "examples_per_user"),
    (dict(privacy_unit="user", user_ids=_ids(), examples_per_user=1.5), TypeError, "examples_per_user"),
    (dict(privacy_unit="user", user_ids=_ids(), examples_per_user=True), TypeError, "examples_per_user"),
    (dict(privacy_unit="user", user_ids=_ids(), max_examples_per_user=0), ValueError, "max_examples_per_user"),
    (dict(privacy_unit="user", user_ids=_ids(), examples_per_user=2, max_examples_per_user=2), ValueError, "exactly one"),
    (dict(privacy_unit="user", user_ids=_ids()), ValueError, "exactly one"),
    (dict(user_ids=_ids()), ValueError, "privacy_unit='user'"),
    (dict(examples_per_user=2), ValueError, "privacy_unit='user'"),
    (dict(max_examples_per_user=2), ValueError, "privacy_unit='user'"),
    (dict(privacy_unit="user", user_ids=np.where(np.arange(26) == 4, np.nan, 1.0), examples_per_user=2), ValueError, "finite"),
    (dict(privacy_unit="user", user_ids=[1, 2, None, 3], examples_per_user=2), ValueError, "missing"),
    (dict(privacy_unit="user", user_ids=np.ones((13, 2), int), examples_per_user=2), ValueError, "one-dimensional"),
    (dict(privacy_unit="user", user_ids=[True, False], examples_per_user=2), TypeError, "bool"),
    (dict(privacy_unit="user", user_ids="abc", examples_per_user=2), TypeError, "string"),
    (dict(privacy_unit="user", user_ids=[], examples_per_user=2), ValueError, "empty"),
    (dict(privacy_unit="user", user_ids=_ids(), examples_per_user=2, sampler="balls_in_bins"), ValueError, "sampler"),
    (dict(privacy_unit="user", user_ids=_ids(), examples_per_user=2, noise_mechanism="blt", epochs=1, batch_size=4),
     ValueError, "noise_mechanism"),
]


@pytest.mark.parametrize("kw,exc,match", BAD)
def test_bad_arguments_raise_before_anything_is_recorded(kw, exc, match):
    led = user_ledger("user" if kw.get("privacy_unit") == "user" else "example")
    with open(led.path, "rb") as f:
        before = f.read()
    with pytest.raises(exc, match=match):
        make_private(dense_model(), tf.keras.optimizers.SGD(0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                     sampling_probability=0.5, ledger=led, **kw)
    with open(led.path, "rb") as f:
        assert f.read() == before
    assert not os.path.exists(led.path + ".users.npz")


def test_bad_data_and_ledgers_raise_before_anything_is_recorded():
    x, y, ids = population((5,))
    common = dict(noise_multiplier=1.0, max_grad_norm=1.0, sampling_probability=0.5)
    # a ledger of another unit, either way round
    with pytest.raises(ValueError, match="unit 'user'"):
        make_private(dense_model(), tf.keras.optimizers.SGD(0.1), ledger=user_ledger("example"), privacy_unit="user",
                     user_ids=ids, examples_per_user=2, **common)
    with pytest.raises(ValueError, match="mixing units"):
        make_private(dense_model(), tf.keras.optimizers.SGD(0.1), ledger=user_ledger("user"), population_size=26,
                     **common)
    led = user_ledger()
    m, dp = build(dense_model, ledger=led, privacy_unit="user", user_ids=ids, examples_per_user=2, **common)
    els_led = user_ledger()
    _, els = build(dense_model, ledger=els_led, privacy_unit="user", user_ids=ids, max_examples_per_user=2, **common)
    # ids not aligned with the data
    for model in (dp, els):
        with pytest.raises(ValueError, match="one id per example"):
            model.batches(x[:-1], y[:-1])
    with pytest.raises(ValueError, match="one id per example"):
        UserPoissonBatches(x, y, user_ids=ids[:-1], examples_per_user=2, sampling_probability=0.5)
    # batches that are not the model's: example-level batches, other users, another k, another q
    with pytest.raises(TypeError, match="UserPoissonBatches"):
        dp.fit(PoissonBatches(x, y, sampling_probability=0.5), verbose=0)
    with pytest.raises(TypeError, match="kept examples"):
        els.fit(PoissonBatches(x, y, sampling_probability=0.5), verbose=0)  # every example: the bound not applied
    with pytest.raises(TypeError, match="kept examples"):
        els.fit(PoissonBatches(x[els.kept_examples], y[els.kept_examples], sampling_probability=0.5), verbose=0)
    other = ids.copy()
    other[0] = ids.max() + 10  # one example moved to a new user
    with pytest.raises(ValueError, match="user_ids are not"):
        dp.fit(UserPoissonBatches(x, y, user_ids=other, examples_per_user=2, sampling_probability=0.5), verbose=0)
    with pytest.raises(ValueError, match="examples_per_user=2"):
        dp.fit(UserPoissonBatches(x, y, user_ids=ids, examples_per_user=3, sampling_probability=0.5), verbose=0)
    with pytest.raises(ValueError, match="sample users at q"):
        dp.fit(UserPoissonBatches(x, y, user_ids=ids, examples_per_user=2, sampling_probability=0.25), verbose=0)
    with pytest.raises(TypeError, match="UserPoissonBatches"):
        dp.fit(x, y, verbose=0)
    # an example-level model refuses user batches
    _, ex = build(dense_model, ledger=user_ledger("example"), population_size=26, **common)
    with pytest.raises(TypeError, match="privacy_unit='user'"):
        ex.fit(UserPoissonBatches(x, y, user_ids=ids, examples_per_user=2, sampling_probability=0.5), verbose=0)
    with pytest.raises(TypeError, match="drawn by"):
        UserPoissonBatches(x, y, user_ids=ids, examples_per_user=2, sampling_probability=0.5)[0]
    assert led.num_releases == els_led.num_releases == ex.ledger.num_releases == 0
    assert all(not entries(lg) for lg in (led, els_led, ex.ledger))
    # a resume with other ids is refused once the ledger holds samples (ULS)
    dp.fit(dp.batches(x, y, steps=1), verbose=0)
    assert led.num_releases == 1
    with pytest.raises(ValueError, match="resumed user-level run"):
        build(dense_model, ledger=led, privacy_unit="user", user_ids=other, examples_per_user=2, **common)
    _, again = build(dense_model, ledger=led, privacy_unit="user", user_ids=list(ids), examples_per_user=2, **common)
    again.fit(again.batches(x, y, steps=1), verbose=0)  # the same ids (another container) continue it
    assert led.num_releases == 2


# -- the grey-box harness with users as the neighbouring unit -------------------------------------

U_AUDIT, Q_AUDIT = 8, 0.5


def audit_population(last):
    """(x, y, ids) of 8 users, the `last` ("largest_user" or "smallest_user") with its records moved
    to the end (users_last): users are numbered by their first example, so removing it leaves
    every other user's number, and so its seeded draws, unchanged."""
    rng = np.random.default_rng(11)
    counts = np.array([3, 1, 4, 2, 5, 2, 3, 6]) if last == "largest_user" else np.array([3, 2, 4, 2, 5, 2, 3, 1])
    ids = np.repeat(np.arange(U_AUDIT), counts)
    rng.shuffle(ids)
    x = rng.normal(size=(len(ids), 8)).astype(np.float32) * 3
    y = rng.integers(0, 3, len(ids)).astype(np.int64)
    return users_last((x, y, ids), 2, last)


def uls_train(clipping="flat", micro=None):
    def train(cols, seed):
        x, y, ids = cols
        tf.keras.utils.set_random_seed(0)  # the same initial weights in every run
        m = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(6, activation="relu"), tf.keras.layers.Dense(3)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dp = make_private(m, tf.keras.optimizers.SGD(0.1), noise_multiplier=1.0, max_grad_norm=1.0, clipping=clipping,
                              privacy_unit="user", user_ids=ids, examples_per_user=3, population_size=U_AUDIT,
                              sampling_probability=Q_AUDIT, ledger=user_ledger(), seed=seed, max_physical_batch_size=micro)
            dp.compile(loss=SCE)
            dp.fit(dp.batches(x, y, steps=3, seed=seed), epochs=1, verbose=0)

    return train


def bad_user(value):
    """A user of three records of `value` features appended (a new largest id)."""

    def make(cols):
        x, y, ids = cols
        extra = np.full((3,) + x.shape[1:], value, x.dtype)
        return (np.concatenate([x, extra]), np.concatenate([y, y[:3]]), np.concatenate([ids, np.full(3, ids.max() + 1)]))

    return Neighbour(f"user of {value}", "add_or_remove", make)


@pytest.mark.parametrize("last,clipping,micro", [("largest_user", "flat", None), ("smallest_user", "flat", None),
                                                 ("largest_user", "per_layer", 4)])
def test_uls_passes_the_greybox_harness_with_users_as_neighbours(last, clipping, micro):
    kinds = [last, bad_user(np.nan), bad_user(1e30), bad_user(0.0)]
    res = neighbour_audit(uls_train(clipping, micro), audit_population(last), kinds, user_column=2,
                          assume_public=("population_size",))
    res.raise_for_findings()
    groups = 1 if clipping == "flat" else 4
    for r in res.runs:
        assert r.releases == 3 * groups and r.ledger_entries == 3 + 3 * groups, r
    assert max(r.max_ratio for r in res.runs) > 0.05  # the neighbour user was sampled and moved the sum


def test_greybox_harness_catches_examples_clipped_one_by_one(monkeypatch):
    # A planted bug: the ULS step clips each example instead of each user's mean, so a user of
    # up to k examples moves the sum by up to k·C, not C. The harness must say so.
    import dpcore.keras._model as keras_mod

    class PerExample:
        def __init__(self, slots, counts):
            pass

        def add(self, start, grads, dtypes):
            return [np.asarray(g) for g in grads]

    monkeypatch.setattr(keras_mod, "user_means", PerExample)
    res = neighbour_audit(uls_train(), audit_population("largest_user"), ["largest_user"], user_column=2,
                          assume_public=("population_size",))
    assert {f.kind for f in res.findings} == {"sensitivity exceeded"}, res.table()
