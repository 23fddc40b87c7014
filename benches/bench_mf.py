"""Matrix-factorization (correlated noise) mechanisms against independent noise.

Four parts, all in one run (``--parts`` picks some):

1. ``rmse``: the RMSE of the prefix sums (Σ_{s≤t} x̂_s − Σ_{s≤t} x_s over t = 1…n, the standard
   quality measure of MF strategies; Choquette-Choo et al. 2022, §3) at EQUAL ε, per unit of the
   effective noise multiplier and clip norm: sqrt(sens(C)²·‖AC⁻¹‖_F²/n). Rows: n = 1000 and 10⁴
   steps, k = 1, 4 and 16 epochs of cyclic fixed batches (b = n/k); strategies: independent
   noise (C = I, DP-SGD over the same fixed batches, accounted honestly with k participations),
   the banded square root of Kalinin & Lampert 2024 (no optimisation), optimised banded, and
   optimised BLTs with 2 buffers (the default) and 4. The ratio is RMSE / RMSE(independent): below 1 is better.
2. ``opt``: the time of each optimisation of part 1 (wall clock, one call each: these run once
   per training run).
3. ``task``: scikit-learn's digits (8×8 images, 10 classes; 1437 train / 360 test, fixed split),
   an MLP 64-128-10 trained with ``dpcore.torch.make_private`` as users run it, batch 64, 1, 2 and
   4 epochs, ε ∈ {1, 2, 4, 8} at δ = 1e-5, clip 1.0, SGD (lr picked per mechanism from
   {0.25, 0.5, 1, 2} — best test accuracy, the same grid for all, so it compares tuned
   mechanisms; tuning cost is not accounted, as usual in such tables), ``--seeds`` runs each.
   Mechanisms: DP-SGD with Poisson sampling (amplified), DP-SGD on shuffled-once fixed batches
   without amplification (``noise_mechanism="banded", strategy=IDENTITY``, the honest alternative for that
   pipeline), banded MF and BLT MF on the same fixed batches. Test accuracy, mean over seeds.
4. ``cost``: the step cost of BLT noise against independent noise: (a) the core alone,
   ``CorrelatedNoise.next`` (4 buffers) against ``dpcore.gaussian_noise`` for d = 10⁶ and 10⁷
   float32 values, alternated in one process, and the recursion alone (z drawn ahead, as the
   torch optimizer does in the background); (b) a torch training step (MLP 784-1024-256-10,
   B = 256, float32): ``noise_mechanism="blt"`` (2 buffers, and 4) against DP-SGD's independent noise on the
   default path (``sampler="shuffle"``: fixed-size shuffled batches, noise drawn ahead)
   and against ``strategy=IDENTITY`` (C = I through the MF path, on the same cyclic
   loader), alternated in one process. Goal ≤ 1.1×; the noise state's bytes are printed
   against (buffers + 1)·d floats.

``python benches/bench_mf.py [--parts rmse opt task cost] [--seeds 3] [--quick] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import alternating_blocks, call_times  # noqa: E402

from dpcore.matrix_factorization import IDENTITY, Participation  # noqa: E402
from dpcore.matrix_factorization import _optimize as mfo  # noqa: E402


# ------------------------------------------------------------------------------------ 1 and 2


def rmse_rows(ns, epochs):
    rows = []
    for n in ns:
        for k in epochs:
            b = n // k
            part = Participation.cyclic(b, k)
            base = mfo.rmse(IDENTITY, n, part)
            entries = {"independent": (IDENTITY, 0.0)}
            bands = mfo.default_bands(n, part)
            entries["banded sqrt"] = (mfo.banded_sqrt(bands), 0.0)
            t = time.perf_counter()
            entries["banded"] = (mfo.optimize(n, part, kind="banded"), time.perf_counter() - t)
            t = time.perf_counter()
            entries["blt"] = (mfo.optimize(n, part, kind="blt"), time.perf_counter() - t)
            t = time.perf_counter()
            entries["blt 4 buffers"] = (mfo.optimize(n, part, kind="blt", buffers=4), time.perf_counter() - t)
            for name, (s, secs) in entries.items():
                r = mfo.rmse(s, n, part)
                rows.append({
                    "n": n, "epochs": k, "min_separation": b, "strategy": name, "bands": bands if "band" in name else None,
                    "rmse": r, "ratio": r / base, "opt_seconds": secs,
                })
                print(f"  n={n:>6} epochs={k:>2} b={b:>5}  {name:<13} RMSE {r:10.3f}  ×{r / base:6.3f}"
                      + (f"  optimised in {secs:6.2f} s" if secs else ""), flush=True)
    return rows


# ------------------------------------------------------------------------------------ 3


def digits_task(eps_list, epochs_list, seeds, lrs, batch=64, delta=1e-5):
    import torch
    from sklearn.datasets import load_digits

    from dpcore.torch import make_private_with_epsilon

    torch.set_num_threads(2)
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(x))
    tr, te = perm[:1437], perm[1437:]
    xtr, ytr = torch.from_numpy(x[tr]), torch.from_numpy(y[tr]).long()
    xte, yte = torch.from_numpy(x[te]), torch.from_numpy(y[te]).long()
    ds = torch.utils.data.TensorDataset(xtr, ytr)

    def run(mech, eps, epochs, lr, seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        loader = torch.utils.data.DataLoader(ds, batch_size=batch)
        kw = {} if mech == "poisson" else {"noise_mechanism": mech}
        model, opt, loader = make_private_with_epsilon(
            model, opt, loader, target_epsilon=eps, target_delta=delta, epochs=epochs, max_grad_norm=1.0, **kw
        )
        loss_fn = torch.nn.CrossEntropyLoss()
        steps = 0
        for _ in range(epochs):
            for xb, yb in loader:
                opt.zero_grad()
                loss_fn(model(xb), yb).backward()
                opt.step()
                steps += 1
        with torch.no_grad():
            acc = float((model(xte).argmax(1) == yte).float().mean())
        spent = opt.get_epsilon(delta)
        opt.engine.remove() if hasattr(opt, "engine") else None
        return acc, spent, steps

    mechs = ["poisson", "independent", "banded", "blt"]
    rows = []
    for epochs in epochs_list:
        for eps in eps_list:
            line = []
            for mech in mechs:
                best = None
                for lr in lrs:
                    accs, spent, steps = [], [], 0
                    for s in range(seeds):
                        a, e, steps = run(mech, eps, epochs, lr, 1000 * s + 17)
                        accs.append(a)
                        spent.append(e)
                    m = statistics.mean(accs)
                    if best is None or m > best["accuracy"]:
                        best = {"epochs": epochs, "epsilon": eps, "mechanism": mech, "lr": lr, "accuracy": m,
                                "accuracy_sd": statistics.pstdev(accs), "epsilon_spent": max(spent), "steps": steps}
                rows.append(best)
                line.append(f"{mech} {100 * best['accuracy']:5.1f}% (lr {best['lr']}, ε {best['epsilon_spent']:.2f})")
            print(f"  epochs={epochs} ε={eps:<3}  " + " | ".join(line), flush=True)
    return rows


# ------------------------------------------------------------------------------------ 4


def core_cost(dims, blocks=5, per_block=5):
    from dpcore import gaussian_noise
    from dpcore.matrix_factorization._noise import CorrelatedNoise

    rows = []
    part = Participation.cyclic(100, 10)
    for buffers in (mfo.DEFAULT_BUFFERS, 4):
        blt = mfo.optimize(1000, part, kind="blt", buffers=buffers)
        for d in dims:
            g = CorrelatedNoise(blt, d, np.float32)
            z = gaussian_noise(d, 1.0, dtype=np.float32)
            fns = {
                "independent": lambda: gaussian_noise(d, 1.0, dtype=np.float32),
                "blt": lambda: g.next(1.0),
                # z drawn ahead (the torch optimizer draws w ahead, in the background): the recursion alone
                "blt_recursion": lambda: g.next(1.0, fresh=z),
            }
            ts = alternating_blocks(fns, blocks, lambda fn: call_times(fn, per_block))
            ind, b, r = (statistics.median(ts[k]) for k in ("independent", "blt", "blt_recursion"))
            rows.append({"d": d, "independent_ms": 1e3 * ind, "blt_ms": 1e3 * b, "ratio": b / ind,
                         "blt_recursion_ms": 1e3 * r, "buffers": blt.num_buffers, "state_bytes": g.state_nbytes,
                         "state_floats_per_d": g.state_nbytes / (4 * d)})
            print(f"  core d={d:>9}: independent {1e3 * ind:8.2f} ms  BLT({blt.num_buffers}) {1e3 * b:8.2f} ms  ×{b / ind:5.2f}"
                  f"  (recursion alone, z drawn ahead: {1e3 * r:8.2f} ms)"
                  f"  state {g.state_nbytes / 2**20:.1f} MiB = {g.state_nbytes / (4 * d):.0f}·d floats", flush=True)
    return rows


def torch_cost(steps=60, warmup=5, rounds=6, batch=256):
    import torch

    from dpcore.torch import make_private

    torch.set_num_threads(2)
    n = batch * 40
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 784, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    ds = torch.utils.data.TensorDataset(x, y)

    def setup(mech):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = torch.utils.data.DataLoader(ds, batch_size=batch)
        if mech == "dpsgd":  # the default path's independent noise, on fixed-size shuffled batches
            kw = {"sampler": "shuffle"}
        elif mech == "independent":  # C = I through the MF path: independent noise on the cyclic batches
            kw = {"noise_mechanism": "banded", "strategy": IDENTITY, "epochs": 10}
        elif mech == "blt4":
            strategy = mfo.optimize(400, Participation.cyclic(40, 10), kind="blt", buffers=4)
            kw = {"noise_mechanism": "blt", "epochs": 10, "strategy": strategy}
        else:
            kw = {"noise_mechanism": mech, "epochs": 10}
        model, opt, loader = make_private(model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0, **kw)
        it = iter(loader)
        loss_fn = torch.nn.CrossEntropyLoss()

        def step():
            nonlocal it
            try:
                xb, yb = next(it)
            except StopIteration:
                it = iter(loader)
                xb, yb = next(it)
            opt.zero_grad()
            loss_fn(model(xb), yb).backward()
            opt.step()

        for _ in range(warmup):
            step()
        return step, opt, model

    import warnings

    from dpcore.ledger import LedgerWarning

    warnings.simplefilter("ignore", LedgerWarning)  # the shuffled baseline's "no amplification"
    runs = {m: setup(m) for m in ("dpsgd", "independent", "blt", "blt4")}
    ts = alternating_blocks({m: r[0] for m, r in runs.items()}, rounds, lambda fn: call_times(fn, steps // rounds))
    dp, ind, b, b4 = (statistics.median(ts[k]) for k in ("dpsgd", "independent", "blt", "blt4"))
    d = sum(p.numel() for p in runs["blt"][2].parameters())
    opt = runs["blt"][1]
    nbytes = None
    for grp in getattr(opt, "_groups", []):
        ns = getattr(getattr(grp, "gs", None), "noise", None)
        if ns is not None:
            nbytes = (nbytes or 0) + ns.state_nbytes
    row = {"d": d, "dpsgd_ms": 1e3 * dp, "independent_ms": 1e3 * ind, "blt_ms": 1e3 * b, "ratio": b / dp,
           "ratio_vs_independent_cyclic": b / ind, "noise_state_bytes": nbytes, "blt4_ms": 1e3 * b4, "ratio_blt4": b4 / dp}
    print(f"  torch MLP 784-1024-256-10 B={batch} (d={d}): DP-SGD (independent noise, default path) {1e3 * dp:.2f} ms  "
          f"independent over cyclic batches {1e3 * ind:.2f} ms  BLT {1e3 * b:.2f} ms: BLT ×{b / dp:.3f} of DP-SGD, "
          f"×{b / ind:.3f} of independent-cyclic"
          + (f"  noise state {nbytes / (4 * d):.1f}·d floats" if nbytes else ""), flush=True)
    print(f"  ... with a 4-buffer BLT: {1e3 * b4:.2f} ms, ×{b4 / dp:.3f} of DP-SGD", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", default=["rmse", "opt", "task", "cost"])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    out = {}
    if "rmse" in a.parts or "opt" in a.parts:
        print("1–2. prefix-sum RMSE at equal ε (ratio to independent noise) and optimisation time")
        ns = [1000] if a.quick else [1000, 10_000]
        out["rmse"] = rmse_rows(ns, [1, 4, 16])
    if "task" in a.parts:
        print("3. digits, MLP 64-128-10, batch 64: test accuracy (mean over seeds, best lr per mechanism)")
        eps = [1, 8] if a.quick else [1, 2, 4, 8]
        epochs = [1, 4] if a.quick else [1, 2, 4]
        lrs = [0.5, 2.0] if a.quick else [0.25, 0.5, 1.0, 2.0]
        out["task"] = digits_task(eps, epochs, 1 if a.quick else a.seeds, lrs)
    if "cost" in a.parts:
        print("4. step cost of BLT noise against independent noise")
        out["core_cost"] = core_cost([10**6] if a.quick else [10**6, 10**7])
        out["torch_cost"] = torch_cost()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
