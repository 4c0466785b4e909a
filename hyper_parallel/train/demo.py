"""The demo: train on an N-D mesh of local ranks and in one process; show they agree.

It launches ``torchrun --standalone`` with one gloo rank per mesh position (dp=2 x
tp=2, or dp_replicate=2 x dp_shard=2 for HSDP: four CPU processes) running
:mod:`hyper_parallel.train.run`, trains the same
model with the same seed and data in this process, prints both loss columns side
by side, plots them, and ends with one line::

    parity: steps=30 max_abs_loss_diff=1.19e-06 tol=1e-4 max_rel_grad_err=2.1e-06 grad_rtol=1e-3 PASS

(``FAIL`` and a non-zero exit status when the largest loss difference exceeds the
tolerance, when any parameter's first-step gradient differs from the one-process
gradient by more than ``grad_rtol`` relative to its norm, when any value is NaN or
infinite, or when the distributed run fails). A loss curve alone cannot see a
gradient 2x too large — AdamW's update is the same for a scaled gradient and
clipping rescales the norm — so each parameter's gradient of the first step (before
clipping) is compared too. Why the two agree: ``init_states`` gives
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
default tolerance widens to :data:`BF16_TOL` (printed on the parity line). Where FSDP2
shards the distributed run's dense states, bf16 is FSDP2's policy (bf16 parameters, a
bf16 stream between blocks), and the reference runs under it too, FSDP2 wrapping its
model over a process group of this process alone; elsewhere both run under autocast.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hyper_parallel.distributed.layout import MeshLayout
from hyper_parallel.distributed.process_group import one_rank_group
from hyper_parallel.train import run_hooks
from hyper_parallel.train.arguments import (
    COMMAND_OPTIONS,
    add_command_arguments,
    config_from_args,
)
from hyper_parallel.train.run import full_gradients
from hyper_parallel.train.trainer import TrainConfig, Trainer, check_config, run_plan

__all__ = ["GradComparison", "add_arguments", "compare_gradients", "main", "run"]

DEFAULT_TOL = 1e-4
BF16_TOL = 2e-2
"""Default tolerance under ``--dtype bf16`` (or ``bf16-true``): both runs round every matmul to bf16's 8-bit
mantissa (relative 2**-8 = 3.9e-3), in different orders (sharded partial sums, FSDP's
casts vs autocast), on losses around 2-6 nats; dp=2 x tp=2 measured 2.4e-3 over 30 steps."""


DEFAULT_MESH = dict(COMMAND_OPTIONS["demo"].defaults["mesh"])

GRAD_RTOL = 1e-3
"""Largest ``||g - g_ref|| / ||g_ref||`` of any parameter's first-step gradient (fp32): far
below the relative error 1 of a gradient 2x too large or zero, far above fp32 rounding."""
BF16_GRAD_RTOL = 0.1
"""The same under ``--dtype bf16`` (both runs round to bf16, differently); still far below 1."""


@dataclass(frozen=True)
class GradComparison:
    """Per-parameter first-step gradients of the distributed run against one process."""

    max_rel_err: float  # NaN when a gradient is missing or not finite
    worst: str  # the parameter with the largest relative error
    problems: tuple[str, ...]  # missing, non-finite or zero-reference parameters

    def ok(self, rtol: float) -> bool:
        """True when every gradient is present, finite and within ``rtol``."""
        return not self.problems and self.max_rel_err <= rtol


def compare_gradients(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
) -> GradComparison:
    """Relative error ``||a - e|| / ||e||`` of every parameter's gradient; NaN-safe.

    A NaN or Inf, a parameter on one side only, or a nonzero gradient where the
    reference is zero is a problem (and makes ``max_rel_err`` NaN or inf); so is
    comparing nothing.
    """
    problems: list[str] = []
    worst, max_rel = "", 0.0
    for name in sorted(set(actual) | set(expected)):
        a, e = actual.get(name), expected.get(name)
        if a is None or e is None:
            problems.append(
                f"{name}: missing in the {'distributed' if a is None else 'reference'} run"
            )
            continue
        a, e = a.detach().double(), e.detach().double()
        if a.shape != e.shape:
            problems.append(f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}")
            continue
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(e).all())):
            problems.append(f"{name}: NaN or Inf")
            continue
        err, ref = float((a - e).norm()), float(e.norm())
        rel = err / ref if ref > 0 else (0.0 if err == 0 else math.inf)
        if rel > max_rel or not worst:
            worst, max_rel = name, rel
    if not actual and not expected:
        problems.append("no gradients compared")
    if problems:
        max_rel = math.nan
    return GradComparison(max_rel, worst, tuple(problems))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser``: the run options every entry point shares
    (:func:`~hyper_parallel.train.arguments.add_command_arguments`), and the tolerance
    and output directory."""
    add_command_arguments(parser, "demo")
    parser.add_argument(
        "--tol",
        type=float,
        default=None,
        help=f"largest allowed |loss difference| (default {DEFAULT_TOL:g}, "
        f"{BF16_TOL:g} with --dtype bf16 or bf16-true)",
    )
    parser.add_argument(
        "--output-dir",
        default="outputs/demo",
        help="where the plot and logs go (default outputs/demo)",
    )


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
    """Run ``cfg`` under torchrun; returns its exit status and rank 0's metrics.

    The metrics carry ``grads``: the first step's full gradients by parameter name.
    """
    config_path = os.path.join(out_dir, "train_config.json")
    metrics_path = os.path.join(out_dir, "distributed_metrics.json")
    grads_path = os.path.join(out_dir, "distributed_first_grads.pt")
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(cfg.to_dict(), f, indent=1)
    for stale in (metrics_path, grads_path):
        if os.path.exists(stale):
            os.remove(stale)
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
        "--grads-out",
        grads_path,
    ]
    # CPU ranks with gloo on any machine (a GPU box would otherwise pick NCCL, one
    # GPU per rank); one thread per rank, as the ranks already share the cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    status = subprocess.run(cmd, env=env, check=False).returncode
    if status != 0 or not os.path.exists(metrics_path) or not os.path.exists(grads_path):
        return status or 1, None
    with open(metrics_path, encoding="utf-8") as f:
        metrics = json.load(f)
    metrics["grads"] = torch.load(grads_path, weights_only=True)
    return 0, metrics


