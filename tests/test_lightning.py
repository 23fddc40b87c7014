"""dpcore.lightning.DPCallback: a LightningModule trained with DP-SGD by one callback.

At noise 0 one training step's update is the brute-force clipped average (one backward pass per
record); a few epochs log ε through Lightning's loggers with one ledger release per step; a run
resumed from a Lightning checkpoint continues the ledger and ends where the uninterrupted run
ends; unsupported trainer configurations are refused before anything is recorded."""

from __future__ import annotations

import copy
import csv
import math
import os
import warnings

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning.pytorch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from dpcore.ledger import LedgerError, LedgerWarning, PrivacyLedger  # noqa: E402
from dpcore.lightning import DPCallback, check_trainer  # noqa: E402
from dpcore.torch import DPOptimizer  # noqa: E402

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings(
    "ignore::dpcore.ledger.LedgerWarning",  # seeded samples (tests only)
    "ignore::lightning.fabric.utilities.warnings.PossibleUserWarning",
    "ignore:.*does not have many workers.*",
    "ignore:.*training_step. returned .None.*",
    "ignore:.*smaller than the logging interval.*",
    "ignore:.*LitLogger.*",
)

N, BS, DELTA = 32, 8, 1e-5  # q = 0.25: 4 logical batches per epoch


def dataset():
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(N, 5, generator=g), torch.randint(0, 3, (N,), generator=g))


class Tiny(L.LightningModule):
    def __init__(self, lr=0.5, momentum=0.0):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
        self.lr, self.momentum = lr, momentum

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)  # the mean over the batch (loss_reduction="mean")
        self.log("train_loss", loss, batch_size=len(x))
        return loss

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=BS, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def trainer(tmp_path, callbacks, **kw):
    kw.setdefault("max_epochs", 1)
    kw.setdefault("logger", False)
    kw.setdefault("enable_checkpointing", False)
    return L.Trainer(
        accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=str(tmp_path), callbacks=callbacks, **kw,
    )


def params(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("memory,direct", [("default", False), ("lean", False), ("lean", True)])
def test_one_step_at_noise_zero_is_the_brute_force_clipped_average(tmp_path, memory, direct):
    """Both memory modes; ``direct``: training_step calls ``self.net(x)``, not the module itself
    (the lean mode taps the outermost call, whichever module it is)."""
    model = Tiny(lr=1.0)
    if direct:
        model.training_step = lambda batch, *a: nn.functional.cross_entropy(model.net(batch[0]), batch[1])
    x, y = dataset().tensors
    ref = copy.deepcopy(model.net)
    per = []  # each record's gradient, one backward pass per record (brute force)
    for i in range(N):
        ref.zero_grad()
        nn.functional.cross_entropy(ref(x[i : i + 1]), y[i : i + 1]).backward()
        per.append([p.grad.detach().double().clone() for p in ref.parameters()])
    norms = torch.tensor([math.sqrt(sum(float((g**2).sum()) for g in gs)) for gs in per])
    clip = float(norms.median())

    dp = DPCallback(noise_multiplier=0.0, max_grad_norm=clip, delta=DELTA, ledger=str(tmp_path / "l.jsonl"), seed=4,
                    memory=memory)
    before = params(model)
    trainer(tmp_path, [dp], max_steps=1).fit(model)
    idx = [int(i) for i in dp.data_loader.last_indices]
    assert len(idx) >= 2 and (norms[idx] > clip).any() and (norms[idx] < clip).any()  # both cases exercised
    den = dp.data_loader.expected_batch_size
    assert den == N * (BS / N)
    want = [torch.zeros_like(g) for g in per[0]]
    for i in idx:
        c = min(1.0, clip / float(norms[i]))
        for w, g in zip(want, per[i]):
            w += c * g
    for p0, p1, w in zip(before, params(model), want):
        torch.testing.assert_close((p0 - p1).double(), w / den, rtol=1e-4, atol=1e-6)  # SGD lr=1: Δ = -average
    assert dp.ledger.num_releases == 1
    assert dp.optimizer.memory == memory
    assert not hasattr(model.net[0], "__dict__") or "forward" not in model.net[0].__dict__  # instrumentation removed


def test_epochs_log_epsilon_and_release_once_per_step(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    model = Tiny()
    path = tmp_path / "run.jsonl"
    dp = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, delta=DELTA, ledger=str(path), seed=1, log_every_n_steps=2)
    tr = trainer(tmp_path, [dp], max_epochs=3, logger=CSVLogger(str(tmp_path), name="csv"), log_every_n_steps=1)
    tr.fit(model)
    assert tr.global_step == 12 and dp.optimizer._releases == 12
    ledger = PrivacyLedger(str(path))  # the file, read back (the callback closed it at teardown)
    assert ledger.num_releases == 12 and len(ledger.samples) == 12
    assert all(s.released for s in ledger.samples)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LedgerWarning)
        eps = ledger.get_epsilon(DELTA)
    assert dp.get_epsilon() == eps and 0 < eps < math.inf
    with open(os.path.join(tr.logger.log_dir, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("epsilon")]
    logged = [float(r["epsilon"]) for r in rows]
    # every 2 steps and at each epoch's end (steps 4, 8, 12: the same values); Lightning's CSV rows
    # may repeat a step-level value in the next step's row
    distinct = sorted(set(logged))
    assert len(distinct) == 6 and logged == sorted(logged) and distinct[-1] == pytest.approx(eps)
    epoch_rows = [float(r["epsilon"]) for r in rows if not r.get("train_loss")]  # the epoch-end rows
    assert len(epoch_rows) == 3 and epoch_rows[-1] == pytest.approx(eps)
    assert tr.callback_metrics["epsilon"] == pytest.approx(eps)


def test_empty_batches_release_noise_without_a_training_step(tmp_path):
    calls = []

    class Counting(Tiny):
        def training_step(self, batch, batch_idx):
            calls.append(len(batch[0]))
            return super().training_step(batch, batch_idx)

        def train_dataloader(self):  # q = 1/32: most samples are empty
            return DataLoader(dataset(), batch_size=1)

    class Sizes(L.Callback):
        sizes = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.sizes.append(len(batch[0]))

    model, sizes = Counting(), Sizes()
    dp = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, delta=DELTA, ledger=str(tmp_path / "l.jsonl"), seed=0)
    tr = trainer(tmp_path, [dp, sizes], max_steps=20)
    tr.fit(model)
    assert dp.ledger.num_releases == 20 and tr.global_step == 20 and len(sizes.sizes) == 20
    assert 0 in sizes.sizes and calls == [n for n in sizes.sizes if n > 0]  # empty batches: no training_step


