"""Pipeline parallelism on gloo: step time per schedule, and the measured bubble.

On ``pp`` spawned gloo ranks, the trainer trains a Llama (``llama3-debug`` with
``--overrides``, default 8 blocks of width 256) with each of torch's schedules, and,
on the same ranks, without a pipeline (pp=1: FSDP2 over ``dp_shard = pp``, the same
global batch). All contenders are built up front and stepped round-robin (order
rotated every repetition). Per contender:

- **step time**: one optimizer step of the trainer (``Trainer.train_step``), median
  (min-max) over ``--reps`` of the slowest rank;
- **measured bubble**: per rank, ``1 - busy / window`` where ``window`` is the wall
  time of the schedule's ``step`` and ``busy`` the time spent inside torch's stage
  actions (``forward_one_chunk``, ``backward_one_chunk``,
  ``backward_weight_one_chunk`` of each ``PipelineStage``), averaged over ranks:
  waiting for a neighbour's activations or gradients (communication included) is
  idle time;
- **predicted bubble**: :func:`hyper_parallel.analysis.pipeline_cost.bubble_fraction`,
  from the schedule's own action list with backward = 2 x forward and free
  communication.

Nothing here is a test: times depend on the machine and its load (ranks share cores
when the machine has fewer cores than ranks).

Run::

    .venv/bin/python benchmarks/bench_pp.py                     # pp=2, every schedule
    .venv/bin/python benchmarks/bench_pp.py --pp 2 4 --reps 5 --json pp.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch.distributed as dist
from _common import gloo_ranks, slowest_rank, summary

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
BASELINE = "pp=1"
_ACTIONS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class _Busy:
    """Time spent in the stages' compute actions, and in the schedule's ``step``."""

    def __init__(self, schedule: Any) -> None:
        self.busy = 0.0
        self.window = 0.0
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        for stage in stages:
            for name in _ACTIONS:
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(getattr(stage, name), "busy"))
        schedule.step = self._timed(schedule.step, "window")

    def _timed(self, fn: Any, field: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - start)

        return call


def _rank(
    rank: int,
    pp: int,
    schedules: list[str],
    microbatches: int,
    overrides: dict[str, Any],
    batch: int,
    seq: int,
    reps: int,
    warmup: int,
) -> dict[str, Any]:
    from hyper_parallel.analysis.pipeline_cost import bubble_fraction
    from hyper_parallel.train import TrainConfig, Trainer

    base = TrainConfig(
        model="llama3-debug",
        model_overrides=overrides,
        batch_size=batch,
        seq_len=seq,
        steps=warmup + reps,
        log_every=0,
        progress=False,
        max_grad_norm=0.0,
    )
    trainers = {BASELINE: Trainer(base.replace(mesh={"dp_shard": pp}), device="cpu")}
    for name in schedules:
        cfg = base.replace(mesh={"pp": pp}, schedule=name, microbatches=microbatches)
        trainers[name] = Trainer(cfg, device="cpu")
    meters = {n: _Busy(t.schedule) for n, t in trainers.items() if t.schedule is not None}
    names = list(trainers)
    times: dict[str, list[float]] = {n: [] for n in names}
    idle: dict[str, list[float]] = {n: [] for n in meters}
    for rep in range(warmup + reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            meter = meters.get(name)
            if meter is not None:
                meter.busy = meter.window = 0.0
            dist.barrier()
            start = time.perf_counter()
            trainers[name].train_step()
            took = time.perf_counter() - start
            if rep >= warmup:
                times[name].append(took * 1e3)
                if meter is not None:
                    idle[name].append(1.0 - meter.busy / meter.window)
    slowest = slowest_rank(times)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, idle)
    rows = []
    for name in names:
        row: dict[str, Any] = {"pp": pp, "contender": name, "step_ms": summary(slowest[name])}
        if name in meters:
            per_rank = [sum(g[name]) / len(g[name]) for g in gathered]
            plan = trainers[name].pipeline_plan
            row |= {
                "num_microbatches": microbatches,
                "stages_per_rank": plan.stages_per_rank,
                "measured_bubble_per_rank": per_rank,
                "measured_bubble": sum(per_rank) / len(per_rank),
                "predicted_bubble": bubble_fraction(name, pp, microbatches, plan.stages_per_rank),
            }
        rows.append(row)
    return {"rows": rows}


def format_result(rows: list[dict[str, Any]]) -> str:
    """A text table of the rows (one per contender and pp)."""
    lines = [
        f"{'pp':>3}  {'contender':<22} {'step ms median (min-max)':>26}  {'vs pp=1':>7}  "
        f"{'bubble measured':>15}  {'predicted':>9}"
    ]
    base = {r["pp"]: r["step_ms"]["median"] for r in rows if r["contender"] == BASELINE}
    for r in rows:
        s = r["step_ms"]
        ratio = s["median"] / base[r["pp"]]
        measured = f"{r['measured_bubble']:.3f}" if "measured_bubble" in r else "-"
        predicted = f"{r['predicted_bubble']:.3f}" if "predicted_bubble" in r else "-"
        label = r["contender"] if r["contender"] != BASELINE else f"pp=1 (dp_shard={r['pp']})"
        lines.append(
            f"{r['pp']:>3}  {label:<22} {s['median']:>10.1f} ({s['min']:.1f}-{s['max']:.1f})".ljust(
                58
            )
            + f"  {ratio:>6.2f}x  {measured:>15}  {predicted:>9}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2], help="pipeline sizes")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument(
        "--overrides",
        type=json.loads,
        default={"num_layers": 8, "dim": 256, "ffn_dim": 768, "num_heads": 8, "num_kv_heads": 4},
        help="model overrides of llama3-debug (JSON)",
    )
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for pp in args.pp:
        result = gloo_ranks(
            _rank,
            pp,
            pp,
            args.schedules,
            args.microbatches,
            args.overrides,
            args.batch,
            args.seq,
            args.reps,
            args.warmup,
        )
        rows += result["rows"]
    print(format_result(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
