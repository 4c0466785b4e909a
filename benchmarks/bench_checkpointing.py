"""Activation checkpointing on one CPU process: what each mode costs, keeps and peaks at.

For ``llama3-debug`` widened by ``--dim`` / ``--layers`` (fp32, one process, the
trainer's one-device build: ``build_model`` of the run plan, so the blocks are wrapped
exactly as the trainer wraps them), a batch of ``--batch`` sequences of ``--seq`` tokens,
each mode of ``--ac`` (``none``, ``selective``, ``op``, ``full``) in turn:

- **step**: forward, loss and backward, median (min-max) over ``--reps`` after
  ``--warmup`` (the modes alternate within each repetition: the machine's load hits
  each alike);
- **held**: bytes the CPU allocator still holds after forward and loss, beyond the loss
  (what the forward keeps for backward; ``torch.profiler``'s memory records), and the dry
  run's end-of-forward bytes for the mode (fake tensors, ``activations_held_by_ac``);
- **peak**: live tensor bytes during one step above the parameters (the running maximum
  of the allocator's allocations less frees), and the dry run's peak for the mode
  (``activations_by_ac``: what backward's recompute adds);
- **recompute**: the FLOPs backward repeats per step as the planner counts them on the
  meta device (``full``: every block's forward; ``selective``: every second; ``op``: the
  matmuls its policy does not keep), as a share of ``full``'s;
- **time vs none**: the step-time increase over ``none`` as a share of ``full``'s,
  measured, and as the planner predicts it for this CPU (``predict`` on one rank with a
  hardware file from ``calibrate --quick`` of this machine, unless ``--hardware``): the
  predicted step adds, besides the FLOPs, every recomputed elementwise operator's memory
  traffic and fixed cost (``op`` repeats all of them).

One thread (what ``calibrate`` measures per rank).

Nothing here is a test: times depend on the machine and its load.

Run::

    .venv/bin/python benchmarks/bench_checkpointing.py
    .venv/bin/python benchmarks/bench_checkpointing.py --dim 512 --layers 4 --seq 512 --json ac.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from typing import Any

import torch
from _common import summary
from bench_suggest import _peak_tensor_bytes

MODES = ("none", "selective", "op", "full")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """llama3-debug widened: heads of 64, half as many key/value heads, a 3x feed-forward."""
    heads = max(1, args.dim // 64)
    return {
        "dim": args.dim,
        "num_layers": args.layers,
        "num_heads": heads,
        "num_kv_heads": max(1, heads // 2),
        "ffn_dim": 3 * args.dim,
        "max_seq_len": max(512, args.seq),
    }


def _build(args: argparse.Namespace, ac: str) -> torch.nn.Module:
    from hyper_parallel.distributed.builder import build_model
    from hyper_parallel.distributed.layout import MeshLayout
    from hyper_parallel.distributed.run_plan import RunPlan

    torch.manual_seed(0)
    plan = RunPlan.for_model("llama3-debug", MeshLayout(), model_overrides=_overrides(args), ac=ac)
    return build_model(plan, None, "cpu", 0)


def _held_after_forward(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    from torch.profiler import ProfilerActivity, profile

    from hyper_parallel.models.llama import cross_entropy_loss

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
    held = sum(e.self_cpu_memory_usage for e in prof.events())
    return held - loss.untyped_storage().nbytes()


def _predicted(args: argparse.Namespace) -> tuple[dict[str, int], dict[str, int]]:
    from hyper_parallel.analysis import dry_run
    from hyper_parallel.dmodule import get_spec
    from hyper_parallel.models.llama import cross_entropy_loss

    config = get_spec("llama3-debug").config(**_overrides(args))
    report = dry_run(
        config,
        {"dp": 1},
        batch_size=args.batch,
        seq_len=args.seq,
        fsdp=False,
        loss_fn=lambda logits, tokens: cross_entropy_loss(logits, tokens),
    )
    return report.activations_held_by_ac, report.activations_by_ac


def _recompute_flops(args: argparse.Namespace) -> dict[str, float]:
    from hyper_parallel.analysis.suggest import ModelSource
    from hyper_parallel.analysis.suggest._operators import count_flops

    source = ModelSource("llama3-debug", tuple(sorted(_overrides(args).items())))
    f = count_flops(source, args.seq)
    n, per_seq = f.num_layers, args.batch
    return {
        "none": 0.0,
        "selective": per_seq * (n // 2) * f.block_fwd,
        "op": per_seq * n * f.block_op_recompute,
        "full": per_seq * n * f.block_fwd,
    }


def _predicted_steps(args: argparse.Namespace, modes: list[str]) -> dict[str, float]:
    """The planner's step time of each mode on one rank of this CPU."""
    import os
    import tempfile

    from hyper_parallel.analysis.suggest import Candidate, ModelSource, predict

    hardware = args.hardware
    if hardware is None:
        from hyper_parallel.analysis.calibrate import calibrate

        hardware = os.path.join(tempfile.mkdtemp(prefix="hp_bench_"), "cpu.yaml")
        calibrate(hardware, ranks=2, threads=1, quick=True)
    source = ModelSource("llama3-debug", tuple(sorted(_overrides(args).items())))
    out = {}
    for ac in modes:
        c = Candidate(1, 1, 1, 1, 1, 1, 1, None, ac, False)
        p = predict(
            source,
            c,
            gpus=1,
            gpu=hardware,
            seq_len=args.seq,
            global_batch_tokens=args.batch * args.seq,
            dtype="fp32",
        )
        out[ac] = p.step_s
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ac", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--hardware", help="hardware file (default: calibrate this CPU, quick)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    from hyper_parallel.models.llama import cross_entropy_loss

    torch.set_num_threads(1)  # as calibrate measures: one thread per rank
    vocab = 256
    tokens = torch.randint(
        0, vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0)
    )
    models = {ac: _build(args, ac) for ac in args.ac}

    def step(model: torch.nn.Module) -> None:
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        model.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {ac: [] for ac in args.ac}
    for rep in range(args.warmup + args.reps):
        for ac in args.ac:
            gc.collect()
            t0 = time.perf_counter()
            step(models[ac])
            if rep >= args.warmup:
                times[ac].append(time.perf_counter() - t0)
    held_pred, peak_pred = _predicted(args)
    flops = _recompute_flops(args)
    steps_pred = _predicted_steps(args, list(args.ac))
    rows = []
    for ac in args.ac:
        model = models[ac]
        params = sum(p.untyped_storage().nbytes() for p in model.parameters())
        gc.collect()
        held = _held_after_forward(model, tokens)
        model.zero_grad(set_to_none=True)
        gc.collect()
        peak = _peak_tensor_bytes(lambda m=model: step(m)) - params
        rows.append(
            {
                "ac": ac,
                "step_s": summary(times[ac]),
                "held_bytes": held,
                "held_predicted": held_pred[ac],
                "peak_bytes": peak,
                "peak_predicted": peak_pred[ac],
                "recompute_flops": flops[ac],
                "step_predicted_s": steps_pred[ac],
            }
        )
    result = {
        "model": "llama3-debug",
        "overrides": _overrides(args),
        "batch": args.batch,
        "seq": args.seq,
        "reps": args.reps,
        "threads": torch.get_num_threads(),
        "results": rows,
    }
    by = {r["ac"]: r for r in rows}
    print(
        f"llama3-debug {_overrides(args)}, batch {args.batch} x {args.seq}, fp32, "
        f"1 thread, {args.reps} reps"
    )
    print(
        f"{'ac':<10} {'step ms':>20} {'pred ms':>8} {'held KiB':>9} {'pred':>9} "
        f"{'peak KiB':>9} {'recompute':>9} {'time vs none':>13} {'pred':>5}"
    )
    for r in rows:
        t = r["step_s"]
        share = flop_share = pred_share = float("nan")
        if "none" in by and "full" in by:
            base, top = by["none"], by["full"]
            span = top["step_s"]["median"] - base["step_s"]["median"]
            share = (t["median"] - base["step_s"]["median"]) / span
            pred_span = top["step_predicted_s"] - base["step_predicted_s"]
            pred_share = (r["step_predicted_s"] - base["step_predicted_s"]) / pred_span
            flop_share = r["recompute_flops"] / top["recompute_flops"]
            r.update(time_share=share, time_share_predicted=pred_share, flop_share=flop_share)
        print(
            f"{r['ac']:<10} {t['median'] * 1e3:>7.1f} ({t['min'] * 1e3:.1f}-{t['max'] * 1e3:.1f}) "
            f"{r['step_predicted_s'] * 1e3:>8.1f} "
            f"{r['held_bytes'] / 1024:>9,.0f} {r['held_predicted'] / 1024:>9,.0f} "
            f"{r['peak_bytes'] / 1024:>9,.0f} {flop_share:>9.2f} {share:>13.2f} {pred_share:>5.2f}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