def _fit(tmp_path, ledger, *, max_epochs=3, max_steps=-1, ckpt_path=None, checkpoint_every=None, **kw):
    model = Tiny(lr=0.3, momentum=0.9)
    dp = DPCallback(noise_multiplier=0.8, max_grad_norm=1.0, delta=DELTA, ledger=ledger, seed=7, **kw)
    cbs = [dp]
    if checkpoint_every is not None:
        from lightning.pytorch.callbacks import ModelCheckpoint

        cbs.append(ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=checkpoint_every, save_top_k=-1))
    tr = trainer(tmp_path, cbs, max_epochs=max_epochs, max_steps=max_steps, enable_checkpointing=checkpoint_every is not None)
    tr.fit(model, ckpt_path=ckpt_path)
    return model, dp, tr


def test_resume_from_a_lightning_checkpoint_continues_the_ledger(tmp_path):
    want_model, want_dp, _ = _fit(tmp_path / "a", str(tmp_path / "a.jsonl"))
    want_eps, want_params = want_dp.get_epsilon(), params(want_model)
    assert want_dp.ledger.num_releases == 12

    # interrupted after 6 steps (in the middle of the second epoch), checkpointed by ModelCheckpoint
    path = str(tmp_path / "b.jsonl")
    _fit(tmp_path / "b", path, max_steps=6, checkpoint_every=3)
    ckpts = sorted(os.listdir(tmp_path / "b" / "ckpt"))
    assert ckpts == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt"]
    ck = torch.load(tmp_path / "b" / "ckpt" / ckpts[1], weights_only=False)
    assert ck["optimizer_states"][0]["dpcore"]["releases"] == 6
    assert ck["optimizer_states"][0]["dpcore"]["data_loader"]["pass_position"] == 2
    state = next(v for k, v in ck["callbacks"].items() if k.startswith("DPCallback"))
    assert state["num_releases"] == 6 and state["ledger"] == os.path.abspath(path)

    # a new process: ledger=None adopts the checkpoint's ledger
    model, dp, tr = _fit(tmp_path / "b", None, ckpt_path=str(tmp_path / "b" / "ckpt" / ckpts[1]))
    assert dp.ledger.path == os.path.abspath(path)
    assert tr.global_step == 12 and dp.optimizer._releases == 12 and dp.ledger.num_releases == 12
    assert dp.get_epsilon() == want_eps
    for a, b in zip(params(model), want_params):
        assert torch.equal(a, b)


