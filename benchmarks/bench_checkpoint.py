"""Checkpoint cost on gloo: step time with no checkpoint, in-place and asynchronous saves.

For ``llama3-debug`` widened by ``--model-overrides`` (default 5.2 M parameters: a
checkpoint of ~60 MB with AdamW's moments) at ``--mesh`` (default ``dp_shard=2``:
FSDP2 over 2 spawned gloo ranks), three trainers of the same run train side by side,
round-robin, ``--every`` steps at a time (the order rotated each round):

- **none**: no checkpoint;
- **sync**: ``Trainer.save`` (DCP's ``save`` into a staged directory, checksums,
  rename) after every ``--every`` steps, as ``train --checkpoint-every N`` does;
- **async**: ``Trainer.save_async`` (``train --async-checkpoint``: DCP's
  ``async_save``, the states copied to CPU memory and written by a thread while the
  next ``--every`` steps train; the previous save finished before the next starts).

Per mode: the time per step over each round of ``--every`` steps plus its save
(median, min-max over ``--reps`` rounds, slowest rank), its ratio to *none*, and the
time the save call held the training loop (the copy, plus waiting for the previous
save in *async*). Expected: *async* costs the copy and whatever the writer thread takes
from the training threads (on a CPU-only machine they share cores; on GPUs the step
runs on the device while the thread writes); *sync* costs the whole write.

Nothing here is a test: times depend on the machine, its disk and its load.

Run::

    .venv/bin/python benchmarks/bench_checkpoint.py
    .venv/bin/python benchmarks/bench_checkpoint.py --every 4 --reps 6 --json ckpt.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from _common import gloo_ranks, summary

MODES = ("none", "sync", "async")
OVERRIDES = {"dim": 256, "ffn_dim": 768, "num_layers": 4, "vocab_size": 4096}


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _rank(
    rank: int,
    mesh: dict[str, int],
    overrides: dict[str, Any],
    batch: int,
    seq: int,
    every: int,
    reps: int,
    warmup: int,
    folder: str,
) -> dict[str, Any]:
    from hyper_parallel.train import TrainConfig, Trainer

    torch.set_num_threads(1)
    rounds = warmup + reps
    trainers = {}
    for mode in MODES:
        cfg = TrainConfig(
            model="llama3-debug",
            model_overrides=overrides,
            mesh=mesh,
            batch_size=batch,
            seq_len=seq,
            steps=rounds * every + 1,
            checkpoint_dir=os.path.join(folder, mode) if mode != "none" else None,
            async_checkpoint=mode == "async",
            log_every=0,
            progress=False,
        )
        trainers[mode] = Trainer(cfg, device="cpu")
        trainers[mode].report.say = lambda *_: None  # no event lines in the figures
    step_s: dict[str, list[float]] = {m: [] for m in MODES}
    held_s: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(rounds):
        shift = r % len(MODES)
        for mode in MODES[shift:] + MODES[:shift]:
            trainer = trainers[mode]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(every):
                trainer.train_step()
            held = time.perf_counter()
            if mode == "sync":
                trainer.save()
            elif mode == "async":
                trainer.save_async()
            end = time.perf_counter()
            if r >= warmup:
                step_s[mode].append((end - start) / every)
                held_s[mode].append(end - held)
    for trainer in trainers.values():
        trainer.wait_for_checkpoint()
    dist.barrier()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"step": step_s, "held": held_s})
    slowest = {
        kind: {m: [max(g[kind][m][i] for g in gathered) for i in range(reps)] for m in MODES}
        for kind in ("step", "held")
    }
    from hyper_parallel.train.checkpoint import checkpoint_steps

    _, latest = checkpoint_steps(os.path.join(folder, "sync"))[-1]
    params = sum(p.numel() for p in trainers["none"].model.parameters())
    del rank
    return {
        "mesh": mesh,
        "model_overrides": overrides,
        "params": params,
        "batch": batch,
        "seq": seq,
        "every": every,
        "reps": reps,
        "checkpoint_bytes": _dir_bytes(latest),
        "results": [
            {
                "mode": m,
                "step_s": summary(slowest["step"][m]),
                "held_s": summary(slowest["held"][m]),
                "times": slowest["step"][m],
            }
            for m in MODES
        ],
    }


def format_result(out: dict[str, Any]) -> str:
    """The table ``main`` prints."""
    rows = {r["mode"]: r for r in out["results"]}
    base = rows["none"]["step_s"]["median"]
    lines = [
        f"checkpoint cost: llama3-debug + {json.dumps(out['model_overrides'])} "
        f"({out['params'] / 1e6:.1f} M parameters, checkpoint "
        f"{out['checkpoint_bytes'] / 2**20:.1f} MiB) on "
        f"{','.join(f'{a}={n}' for a, n in out['mesh'].items())}, batch {out['batch']} x "
        f"{out['seq']}, a save every {out['every']} steps; median (min-max) of "
        f"{out['reps']} rounds, slowest rank",
        f"  {'mode':>6} {'ms per step':>22} {'vs none':>8} {'save held the loop, ms':>26}",
    ]
    for m in MODES:
        t, h = rows[m]["step_s"], rows[m]["held_s"]
        step = f"{t['median'] * 1e3:.1f} ({t['min'] * 1e3:.1f}-{t['max'] * 1e3:.1f})"
        held = f"{h['median'] * 1e3:.1f} ({h['min'] * 1e3:.1f}-{h['max'] * 1e3:.1f})"
        lines.append(f"  {m:>6} {step:>22} {t['median'] / base:>8.2f} {held:>26}")
    sync, asyn = rows["sync"]["step_s"]["median"], rows["async"]["step_s"]["median"]
    lines.append(
        f"  async / sync step time: {asyn / sync:.2f}; checkpoint overhead per step: sync "
        f"{(sync - base) * 1e3:.1f} ms, async {(asyn - base) * 1e3:.1f} ms"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="dp_shard=2", help="axis sizes (default dp_shard=2)")
    parser.add_argument(
        "--model-overrides", default=json.dumps(OVERRIDES), help="llama3-debug overrides (JSON)"
    )
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--every", type=int, default=4, help="steps between saves")
    parser.add_argument("--reps", type=int, default=5, help="measured rounds per mode")
    parser.add_argument("--warmup", type=int, default=1, help="rounds not measured")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)
    from hyper_parallel.distributed.layout import MeshLayout

    layout = MeshLayout.parse(args.mesh)
    folder = tempfile.mkdtemp(prefix="hp_bench_ckpt_")
    try:
        out = gloo_ranks(
            _rank,
            layout.world_size,
            layout.active(),
            json.loads(args.model_overrides),
            args.batch,
            args.seq,
            args.every,
            args.reps,
            args.warmup,
            folder,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(format_result(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
