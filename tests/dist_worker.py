"""One rank of the data-parallel tests (tests/test_torch_distributed.py starts two of these).

Usage: python dist_worker.py SCENARIO OUTDIR [key=value ...]; the rank and world come from the
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), as torchrun sets them. Each rank writes
OUTDIR/rank{r}.pt with what the test compares.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import dpcore
from dpcore.torch import DistributedError, make_private

N, D, K = 240, 12, 3


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g)
    y = torch.randint(0, K, (N,), generator=g)
    return TensorDataset(x, y)


def model(init_seed: int, kind: str = "mlp") -> torch.nn.Module:
    torch.manual_seed(init_seed)
    if kind == "conv":  # a convolution and a GroupNorm (the rules an empty batch crashed)
        return torch.nn.Sequential(
            torch.nn.Unflatten(1, (3, 2, 2)), torch.nn.Conv2d(3, 32, 2, padding=1), torch.nn.GroupNorm(4, 32),
            torch.nn.Tanh(), torch.nn.Flatten(), torch.nn.Linear(32 * 9, K),
        )
    return torch.nn.Sequential(torch.nn.Linear(D, 16), torch.nn.Tanh(), torch.nn.Linear(16, K))


def user_ids():
    """The user of each of the N examples (user-level tests): 60 users with 1 to 9 examples, in
    no particular order."""
    import numpy as np

    rng = np.random.default_rng(5)
    counts = np.concatenate([np.full(20, 1), np.full(20, 3), rng.integers(4, 10, 20)])
    counts[-1] += N - counts.sum()
    return rng.permutation(np.repeat(np.arange(60), counts))


def empty_steps(opts: dict, rank: int) -> set:
    """The logical steps at which this rank's batch is replaced by an empty one (``empty0=1,3``:
    rank 0 at steps 1 and 3), as a Poisson sample of no record would be."""
    v = opts.get(f"empty{rank}", "")
    return {int(s) for s in v.split(",") if s}


def adaptive_query(clip: float, z: float, batch: int, n: int):
    """The adaptive-clipping query of the tests (its count is summed over the ranks)."""
    from dpcore.queries import QuantileAdaptiveClipQuery

    q = batch / n
    return QuantileAdaptiveClipQuery(
        initial_l2_norm_clip=clip, noise_multiplier=z, target_unclipped_quantile=0.5, learning_rate=0.2,
        clipped_count_stddev=0.0, expected_num_records=q * n, denominator=q * n,
    )


def start(default_steps: int) -> tuple:
    """The rank's start-up, shared with fsdp_worker.py: (scenario, out, opts, rank, steps, batch,
    noise, clip, seed, ledger), after joining the gloo process group."""
    scenario, out = sys.argv[1], sys.argv[2]
    opts = dict(a.split("=", 1) for a in sys.argv[3:])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(opts.get("timeout", 60))))
    seed = int(opts["seed"]) if "seed" in opts else None
    return (
        scenario, out, opts, dist.get_rank(), int(opts.get("steps", default_steps)), int(opts.get("batch", 48)),
        float(opts.get("noise", 0.0)), float(opts.get("clip", 0.5)), seed,
        opts.get("ledger", os.path.join(out, "ledger.jsonl")),
    )


def greybox(out: str, opts: dict, rank: int, make_model) -> None:
    """The grey-box neighbour harness run on every rank in step (the same sequence of runs on
    each, so that their collectives meet): 3 Poisson steps of data-parallel (or FSDP2) DP-SGD on
    D and on each neighbour, the population size declared; the findings saved."""
    from dpcore.audit import neighbour_audit

    g = torch.Generator().manual_seed(1)
    n = 48
    x, y = torch.randn(n, D, generator=g).numpy(), torch.randint(0, K, (n,), generator=g).numpy()
    runs = [0]

    def train(cols, seed):
        xs, ys = cols
        net = make_model()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        runs[0] += 1
        kw = {"max_physical_batch_size": int(opts["physical"])} if "physical" in opts else {}
        data = DataLoader(TensorDataset(torch.from_numpy(xs), torch.from_numpy(ys)), batch_size=16)
        net, opt, loader = make_private(net, opt, data, noise_multiplier=1.0, max_grad_norm=1.0, seed=seed,
                                        ledger=os.path.join(out, f"greybox{runs[0]}.jsonl"), population_size=n, **kw)
        loader.steps = 3
        for xb, yb in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(xb), yb).backward()
            opt.step()

    res = neighbour_audit(train, (x, y), ("remove", "add", "replace", "nan", "inf", "huge", "zero"))
    torch.save({"findings": [str(f) for f in res.findings], "table": res.table(),
                "releases": [r.releases for r in res.runs], "ratios": [r.max_ratio for r in res.runs]},
               os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    scenario, out, opts, rank, steps, batch, z, clip, seed, ledger = start(5)
    if scenario == "greybox":
        return greybox(out, opts, rank, lambda: model(100 + rank))
    # Different initial weights on each rank: make_private must start every rank from rank 0's.
    net: torch.nn.Module = model(100 + rank, opts.get("model", "mlp"))
    if opts.get("ddp") == "1":
        net = torch.nn.parallel.DistributedDataParallel(net)
    kw = {}
    if "physical" in opts:
        kw["max_physical_batch_size"] = int(opts["physical"])
    if "on_nonfinite" in opts:
        kw["on_nonfinite"] = opts["on_nonfinite"]
    if "memory" in opts:
        kw["memory"] = opts["memory"]
    if scenario == "noise":
        net = torch.nn.Linear(200, 100)
        ds = TensorDataset(torch.randn(N, 200), torch.zeros(N, 100))
    else:
        ds = dataset()
    if "users" in opts:  # the privacy unit "user": users sampled, at most k examples each
        kw.update(privacy_unit="user", user_ids=user_ids(), examples_per_user=int(opts["users"]))
    if opts.get("adaptive") == "1":
        kw["query"] = adaptive_query(clip, z, batch, N)
    else:
        kw["noise_multiplier"], kw["max_grad_norm"] = z, clip
    opt = torch.optim.SGD(net.parameters(), lr=float(opts.get("lr", 0.5 if scenario != "noise" else 1.0)))
    reduction = opts.get("reduction", "mean")
    net, opt, loader = make_private(net, opt, DataLoader(ds, batch_size=batch), ledger=ledger, seed=seed,
                                    loss_reduction=reduction, **kw)
    loader.steps = steps
    result: dict = {"indices": [], "sizes": [], "errors": None, "completed": 0, "clips": [], "groups": []}
    emptied = empty_steps(opts, rank)
    # the common loop: forward and backward also on an empty batch (else skipped, as the docs allow)
    always = opts.get("always_backward") == "1"
    before = [p.detach().clone() for p in net.parameters()]
    cur: list = []
    die_after = int(opts.get("die_after", -1))
    nan_at = int(opts.get("nan_at", -1))
    t0 = time.monotonic()
    try:
        for x, y in loader:
            idx = loader.last_indices.copy()
            if result["completed"] in emptied:
                x, y, idx = x[:0], y[:0], idx[:0]
            cur.append(idx)
            if getattr(loader, "record_groups", None) is not None:
                result["groups"].append(loader.record_groups.copy())
            opt.zero_grad()
            if rank == 1 and result["completed"] == nan_at and len(x):
                x = x.clone()
                x[0] = float("nan")  # a bad record on one rank only
            if len(x) or always:
                out_ = net(x)
                if scenario == "noise":
                    loss = (out_ * 0.0).sum()
                else:
                    loss = torch.nn.functional.cross_entropy(out_, y, reduction=reduction)
                loss.backward()
            opt.step()
            if opt.last_step_released:
                import numpy as np

                result["indices"].append(np.concatenate(cur) if cur else np.zeros(0, np.int64))
                result["sizes"].append(sum(len(c) for c in cur))
                cur = []
                result["completed"] += 1
                result["clips"].append(opt._groups[0].plan().l2_norm_clip)
                if rank == 1 and result["completed"] == die_after:
                    os._exit(3)  # dies between steps, without a word to the others
    except (DistributedError, ValueError) as e:
        result["errors"] = f"{type(e).__name__}: {e}"
        result["error_after_s"] = time.monotonic() - t0
    result["params"] = [p.detach().clone() for p in net.parameters()]
    result["before"] = before
    result["updates"] = [b - a for a, b in zip(result["params"], before)]
    result["ledger_path"] = opt.ledger.path
    finish(result, opt, out, rank, z * clip / (batch / N * N))


def finish(result: dict, opt, out: str, rank: int, noise_std: float) -> None:
    """What every worker saves of its optimizer's ledger, then the save and, after a run without
    error, the barrier and the end of the process group (shared with fsdp_worker.py)."""
    result["epsilon"] = opt.get_epsilon(1e-5)
    result["replica"] = opt.ledger.is_replica
    result["releases"] = opt.ledger.num_releases
    result["noise_std"] = noise_std
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    if result["errors"] is None:
        dist.barrier()
        dist.destroy_process_group()
    else:
        # After a failed step the process group may hold a peer that is gone or about to go;
        # gloo's teardown at interpreter exit then sometimes aborts ("terminate called without
        # an active exception", exit -6) after everything above was saved. The test judges what
        # was saved, so the process leaves without that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
