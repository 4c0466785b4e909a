"""One gloo process group per test module: a pool of rank processes that run test functions.

A test module sets ``WORLD_SIZE`` and uses the ``dist`` fixture (see ``conftest.py``);
``dist.run(fn, *args)`` runs the module-level function ``fn(*args)`` on every rank
and returns the per-rank results, raising with each failing rank's traceback.
Rendezvous is a ``file://`` URL in a temporary directory: no TCP port is fixed.

Ranks are forked from one ``forkserver`` that imported torch and hyper_parallel once
for the whole test session: a module's pool then starts in well under a second,
where spawning fresh interpreters cost 10-20 s per module on a 2-core machine (each
rank imports torch again). A forked rank starts from the server's fresh imports, not
from the test process's state, as a spawned one would.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

_READY = "__ready__"
# Imported once by the fork server; every rank starts from them.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "hyper_parallel",
    "tests.distributed.harness",
]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # no effect once the server runs
    return ctx


def _worker(rank: int, world_size: int, init_file: str, tasks: Any, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    results.put((rank, True, _READY))
    while True:
        try:
            item = tasks.get()
        except (EOFError, OSError):  # the test process is gone: do not linger
            break
        if item is None:
            break
        fn, args = item
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # report every failure to the test process
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class DistributedPool:
    """``world_size`` rank processes sharing one gloo process group."""

    def __init__(self, world_size: int, timeout: float = 240.0) -> None:
        self.world_size = world_size
        self.timeout = timeout
        ctx = _context()
        self._dir = tempfile.TemporaryDirectory(prefix="hp_dist_")
        init_file = os.path.join(self._dir.name, "rendezvous")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, init_file, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect()

    def _collect(self) -> list[Any]:
        out: dict[int, Any] = {}
        failures: list[str] = []
        while len(out) + len(failures) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=self.timeout)
            except queue.Empty:
                self.close(force=True)
                raise TimeoutError(
                    f"distributed pool: no answer from some rank within {self.timeout}s "
                    "(a collective mismatch hangs the others); pool closed."
                ) from None
            if ok:
                out[rank] = value
            else:
                failures.append(f"--- rank {rank} ---\n{value}")
        if failures:
            # The others may be stuck in a collective the failing rank skipped.
            self.close(force=True)
            raise AssertionError("failure on rank(s):\n" + "\n".join(failures))
        return [out[r] for r in range(self.world_size)]

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run ``fn(*args)`` on every rank; returns the results in rank order."""
        if not self._procs:
            raise RuntimeError("distributed pool is closed (an earlier test failed on a rank)")
        for q in self._tasks:
            q.put((fn, args))
        return self._collect()

    def close(self, force: bool = False) -> None:
        if not self._procs:
            return
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=30)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []
        self._dir.cleanup()
