"""Counting what a training step asks of the device: the aten operators it dispatches and those
of them that force a device→host synchronisation on CUDA.

On a GPU a DP step is bound by the host when it launches many small kernels or waits for the
device (a ``.item()``, a boolean mask, ``torch.unique``): the device idles while Python runs.
Both can be counted on any machine, CPU included, with a ``TorchDispatchMode``: every operator
that reaches the dispatcher is one kernel launch (or more) on CUDA, and the operators listed in
:data:`SYNC_OPS` (and a boolean-mask ``index``/``index_put``, a ``repeat_interleave`` without
``output_size``) read the device before they can return. ``tests/test_torch_sync.py`` asserts
the counts; ``benches/bench_step_ops.py`` prints them against non-private torch and Opacus.

    from dpcore.torch.opcount import OpCounter
    with OpCounter() as c:
        step()
    print(c.total, c.syncs, c.sync_ops)
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, Dict, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "SYNC_OPS", "fused", "is_sync"]

#: Operators that read a device tensor's values on the host before returning (on CUDA), by
#: their overload packet's name.
SYNC_OPS = frozenset({
    "_local_scalar_dense", "item", "nonzero", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive",
    "equal", "masked_select", "bincount", "is_nonzero", "allclose",
})
# Free of device reads whatever their arguments: views and metadata, which never launch a kernel
# either (not counted as operators).
_METADATA = frozenset({
    "view", "_unsafe_view", "reshape", "expand", "as_strided", "t", "transpose", "permute", "unsqueeze",
    "squeeze", "select", "slice", "detach", "alias", "_reshape_alias", "split", "split_with_sizes", "unbind",
    "chunk", "narrow", "diagonal", "unfold", "view_as_real", "view_as_complex", "lift_fresh",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type",
    "set_", "resize_", "_fw_primal", "_make_dual", "_unpack_dual", "_conj", "_neg_view", "conj", "numpy_T",
    "expand_as", "view_as", "flatten", "unflatten", "movedim", "swapaxes",
})


def is_sync(func: Any, args: Any, kwargs: Optional[Dict[str, Any]]) -> bool:
    """Whether dispatching ``func(*args, **kwargs)`` waits for the device on CUDA."""
    name = func.overloadpacket.__name__
    if name in SYNC_OPS or name.rstrip("_") in SYNC_OPS:
        return True
    kwargs = kwargs or {}
    if name in ("index", "index_put", "index_put_", "_index_put_impl", "_index_put_impl_", "_unsafe_index_put"):
        # a boolean mask's number of true elements is the result's size
        idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (idx or ()) if i is not None)
    if name == "repeat_interleave":
        # repeat_interleave.Tensor(repeats): the output's length is the repeats' sum, read on the
        # host unless output_size is given (the self_Tensor form decomposes into this one)
        return func._overloadname == "Tensor" and kwargs.get("output_size") is None
    return False


class OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched inside the ``with`` block and those that
    synchronise on CUDA (:func:`is_sync`).

    ``total``: every operator dispatched (views and metadata included: each costs host time,
    the dispatcher's and Python's, though none launches a kernel); ``kernels``: those that are
    not views or metadata; ``ops``: a Counter by operator name; ``syncs`` and ``sync_ops``: the
    synchronising ones. Autograd's backward operators are counted too when ``backward()`` runs
    inside the block. A region marked with :func:`fused` counts as one kernel (the code that
    an accelerator runs compiled). The mode is thread-local: work on another thread (dpcore's
    noise drawn ahead) is not seen."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.sync_ops: Counter = Counter()
        self.views = 0
        self._paused = 0

    @property
    def total(self) -> int:
        return sum(self.ops.values()) + self.views

    @property
    def kernels(self) -> int:
        return sum(self.ops.values())

    @property
    def syncs(self) -> int:
        return sum(self.sync_ops.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self._paused:
            name = func.overloadpacket.__name__
            if name.rstrip("_") in _METADATA or name in _METADATA:
                self.views += 1
            else:
                self.ops[name] += 1
            if is_sync(func, args, kwargs):
                self.sync_ops[name] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def fused(name: str) -> Iterator[None]:
    """Inside an :class:`OpCounter`, the operators of the block count as one kernel ``name``:
    for code that runs as one compiled kernel on an accelerator (the ChaCha20 block function,
    ``torch.compile``d there) and eagerly on CPU, so that a CPU count is the device's."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    mode = _get_current_dispatch_mode()
    if not isinstance(mode, OpCounter):
        yield
        return
    mode.ops[name] += 1
    mode._paused += 1
    try:
        yield
    finally:
        mode._paused -= 1
