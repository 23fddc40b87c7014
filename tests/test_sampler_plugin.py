"""A sampler is one class and one registration (issue 37): a sampler defined here, in the test,
and registered with dpcore.sampling.register_sampler trains through torch's make_private and the
numpy aggregator, is recorded in the ledger under its own name, read back from the file, stated
in the report with its guarantee, calibrated by the plan, and accounted by its own event, with no
other file touched.

The sampler is Poisson sampling under another name with its own draw (a step is the core's
Poisson sample at q, keyed from its own path), so the independent check is exact: its ε must be
Poisson's ε to the last digit, step for step, and a sampler whose event the ledger ignored (or
read as another policy's) would not match both that and its own recorded name."""

from __future__ import annotations

import numpy as np
import pytest

import dpcore
from dpcore.events import GaussianEvent, PoissonSampledEvent, SelfComposedEvent, SumQueryEvent
from dpcore.ledger import PrivacyLedger
from dpcore.sampling import Sampler, register_sampler, registered_samplers, sampler_class

DELTA = 1e-5
N, BS = 40, 8
NAME = "test_bernoulli"


class BernoulliSampler(Sampler):
    """Each record joins each step with probability q, drawn by the test."""

    name = NAME
    guarantee = "Poisson amplification at rate q (a sampler defined by a test)"

    def __init__(self, population_size, sampling_probability, *, seed=None, ledger=None):
        self._q = float(sampling_probability)
        self._setup(int(population_size), max(1, round(1.0 / self._q)), seed, ledger)

    def _indices(self, t):
        seed = None if self._seed is None else (self._seed * 1_000_003 + t) % (1 << 63)
        return dpcore.poisson_sample(self._n, self._q, seed=seed)

    @classmethod
    def _planned_event(cls, z, steps, q, n, neighboring, steps_per_epoch, **options):
        return SelfComposedEvent(PoissonSampledEvent(q, GaussianEvent(z)), steps)

    @classmethod
    def step_event(cls, sample, z, neighboring, gaussian, acc):
        return acc.PoissonSampledEvent(sample.sampling_probability, gaussian(z))


@pytest.fixture
def registered():
    from dpcore.sampling import _base

    assert NAME not in registered_samplers()
    register_sampler(BernoulliSampler)
    try:
        yield BernoulliSampler
    finally:
        del _base._REGISTRY[NAME]  # other tests see the built-in registry only


def as_poisson(led, path):
    """The same samples and releases recorded under the built-in ``poisson`` policy: the ε the
    ledger states for them is the oracle of the test sampler's (its event is Poisson's)."""
    from dpcore.events import ComposedQueryEvent

    ref = PrivacyLedger(str(path))
    for s in led.samples:
        ref.record_sample(s.population_size, s.sampling_probability, "poisson", seeded=s.seeded)
        ref.record_release(ComposedQueryEvent(s.queries) if len(s.queries) > 1 else s.queries[0])
    return ref


def poisson_eps(z, steps, q=BS / N):
    from dpcore.accounting.samplers import sampler_epsilon

    return sampler_epsilon("poisson", z, steps, DELTA, sampling_probability=q)


def test_registration_rules(registered):
    assert sampler_class(NAME) is BernoulliSampler and NAME in registered_samplers(selectable=True)
    with pytest.raises(ValueError, match="already registered"):
        register_sampler(type("Other", (BernoulliSampler,), {"name": NAME}))
    with pytest.raises(ValueError, match="class attribute name"):
        register_sampler(type("Nameless", (BernoulliSampler,), {}))
    with pytest.raises(ValueError, match="must implement _indices"):
        register_sampler(type("Drawless", (Sampler,), {"name": "drawless"}))
    # the planned event and the one formula of the plan come from the class
    from dpcore.plan import make_plan, steps_for_epochs

    assert steps_for_epochs(NAME, 3, BS / N) == 15
    plan = make_plan(sampler=NAME, sampling_probability=BS / N, epochs=3, noise_multiplier=1.1)
    assert plan.steps == 15 and plan.epsilon(DELTA) == poisson_eps(1.1, 15)


