"""Run the configuration matrix: one row per configuration, then a summary (``make matrix``).

Each configuration (:mod:`tests.matrix.configs`: a pairwise covering array over every
switch on 4 ranks, and a few 8-rank runs) is

- ``refused``: the trainer's gate refuses it before any rank builds, and
  ``hyper-parallel validate``, ``plan`` and ``suggest --mesh`` with the same switches
  report the same findings word for word (else ``GATES DIFFER``); or
- ``ran``: built on real gloo ranks, trained 2 steps and held to one device (loss and
  every first-step gradient, :func:`tests.matrix.checks.judge`); the row gives the
  largest loss difference and gradient relative error (against the fp32 one-process
  gradients under bf16); or
- ``WRONG`` (ran, numbers off one device), ``CRASHED`` (a rank raised or hung), or
  ``GATES DIFFER`` (``validate`` refuses a run the trainer accepts, or misses a finding).

The exit status is 0 only when every configuration is refused or ran.

Usage::

    python -m tests.matrix.run_matrix                   # the whole matrix
    python -m tests.matrix.run_matrix --slice 0/4       # every 4th, from the first
    python -m tests.matrix.run_matrix --only 3 17       # by index
    python -m tests.matrix.run_matrix --list            # the configurations and the gate only
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from collections import Counter
from typing import Any

from tests.matrix.checks import gate, judge, train_vs_one_device
from tests.matrix.configs import Config, covering, matrix

__all__ = ["Outcome", "main", "run_one"]

RANK_TIMEOUT_S = 600.0


@dataclasses.dataclass
class Outcome:
    """What one configuration did."""

    config: Config
    status: str  # refused | ran | WRONG | CRASHED | GATES DIFFER
    detail: str = ""
    loss_err: float | None = None
    grad_rel: float | None = None
    seconds: float = 0.0

    def row(self) -> str:
        numbers = ""
        if self.loss_err is not None:
            numbers = f"loss {self.loss_err:.2e} grad_rel {self.grad_rel:.2e}  "
        return (
            f"#{self.config.index:<3d} {self.status:<12s} {self.seconds:6.1f}s  "
            f"{self.config.describe():<72s} {numbers}{self.detail}"
        )


class _Pools:
    """One gloo pool per world size, replaced after a rank failure."""

    def __init__(self) -> None:
        self.pools: dict[int, Any] = {}

    def run(self, world_size: int, fn: Any, *args: Any) -> list[Any]:
        from tests.distributed.harness import DistributedPool

        pool = self.pools.get(world_size)
        if pool is None or not pool._procs:
            pool = self.pools[world_size] = DistributedPool(world_size, timeout=RANK_TIMEOUT_S)
        return pool.run(fn, *args)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    # The last line of a rank's traceback names the exception.
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors[-1] if errors else lines[-1] if lines else "")[:300]


def run_one(
    config: Config, pools: _Pools | None, backend: str = "aot_eager", execute: bool = True
) -> Outcome:
    """Gate one configuration and, when accepted (and ``execute``), run it on ranks."""
    t0 = time.perf_counter()
    cfg = config.train_config(backend)
    g = gate(cfg, config.world_size)
    if g["refused"]:
        differ = g["validate_missing"] or g["plan_missing"] or g["suggest_missing"]
        status = "refused" if not differ else "GATES DIFFER"
        lines = [ln.strip() for ln in g["findings"][0].splitlines() if ln.strip()]
        first = lines[1 if len(lines) > 1 else 0][:240]  # past "TrainConfig: n problem(s):"
        detail = f"{len(g['findings'])} finding(s): {first}"
        if g["validate_missing"]:
            detail += f" | validate (rc {g['validate_rc']}) misses it"
        if g["plan_missing"]:
            detail += " | plan misses it"
        if g["suggest_missing"]:
            detail += " | suggest --mesh misses it"
        return Outcome(config, status, detail, seconds=time.perf_counter() - t0)
    if g["validate_extra"]:
        return Outcome(
            config,
            "GATES DIFFER",
            "validate refuses a run the trainer accepts: " + _first_line(g["validate_extra"]),
            seconds=time.perf_counter() - t0,
        )
    if not execute or pools is None:
        return Outcome(config, "accepted", seconds=time.perf_counter() - t0)
    try:
        result = pools.run(config.world_size, train_vs_one_device, cfg)[0]
    except (AssertionError, TimeoutError, RuntimeError) as e:
        return Outcome(config, "CRASHED", _first_line(str(e)), seconds=time.perf_counter() - t0)
    try:
        loss_err, grad_rel = judge(result)
    except AssertionError as e:
        return Outcome(config, "WRONG", _first_line(str(e)), seconds=time.perf_counter() - t0)
    return Outcome(
        config, "ran", loss_err=loss_err, grad_rel=grad_rel, seconds=time.perf_counter() - t0
    )


def _select(configs: list[Config], args: argparse.Namespace) -> list[Config]:
    if args.only:
        wanted = set(args.only)
        return [c for c in configs if c.index in wanted]
    if args.slice:
        start, step = (int(x) for x in args.slice.split("/"))
        return configs[start::step]
    return configs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="run_matrix", description=__doc__.splitlines()[0])
    parser.add_argument("--slice", metavar="I/N", help="every N-th configuration from the I-th")
    parser.add_argument("--only", type=int, nargs="+", metavar="INDEX", help="these indices")
    parser.add_argument(
        "--backend",
        default="aot_eager",
        choices=("aot_eager", "inductor", "eager"),
        help="torch.compile backend of the compile runs (default aot_eager: traced, no "
        "code generation; inductor compiles C++ for minutes per run on a small CPU machine)",
    )
    parser.add_argument("--list", action="store_true", help="gate only; run nothing on ranks")
    parser.add_argument("--no-eight", action="store_true", help="leave out the 8-rank runs")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cover = covering()
    configs = _select(matrix(eight=not args.no_eight), args)
    print(
        f"matrix: {len(cover.rows)} covering rows over {len(cover.switches)} switches "
        f"({len(cover.impossible)} value pairs impossible under the constraints), "
        f"running {len(configs)}",
        flush=True,
    )
    pools = None if args.list else _Pools()
    outcomes: list[Outcome] = []
    t0 = time.perf_counter()
    try:
        for config in configs:
            outcome = run_one(config, pools, args.backend, execute=not args.list)
            outcomes.append(outcome)
            print(outcome.row(), flush=True)
    finally:
        if pools is not None:
            pools.close()
    counts = Counter(o.status for o in outcomes)
    ran = [o for o in outcomes if o.status == "ran"]
    worst_loss = max((o.loss_err for o in ran if o.loss_err is not None), default=0.0)
    worst_grad = max((o.grad_rel for o in ran if o.grad_rel is not None), default=0.0)
    print(
        f"summary: {len(outcomes)} configurations: "
        + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        + f"; max loss diff {worst_loss:.2e}, max gradient relative error {worst_grad:.2e}; "
        f"{time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    bad = sum(v for k, v in counts.items() if k not in ("refused", "ran", "accepted"))
    return 1 if bad or any(math.isnan(x) for x in (worst_loss, worst_grad)) else 0


if __name__ == "__main__":
    sys.exit(main())
