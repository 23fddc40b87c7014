"""The stages of dpcore.torch's DPOptimizer: the supported combinations (decided in one place),
the loader protocol and its defaults, the transport and noise sources chosen at construction,
and the optimizer's public checkpoint state methods."""

from __future__ import annotations

import os
import tempfile

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from dpcore.matrix_factorization import BandedStrategy, Participation  # noqa: E402
from dpcore.queries import MatrixFactorizationQuery  # noqa: E402
from dpcore.torch import DPDataLoader, DPOptimizer, make_private  # noqa: E402
from dpcore.torch._combinations import Setup, check_combination  # noqa: E402
from dpcore.torch._loader import LoaderView  # noqa: E402
from dpcore.torch._mf import MFNoise  # noqa: E402
from dpcore.torch._noise import DiscreteGaussianNoise, GaussianNoise  # noqa: E402
from dpcore.torch._transport import SingleProcess  # noqa: E402

MF = "matrix_factorization"


def _setup(**kw):
    base = dict(distributed=False, sharded=(False, False), generic_layers=(), mechanisms=("gaussian",))
    base.update(kw)
    return Setup(**base)


def _ledger():
    return os.path.join(tempfile.mkdtemp(), "l.jsonl")


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))


@pytest.mark.parametrize(
    "kw,op,err,match",
    [
        (dict(sharded=(True, True)), None, ValueError, "not initialised with more than one rank.*torchrun"),
        (dict(distributed=True, sharded=(True, False)), None, ValueError, "call fully_shard on the root module too"),
        (dict(distributed=True, sharded=(True, True), generic_layers=("a",)), None, NotImplementedError, "register_layer"),
        (dict(distributed=True, mechanisms=(MF,)), None, NotImplementedError, "noise_mechanism=None"),
        (dict(distributed=True, mechanisms=("discrete_gaussian",)), None, NotImplementedError, "use mechanism='gaussian'"),
        (dict(distributed=True, grad_scaler=True), None, NotImplementedError, "bfloat16 autocast"),
        (dict(mechanisms=(MF,), grad_scaler=True), None, ValueError, "bfloat16 autocast"),
        (dict(distributed=True), "accumulate", NotImplementedError, "max_physical_batch_size instead"),
        (
            dict(mechanisms=(MF,), mf_participations=(Participation(4, 2),), loader_participation=Participation(5, 2)),
            None, ValueError, "the data loader follows.*give the query the loader's participation",
        ),
    ],
)
def test_every_refusal_says_what_to_use_instead(kw, op, err, match):
    with pytest.raises(err, match=match):
        check_combination(_setup(**kw), op)


def test_supported_combinations_pass():
    check_combination(_setup())
    check_combination(_setup(grad_scaler=True), "accumulate")
    check_combination(_setup(distributed=True, sharded=(True, True)))
    check_combination(_setup(mechanisms=("discrete_gaussian", "gaussian"), grad_scaler=True))
    same = Participation(4, 2)
    check_combination(_setup(mechanisms=(MF,), mf_participations=(same,), loader_participation=Participation(4, 2)))
    check_combination(_setup(mechanisms=(MF,), mf_participations=(same,), loader_participation=None))


def test_loader_protocol_defaults():
    for view in (LoaderView(None), LoaderView(object())):
        assert view.ledger is None and view.samples_drawn is None and view.participation is None
        assert view.accountant is None and view.logical_batch_complete is True
        assert view.state_dict() is None and not view.can_restore
        view.use_equal_micro_batches()  # absent: nothing to do
        view.check_state_dict({"anything": 1})  # absent: nothing to check

    class Partial:
        logical_batch_complete = 0
        accountant = 3  # not a name: ignored
        ledger = "not a ledger"

    view = LoaderView(Partial())
    assert view.logical_batch_complete is False and view.accountant is None and view.ledger is None


