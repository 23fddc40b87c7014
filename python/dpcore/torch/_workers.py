"""The background threads of the DP step: each stage that works ahead of the training loop owns
one :class:`Worker` (the independent noise's draws, the ledger writes, a matrix-factorization
stream's draws and buffer updates); this is the one place a thread pool is created."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

__all__ = ["Worker"]


class Worker:
    """One background thread named ``dpcore-<name>``, started by the first :meth:`submit`."""

    def __init__(self, name: str) -> None:
        self.name = f"dpcore-{name}"
        self._pool: Optional[ThreadPoolExecutor] = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.name)
        return self._pool.submit(fn, *args)
