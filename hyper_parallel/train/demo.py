"""The demo: train on an N-D mesh of local ranks and in one process; show they agree.

It launches ``torchrun --standalone`` with one gloo rank per mesh position (dp=2 x
tp=2, or dp_replicate=2 x dp_shard=2 for HSDP: four CPU processes) running
:mod:`hyper_parallel.train.run`, trains the same
model with the same seed and data in this process, prints both loss columns side
by side, plots them, and ends with one line::

    parity: steps=30 max_abs_loss_diff=1.19e-06 tol=1e-4 PASS

(``FAIL`` and a non-zero exit status when the largest difference exceeds the
tolerance or the distributed run fails). Why the two agree: ``init_states`` gives
every mesh the single-process initial values; every step's global batch is the
same and each data-parallel rank takes an equal slice; FSDP (HSDP) averages the data
ranks' gradients, which is the gradient of the global-batch mean loss; everything is
float32.

Run it as ``hyper-parallel demo --mesh dp=2,tp=2`` (any axes of
:class:`~hyper_parallel.distributed.MeshLayout`) or ``python -m hyper_parallel.train.demo``.

``--compile``, ``--ac`` and ``--dtype`` apply the trainer's switches to the
distributed run. The one-process reference always runs eagerly without activation
checkpointing (neither may change the result) but under the same precision policy:
with ``--dtype bf16`` both compute in bfloat16 from fp32 master weights, and the
default tolerance widens to :data:`BF16_TOL` (printed on the parity line).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence

import torch

from hyper_parallel.distributed.layout import MeshLayout
from hyper_parallel.train import run_hooks
from hyper_parallel.train.run import _json_object, _mesh_argument
from hyper_parallel.train.trainer import TrainConfig, Trainer, check_config

__all__ = ["add_arguments", "main", "run"]

DEFAULT_TOL = 1e-4
BF16_TOL = 2e-2
"""Default tolerance under ``--dtype bf16``: both runs round every matmul to bf16's 8-bit
mantissa (relative 2**-8 = 3.9e-3), in different orders (sharded partial sums, FSDP's
casts vs autocast), on losses around 2-6 nats; dp=2 x tp=2 measured 2.4e-3 over 30 steps."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser``."""
    parser.add_argument(
        "--mesh",
        type=_mesh_argument,
        default={"dp_shard": 2, "tp": 2},
        help="mesh of local ranks over pp, dp_replicate, dp_shard (alias dp), cp, tp, ep, "
        "e.g. dp=2,tp=2 (default), dp_replicate=2,dp_shard=2 (HSDP) or tp=2",
    )
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument(
        "--sp", action="store_true", help="tensor + sequence parallel instead of plain TP"
    )
    parser.add_argument("--model", default="llama3-debug", help="registered model name")
    parser.add_argument(
        "--model-overrides",
        type=_json_object,
        default={},
        metavar="JSON",
        help="model config overrides, e.g. '{\"num_layers\": 4}'",
    )
    parser.add_argument(
        "--schedule",
        default="1F1B",
        help="pipeline schedule under pp > 1 (torch's names: GPipe, 1F1B, Interleaved1F1B, "
        "InterleavedZeroBubble, ZBVZeroBubble)",
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="pipeline micro-batches per step (default: one sequence each)",
    )
    parser.add_argument("--seed", type=int, default=0, help="initialization seed")
    parser.add_argument(
        "--tol",
        type=float,
        default=None,
        help=f"largest allowed |loss difference| (default {DEFAULT_TOL:g}, "
        f"{BF16_TOL:g} with --dtype bf16)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each transformer block of the distributed run",
    )
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="fp32 (default), or bf16 mixed precision with fp32 master weights in both runs",
    )
    parser.add_argument(
        "--ac",
        choices=("none", "full", "selective"),
        default="none",
        help="activation checkpointing of the distributed run (default none)",
    )
    parser.add_argument(
        "--output-dir",
        default="outputs/demo",
        help="where the plot and logs go (default outputs/demo)",
    )
    run_hooks.add_arguments(parser, defaults=True)


def _style(layout: MeshLayout, sequence_parallel: bool) -> str:
    """``"TP+SP x HSDP"``: what runs on each active axis of the mesh."""
    parts = []
    if layout.cp > 1:
        parts.append("CP (head-tail)")
    if layout.pp > 1:
        parts.append("PP")
    if layout.tp > 1:
        parts.append("TP+SP" if sequence_parallel else "TP")
    # FSDP shards over dp_shard (x cp, except that a context-parallel plan keeps cp).
    if layout.dp_replicate > 1:
        parts.append("HSDP" if layout.dp_shard > 1 else "replicated DP")
    elif layout.dp_shard > 1:
        parts.append("FSDP2")
    return " x ".join(parts) or "one device"


def _format_tol(tol: float) -> str:
    mantissa, exponent = f"{tol:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _launch_ranks(cfg: TrainConfig, out_dir: str) -> tuple[int, dict | None]:
    """Run ``cfg`` under torchrun; returns its exit status and rank 0's metrics."""
    config_path = os.path.join(out_dir, "train_config.json")
    metrics_path = os.path.join(out_dir, "distributed_metrics.json")
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(cfg.to_dict(), f, indent=1)
    if os.path.exists(metrics_path):
        os.remove(metrics_path)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # rendezvous on a free local port
        "--nproc-per-node",
        str(cfg.world_size),
        "-m",
        "hyper_parallel.train.run",
        "--config",
        config_path,
        "--metrics-out",
        metrics_path,
    ]
    # CPU ranks with gloo on any machine (a GPU box would otherwise pick NCCL, one
    # GPU per rank); one thread per rank, as the ranks already share the cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    status = subprocess.run(cmd, env=env, check=False).returncode
    if status != 0 or not os.path.exists(metrics_path):
        return status or 1, None
    with open(metrics_path, encoding="utf-8") as f:
        return 0, json.load(f)


