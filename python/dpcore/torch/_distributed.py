"""Data-parallel DP-SGD over ``torch.distributed`` (gloo on CPU, NCCL on GPUs).

The mechanism is the single-process one (Abadi et al. 2016, Algorithm 1, with the
fixed-denominator average of McMahan et al. 2018, §3), cut across W ranks:

* **Sampling.** Rank r holds the records i with i mod W = r and draws its Poisson sample of that
  shard at the same rate q from its own ChaCha20 stream (keyed from the OS). Records join
  independently, so the union over the ranks is one Poisson sample of all N records at rate q:
  the sample the accountant assumes, recorded once as (N, q).
* **Clipping** stays per record, on each rank. The clipped sums, already divided by the global
  expected batch size q·N, are added across the ranks by one all-reduce.
* **Noise once.** Only rank 0 adds the Gaussian noise of the release, drawn from its own
  CSPRNG, into its part of that all-reduce. Every rank receives the same noised average
  Σ_i clip(g_i)/(qN) + N(0, (σC/(qN))²): exactly the single-process release, neither √W times
  noisier nor split into per-rank shares that a rank could subtract.
* **Ledger.** Rank 0 writes it, once the all-reduce has succeeded (every rank's records are then
  in the sum) and before any rank applies the update: the other ranks wait for its commit
  message. The other ranks keep an in-memory replica, so ``get_epsilon`` answers everywhere.
* **Faults.** A collective that fails (a rank died, or did not answer within the process
  group's timeout) raises :class:`DistributedError` on the surviving ranks; the step is neither
  recorded nor applied.

**Sharded training (FSDP2).** When the parameters are sharded by
``torch.distributed.fsdp.fully_shard`` (DTensors, ``Shard(0)`` on a one-dimensional mesh over
the W ranks), each rank holds rows [r·c, r·c + n_r) of every parameter, c = ⌈d₀/W⌉ (torch.chunk's
split). The mechanism is the same single-process release, laid out differently:

* per-record norms and the clipped sums come from the gathered (unsharded) weights that FSDP2
  hands each layer's forward; every rank forms the full-shape clipped sum of its own records;
* rank r adds the noise of *its own rows only* (its own ChaCha20 stream, keyed from the OS) to
  its clipped sum, before the reduce-scatter; the reduce-scatter then hands rank r the sum over
  all ranks of rows [r·c, r·c + n_r): Σ_i clip(g_i)/(qN) + N(0, (σC/(qN))²) on those rows. The
  rows of the ranks are disjoint, so every coordinate gets its noise once, and the un-noised
  total of a shard never exists on any rank;
* the failure count, the ledger (rank 0, before any rank applies the update) and the commit
  message are those of data-parallel training; each rank then sets the ``.grad`` of its shards
  and the wrapped optimizer updates them (its state is shard-shaped: about 1/W per rank).
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..ledger import LedgerError, PrivacyLedger
from ._amp import work_dtype

__all__ = ["DistributedError", "Communicator", "ShardLayout", "current_communicator", "is_sharded", "resolve_ledger", "unwrap_ddp"]


class DistributedError(RuntimeError):
    """A collective of a data-parallel DP step failed: a rank died or timed out. Nothing was
    recorded in the ledger or applied to the model for that step."""


def current_communicator(group: Any = None) -> Optional["Communicator"]:
    """The communicator of the initialised default process group (or ``group``), or None in a
    single process (torch.distributed not initialised, or a world of one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size(group) < 2:
        return None
    return Communicator(group)


class Communicator:
    """The collectives of a data-parallel DP step, each failure turned into
    :class:`DistributedError` (nothing else in dpcore talks to ``torch.distributed``)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        # The root's global rank (the default group: 0); collectives address it by global rank.
        self._root = dist.get_global_rank(group, 0) if group is not None else 0
        #: Seconds spent in this communicator's collectives (the bench reads it).
        self.seconds = 0.0

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def _object_device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _run(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        import time

        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        except DistributedError:
            raise
        except Exception as e:  # gloo/NCCL report a dead peer or a timeout as RuntimeError/DistBackendError
            raise DistributedError(
                f"rank {self.rank} of {self.world_size}: {what} failed ({type(e).__name__}: {e}); "
                "a rank died or did not answer within the process group's timeout"
            ) from e
        finally:
            self.seconds += time.perf_counter() - t0

    def share(self, obj: Any, what: str) -> Any:
        """Rank 0's ``obj`` on every rank (a pickled broadcast)."""
        box = [obj if self.is_root else None]
        self._run(what, dist.broadcast_object_list, box, src=self._root, group=self.group, device=self._object_device())
        return box[0]

    def gather(self, obj: Any, what: str) -> List[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        out: List[Any] = [None] * self.world_size
        self._run(what, dist.all_gather_object, out, obj, group=self.group)
        return out

    def sum_(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        """In-place sum over the ranks of each tensor (one all-reduce per tensor: the caller
        passes a few flat buffers)."""
        for t in tensors:
            self._run(what, dist.all_reduce, t, op=dist.ReduceOp.SUM, group=self.group)

    def maximum(self, value: int, what: str) -> int:
        """The largest ``value`` over the ranks."""
        t = torch.tensor([int(value)], dtype=torch.int64, device=self._object_device())
        self._run(what, dist.all_reduce, t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def count(self, flag: bool, device: torch.device, what: str) -> int:
        """How many ranks passed ``flag = True`` (one small all-reduce)."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
        self._run(what, dist.all_reduce, t, op=dist.ReduceOp.SUM, group=self.group)
        return int(t.item())

    def reduce_scatter_(self, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], what: str) -> None:
        """outs[k] = rank r's block (dim 0 cut in W equal blocks) of the sum over the ranks of
        ins[k] (one reduce-scatter per tensor)."""
        for o, i in zip(outs, ins):
            self._run(what, dist.reduce_scatter_tensor, o, i, op=dist.ReduceOp.SUM, group=self.group)

    def commit(self, ok: bool, device: torch.device, what: str) -> bool:
        """Rank 0 tells every rank whether it recorded the release (its ``ok``)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
        self._run(what, dist.broadcast, flag, src=self._root, group=self.group)
        return bool(flag.item())

    def broadcast_module(self, module: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers on every rank, so that the ranks start identical
        (as DistributedDataParallel does at construction)."""
        tensors = [t for t in list(module.parameters()) + list(module.buffers())]
        for dt_dev, group in _by_dtype_device(tensors).items():
            flat = torch.cat([t.detach().reshape(-1) for t in group]) if group else None
            if flat is None:
                continue
            self._run("broadcasting the model from rank 0", dist.broadcast, flat, src=self._root, group=self.group)
            off = 0
            with torch.no_grad():
                for t in group:
                    n = t.numel()
                    t.copy_(flat[off : off + n].view_as(t))
                    off += n


def is_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a DTensor (a parameter sharded by FSDP2's ``fully_shard``)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(p, DTensor)


class ShardLayout:
    """Where this rank's rows of a ``Shard(0)`` parameter sit: the full shape, the block size c
    (dim 0 cut as torch.chunk cuts it, padded to W·c rows for the reduce-scatter) and this
    rank's n_r rows starting at r·c."""

    def __init__(self, p: torch.Tensor, comm: "Communicator") -> None:
        from torch.distributed.tensor import Shard

        mesh, placements = p.device_mesh, tuple(p.placements)
        if mesh.ndim != 1 or len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
            raise NotImplementedError(
                f"a sharded parameter with placements {placements} on a {mesh.ndim}-dimensional mesh: dpcore supports "
                "FSDP2's fully_shard on a one-dimensional mesh (Shard(0)) only"
            )
        if mesh.size() != comm.world_size:
            raise NotImplementedError(
                f"a parameter sharded over {mesh.size()} of the {comm.world_size} ranks: dpcore supports FSDP2 sharding "
                "over the whole process group (no hybrid sharding)"
            )
        self.shape = tuple(p.shape)
        self.world = comm.world_size
        d0 = self.shape[0] if self.shape else 1
        self.block = -(-d0 // self.world)
        local = p.to_local()
        self.rows = int(local.shape[0]) if local.dim() else 1
        self.start = comm.rank * self.block
        if self.rows and self.start + self.rows > d0:
            raise NotImplementedError(f"unexpected shard of a parameter of shape {self.shape}: rows {self.start}+{self.rows}")
        self.mesh, self.placements, self.stride = mesh, placements, p.stride()

    @property
    def local_shape(self) -> Tuple[int, ...]:
        return (self.rows,) + self.shape[1:]

    def padded(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Zeros of W·c rows: the reduce-scatter's input (its first d₀ rows are the full sum)."""
        return torch.zeros((self.world * self.block,) + self.shape[1:], dtype=dtype, device=device)

    def grad(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's rows as the DTensor gradient of the parameter."""
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=torch.Size(self.shape),
                                  stride=self.stride)


def _by_dtype_device(tensors: Sequence[torch.Tensor]) -> Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]]:
    out: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault((t.dtype, t.device), []).append(t)
    return out


def flat_views(params: Sequence[torch.Tensor], flag: bool = False) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Zeroed flat buffers (one per dtype and device) and, for each parameter, a contiguous view
    into one of them shaped like it: accumulating into the views fills the buffers that one
    all-reduce per buffer then sums, with no copy. ``flag``: the first buffer gets one more
    element after the views (each rank puts 1 there when it failed; the sum counts them)."""
    groups = _by_dtype_device(params)
    bufs: List[torch.Tensor] = []
    views: Dict[int, torch.Tensor] = {}
    for (dt, dev), ps in groups.items():
        extra = 1 if flag and not bufs else 0
        # float32 or wider whatever the parameters' dtype: noise and sums are never bfloat16
        buf = torch.zeros(sum(p.numel() for p in ps) + extra, dtype=work_dtype(dt), device=dev)
        bufs.append(buf)
        off = 0
        for p in ps:
            views[id(p)] = buf[off : off + p.numel()].view(p.shape)
            off += p.numel()
    return bufs, [views[id(p)] for p in params]


def _default_ledger_path() -> str:
    """A fresh temporary ledger file for a run given no ``ledger=``, logged once (logger
    ``dpcore``, INFO) so that the user can find it."""
    path = os.path.join(tempfile.mkdtemp(prefix="dpcore-"), "ledger.jsonl")
    logging.getLogger("dpcore").info(
        "no ledger= given: the privacy ledger is %s (a temporary file; pass ledger='run.jsonl' to choose where, "
        "optimizer.ledger.path gives it)", path
    )
    return path


def _unit_checked(ledger: PrivacyLedger, privacy_unit: Optional[str]) -> PrivacyLedger:
    if privacy_unit is not None and ledger.privacy_unit != privacy_unit:
        raise ValueError(
            f"the ledger records privacy unit {ledger.privacy_unit!r} but this run's unit is {privacy_unit!r}: one "
            "ledger holds one unit (give a new ledger for a run of another unit)"
        )
    return ledger


def resolve_ledger(ledger: Any, comm: Optional[Communicator], privacy_unit: Optional[str] = None) -> PrivacyLedger:
    """The ledger of this process from what the user passed (a :class:`PrivacyLedger`, a path,
    or None for a temporary file).

    Under ``torch.distributed`` every rank calls this at the same point (it is one collective):
    rank 0 opens the file and sends its samples, so that a ledger continued after a restart is
    continued on every rank; the other ranks build an in-memory replica (:meth:`PrivacyLedger.
    _replica`) and never open the path. A rank other than 0 given an open ledger gets an error:
    two ranks must not write two ledgers of one run."""
    if ledger is not None and not isinstance(ledger, (PrivacyLedger, str, os.PathLike)):
        raise TypeError(f"ledger must be a dpcore.PrivacyLedger, a path or None, got {type(ledger).__name__}")
    if comm is None:
        if isinstance(ledger, PrivacyLedger):
            return _unit_checked(ledger, privacy_unit)
        if ledger is None:
            ledger = _default_ledger_path()
        return PrivacyLedger(ledger, privacy_unit=privacy_unit)
    if comm.is_root:
        opened: Optional[PrivacyLedger] = None
        err: Optional[BaseException] = None
        try:
            if isinstance(ledger, PrivacyLedger):
                opened = ledger if not ledger.is_replica else None
                if opened is None:
                    raise ValueError("rank 0 was given a replica ledger; give it the ledger's path")
                _unit_checked(opened, privacy_unit)
            else:
                path = ledger if ledger is not None else _default_ledger_path()
                opened = PrivacyLedger(path, privacy_unit=privacy_unit)
        except BaseException as e:
            err = e
        msg = (
            (None, f"{type(err).__name__}: {err}", None)
            if err is not None
            else (opened.path, opened._samples.copy(), opened.privacy_unit)  # type: ignore[union-attr]
        )
        comm.share(msg, "sharing the ledger from rank 0")
        if err is not None:
            raise err
        assert opened is not None
        return opened
    path, payload, unit = comm.share(None, "sharing the ledger from rank 0")
    if path is None:
        raise LedgerError(f"rank 0 could not open the ledger: {payload}")
    if isinstance(ledger, PrivacyLedger):
        if ledger.is_replica:
            return _unit_checked(ledger, privacy_unit)
        raise ValueError(
            f"rank {comm.rank}: under torch.distributed only rank 0 writes the ledger; pass the ledger's path "
            "(the same on every rank) or None on the other ranks, not an open PrivacyLedger"
        )
    return PrivacyLedger._replica(f"<rank {comm.rank} replica of {path}>", payload, unit)


def unwrap_ddp(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a DistributedDataParallel wrapper, with the wrapper's own gradient
    all-reduce switched off (dpcore reduces the clipped sums itself, once); other models as is."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        # What DDP's no_sync() sets for one step, for good: its forward then does not prepare
        # its reducer, and its autograd hooks all-reduce nothing.
        model.require_backward_grad_sync = False
        return model.module
    return model