def test_resume_with_the_ledger_ahead_of_the_checkpoint(tmp_path):
    path = str(tmp_path / "l.jsonl")
    _fit(tmp_path, path, max_steps=6, checkpoint_every=3)
    early = str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt")  # the ledger went on to 6 releases after it
    with pytest.raises(LedgerError, match="ledger_ahead"):
        _fit(tmp_path, path, ckpt_path=early)
    assert PrivacyLedger(path).num_releases == 6  # nothing recorded by the refused resume
    _, dp, tr = _fit(tmp_path, path, ckpt_path=early, ledger_ahead="keep")
    assert tr.global_step == 12 and dp.optimizer._releases == 12
    assert dp.ledger.num_releases == 15  # the 3 releases after the checkpoint stay counted


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"accumulate_grad_batches": 2}, "accumulate_grad_batches"),
        ({"gradient_clip_val": 1.0}, "gradient_clip_val"),
        ({"overfit_batches": 2}, "overfit_batches"),
    ],
)
def test_refused_trainer_options_record_nothing(tmp_path, kw, match):
    path = tmp_path / "l.jsonl"
    dp = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, delta=DELTA, ledger=str(path))
    model = Tiny()
    before = params(model)
    with pytest.raises(ValueError, match=match):
        trainer(tmp_path, [dp], **kw).fit(model)
    assert not path.exists() or PrivacyLedger(str(path)).num_releases == 0
    assert all(torch.equal(a, b) for a, b in zip(params(model), before))


def test_refuses_multi_device_strategies_and_other_configurations(tmp_path):
    ddp = L.Trainer(strategy="ddp", devices=2, accelerator="cpu", logger=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match="one process on one device"):
        check_trainer(ddp)
    check_trainer(L.Trainer(accelerator="cpu", devices=1, logger=False, precision="bf16-mixed"))
    with pytest.raises(ValueError, match="precision"):
        check_trainer(_with_scaler())

    class Manual(Tiny):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(ValueError, match="manual optimization"):
        trainer(tmp_path, [DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, delta=DELTA)]).fit(Manual())

    class AlreadyPrivate(Tiny):
        def configure_optimizers(self):
            return DPOptimizer(torch.optim.SGD(self.parameters(), lr=0.1), model=self, noise_multiplier=1.0,
                               max_grad_norm=1.0, expected_batch_size=BS)

    with pytest.raises(ValueError, match="already a DPOptimizer"):
        trainer(tmp_path, [DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, delta=DELTA)]).fit(AlreadyPrivate())
    with pytest.raises(ValueError, match="max_physical_batch_size"):
        DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, delta=DELTA, max_physical_batch_size=4)
    with pytest.raises(TypeError, match="delta"):
        DPCallback(noise_multiplier=1.0, max_grad_norm=1.0)


def _with_scaler():
    """A trainer whose precision plugin has a GradScaler ('16-mixed' needs CUDA in Lightning,
    so its plugin is built directly)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    return L.Trainer(
        accelerator="cpu", devices=1, logger=False,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
    )


def test_target_epsilon_calibrates_for_the_trainer_epochs(tmp_path):
    model = Tiny()
    dp = DPCallback(target_epsilon=3.0, target_delta=DELTA, max_grad_norm=1.0, ledger=str(tmp_path / "l.jsonl"), seed=2)
    trainer(tmp_path, [dp], max_epochs=2).fit(model)
    assert dp.optimizer.noise_multiplier > 0
    assert dp.ledger.num_releases == 8
    assert dp.get_epsilon() <= 3.0 * (1 + 1e-6)


def test_names_sampler_and_noise_mechanism_and_their_old_spellings(tmp_path):
    # the names of dpcore.torch.make_private: sampler= and noise_mechanism= go through
    model = Tiny()
    dp = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, delta=DELTA, ledger=str(tmp_path / "s.jsonl"), seed=3,
                    sampler="balls_in_bins")
    trainer(tmp_path, [dp], max_epochs=1).fit(model)
    assert {s.policy for s in dp.ledger.samples} == {"balls_in_bins"} and dp.ledger.num_releases == 4
    dp = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, delta=DELTA, noise_mechanism="discrete_gaussian")
    assert dp.make_private_kwargs["noise_mechanism"] == "discrete_gaussian"
    for mech in ("banded", "blt"):
        with pytest.raises(ValueError, match=f"noise_mechanism='{mech}'.*torch loop"):
            DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, delta=DELTA, noise_mechanism=mech)
    # the old spellings still work, each with one DeprecationWarning at construction
    with pytest.warns(DeprecationWarning, match="mechanism= is deprecated"):
        dp = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, delta=DELTA, mechanism="discrete_gaussian")
    assert dp.make_private_kwargs == {"noise_mechanism": "discrete_gaussian"}
    with pytest.warns(DeprecationWarning, match="poisson_sampling= is deprecated"):
        dp = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, delta=DELTA, poisson_sampling=False)
    assert dp.make_private_kwargs == {"sampler": "shuffle"}