def _train_here(cfg: TrainConfig) -> list[float]:
    """The same run in this process, on one device."""
    threads = torch.get_num_threads()
    # The debug model is tiny: extra threads only contend for the cores.
    torch.set_num_threads(1)
    try:
        return Trainer(cfg, device="cpu").fit().losses
    finally:
        torch.set_num_threads(threads)


def _plot(
    path: str, steps: list[int], dist_losses: list[float], one_losses: list[float], label: str
) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: matplotlib is not installed; pip install 'hyper-parallel[demo]')")
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, dist_losses, label=label, linewidth=2.5, alpha=0.7)
    ax.plot(steps, one_losses, label="1 process", linestyle="--", linewidth=1.5, color="black")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross entropy, nats)")
    ax.set_title("Same model, seed and data: sharded vs one process")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run(args: argparse.Namespace) -> int:
    """Run the demo with parsed options; returns the exit status (0 when parity holds)."""
    t0 = time.perf_counter()
    layout = MeshLayout.from_sizes(args.mesh)
    mesh = layout.active()
    world = layout.world_size
    dtype = getattr(args, "dtype", "fp32")
    tol = args.tol if args.tol is not None else (BF16_TOL if dtype == "bf16" else DEFAULT_TOL)
    tol_text = _format_tol(tol)
    if world < 2:
        print(
            f"demo: mesh {args.mesh} has one rank; give at least two, e.g. --mesh dp=2,tp=2.",
            file=sys.stderr,
        )
        return 2
    try:
        cfg = TrainConfig(
            model=args.model,
            model_overrides=args.model_overrides,
            schedule=args.schedule,
            num_microbatches=args.microbatches,
            mesh=mesh,
            sequence_parallel=args.sp,
            num_steps=args.steps,
            seed=args.seed,
            log_every=max(1, args.steps // 3),
            progress=False,
            compile=getattr(args, "compile", False),
            dtype=dtype,
            ac=getattr(args, "ac", "none"),
            **{f: getattr(args, f) for f in run_hooks.HF_ARGUMENT_FIELDS if hasattr(args, f)},
        )
        # Every problem (axes the trainer cannot run, shapes that do not fit the mesh)
        # is reported here, before any rank starts.
        problems = check_config(cfg, world)
    except ValueError as e:
        print(f"demo: {e}", file=sys.stderr)
        return 2
    if problems:
        lines = "\n".join(f"  {f}" for f in problems)
        print(f"demo: {len(problems)} problem(s) with --mesh {layout}:\n{lines}", file=sys.stderr)
        return 2
    os.makedirs(args.output_dir, exist_ok=True)
    out_dir = os.path.abspath(args.output_dir)
    style = _style(layout, cfg.sequence_parallel)
    label = " x ".join(f"{axis}={size}" for axis, size in mesh.items())
    print(
        f"demo: {cfg.model}, {cfg.num_steps} steps, global batch {cfg.global_batch_size} x "
        f"{cfg.seq_len} {'tokens' if cfg.data else 'bytes'}, seed {cfg.seed}"
    )
    # Flushed: the ranks write to the same terminal next.
    switches = f"{cfg.dtype}, ac={cfg.ac}" + (", compiled blocks" if cfg.compile else "")
    print(
        f"[1/2] {label} ({style}, {switches}): {world} gloo ranks under torchrun",
        flush=True,
    )
    status, metrics = _launch_ranks(cfg, out_dir)
    if metrics is None:
        print(f"demo: the distributed run failed (exit status {status}); see the output above.")
        print(f"parity: steps={cfg.num_steps} max_abs_loss_diff=nan tol={tol_text} FAIL")
        return status or 1
    print(
        f"[2/2] the same training in this process, one device, {cfg.dtype}, eager, no AC",
        flush=True,
    )
    # The reference keeps the precision policy (bf16 is a different computation) but
    # runs eagerly without checkpointing: compile and AC must not change the result.
    one_losses = _train_here(
        cfg.replace(
            mesh={},
            sequence_parallel=False,
            log_every=0,
            compile=False,
            ac="none",
            save_hf=None,
            tensorboard=None,
        )
    )
    steps, dist_losses = metrics["steps"], metrics["losses"]
    diffs = [abs(a - b) for a, b in zip(dist_losses, one_losses, strict=True)]
    print()
    print(f"{'step':>5}  {label + ' loss':>16}  {'1-process loss':>16}  {'|diff|':>9}")
    for step, a, b, d in zip(steps, dist_losses, one_losses, diffs, strict=True):
        print(f"{step:>5}  {a:>16.6f}  {b:>16.6f}  {d:>9.2e}")
    print()
    plot_path = os.path.join(out_dir, "loss_parity.png")
    if _plot(plot_path, steps, dist_losses, one_losses, f"{label} ({style})"):
        print(f"plot: {plot_path}")
    print(f"time: {time.perf_counter() - t0:.1f} s")
    max_diff = max(diffs)
    ok = max_diff <= tol
    print(
        f"parity: steps={len(steps)} max_abs_loss_diff={max_diff:.2e} tol={tol_text} "
        f"{'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hyper_parallel.train.demo [options]``."""
    parser = argparse.ArgumentParser(
        prog="python -m hyper_parallel.train.demo",
        description="Train on an N-D mesh of local ranks and in one process; compare.",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
