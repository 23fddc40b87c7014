"""dpcore.torch on a CUDA device (``pytest -m cuda``; every test here skips without a GPU).

What runs on a GPU and nowhere else in the suite:

* the noise-0 release equals the brute-force per-record clipped sum for every layer family, on
  the device, in float32, under bfloat16 autocast and under float16 autocast with a GradScaler
  (the brute force runs under the same autocast, in float64 sums; tolerance 2e-4 relative in
  float32; in low precision 4u of the largest reference entry, as ``test_torch_amp.py`` states,
  plus the brute force's own distance from the float32 brute force at the same clip);
* the device noise's ChaCha20 words are the core's, word for word, when generated on the GPU
  (eager and compiled block functions), and its normals equal the host transform of those words;
* a DP step makes a constant number of host-device synchronisations, whatever the number of
  parameters (counted with ``torch.cuda.set_sync_debug_mode``): a model with four times as many
  layers syncs no more often; and a steady-state step of every layer family, in both memory
  modes, under bfloat16 autocast and with a GradScaler, makes none at all (``"error"`` mode:
  issue 52; the CPU twin, counting the operators, is ``test_torch_sync.py``);
* a checkpoint saved on the GPU resumes on the CPU and back, continuing the ledger.
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

import dpcore  # noqa: E402
from dpcore.torch import DPOptimizer, FallbackWarning, make_private  # noqa: E402
from test_torch_amp import Enc, OwnMatmul  # noqa: E402
from test_torch_layers import brute_force  # noqa: E402

CUDA = torch.device("cuda")
BF16, FP16 = torch.bfloat16, torch.float16
N = 6


def _ledger() -> dpcore.PrivacyLedger:
    return dpcore.PrivacyLedger(os.path.join(tempfile.mkdtemp(prefix="dpcore-cuda-"), "l.jsonl"))


def ce(out, y):
    return nn.functional.cross_entropy(out.float(), y, reduction="sum")


# ----------------------------------------------------------------------------- the families


class Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.l, self.h = nn.Embedding(11, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, i):
        return self.h(torch.tanh(self.l(self.emb(i))).mean(1))


class Norms(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.l, self.n, self.h = nn.Linear(7, 8), norm, nn.Linear(8, 3)

    def forward(self, x):
        return self.h(torch.tanh(self.n(self.l(x).view(x.shape[0], 8, 1)).view(x.shape[0], 8)))


class Convs(nn.Module):
    def __init__(self, dim):
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dim]
        self.dim = dim
        # a stride-2 downsampling conv and a grouped one, as the CNNs people train
        self.c1, self.c2 = conv(3, 4, 3, stride=2, padding=1), conv(4, 4, 3, groups=2, padding=1)
        self.g, self.h = nn.GroupNorm(2, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = torch.relu(self.g(self.c2(torch.relu(self.c1(x)))))
        return self.h(h.flatten(2).mean(2))


class Rnn(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.emb, self.r, self.h = nn.Embedding(11, 8), cell(8, 6, batch_first=True), nn.Linear(6, 3)

    def forward(self, i):
        return self.h(self.r(self.emb(i))[0][:, -1])


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.mix = nn.Embedding(10, 6), nn.Linear(6, 6)
        self.out = nn.Linear(6, 3, bias=False)
        self.proj = nn.Linear(6, 10, bias=False)
        self.proj.weight = self.emb.weight  # tied

    def forward(self, i):
        h = torch.tanh(self.mix(torch.tanh(self.mix(self.emb(i)))))  # a layer used twice
        return self.out(h).mean(1) + self.proj(h).mean((1, 2), keepdim=False)[:, None]


_g = torch.Generator().manual_seed(1)
IDX = torch.randint(0, 10, (N, 5), generator=_g)
VEC = torch.randn(N, 7, generator=_g)
IMG = {1: torch.randn(N, 3, 9, generator=_g), 2: torch.randn(N, 3, 7, 7, generator=_g),
       3: torch.randn(N, 3, 5, 5, 5, generator=_g)}
Y = torch.randint(0, 3, (N,), generator=_g)

FAMILIES = {
    "linear": (lambda: nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 3)), VEC),
    "embedding": (Seq, IDX),
    "conv1d": (lambda: Convs(1), IMG[1]),
    "conv2d": (lambda: Convs(2), IMG[2]),
    "conv3d": (lambda: Convs(3), IMG[3]),
    "layernorm": (lambda: Norms(nn.LayerNorm(1)), VEC),
    "groupnorm": (lambda: Norms(nn.GroupNorm(2, 8)), VEC),
    "attention": (Enc, IDX),
    "lstm": (lambda: Rnn(nn.LSTM), IDX),
    "gru": (lambda: Rnn(nn.GRU), IDX),
    "rnn": (lambda: Rnn(nn.RNN), IDX),
    "generic": (lambda: nn.Sequential(nn.Linear(7, 7), OwnMatmul(), nn.Linear(9, 3)), VEC),
    "tied": (Tied, IDX),
}
if hasattr(nn, "RMSNorm"):
    FAMILIES["rmsnorm"] = (lambda: nn.Sequential(nn.Linear(7, 8), nn.RMSNorm(8), nn.Linear(8, 3)), VEC)


def _loss(x, dtype):
    def loss_of(m, i):
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            out = m(x[i])
        return ce(out, Y.to(CUDA)[i])

    return loss_of


def dp_release(model, loss_of, n, clip, den, scaler=None, memory="default"):
    m = copy.deepcopy(model)
    params = [p for p in m.parameters() if p.requires_grad]
    opt = DPOptimizer(torch.optim.SGD(params, lr=0.0), model=m, noise_multiplier=0.0, max_grad_norm=clip,
                      expected_batch_size=den, ledger=_ledger(), loss_reduction="sum", grad_scaler=scaler,
                      memory=memory)
    opt.ledger.record_sample(100, 0.1)
    loss = loss_of(m, list(range(n)))
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    assert opt.ledger.num_releases == 1
    got = [p.grad for p in params]
    names = [nm for nm, p in m.named_parameters() if p.requires_grad]
    opt.engine.remove()
    return got, names


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("mode", ["fp32", "bf16-autocast", "fp16-gradscaler"])
def test_release_equals_brute_force_on_cuda(family, mode):
    if mode == "bf16-autocast" and not torch.cuda.is_bf16_supported():
        pytest.skip("no bfloat16 on this GPU")
    make, x = FAMILIES[family]
    # cuDNN convolutions default to TF32 (10-bit mantissa), the per-record products to float32
    # matmuls: compare float32 with float32
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        _check_family(family, mode, make, x)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lean_memory_release_equals_brute_force_on_cuda(family):
    """memory="lean" (norms in a first backward pass, sums in a second) in float32."""
    make, x = FAMILIES[family]
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        _check_family(family, "fp32", make, x, memory="lean")
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


def _check_family(family, mode, make, x, memory="default"):
    torch.manual_seed(0)
    model = make().to(CUDA)
    dtype = {"fp32": None, "bf16-autocast": BF16, "fp16-gradscaler": FP16}[mode]
    loss_of = _loss(x.to(CUDA), dtype)
    den = 7.0
    clip, ref, norms = brute_force(model, loss_of, N)
    assert min(norms) < clip < max(norms)
    # the brute force's own rounding: its distance from the float32 brute force at the same clip
    own = [torch.zeros_like(r) for r in ref] if dtype is None else \
        [r - r32 for r, r32 in zip(ref, brute_force(model, _loss(x.to(CUDA), None), N, clip)[1])]
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**8) if mode == "fp16-gradscaler" else None
    with warnings.catch_warnings():
        if family != "generic":
            warnings.simplefilter("error", FallbackWarning)
        got, names = dp_release(model, loss_of, N, clip, den, scaler, memory=memory)
    scale = max(float(r.abs().max()) for r in ref) / den
    u = {"fp32": None, "bf16-autocast": 2.0**-8, "fp16-gradscaler": 2.0**-11}[mode]
    for name, g, r, o in zip(names, got, ref, own):
        assert g is not None and g.device.type == "cuda", name
        want = (r / den).cpu().numpy()
        have = g.double().cpu().numpy()
        if u is None:
            np.testing.assert_allclose(have, want, rtol=2e-4, atol=2e-4 * scale, err_msg=name)
        else:
            # 4u of the largest entry (docs/pytorch.md, "Mixed precision"), plus the rounding the
            # brute force itself makes under autocast (a bias summed over many positions in
            # bfloat16 drifts by more than 4u from float32; a wrong norm is off by O(1))
            err = float(np.abs(have - want).max())
            slack = float(o.abs().max()) / den
            assert err <= 4 * u * scale + slack, (name, err / scale, slack / scale)


# ----------------------------------------------------------------------------- device noise


@pytest.mark.parametrize("fused", [False, True])
def test_device_noise_words_are_the_cores(fused):
    from dpcore import _core
    from dpcore.torch._device_noise import NOISE_CHUNK, chacha20_stream_words, device_gaussian_noise

    for key in (_core.seed_key(0), _core.seed_key(2**64 - 1), bytes(range(32))):
        for part, chunk, n, start in ((0, 0, 4096, 0), (3, 17, 1000, 123), (2**24 - 1, 2**32 - 1, 64, 0)):
            want = _core.chacha_stream_words(key, part, chunk, n, start)
            got = chacha20_stream_words(key, part, chunk, n, start, device=CUDA)
            assert got.device.type == "cuda"
            np.testing.assert_array_equal(got.cpu().numpy().astype(np.uint32), want)
    # the normals on the GPU equal the same call on the CPU (same words, same transform)
    n = 2 * NOISE_CHUNK + 1001
    a = device_gaussian_noise(n, 1.5, device=CUDA, seed=11, part=2, fused=fused, dtype=torch.float64)
    b = device_gaussian_noise(n, 1.5, device="cpu", seed=11, part=2, fused=False, dtype=torch.float64)
    np.testing.assert_allclose(a.cpu().numpy(), b.numpy(), rtol=1e-12, atol=1e-12)
    # many tensors in one call: each the one-tensor call with its part, on the GPU too
    from dpcore.torch._device_noise import device_gaussian_noise_many

    specs = [((7, 3), 1.0, torch.float32), ((NOISE_CHUNK + 5,), 2.0, torch.float64), ((40000,), 0.5, torch.float32)]
    for i, z in enumerate(device_gaussian_noise_many(specs, device=CUDA, seed=5, fused=fused)):
        one = device_gaussian_noise(specs[i][0], specs[i][1], device=CUDA, dtype=specs[i][2], part=i, seed=5, fused=fused)
        assert z.device.type == "cuda" and torch.equal(z, one), i
    x = device_gaussian_noise(2_000_000, 2.0, device=CUDA, seed=3, fused=fused).double()
    assert abs(float(x.mean())) < 5 * 2.0 / math.sqrt(2e6)
    assert abs(float(x.std()) / 2.0 - 1.0) < 5 / math.sqrt(2 * 2e6)


# ----------------------------------------------------------------------------- synchronisation


def _syncs_per_step(layers: int) -> int:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(16, 16), nn.Tanh())], nn.Linear(16, 3)).to(CUDA)
    data = torch.utils.data.TensorDataset(torch.randn(256, 16), torch.randint(0, 3, (256,)))
    model, opt, loader = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      torch.utils.data.DataLoader(data, batch_size=32),
                                      noise_multiplier=1.0, max_grad_norm=1.0, ledger=_ledger(), seed=1)

    def step(x, y):
        opt.zero_grad()
        if len(x):
            nn.functional.cross_entropy(model(x.to(CUDA)), y.to(CUDA)).backward()
        opt.step()

    counts = []
    for i, (x, y) in enumerate(loader):
        if i < 2:  # warm-up: lazy buffers, the compiled block function
            step(x, y)
            torch.cuda.synchronize()
            continue
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step(x, y)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message).lower() for w in seen))
        if len(counts) == 3:
            break
    return max(counts)


def _steady_step_under_sync_error(build, kind, *, memory="default", bf16=False, scaler=None):
    """Warm-up steps, then three steps under ``set_sync_debug_mode("error")``: any
    device->host synchronisation in dpcore's step raises."""
    from test_torch_sync import _data, training_step

    torch.manual_seed(0)
    model = build().to(CUDA)
    x, y = _data(kind, torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    kw = {} if scaler is None else {"grad_scaler": scaler}
    model, opt, loader = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, noise_multiplier=1.0,
                                      max_grad_norm=1.0, ledger=_ledger(), memory=memory, **kw)
    step = training_step(model, opt, "cuda", bf16=bf16, scaler=scaler)
    done = 0
    for epoch in range(4):
        for i, (xb, yb) in enumerate(loader):
            xb, yb = xb.to(CUDA), yb.to(CUDA)  # the user's transfer, outside the checked step
            if epoch == 0 and i < 3:
                step(xb, yb)  # warm-up: lazy buffers, the compiled block function and its check
                torch.cuda.synchronize()
                continue
            torch.cuda.set_sync_debug_mode("error")
            try:
                step(xb, yb)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            done += 1
            if done == 3:
                return