def test_loader_protocol_on_dpcores_loaders():
    ds = TensorDataset(torch.randn(20, 5), torch.randint(0, 3, (20,)))
    dl = DPDataLoader(ds, 0.25, ledger=_ledger(), seed=1)
    view = LoaderView(dl)
    assert view.ledger is dl.ledger and view.samples_drawn == 0 and view.participation is None
    assert view.state_dict() == dl.state_dict() and view.can_restore
    assert not dl.equal_micro_batches
    view.use_equal_micro_batches()
    assert dl.equal_micro_batches
    m = _mlp()
    model, opt, loader = make_private(m, torch.optim.SGD(m.parameters(), lr=0.1), DataLoader(ds, batch_size=4),
                                      noise_multiplier=0.5, max_grad_norm=1.0, ledger=_ledger(), seed=1,
                                      noise_mechanism="banded", epochs=2)
    view = LoaderView(loader)
    assert view.participation == loader.participation and view.participation is not None


def test_stages_are_chosen_at_construction():
    def build(**kw):
        m = _mlp()
        return DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), model=m, ledger=_ledger(), **kw)

    opt = build(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4.0)
    assert type(opt._transport) is SingleProcess and not opt._transport.distributed
    assert [type(s) for s in opt._noise.sources] == [GaussianNoise] and not opt._noise.correlated
    opt = build(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4.0, mechanism="discrete_gaussian")
    assert [type(s) for s in opt._noise.sources] == [GaussianNoise, DiscreteGaussianNoise]
    q = MatrixFactorizationQuery(1.0, 1.0, strategy=BandedStrategy([1.0, 0.5]), participation=Participation(4, 2),
                                 steps=8, denominator=4.0)
    opt = build(query=q, expected_batch_size=4.0)
    assert [type(s) for s in opt._noise.sources] == [GaussianNoise, MFNoise] and opt._noise.correlated
    assert opt.noise_multiplier == q.noise_multiplier


def test_a_refused_wrap_leaves_the_model_as_it_was():
    m = _mlp()
    q = MatrixFactorizationQuery(1.0, 1.0, strategy=BandedStrategy([1.0, 0.5]), participation=Participation(4, 2),
                                 steps=8, denominator=4.0)
    before = {n: mod.forward for n, mod in m.named_modules()}
    with pytest.raises(ValueError, match="grad_scaler with matrix-factorization noise"):
        DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), model=m, query=q, expected_batch_size=4.0,
                    ledger=_ledger(), grad_scaler=torch.amp.GradScaler("cpu"))
    assert not m._forward_pre_hooks and all(not p._backward_hooks for p in m.parameters())
    assert {n: mod.forward for n, mod in m.named_modules()} == before
    DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), model=m, query=q, expected_batch_size=4.0, ledger=_ledger())


def test_checkpoint_state_and_restore_state():
    m = _mlp()
    opt = DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), model=m, noise_multiplier=1.0, max_grad_norm=1.0,
                      expected_batch_size=4.0, ledger=_ledger(), seed=2)
    st = opt.checkpoint_state()
    assert st["releases"] == 0 and st["drawn_at_release"] == 0 and st["skipped_steps"] == 0
    assert st["logical_batch_complete"] and not st["correlated_noise"]
    assert st["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert st["param_shapes"] == [[4, 5], [4], [3, 4], [3]]
    assert [g["members"] for g in st["groups"]] == [st["param_names"]] and st["groups"][0]["query"] is opt.query
    opt.ledger.record_sample(100, 0.04)
    nn.functional.cross_entropy(m(torch.randn(4, 5)), torch.tensor([0, 1, 2, 0])).backward()
    opt.step()
    assert opt.checkpoint_state()["releases"] == 1 and opt._noise.drawn_ahead == [1]
    gs = opt.checkpoint_state()["groups"][0]["global_state"]
    opt.restore_state(releases=7, drawn_at_release=3, skipped_steps=2, global_states=[gs])
    st = opt.checkpoint_state()
    assert (st["releases"], st["drawn_at_release"], st["skipped_steps"]) == (7, 3, 2) and opt.skipped_steps == 2
    assert opt._noise.drawn_ahead == [None]  # drawn for release 1 of the run before: dropped
    nn.functional.cross_entropy(m(torch.randn(4, 5)), torch.tensor([0, 1, 2, 0])).backward()
    opt.accumulate()
    assert not opt.checkpoint_state()["logical_batch_complete"]
    opt.discard()
    assert opt.checkpoint_state()["logical_batch_complete"]
