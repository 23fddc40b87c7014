"""User-level DP (issue 40): ε and test accuracy of user-level sampling (ULS), example-level
sampling with a user-level guarantee (ELS) and example-level DP-SGD stated for users by group
privacy, on a long-tailed population; and the ULS step time on bench_torch.py's transformer
against the example-level step.

**The population** (``population()``; numpy seed 0, the same in every run). scikit-learn's
digits (1,797 8x8 images, features scaled to [0, 1]) split once at random into a training pool of
1,297 images and a test pool of 500. Each of ``--users`` training users (default 2,000) and
``--test-users`` held-out users (default 500) gets a count of examples drawn from a lognormal
(median 8, log-sd 1.3) rounded and clipped to [1, 200] (with the defaults: 35,962 training
examples, median 8 and mean 18 a user, 14 users at 200), a label distribution from Dirichlet(0.5)
over the 10 digits (label skew), and a style: a gain U(0.7, 1.3) on the image and a fixed
background N(0, 0.1²) per pixel. Each example is an image of a label drawn from the user's
distribution, picked at random (with replacement) from the pool's images of that label, times
the gain, plus the background, plus fresh N(0, 0.1²) noise per pixel. Training users draw from
the training pool, test users from the test pool (no image is shared). Test accuracy is over all
the test users' examples (each example counts once).

**Training.** An MLP 64-64-10 (ReLU), SGD without momentum (``--lr`` 1.0 for every DP method, not
tuned per method; ``--lr-nonprivate`` 0.3), max grad norm C = 1, ``--epochs`` epochs (default 10)
of 20 Poisson steps: q = 1/20 of the method's records, so every method takes the same 200 steps
and each of its records takes part in 10 steps on average. For each target ε in 1, 4, 8 at
δ = 1e-5 (user level; δ < 1/U), σ is calibrated once per method and ε and reused for every seed:

* ``ULS k``: ``make_private_with_epsilon(..., privacy_unit="user", user_ids=ids,
  examples_per_user=k)``; the DataLoader's batch size is U/20 users, each gives the mean of at
  most k of its examples, clipped as one record. Its ε does not depend on k.
* ``ELS K``: the same with ``max_examples_per_user=K``: each user bounded once to K examples,
  the N_K kept examples Poisson sampled (batch size N_K/20 examples), clipped one by one,
  accounted by dpcore as a mixture of Gaussians.
* ``example, group K``: ordinary example-level DP-SGD (``privacy_unit="example"``) on the data
  with each user first bounded to K examples (``dpcore.sampling.UserIndex.bound``, the bound ELS
  uses), batch N_K/20; its user-level ε is group privacy with group size K. ``example, group
  all``: no bound, group size = the largest user's count (200). σ: example-level DP-SGD
  calibrated to (ε/K, δ/(K·e^{(K−1)ε/K})), the conversion at ε' = ε/K (a bisection on σ over the
  full δ' search gave the same σ to 1e-4 for K = 4 and 200).
* ``non-private``: plain SGD on all the training examples, batch N/20 (drop_last), the same 200
  steps: a reference, ε = ∞.

Group privacy (Vadhan 2017, Lemma 2.2): an (ε', δ')-DP mechanism for examples is
(Kε', K·e^{(K−1)ε'}·δ')-DP for groups of K. The example-level rows report
``dpcore.accounting.group_privacy_epsilon(curve, K, δ)`` over the run's own ledger curve δ' ↦
``optimizer.get_epsilon(δ')`` (the output names the method; without that helper, or with
``--no-group-helper``, the bench's own search :func:`group_epsilon`: the largest δ' whose group δ
is ≤ δ, K·ε'(δ')); on seed 0 the bench's search runs beside the helper and the output says how
far apart they are. ``ε spent`` is ``optimizer.get_epsilon(1e-5)`` of the run's ledger (unit
``user`` for ULS and ELS), group-converted for the example-level rows; it is deterministic given
σ and the steps (the same for every seed). A cross-check table accounts each ELS run (seed 0)
instead as example-level DP-SGD with the same σ, q and steps, converted by group privacy (the
bench's search over ``dpcore.accounting.epsilon``): it must come out looser than the mixture.

Test accuracy is the mean ± standard deviation (n − 1) over ``--seeds`` seeds (default 5: the
model's initialisation; the Poisson samples, the ELS bound and the noise come from the core's
CSPRNG, unseeded, so they differ between runs too). The accuracy part runs on one torch thread
(``--train-threads``: the MLP is tiny, and a second thread only waits on a shared machine) and
writes its ledgers under /dev/shm when it exists (a ledger fsyncs every step); it times nothing.

**Step time.** bench_torch.py's transformer (Embedding(8000, 256) + 2 x TransformerEncoderLayer
(256, 4 heads, ff 1024) + Linear(256, 2), length 128, random tokens; ``_build("transformer")``)
over its 1,600 records, grouped into 200 users of 8 examples. ``example``: ``make_private``
(noise 1.0, C = 1.0, Poisson, expected batch 32 examples); ``ULS k=4``: ``make_private(...,
privacy_unit="user", user_ids=ids, examples_per_user=4)`` with batch size 8 users (32 examples
a step expected). Both models start from the same seed and live in one process, on ``--threads``
(2) torch threads; after ``--warmup`` steps each, ``--rounds`` rounds each time
``--steps-per-round`` steps of each, the order flipped every round. The table shows the median
wall and process-CPU ms per step (the batch drawn inside the timed step) and the ratio ULS /
example (goal ≤ 1.2x), the mean examples a step held, the total time per example, and a
Theil–Sen line of ms on examples evaluated at 32 examples: the ULS batch varies more
(4·Bin(200, 0.04), s.d. 11, against Bin(1600, 0.02), s.d. 5.6), so over a few dozen steps the
medians also compare different batch sizes.

``python benches/bench_user_level.py [--seeds 5] [--epochs 10] [--users 2000] [--epsilons 1 4 8]
[--rounds 12] [--quick] [--json out.json] [--skip-accuracy | --skip-step]``. The default run
takes 4 to 7 minutes on 2 CPU cores (7 with another process holding a core: the transformer step
then takes 2 s instead of 0.5); ``--quick``
(500 users, 200 test users, 1 seed, 3 epochs, K = k = 4 only, 1 warm-up and 2 timed steps each)
about 30 seconds.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
from _timing import fill_defaults, finish, run_parts
import torch
from torch import nn

DELTA = 1e-5
EPSILONS = (1.0, 4.0, 8.0)
STEPS_PER_EPOCH = 20  # q = 1/20 of each method's records
MAX_COUNT = 200
GROUP_DELTA_NOTE = "Vadhan 2017 Lemma 2.2, computed in this bench"
HOW_BUILT = (
    "Built from scikit-learn's digits (1,797 8x8 images scaled to [0, 1]), split once into a 1,297-image training "
    "pool and a 500-image test pool (numpy seed 0). Each user: a count from a lognormal (median 8, log-sd 1.3) "
    "rounded and clipped to [1, 200]; labels from its own Dirichlet(0.5) distribution over the 10 digits; each "
    "example a random pool image of its label (with replacement) x the user's gain U(0.7, 1.3) + the user's fixed "
    "background N(0, 0.1^2) per pixel + fresh N(0, 0.1^2) pixel noise. Test users draw from the test pool only."
)


# -- the population ----------------------------------------------------------------------------


def population(users: int, test_users: int, seed: int = 0) -> Dict[str, Any]:
    """The long-tailed population of the module docstring: train and test arrays, user ids, counts."""
    from sklearn.datasets import load_digits

    x_all, y_all = load_digits(return_X_y=True)
    x_all = (x_all / 16.0).astype(np.float32)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(y_all))
    test_pool, train_pool = perm[:500], perm[500:]

    def make(n_users: int, pool: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        counts = np.clip(np.rint(np.exp(rng.normal(math.log(8.0), 1.3, n_users))), 1, MAX_COUNT).astype(np.int64)
        by_label = [pool[y_all[pool] == c] for c in range(10)]
        xs, ys = [], []
        for c in counts:
            p = rng.dirichlet(np.full(10, 0.5))
            labels = rng.choice(10, size=int(c), p=p)
            imgs = np.array([rng.choice(by_label[l]) for l in labels])
            gain = rng.uniform(0.7, 1.3)
            background = rng.normal(0.0, 0.1, 64)
            xs.append(gain * x_all[imgs] + background + rng.normal(0.0, 0.1, (int(c), 64)))
            ys.append(labels)
        ids = np.repeat(np.arange(n_users), counts)
        return np.concatenate(xs).astype(np.float32), np.concatenate(ys).astype(np.int64), ids, counts

    xtr, ytr, ids, counts = make(users, train_pool)
    xte, yte, _, tcounts = make(test_users, test_pool)
    return {"x": torch.from_numpy(xtr), "y": torch.from_numpy(ytr), "ids": ids, "counts": counts,
            "x_test": torch.from_numpy(xte), "y_test": torch.from_numpy(yte), "test_counts": tcounts}


def describe_population(pop: Dict[str, Any]) -> Dict[str, Any]:
    c = pop["counts"]
    return {
        "users": int(len(c)), "examples": int(c.sum()), "min_count": int(c.min()), "median_count": float(np.median(c)),
        "mean_count": float(c.mean()), "p90_count": float(np.percentile(c, 90)), "p99_count": float(np.percentile(c, 99)),
        "max_count": int(c.max()), "users_at_max": int((c == c.max()).sum()),
        "share_of_examples_top_1pct_users": float(np.sort(c)[::-1][: max(1, len(c) // 100)].sum() / c.sum()),
        "test_users": int(len(pop["test_counts"])), "test_examples": int(pop["test_counts"].sum()),
    }


# -- methods -----------------------------------------------------------------------------------


def methods(quick: bool) -> List[Dict[str, Any]]:
    """(name, kind, bound) for each method; kind: uls, els, group, nonprivate."""
    ks = (4,) if quick else (4, 16)
    out = [{"name": f"ULS k={k}", "kind": "uls", "k": k} for k in ks]
    out += [{"name": f"ELS K={k}", "kind": "els", "k": k} for k in ks]
    out += [{"name": f"example, group K={k}", "kind": "group", "k": k} for k in ks]
    out.append({"name": "example, group all", "kind": "group", "k": None})
    out.append({"name": "non-private", "kind": "nonprivate", "k": None})
    return out


def _group_helper() -> Optional[Callable[..., Any]]:
    """dpcore.accounting's group-privacy conversion (``group_privacy_epsilon(curve, k, delta)``),
    when this tree has it."""
    import dpcore.accounting as acc

    return getattr(acc, "group_privacy_epsilon", None)


def group_epsilon(eps_of: Callable[[float], float], k: int, delta: float, max_evals: int = 24) -> Tuple[float, float, float]:
    """(user-level ε at `delta`, the example-level δ' used, the example-level ε' at δ') for groups
    of `k` by Vadhan's Lemma 2.2, (ε', δ') -> (k·ε', k·e^{(k−1)ε'}·δ'): the largest δ' found whose
    group δ is ≤ `delta` (to 1e-6 relative in the group δ), and ε_user = k·ε'(δ'). `eps_of(δ')` is
    the example-level curve (one PLD evaluation a call). The search runs on x = log δ', where
    F(x) = log k + (k−1)·ε'(e^x) + x − log δ increases (ε' falls as δ' grows): step down from
    log(δ/k) until F ≤ 0, then a secant safeguarded by bisection between the best feasible point
    (F ≤ 0) and the nearest infeasible one. Only feasible points are ever returned."""
    if k == 1:
        e = eps_of(delta)
        return e, delta, e
    evals = [0]

    def f(x: float) -> Tuple[float, float]:
        evals[0] += 1
        e = eps_of(math.exp(x))
        return math.log(k) + (k - 1) * e + x - math.log(delta), e

    hi = math.log(delta / k)  # F(hi) = (k−1)·ε' ≥ 0
    f_hi, _ = f(hi)
    step = max(f_hi, 1e-3)
    x, (fx, e) = hi - step, f(hi - step)
    floor = -690.0  # δ′ ≈ 1e-300: deeper only grows ε′
    while fx > 0 and evals[0] < max_evals and x > floor:
        hi, f_hi = x, fx
        step *= 2
        x = max(floor, x - step)
        fx, e = f(x)
    if fx > 0:  # the conversion certifies nothing at `delta`
        return math.inf, math.exp(x), e
    lo, f_lo, e_lo = x, fx, e
    while f_lo < -1e-6 and evals[0] < max_evals and hi - lo > 1e-12:
        xs = lo - f_lo * (hi - lo) / (f_hi - f_lo) if f_hi > f_lo else 0.5 * (lo + hi)
        if not lo < xs < hi:
            xs = 0.5 * (lo + hi)
        xs = lo + (xs - lo) * (1 - 1e-6)  # just below the secant's root: stays feasible more often
        fs, es = f(xs)
        if fs <= 0:
            lo, f_lo, e_lo = xs, fs, es
        else:
            hi, f_hi = xs, fs
            if f_lo < -1e-3:  # a secant that overshoots: halve the bracket once too
                xm = 0.5 * (lo + hi)
                fm, em = f(xm)
                if fm <= 0:
                    lo, f_lo, e_lo = xm, fm, em
                else:
                    hi, f_hi = xm, fm
    return k * e_lo, math.exp(lo), e_lo


def calibrate_group_sigma(target: float, delta: float, k: int, q: float, steps: int) -> float:
    """The smallest σ whose group-converted user-level ε is ≤ target at δ: example-level DP-SGD
    calibrated to (target/k, δ/(k·e^{(k−1)·target/k})), the conversion at ε' = target/k (a
    bisection on σ over the δ' search above gave the same σ to 1e-4 for K = 4 and 200)."""
    import dpcore.accounting as acc

    return acc.calibrate_noise_multiplier(target / k, delta / (k * math.exp((k - 1) * target / k)), q, steps)