@pytest.mark.parametrize("memory", ["default", "lean"])
@pytest.mark.parametrize("family", ["transformer", "lstm", "cnn", "mlp"])
def test_a_steady_step_never_synchronises(family, memory):
    from test_torch_sync import FAMILIES

    build, kind = FAMILIES[family]
    _steady_step_under_sync_error(build, kind, memory=memory)


def test_a_steady_step_never_synchronises_under_bf16_or_a_grad_scaler():
    from test_torch_sync import FAMILIES, _mlp

    build, kind = FAMILIES["transformer"]
    _steady_step_under_sync_error(build, kind, bf16=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**8, growth_interval=2**31 - 1)
    _steady_step_under_sync_error(_mlp, "vector", scaler=scaler)


def test_syncs_per_step_do_not_grow_with_the_parameters():
    few, many = _syncs_per_step(2), _syncs_per_step(8)
    assert many <= few, (few, many)
    assert few <= 8, few


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoint_saved_on_gpu_resumes_on_cpu_and_back(tmp_path):
    def build(device, ledger, weights=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 4))
        if weights is not None:
            model.load_state_dict(weights)
        model = model.to(device)
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(40, 7, generator=g), torch.randint(0, 4, (40,), generator=g))
        return make_private(model, torch.optim.Adam(model.parameters(), lr=0.05),
                            torch.utils.data.DataLoader(data, batch_size=8), noise_multiplier=0.8,
                            max_grad_norm=1.0, ledger=str(ledger), seed=3)

    def train(model, opt, loader, device, steps):
        done = 0
        while done < steps:
            for x, y in loader:
                opt.zero_grad()
                if len(x):
                    nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
                opt.step()
                done += 1
                if done == steps:
                    return

    ledger = tmp_path / "run.jsonl"
    path = tmp_path / "ck.pt"
    for first, second in ((CUDA, torch.device("cpu")), (torch.device("cpu"), CUDA)):
        if ledger.exists():
            ledger.unlink()
        model, opt, loader = build(first, ledger)
        train(model, opt, loader, first, 3)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        releases = opt.ledger.num_releases
        opt.ledger.close()  # the process ends
        ck = torch.load(path, map_location=second, weights_only=True)
        model2, opt2, loader2 = build(second, ledger, weights=ck["model"])
        opt2.load_state_dict(ck["optimizer"])
        assert opt2.ledger.num_releases == releases
        for p in model2.parameters():
            assert p.device.type == second.type
        for st in opt2.original_optimizer.state.values():
            for v in st.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    assert v.device.type == second.type
        train(model2, opt2, loader2, second, 2)
        assert opt2.ledger.num_releases == releases + 2
        assert all(torch.isfinite(p).all() for p in model2.parameters())
        opt2.ledger.close()