def _train_here(
    cfg: TrainConfig, hf: Any = None, *, one_rank_fsdp: bool = False
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same run in this process, on one device: its losses and first-step gradients.

    ``one_rank_fsdp``: compute as FSDP2 makes the distributed run compute (its model
    wrapped by FSDP2 over a process group of this process alone): :func:`_casts_as_fsdp`.
    """
    threads = torch.get_num_threads()
    # The debug model is tiny: extra threads only contend for the cores.
    torch.set_num_threads(1)
    grads: dict[str, torch.Tensor] = {}

    def keep_first(step: int, model_parts: list[torch.nn.Module]) -> None:
        if step == 0:
            grads.update(full_gradients(model_parts))

    def fit() -> list[float]:
        trainer = Trainer(
            cfg, device="cpu", grad_callback=keep_first, hf=hf, one_rank_fsdp=one_rank_fsdp
        )
        return trainer.fit().losses

    try:
        if not one_rank_fsdp:
            return fit(), grads
        with one_rank_group("cpu"):
            return fit(), grads
    finally:
        torch.set_num_threads(threads)


def _casts_as_fsdp(cfg: TrainConfig, world: int) -> bool:
    """Whether the one-process reference of ``cfg`` runs under FSDP2's policy (on one rank).

    Under ``bf16`` a run whose dense states FSDP2 shards computes under FSDP2's
    mixed-precision policy: bf16 parameters, and the stream between units (each block,
    the root) cast to bf16. One device alone computes under autocast instead, whose
    residual stream stays fp32. The two round differently enough to move a MoE's top-k
    routing (qwen3-moe-debug, dp_shard=2 x ep=2: first-step gradients 11.5 % apart), so
    the reference of such a run takes the run's own policy. ``fp32`` casts nothing and
    ``bf16-true`` stores bf16 parameters either way.
    """
    return cfg.dtype == "bf16" and run_plan(cfg, world).casts_as_fsdp


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


def _in_job_file(args: argparse.Namespace, name: str) -> bool:
    """Whether ``--config``'s job file sets the option of field ``name``."""
    if not getattr(args, "config", None):
        return False
    from hyper_parallel.train.arguments import RUN_OPTIONS
    from hyper_parallel.train.job import load_job_file

    return name in load_job_file(args.config, RUN_OPTIONS)


def run(args: argparse.Namespace) -> int:
    """Run the demo with parsed options; returns the exit status (0 when parity holds)."""
    t0 = time.perf_counter()
    try:
        cfg = config_from_args(args, defaults=COMMAND_OPTIONS["demo"].defaults, progress=False)
        if getattr(args, "log_every", None) is None and not _in_job_file(args, "log_every"):
            cfg = cfg.replace(log_every=max(1, cfg.steps // 3))
        # A Hugging Face source's config.json, read once here (the one-device run takes it).
        replaced = run_hooks.replaced_model_note(cfg)
        cfg, hf = run_hooks.resolve_model(cfg)
    except ValueError as e:
        print(f"demo: {e}", file=sys.stderr)
        return 2
    if cfg.resume:
        # Both runs are compared from step 0 (losses and the first step's gradients); a
        # resumed distributed run has no step 0 and the reference always starts fresh.
        print(
            "demo: --resume is not supported: the demo compares the distributed run with "
            "one process from step 0 (losses and the first step's gradients). Drop "
            "--resume (with a new --checkpoint-dir, or --overwrite to replace its "
            "checkpoints), or continue a run with 'hyper-parallel train --resume'.",
            file=sys.stderr,
        )
        return 2
    layout = cfg.layout
    mesh = layout.active()
    world = layout.world_size
    dtype = cfg.dtype
    low = dtype != "fp32"  # bf16 or bf16-true: both runs round to bf16
    tol = args.tol if args.tol is not None else (BF16_TOL if low else DEFAULT_TOL)
    tol_text = _format_tol(tol)
    grad_rtol = BF16_GRAD_RTOL if low else GRAD_RTOL
    grad_text = f"max_rel_grad_err={{}} grad_rtol={_format_tol(grad_rtol)}"
    if world < 2:
        print(
            f"demo: mesh {mesh} has one rank; give at least two, e.g. --mesh dp=2,tp=2.",
            file=sys.stderr,
        )
        return 2
    # Every problem (the run plan's findings: axes, shapes, the pipeline) is reported
    # here, before any rank starts.
    problems = check_config(cfg, world)
    if problems:
        lines = "\n".join(f"  {f}" for f in problems)
        print(
            f"demo: {len(problems)} problem(s) with the run on --mesh {layout}:\n{lines}",
            file=sys.stderr,
        )
        return 2
    # What the ranks would refuse first (outputs that would clobber, a damaged
    # checkpoint), said here before they start: it ended as "the distributed run failed".
    from hyper_parallel.train.checkpoint import checkpoint_steps
    from hyper_parallel.train.report import check_files

    if cfg.checkpoint_dir and not cfg.overwrite and checkpoint_steps(cfg.checkpoint_dir):
        # The trainer's message offers --resume, which the demo refuses (above).
        print(
            f"demo: --checkpoint-dir {cfg.checkpoint_dir} holds checkpoints of an earlier "
            "run, and the demo trains from step 0: pass --overwrite to replace them, or "
            "choose another directory.",
            file=sys.stderr,
        )
        return 2
    try:
        # With it, a model too small for the bytes of the shipped text (each rank refused
        # it after building: "the distributed run failed" and parity nan FAIL).
        check_files(cfg)
    except ValueError as e:  # OutputError, HFCheckpointError: ValueErrors naming the flag
        print(f"demo: {e}", file=sys.stderr)
        return 2
    if replaced:
        print(replaced)
    os.makedirs(args.output_dir, exist_ok=True)
    out_dir = os.path.abspath(args.output_dir)
    style = _style(layout, cfg.sp)
    label = " x ".join(f"{axis}={size}" for axis, size in mesh.items())
    print(
        f"demo: {cfg.model}, {cfg.steps} steps, global batch {cfg.batch_size} x "
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
        print(
            f"parity: steps={cfg.steps} max_abs_loss_diff=nan tol={tol_text} "
            f"{grad_text.format('nan')} FAIL"
        )
        return status or 1
    # The reference keeps the precision policy (bf16 is a different computation) but
    # runs eagerly without checkpointing: compile and AC must not change the result.
    as_fsdp = _casts_as_fsdp(cfg, world)
    policy = f"{cfg.dtype} as FSDP2 casts it (one rank)" if as_fsdp else cfg.dtype
    print(
        f"[2/2] the same training in this process, one device, {policy}, eager, no AC",
        flush=True,
    )
    one_losses, one_grads = _train_here(
        cfg.replace(
            mesh={},
            sp=False,
            log_every=0,
            compile=False,
            ac="none",
            checkpoint_dir=None,
            resume=False,
            save_hf=None,
            tensorboard=None,
        ),
        hf,
        one_rank_fsdp=as_fsdp,
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
    grads = compare_gradients(metrics["grads"], one_grads)
    print(
        f"first-step gradients: {len(one_grads)} parameters, largest relative error "
        f"{grads.max_rel_err:.2e} ({grads.worst or '-'}), bound {grad_rtol:g}"
    )
    for problem in grads.problems[:10]:
        print(f"  gradient problem: {problem}")
    # NaN-safe: Python's max() skips a NaN that is not first; any NaN fails.
    max_diff = math.nan if any(math.isnan(d) for d in diffs) else max(diffs, default=math.nan)
    ok = max_diff <= tol and len(diffs) == cfg.steps and grads.ok(grad_rtol)
    print(
        f"parity: steps={len(steps)} max_abs_loss_diff={max_diff:.2e} tol={tol_text} "
        f"{grad_text.format(f'{grads.max_rel_err:.2e}')} {'PASS' if ok else 'FAIL'}"
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
