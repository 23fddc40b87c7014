"""What the engine's autograd functions ask of the autograd state: which backward pass is
running, whether torch.func transforms are active, and whether a lean norm pass is running
(its graph is run again by the sum pass, so a node must not free what it saved). Imports
nothing of dpcore: the rules, the recurrent kernels and the lean passes all sit above it."""

from __future__ import annotations

import threading

import torch

__all__ = ["graph_task", "functorch_active", "retaining_graph", "retaining"]


def graph_task() -> int:
    """The id of the backward pass running on this thread (-1 outside one)."""
    f = getattr(torch._C, "_current_graph_task_id", None)
    return int(f()) if f is not None else -1


def functorch_active() -> bool:
    f = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(f()) if f is not None else False


class _Retaining(threading.local):
    depth = 0


_retaining = _Retaining()


def retaining_graph() -> bool:
    """Whether a lean norm pass is running on this thread: its graph is run again by the sum
    pass, so a node must not free what it saved (as ``retain_graph=True`` asks of autograd's own)."""
    return _retaining.depth > 0


class retaining:
    """The block of a lean norm pass (see :func:`retaining_graph`)."""

    def __enter__(self) -> None:
        _retaining.depth += 1

    def __exit__(self, *exc: object) -> None:
        _retaining.depth -= 1