# -- one training run --------------------------------------------------------------------------


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        acc = float((model(x).argmax(1) == y).float().mean())
    model.train()
    return acc


def train_one(pop: Dict[str, Any], method: Dict[str, Any], target: Optional[float], seed: int, args: argparse.Namespace,
              sigmas: Dict[Tuple[str, Optional[float]], float], ledger_dir: str) -> Dict[str, Any]:
    """Trains one (method, target ε, seed); σ from `sigmas` (calibrated on first use and stored)."""
    import dpcore.torch
    from dpcore.sampling import UserIndex

    kind, k = method["kind"], method["k"]
    x, y, ids = pop["x"], pop["y"], pop["ids"]
    torch.manual_seed(seed)
    model = mlp()
    opt: Any = torch.optim.SGD(model.parameters(), lr=args.lr_nonprivate if kind == "nonprivate" else args.lr)
    key = (method["name"], target)
    ledger = os.path.join(tempfile.mkdtemp(dir=ledger_dir), "ledger.jsonl")
    out: Dict[str, Any] = {"method": method["name"], "target_epsilon": target, "seed": seed}
    t0 = time.perf_counter()
    if kind == "nonprivate":
        ds = torch.utils.data.TensorDataset(x, y)
        # drop_last: N mod batch examples would otherwise make a tiny, noisy last step each epoch
        loader: Any = torch.utils.data.DataLoader(ds, batch_size=max(1, len(ds) // STEPS_PER_EPOCH), shuffle=True,
                                                  drop_last=True)
        out["records"] = len(ds)
    elif kind in ("uls", "els"):
        ds = torch.utils.data.TensorDataset(x, y)
        index = UserIndex(ids, len(ds))
        if kind == "uls":
            n_records = index.num_users
            unit = {"examples_per_user": k}
        else:
            n_records = int(np.minimum(index.counts, k).sum())
            unit = {"max_examples_per_user": k}
        bs = max(1, round(n_records / STEPS_PER_EPOCH))
        loader = torch.utils.data.DataLoader(ds, batch_size=bs)
        kw = dict(max_grad_norm=1.0, ledger=ledger, privacy_unit="user", user_ids=ids, **unit)
        if key not in sigmas:
            tc = time.perf_counter()
            model, opt, loader = dpcore.torch.make_private_with_epsilon(
                model, opt, loader, target_epsilon=target, target_delta=DELTA, epochs=args.epochs, **kw)
            sigmas[key] = float(opt.noise_multiplier)
            out["calibration_s"] = time.perf_counter() - tc
        else:
            model, opt, loader = dpcore.torch.make_private(model, opt, loader, noise_multiplier=sigmas[key], **kw)
        out["records"] = n_records
    else:  # example-level DP-SGD, users bounded to k (None: all examples), group privacy with group size k
        if k is None:
            kept = np.arange(len(y))
            group = int(pop["counts"].max())
        else:
            kept = UserIndex(ids, len(y)).bound(k)
            group = k
        kt = torch.from_numpy(kept)
        ds = torch.utils.data.TensorDataset(x[kt], y[kt])
        bs = max(1, round(len(ds) / STEPS_PER_EPOCH))
        loader = torch.utils.data.DataLoader(ds, batch_size=bs)
        steps = args.epochs * STEPS_PER_EPOCH
        if key not in sigmas:
            tc = time.perf_counter()
            sigmas[key] = calibrate_group_sigma(target, DELTA, group, min(1.0, bs / len(ds)), steps)
            out["calibration_s"] = time.perf_counter() - tc
        model, opt, loader = dpcore.torch.make_private(model, opt, loader, noise_multiplier=sigmas[key],
                                                       max_grad_norm=1.0, ledger=ledger)
        out["records"] = len(ds)
        out["group_size"] = group
    out["batch_size"] = bs if kind != "nonprivate" else loader.batch_size
    out["sigma"] = sigmas.get(key)
    tt = time.perf_counter()
    steps_done = 0
    for _ in range(args.epochs):
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            steps_done += 1
    out["train_s"] = time.perf_counter() - tt
    out["steps"] = steps_done
    out["test_accuracy"] = accuracy(model, pop["x_test"], pop["y_test"])
    te = time.perf_counter()
    if kind in ("uls", "els"):
        out["epsilon_spent"] = float(opt.get_epsilon(DELTA))
        out["ledger_unit"] = opt.ledger.privacy_unit
        if kind == "els" and seed == 0:
            # cross-check: the same run (σ, q, steps) accounted at example level and converted by
            # group privacy with group size K (must come out looser than the mixture of Gaussians)
            import dpcore.accounting as acc

            q, steps = min(1.0, bs / out["records"]), steps_done
            e, _, _ = group_epsilon(lambda d: acc.epsilon(q, sigmas[key], steps, d), k, DELTA)
            out["group_privacy_epsilon_same_sigma"] = e
    elif kind == "group":
        curve = lambda d: float(opt.get_epsilon(d))  # noqa: E731  the run's example-level ledger
        helper = _group_helper()
        if helper is not None and args.group_helper:
            out["epsilon_spent"] = float(helper(curve, out["group_size"], DELTA))
            out["group_method"] = f"dpcore.accounting.{helper.__name__} (Vadhan 2017 Lemma 2.2)"
            if seed == 0:  # the bench's own search beside it, once per (method, ε)
                out["epsilon_spent_bench_search"] = group_epsilon(curve, out["group_size"], DELTA)[0]
        else:
            e, d, e_ex = group_epsilon(curve, out["group_size"], DELTA)
            out.update(epsilon_spent=e, example_delta=d, example_epsilon=e_ex, group_method=GROUP_DELTA_NOTE)
        out["ledger_unit"] = opt.ledger.privacy_unit
    out["epsilon_s"] = time.perf_counter() - te
    out["total_s"] = time.perf_counter() - t0
    if hasattr(opt, "engine"):
        opt.engine.remove()
    return out


def _mean_std(v: List[float]) -> Tuple[float, float]:
    return statistics.mean(v), (statistics.stdev(v) if len(v) > 1 else 0.0)


def run_accuracy(args: argparse.Namespace, log: Callable[[str], None]) -> Dict[str, Any]:
    torch.set_num_threads(args.train_threads)
    pop = population(args.users, args.test_users)
    desc = describe_population(pop)
    log(f"population: {desc}")
    ms = methods(args.quick)
    sigmas: Dict[Tuple[str, Optional[float]], float] = {}
    runs: List[Dict[str, Any]] = []
    ledger_dir = tempfile.mkdtemp(prefix="bench-user-level-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    t0 = time.perf_counter()
    try:
        for seed in range(args.seeds):
            for m in ms:
                for target in ([None] if m["kind"] == "nonprivate" else args.epsilons):
                    try:
                        r = train_one(pop, m, target, seed, args, sigmas, ledger_dir)
                    except Exception as e:  # shown in the tables, not raised
                        if args.raise_errors:
                            raise
                        first = (str(e).strip().splitlines() or [""])[0]
                        r = {"method": m["name"], "target_epsilon": target, "seed": seed,
                             "error": f"{type(e).__name__}: {first[:300]}"}
                    runs.append(r)
                    status = r.get("error") or (f"acc {r['test_accuracy']:.3f} sigma {r['sigma']} eps "
                                                f"{r.get('epsilon_spent')} ({r['total_s']:.1f} s)")
                    log(f"[{time.perf_counter() - t0:6.0f} s] seed {seed} {m['name']} eps={target}: {status}")
    finally:
        import shutil

        shutil.rmtree(ledger_dir, ignore_errors=True)
    return {"population": desc, "methods": ms, "runs": runs, "seconds": time.perf_counter() - t0}


def accuracy_tables(res: Dict[str, Any], args: argparse.Namespace) -> str:
    d = res["population"]
    eps = args.epsilons
    lines = [
        HOW_BUILT,
        "",
        f"Population: {d['users']} training users, {d['examples']} examples (per user min {d['min_count']}, median "
        f"{d['median_count']:.0f}, mean {d['mean_count']:.1f}, p90 {d['p90_count']:.0f}, p99 {d['p99_count']:.0f}, "
        f"max {d['max_count']} ({d['users_at_max']} users at the max); the top 1% of users hold "
        f"{100 * d['share_of_examples_top_1pct_users']:.0f}% of the examples); test: {d['test_users']} held-out users, "
        f"{d['test_examples']} examples. MLP 64-64-10, SGD lr {args.lr} (non-private {args.lr_nonprivate}), C = 1, "
        f"{args.epochs} epochs x {STEPS_PER_EPOCH} Poisson steps (q = 1/{STEPS_PER_EPOCH} of each method's records: "
        f"users for ULS, kept examples otherwise), δ = {DELTA:g} (user level); σ calibrated once per method and ε.",
        "",
    ]
    by: Dict[Tuple[str, Any], List[Dict[str, Any]]] = {}
    for r in res["runs"]:
        by.setdefault((r["method"], r["target_epsilon"]), []).append(r)

    def first_ok(rs: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        return next((r for r in rs if "error" not in r), None)

    # ε table
    lines.append("User-level ε at δ = %g: σ calibrated for the target, ε spent from the run's ledger" % DELTA)
    lines.append("")
    head = "| method | records (per-step batch) |" + "".join(f" ε={e:g}: σ | ε spent |" for e in eps)
    lines += [head, "|" + "---|" * (2 + 2 * len(eps))]
    for m in res["methods"]:
        if m["kind"] == "nonprivate":
            continue
        rs = [first_ok(by.get((m["name"], e), [])) for e in eps]
        r0 = next((r for r in rs if r), None)
        recs = f"{r0['records']} ({r0['batch_size']})" if r0 else "-"
        cells = []
        for e, r in zip(eps, rs):
            if r is None:
                err = (by.get((m["name"], e)) or [{"error": "not run"}])[0].get("error", "")
                cells += ["failed", err[:80]]
            else:
                spent = {round(x["epsilon_spent"], 4) for x in by[(m["name"], e)] if "epsilon_spent" in x}
                s = f"{r['epsilon_spent']:.3f}" + ("" if len(spent) <= 1 else " (varies)")
                cells += [f"{r['sigma']:.3f}", s]
        lines.append(f"| {m['name']} | {recs} | " + " | ".join(cells) + " |")
    lines.append("")
    # accuracy table
    n_seeds = args.seeds
    lines.append(f"Test accuracy (held-out users), mean ± std over {n_seeds} seed(s)")
    lines.append("")
    lines += ["| method |" + "".join(f" ε={e:g} |" for e in eps) + " ε=∞ |", "|" + "---|" * (2 + len(eps))]
    for m in res["methods"]:
        cells = []
        for e in (eps if m["kind"] != "nonprivate" else []):
            acc = [r["test_accuracy"] for r in by.get((m["name"], e), []) if "error" not in r]
            cells.append(f"{_mean_std(acc)[0]:.3f} ± {_mean_std(acc)[1]:.3f} (n={len(acc)})" if acc else "failed")
        if m["kind"] == "nonprivate":
            acc = [r["test_accuracy"] for r in by.get((m["name"], None), []) if "error" not in r]
            cells = ["-"] * len(eps) + [f"{_mean_std(acc)[0]:.3f} ± {_mean_std(acc)[1]:.3f} (n={len(acc)})" if acc else "failed"]
        else:
            cells.append("-")
        lines.append(f"| {m['name']} | " + " | ".join(cells) + " |")
    lines.append("")
    gm = {r.get("group_method") for r in res["runs"] if r.get("group_method")}
    if gm:
        lines.append(f"Group privacy for the example-level rows: {', '.join(sorted(gm))} (group size K; 'all': the "
                     "largest user's count, no bound).")
        own = [(r["epsilon_spent"], r["epsilon_spent_bench_search"]) for r in res["runs"]
               if "epsilon_spent_bench_search" in r]
        if own:
            worst = max(abs(a / b - 1) for a, b in own if math.isfinite(a) and math.isfinite(b))
            lines.append(f"The bench's own δ′ search on the same ledgers: within {worst:.1e} (relative) of it.")
        lines.append("")
    cross = [r for r in res["runs"] if "group_privacy_epsilon_same_sigma" in r]
    if cross:
        lines += [
            "Cross-check: each ELS run (seed 0) accounted as example-level DP-SGD with the same σ, q and steps, converted "
            "by group privacy with group size K (the bench's δ′ search); it must come out looser than ELS's own ε",
            "",
            "| method | target ε | σ | ELS ε (mixture of Gaussians) | group-privacy ε, same run | looser |",
            "|---|---|---|---|---|---|",
        ]
        for r in cross:
            g, e = r["group_privacy_epsilon_same_sigma"], r["epsilon_spent"]
            gs = f"{g:.3f}" if math.isfinite(g) else "∞ (certifies nothing at this δ)"
            ratio = f" ({g / e:.2f}x)" if math.isfinite(g) else ""
            lines.append(f"| {r['method']} | {r['target_epsilon']:g} | {r['sigma']:.3f} | {e:.3f} | {gs} | "
                         f"{'yes' if g > e else 'NO'}{ratio} |")
        lines.append("")
    return "\n".join(lines)


# -- step time on the transformer ---------------------------------------------------------------


def step_time(args: argparse.Namespace, log: Callable[[str], None]) -> Dict[str, Any]:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    import dpcore.torch
    from bench_torch import RECORDS_PER_BATCH, _build, _forever

    configs: Dict[str, Dict[str, Any]] = {}
    for name in ("example", "ULS k=4"):
        model, b, make = _build("transformer")  # the same seed each time: identical weights and data
        model = model.to(device)
        x, y = make(RECORDS_PER_BATCH * b)  # 1600 records
        ds = torch.utils.data.TensorDataset(x, y)
        opt: Any = torch.optim.SGD(model.parameters(), lr=0.01)
        if name == "example":
            loader = torch.utils.data.DataLoader(ds, batch_size=b)
            model, opt, loader = dpcore.torch.make_private(model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0)
        else:
            per_user, k = 8, 4
            ids = np.repeat(np.arange(len(ds) // per_user), per_user)  # 200 users of 8 examples
            loader = torch.utils.data.DataLoader(ds, batch_size=b // k)  # 8 users a step: 32 examples expected
            model, opt, loader = dpcore.torch.make_private(model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0,
                                                           privacy_unit="user", user_ids=ids, examples_per_user=k)
        crit = nn.CrossEntropyLoss()
        batches = _forever(loader)

        def step(model=model, opt=opt, batches=batches, crit=crit) -> int:
            xb, yb = next(batches)
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            opt.zero_grad()
            crit(model(xb), yb).backward()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            return len(yb)

        configs[name] = {"step": step, "times": [], "cpu": [], "examples": []}
    for name, c in configs.items():
        for _ in range(args.warmup):
            c["step"]()
    names = list(configs)
    for rnd in range(args.rounds):
        order = names if rnd % 2 == 0 else names[::-1]
        for name in order:
            c = configs[name]
            for _ in range(args.steps_per_round):
                t, p = time.perf_counter(), time.process_time()
                n = c["step"]()
                c["times"].append((time.perf_counter() - t) * 1e3)
                c["cpu"].append((time.process_time() - p) * 1e3)
                c["examples"].append(n)
        log(f"step time round {rnd + 1}/{args.rounds}: " + ", ".join(
            f"{n} {statistics.median(configs[n]['times']):.0f} ms" for n in names))
    out = {}
    for name, c in configs.items():
        out[name] = {"times_ms": c["times"], "cpu_ms": c["cpu"], "examples": c["examples"],
                     "median_ms": statistics.median(c["times"]), "median_cpu_ms": statistics.median(c["cpu"]),
                     "mean_examples": statistics.mean(c["examples"]), "steps": len(c["times"]),
                     "ms_per_example": sum(c["times"]) / max(1, sum(c["examples"])),
                     "ms_at_32": _fit_at(c["examples"], c["times"], 32.0)}
    return out


def _fit_at(n: List[int], t: List[float], at: float) -> Optional[float]:
    """A line t = a + b·n through the steps' (examples, ms), evaluated at `at` examples: both
    configurations compared at the same number of examples a step, whatever their Poisson batch
    sizes came out as. Theil–Sen (b the median of the pairwise slopes, a the median of t − b·n),
    so that a few steps slowed by other processes do not tilt it. None with fewer than 3 steps
    or a single batch size."""
    x, y = np.asarray(n, float), np.asarray(t, float)
    if len(x) < 3 or len(set(n)) < 2:
        return None
    i, j = np.triu_indices(len(x), 1)
    keep = x[i] != x[j]
    b = float(np.median((y[j] - y[i])[keep] / (x[j] - x[i])[keep]))
    a = float(np.median(y - b * x))
    return a + b * at


def step_table(res: Dict[str, Any], args: argparse.Namespace) -> str:
    base = res["example"]
    lines = [
        f"Step time, bench_torch.py's transformer (2 x TransformerEncoderLayer(256), length 128), {args.device}, "
        f"{args.threads} threads: {args.warmup} warm-up steps each, then {args.rounds} alternating rounds of "
        f"{args.steps_per_round} steps each; medians",
        "",
        "| configuration | median ms | vs example | cpu ms | (ratio) | examples/step (mean) | ms per example | (ratio) | "
        "fit: ms at 32 examples | (ratio) | steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in res.items():
        fit, fb = r.get("ms_at_32"), base.get("ms_at_32")
        fit_cells = f"{fit:.1f} | {fit / fb:.2f}x" if fit and fb else "- | -"
        lines.append(
            f"| {name} | {r['median_ms']:.1f} | {r['median_ms'] / base['median_ms']:.2f}x | {r['median_cpu_ms']:.1f} | "
            f"{r['median_cpu_ms'] / base['median_cpu_ms']:.2f}x | {r['mean_examples']:.1f} | {r['ms_per_example']:.2f} | "
            f"{r['ms_per_example'] / base['ms_per_example']:.2f}x | {fit_cells} | {r['steps']} |")
    u = res.get("ULS k=4")
    if u:
        ratio = u["median_ms"] / base["median_ms"]
        lines += ["", f"ULS / example-level median step: {ratio:.3f}x (goal <= 1.2x: {'ok' if ratio <= 1.2 else 'MISSED'})"]
        if u.get("ms_at_32") and base.get("ms_at_32"):
            lines.append(f"at 32 examples a step (Theil–Sen fit of ms on examples): {u['ms_at_32'] / base['ms_at_32']:.3f}x")
    return "\n".join(lines)


# -- main --------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, default=None, help="training users (default 2000; --quick 500)")
    ap.add_argument("--test-users", type=int, default=None, help="held-out users (default 500; --quick 200)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per (method, ε) (default 5; --quick 1)")
    ap.add_argument("--epochs", type=int, default=None, help=f"epochs of {STEPS_PER_EPOCH} steps (default 10; --quick 3)")
    ap.add_argument("--epsilons", type=float, nargs="+", default=list(EPSILONS))
    ap.add_argument("--lr", type=float, default=1.0, help="SGD learning rate of the DP runs")
    ap.add_argument("--lr-nonprivate", type=float, default=0.3, help="SGD learning rate of the non-private reference")
    ap.add_argument("--rounds", type=int, default=None, help="step-time rounds (default 12; --quick 1)")
    ap.add_argument("--steps-per-round", type=int, default=None, help="default 4; --quick 2")
    ap.add_argument("--warmup", type=int, default=None, help="default 2; --quick 1")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the step-time part")
    ap.add_argument("--train-threads", type=int, default=1,
                    help="torch threads of the accuracy part (the MLP is tiny: a second thread only waits)")
    ap.add_argument("--device", default="cpu", help="the step-time part's device (cuda on a GPU)")
    ap.add_argument("--quick", action="store_true", help="a smoke run under a minute")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--skip-step", action="store_true")
    ap.add_argument("--no-group-helper", dest="group_helper", action="store_false",
                    help="use the bench's own group-privacy conversion even if dpcore.accounting has one")
    ap.add_argument("--raise-errors", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write every result to this file")
    args = ap.parse_args()
    quick = dict(users=500, test_users=200, seeds=1, epochs=3, rounds=1, steps_per_round=2, warmup=1)
    full = dict(users=2000, test_users=500, seeds=5, epochs=10, rounds=12, steps_per_round=4, warmup=2)
    fill_defaults(args, quick, full)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    print(f"torch {torch.__version__}, step time on {args.device}, {args.threads} threads, load average {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} cores")
    out: Dict[str, Any] = {"args": vars(args), "delta": DELTA}
    run_parts(out, [(args.skip_accuracy, "accuracy", run_accuracy, accuracy_tables),
                    (args.skip_step, "step_time", step_time, step_table)], args)
    finish(out, t0, args.json)


if __name__ == "__main__":
    main()
