"""Wrap-time and step-time checks of dpcore.torch: every trainable parameter is covered by a
rule (or the fallback) or named; which parameters train is fixed at wrap time; the records of
two backward passes are never merged into one."""

from __future__ import annotations

import os
import tempfile

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import dpcore  # noqa: E402
from dpcore.torch import DPOptimizer  # noqa: E402

torch.set_num_threads(1)


def _opt(model, params=None, **kw):
    params = [p for p in model.parameters() if p.requires_grad] if params is None else params
    ledger = dpcore.PrivacyLedger(os.path.join(tempfile.mkdtemp(), "l.jsonl"))
    return DPOptimizer(torch.optim.SGD(params, lr=0.1), model=model, noise_multiplier=1.0, max_grad_norm=1.0,
                       expected_batch_size=4.0, ledger=ledger, **kw)


def _backward(model, n=4):
    x, y = torch.randn(n, 7), torch.randint(0, 3, (n,))
    nn.functional.cross_entropy(model(x), y).backward()


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 3))


class UsesWeightOutside(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(7, 9), nn.ReLU())
        self.head = nn.Linear(9, 3)

    def forward(self, x):
        h = self.inner(x)
        # the head's weight used by the parent, not by the head's own forward
        return nn.functional.linear(h, self.head.weight, self.head.bias)


def test_parameter_outside_the_model_is_refused_at_wrap_time():
    model = mlp()
    stray = nn.Parameter(torch.zeros(5, 2))
    with pytest.raises(ValueError, match=r"\(5, 2\)\]\) do not belong to any module"):
        _opt(model, list(model.parameters()) + [stray])


def test_parameter_used_outside_its_module_is_named_at_the_first_backward():
    model = UsesWeightOutside()
    opt = _opt(model)
    opt.ledger.record_sample(40, 0.1)
    with pytest.raises(RuntimeError, match=r"'head\.(weight|bias)'.*did not capture per record"):
        _backward(model)
    assert opt.ledger.num_releases == 0


@pytest.mark.parametrize("change", ["freeze", "unfreeze"])
def test_trainable_set_changed_after_wrapping_is_refused(change):
    model = mlp()
    if change == "unfreeze":
        model[0].weight.requires_grad_(False)
    opt = _opt(model, list(model.parameters()))  # the inner optimizer holds every parameter
    opt.ledger.record_sample(40, 0.1)
    _backward(model)
    opt.step()
    assert opt.ledger.num_releases == 1
    model[0].weight.requires_grad_(change == "unfreeze")
    opt.ledger.record_sample(40, 0.1)
    before = model[0].weight.detach().clone()
    _backward(model)
    how = "frozen" if change == "freeze" else "unfrozen"
    with pytest.raises(RuntimeError, match=rf"'0\.weight' was {how}"):
        opt.step()
    assert opt.ledger.num_releases == 1
    assert torch.equal(model[0].weight, before)
    # an unfrozen parameter's ordinary (unclipped) gradient is not left behind
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(RuntimeError, match=how):
        opt.accumulate()


def test_two_backward_passes_are_never_merged():
    model = mlp()
    opt = _opt(model)
    opt.ledger.record_sample(40, 0.1)
    _backward(model)
    _backward(model)  # same batch size: merging record i of both passes would go unnoticed
    with pytest.raises(ValueError, match="2 backward passes"):
        opt.step()
    assert opt.ledger.num_releases == 0
    opt.zero_grad()
    _backward(model)
    opt.step()
    assert opt.ledger.num_releases == 1


def test_accumulate_then_step_is_one_release_of_both_micro_batches():
    torch.manual_seed(0)
    x, y = torch.randn(8, 7), torch.randint(0, 3, (8,))
    grads = []
    for split in (False, True):
        model = mlp()
        opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model=model, noise_multiplier=0.0,
                          max_grad_norm=0.5, expected_batch_size=8.0, loss_reduction="sum",
                          ledger=os.path.join(tempfile.mkdtemp(), "l.jsonl"))
        opt.ledger.record_sample(80, 0.1)
        if split:
            nn.functional.cross_entropy(model(x[:3]), y[:3], reduction="sum").backward()
            opt.accumulate()
            nn.functional.cross_entropy(model(x[3:]), y[3:], reduction="sum").backward()
        else:
            nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
        opt.step()
        assert opt.ledger.num_releases == 1
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_reentrant_activation_checkpointing_is_one_pass():
    from torch.utils.checkpoint import checkpoint

    class Ckpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(7, 9), nn.Linear(9, 9), nn.Linear(9, 3)

        def forward(self, x):
            h = checkpoint(lambda t: torch.relu(self.a(t)), x, use_reentrant=True)
            h = checkpoint(lambda t: torch.relu(self.b(t)), h, use_reentrant=True)
            return self.c(h)

    torch.manual_seed(0)
    model = Ckpt()
    opt = _opt(model)
    opt.ledger.record_sample(40, 0.1)
    x = torch.randn(4, 7, requires_grad=True)
    nn.functional.cross_entropy(model(x), torch.randint(0, 3, (4,))).backward()
    opt.step()
    assert opt.ledger.num_releases == 1
    assert all(p.grad is not None for p in model.parameters())
