"""The plan (issue 37): one formula turns epochs into steps and one path calibrates the noise, so
`dpcore calibrate --epochs` and every `target_epsilon=` (torch, Keras, the HF trainer) give the
same σ for the same run, at several q including 0.003 (where ceil(E/q) and E·round(1/q) differ:
334 against 333 steps an epoch)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from dpcore import accounting
from dpcore.plan import Plan, calibrate_noise, make_plan, steps_for_epochs
from dpcore.sampling import sampler_class

EPS, DELTA, EPOCHS, N = 2.0, 1e-5, 3, 1000


def test_steps_for_epochs_per_sampler():
    # q = 0.003: round(1/q) = 333 Poisson steps an epoch, ⌈1/q⌉ = 334 shuffled batches (the last
    # short), ⌊1/q⌋ = 333 fixed batches (the rest dropped)
    assert steps_for_epochs("poisson", 3, 0.003) == 999
    assert steps_for_epochs("truncated_poisson", 3, 0.003) == 999
    assert steps_for_epochs("shuffle", 3, 0.003) == 1002
    assert steps_for_epochs("sequential", 2, 0.003) == 668
    assert steps_for_epochs("cyclic", 2, 0.003) == 666
    assert steps_for_epochs("shuffle", 2, 0.003, steps_per_epoch=10) == 20  # a loader's own len
    # fractions of an epoch round up to a whole step
    assert steps_for_epochs("poisson", 0.5, 0.003) == 167 and steps_for_epochs("poisson", 1.001, 0.5) == 3
    # allocation: b batches an epoch; random allocation in whole rounds of t = k/q steps (k passes each)
    assert steps_for_epochs("balls_in_bins", 3, 0.2) == 15
    assert steps_for_epochs("random_allocation", 3, 0.2, num_selected=2) == 2 * 10
    assert steps_for_epochs("random_allocation", 4, 0.2, num_selected=2) == 2 * 10
    with pytest.raises(ValueError, match="whole number"):
        steps_for_epochs("balls_in_bins", 1, 0.3)
    for bad in (0, -1, math.inf, math.nan):
        with pytest.raises(ValueError, match="epochs"):
            steps_for_epochs("poisson", bad, 0.1)
    with pytest.raises(ValueError, match="sampler must be one of"):
        steps_for_epochs("bogus", 1, 0.1)


def test_make_plan_resolves_once():
    p = make_plan(sampling_probability=0.003, epochs=EPOCHS, target_epsilon=EPS, target_delta=DELTA)
    assert isinstance(p, Plan) and p.steps == 999 and p.neighboring == "add_or_remove" and p.accountant == "pld"
    assert p.noise_multiplier == accounting.calibrate_noise_multiplier(EPS, DELTA, 0.003, 999, accountant="pld")
    assert p.epsilon() <= EPS
    with pytest.raises(AttributeError):
        p.steps = 3  # frozen
    s = make_plan(sampler="shuffle", sampling_probability=0.01, epochs=EPOCHS, noise_multiplier=1.0)
    assert s.neighboring == "zero_out" and s.steps == 300
    # zero-out, no amplification: one Gaussian of z per epoch
    assert s.epsilon(DELTA) == accounting.epsilon(1.0, 1.0, EPOCHS, DELTA, accountant="pld")
    with pytest.raises(ValueError, match="replace-one"):
        make_plan(sampling_probability=0.01, steps=10, noise_multiplier=1.0, neighboring="replace_one")
    with pytest.raises(ValueError, match="no certified PLD"):
        make_plan(sampler="balls_in_bins", sampling_probability=0.1, steps=10, noise_multiplier=1.0, accountant="pld")
    with pytest.raises(TypeError, match="steps or epochs"):
        make_plan(sampling_probability=0.01, noise_multiplier=1.0)
    with pytest.raises(TypeError, match="noise_multiplier, or target_epsilon"):
        make_plan(sampling_probability=0.01, steps=10)
    with pytest.raises(ValueError, match="clipping"):
        make_plan(sampling_probability=0.01, steps=10, noise_multiplier=1.0, clipping="bogus")
    with pytest.raises(ValueError, match="max_batch_size is the cap"):
        make_plan(sampling_probability=0.01, steps=10, noise_multiplier=1.0, max_batch_size=4)


def test_calibrate_noise_meets_the_target_per_sampler():
    for sampler, kw in (("poisson", {}), ("truncated_poisson", dict(population_size=N, max_batch_size=40)),
                        ("balls_in_bins", {}), ("shuffle", {}), ("cyclic", {})):
        q = 0.02
        steps = steps_for_epochs(sampler, EPOCHS, q)
        z = calibrate_noise(EPS, DELTA, sampler=sampler, sampling_probability=q, steps=steps, **kw)
        cls = sampler_class(sampler)
        acct = accounting.make_accountant(cls.default_accountant, "add_or_remove")
        ev = cls.event(z, steps, sampling_probability=q, **kw)
        assert acct.compose(ev).get_epsilon(DELTA) <= EPS, sampler
        lower = accounting.make_accountant(cls.default_accountant, "add_or_remove").compose(
            cls.event(z * (1 - 1e-3), steps, sampling_probability=q, **kw)).get_epsilon(DELTA)
        assert lower > EPS, sampler  # the smallest such z, to 1e-3


def cli_sigma(q, *extra):
    out = subprocess.run(
        [sys.executable, "-m", "dpcore", "calibrate", "--epsilon", str(EPS), "--delta", str(DELTA), "-q", repr(q),
         "--epochs", str(EPOCHS), *extra, "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def torch_sigma(batch_size, **kw):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    from dpcore.torch import make_private_with_epsilon

    ds = TensorDataset(torch.randn(N, 3), torch.randint(0, 2, (N,)))
    model = torch.nn.Linear(3, 2)
    _, opt, _ = make_private_with_epsilon(
        model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(ds, batch_size=batch_size),
        target_epsilon=EPS, target_delta=DELTA, epochs=EPOCHS, max_grad_norm=1.0, **kw,
    )
    return opt.noise_multiplier


def keras_sigma(q):
    # TensorFlow and the CUDA build of torch abort when loaded into one process: a fresh one
    code = (
        "import keras, dpcore.tensorflow as t\n"
        "m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])\n"
        f"dp = t.make_private_with_epsilon(m, keras.optimizers.SGD(0.1), target_epsilon={EPS}, target_delta={DELTA},"
        f" epochs={EPOCHS}, max_grad_norm=1.0, population_size={N}, sampling_probability={q!r})\n"
        "print(repr(dp.noise_multiplier))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.strip().splitlines()[-1])


def hf_sigma(batch_size, tmp_path, **kw):
    transformers = pytest.importorskip("transformers")
    import torch

    from dpcore.transformers import DPTrainer

    cfg = transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1)
    model = transformers.GPT2LMHeadModel(cfg)
    data = [{"input_ids": torch.ones(4, dtype=torch.long), "labels": torch.ones(4, dtype=torch.long)}] * N
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=1, num_train_epochs=EPOCHS, save_strategy="no",
    )
    tr = DPTrainer(model=model, args=args, train_dataset=data, target_epsilon=EPS, target_delta=DELTA,
                   max_grad_norm=1.0, **kw)
    return tr.noise_multiplier


@pytest.mark.parametrize("batch_size", [3, 10, 250])  # q = 0.003, 0.01, 0.25
def test_the_same_sigma_for_the_same_run_everywhere(batch_size, tmp_path):
    q = batch_size / N
    cli = cli_sigma(q)
    plan = make_plan(sampling_probability=q, epochs=EPOCHS, target_epsilon=EPS, target_delta=DELTA)
    assert cli["steps"] == plan.steps == EPOCHS * round(N / batch_size)
    assert cli["noise_multiplier"] == plan.noise_multiplier
    assert torch_sigma(batch_size) == plan.noise_multiplier
    assert hf_sigma(batch_size, tmp_path) == plan.noise_multiplier
    assert keras_sigma(q) == plan.noise_multiplier


@pytest.mark.parametrize("batch_size", [3, 250])
def test_the_same_sigma_for_shuffled_batches_everywhere(batch_size, tmp_path):
    q = batch_size / N
    cli = cli_sigma(q, "--sampler", "shuffle")
    plan = make_plan(sampler="shuffle", sampling_probability=q, epochs=EPOCHS, target_epsilon=EPS, target_delta=DELTA)
    assert cli["steps"] == plan.steps == EPOCHS * -(-N // batch_size)
    assert cli["noise_multiplier"] == plan.noise_multiplier
    assert torch_sigma(batch_size, sampler="shuffle") == plan.noise_multiplier
    assert hf_sigma(batch_size, tmp_path, sampler="shuffle") == plan.noise_multiplier