def test_trains_records_and_accounts_through_torch(tmp_path, registered):
    torch = pytest.importorskip("torch")
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from dpcore.torch import make_private, make_private_with_epsilon

    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(N, 7, generator=g), torch.randint(0, 4, (N,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 4))
    path = tmp_path / "l.jsonl"
    model, opt, loader = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(ds, batch_size=BS), noise_multiplier=1.0,
        max_grad_norm=1.0, ledger=str(path), sampler=NAME, seed=5,
    )
    assert isinstance(loader.sampler, BernoulliSampler) and len(loader) == 5
    steps = 0
    for _ in range(2):
        for x, y in loader:
            opt.zero_grad()
            if len(x):
                nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            steps += 1
    samples = opt.ledger.samples
    assert steps == 10 and [s.policy for s in samples] == [NAME] * 10
    assert all(s.sampling_probability == BS / N and s.seeded for s in samples)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the seeded-sample warning
        eps = opt.get_epsilon(DELTA)
        assert eps == as_poisson(opt.ledger, tmp_path / "ref.jsonl").get_epsilon(DELTA)
        assert eps == pytest.approx(poisson_eps(1.0, 10), rel=1e-9)
        # from the file, by a fresh reader: the policy is known by its registered name
        led = PrivacyLedger.load(str(path))
        assert led.get_epsilon(DELTA) == eps and led.neighboring == "add_or_remove"
        report = led.report(DELTA)
    assert NAME in str(report)

    # the plan calibrates it like every other sampler: the smallest z meeting the target
    torch.manual_seed(0)
    m2 = nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 4))
    _, opt2, loader2 = make_private_with_epsilon(
        m2, torch.optim.SGD(m2.parameters(), lr=0.1), DataLoader(ds, batch_size=BS), target_epsilon=3.0,
        target_delta=DELTA, epochs=4, max_grad_norm=1.0, ledger=str(tmp_path / "m.jsonl"), sampler=NAME,
    )
    z = opt2.noise_multiplier
    assert poisson_eps(z, 20) <= 3.0 < poisson_eps(z * (1 - 1e-3), 20)


def test_draws_records_and_accounts_through_the_aggregator(tmp_path, registered):
    from dpcore import PrivateAggregator
    from dpcore.queries import GaussianSumQuery

    led = PrivacyLedger(str(tmp_path / "a.jsonl"))
    sampler = BernoulliSampler(N, BS / N, seed=11, ledger=led)
    agg = PrivateAggregator(GaussianSumQuery(1.0, 1.3), led, N, sampler=sampler)
    x = np.random.default_rng(0).normal(size=(N, 3))
    for t in range(6):
        idx = agg.sample()
        expect = BernoulliSampler(N, BS / N, seed=11)._indices(t)
        np.testing.assert_array_equal(idx, expect)  # the sampler's own draw, step t
        agg.aggregate(x[idx])
    assert [s.policy for s in led.samples] == [NAME] * 6
    assert all(s.queries == (SumQueryEvent(1.0, 1.3),) for s in led.samples)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eps = as_poisson(led, tmp_path / "ref.jsonl").get_epsilon(DELTA)
        assert led.get_epsilon(DELTA) == eps == pytest.approx(poisson_eps(1.3, 6), rel=1e-9)
        assert PrivacyLedger.load(str(tmp_path / "a.jsonl")).get_epsilon(DELTA) == eps


def test_an_unregistered_policy_is_still_refused(tmp_path):
    led = PrivacyLedger(str(tmp_path / "u.jsonl"))
    with pytest.raises(ValueError, match="policy must be one of"):
        led.record_sample(N, 0.2, NAME)


KERAS_CASE = r'''
import sys, warnings
sys.path.insert(0, sys.argv[1])
import numpy as np
import keras
from test_sampler_plugin import NAME, BernoulliSampler, as_poisson
from dpcore.ledger import PrivacyLedger
from dpcore.sampling import register_sampler
import dpcore.tensorflow as dtf

register_sampler(BernoulliSampler)
rng = np.random.default_rng(0)
x, y = rng.normal(size=(40, 5)).astype("float32"), rng.integers(0, 3, size=40)
m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
dp = dtf.make_private(m, keras.optimizers.SGD(0.1), noise_multiplier=1.0, max_grad_norm=1.0, population_size=40,
                      expected_batch_size=8, sampler=NAME, ledger=PrivacyLedger(sys.argv[2]))
dp.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
batches = dp.batches(x, y)
assert isinstance(batches.sampler, BernoulliSampler) and len(batches) == 5
dp.fit(batches, epochs=2, verbose=0)
led = dp.ledger
assert [s.policy for s in led.samples] == [NAME] * 10, [s.policy for s in led.samples]
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    eps = led.get_epsilon(1e-5)
    assert eps == as_poisson(led, sys.argv[3]).get_epsilon(1e-5)
print("ok", eps)
'''


def test_trains_records_and_accounts_through_keras(tmp_path):
    # TensorFlow and the CUDA build of torch abort when loaded into one process: a fresh one
    pytest.importorskip("tensorflow")
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", KERAS_CASE, os.path.dirname(__file__), str(tmp_path / "k.jsonl"), str(tmp_path / "r.jsonl")],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-3000:]
