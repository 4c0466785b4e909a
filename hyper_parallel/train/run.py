"""Command-line entry for training: one script for a laptop and for a cluster.

Under ``torchrun`` each rank runs this module; it joins the process group torchrun
set up (NCCL on GPUs, gloo on CPUs), builds the N-D mesh and trains::

    # 4 local CPU ranks: FSDP x TP, or HSDP (2 replicas of 2-way FSDP)
    torchrun --standalone --nproc-per-node 4 -m hyper_parallel.train.run --mesh dp=2,tp=2
    torchrun --standalone --nproc-per-node 4 -m hyper_parallel.train.run \\
        --mesh dp_replicate=2,dp_shard=2

    # 2 nodes x 8 GPUs (run on every node; same code path, NCCL picked from the device;
    # 'hyper-parallel launch --nodes 2 --gpus-per-node 8 --slurm job.sbatch ...' prints
    # this line and writes a SLURM script)
    torchrun --nnodes 2 --nproc-per-node 8 --node-rank "$NODE_RANK" --rdzv-backend c10d \\
        --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" -m hyper_parallel.train.run \\
        --mesh dp=2,tp=8 --checkpoint-dir /shared/ckpt --checkpoint-every 100 --resume \\
        --async-checkpoint

    # one process, no launcher
    python -m hyper_parallel.train.run --steps 20

``--mesh`` takes ``name=size`` pairs over ``pp, dp_replicate, dp_shard`` (alias
``dp``), ``cp, tp, ep``; every problem of the mesh (against the number of ranks
torchrun starts, too) is reported before any process group is created.
Options override the values of ``--config FILE`` (a JSON object of
:class:`~hyper_parallel.train.TrainConfig` fields). With ``--resume`` and a
restarting launcher (``torchrun --max-restarts N``), a run that lost a rank continues
from its latest complete checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel._warnings import quiet_strided_gather
from hyper_parallel.distributed.process_group import init_process_group
from hyper_parallel.train import report, run_hooks
from hyper_parallel.train.arguments import (
    RUN_OPTIONS,
    add_command_arguments,
    add_train_arguments,
    config_from_args,
    json_object,
    mesh_argument,
    parse_mesh,
)
from hyper_parallel.train.checkpoint import checkpoint_steps
from hyper_parallel.train.job import write_run_record
from hyper_parallel.train.trainer import Trainer, check_config

quiet_strided_gather()  # full_gradients' full_tensor of FSDP-over-TP gradients (see _warnings)

__all__ = [
    "add_train_arguments",
    "build_parser",
    "config_from_args",
    "full_gradients",
    "main",
    "parse_mesh",
]


def full_gradients(model_parts: list[torch.nn.Module], pp: int = 1) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient by name, in fp32 on the CPU (a collective).

    Sharded gradients are gathered with ``full_tensor``; under ``pp > 1`` the stages'
    parameters are gathered from every rank. Every rank calls it and gets them all.
    """
    from hyper_parallel.core.dtensor.dtensor import DTensor

    out: dict[str, torch.Tensor] = {}
    for part in model_parts:
        for name, p in part.named_parameters():
            grad = p.grad
            if grad is None:
                continue
            if isinstance(grad, DTensor):
                grad = grad.full_tensor()
            out[name] = grad.detach().to("cpu", torch.float32).clone()
    if pp > 1 and dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, out)
        for part_grads in gathered:
            out.update(part_grads)
    return out


def _first_grads_writer(path: str, pp: int) -> Callable[[int, list[torch.nn.Module]], None]:
    """A ``grad_callback`` that saves the first step's gradients to ``path`` (rank 0)."""

    def write(step: int, model_parts: list[torch.nn.Module]) -> None:
        if step != 0:
            return
        grads = full_gradients(model_parts, pp)
        if not dist.is_initialized() or dist.get_rank() == 0:
            torch.save(grads, path)

    return write


# The run options are defined once (hyper_parallel.train.arguments); re-exported here.
_json_object = json_object
_mesh_argument = mesh_argument
# Joining the process group is distributed's (hyper_parallel.distributed.process_group);
# the old private name stays for callers of this module.
_init_process_group = init_process_group


def build_parser(prog: str = "python -m hyper_parallel.train.run") -> argparse.ArgumentParser:
    """The command line of ``python -m hyper_parallel.train.run``: the run options
    (:data:`~hyper_parallel.train.arguments.COMMAND_OPTIONS` ``"train"``) and its outputs."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train a registered model on an N-D mesh (TP (+SP) x FSDP2 / HSDP) "
        "with DCP checkpoints.",
    )
    add_command_arguments(parser, "train")
    parser.add_argument(
        "--metrics-out",
        help="rank 0 writes the steps this run trains, their losses and timing here (JSON); "
        "kept unless --overwrite, or under --resume when it is the metrics of the run "
        "resumed (same --checkpoint-dir), which the resumed steps replace (the earlier "
        "ones are in train.log; a resume with no step to train keeps it)",
    )
    parser.add_argument(
        "--grads-out",
        help="rank 0 saves the first step's full gradients here (torch.save), before clipping",
    )
    return parser


def main(
    argv: Sequence[str] | None = None,
    *,
    step_callback: Callable[[int, float], None] | None = None,
    prog: str = "python -m hyper_parallel.train.run",
) -> int:
    """Train from command-line options; returns the exit status.

    Args:
        argv: Options (default ``sys.argv[1:]``).
        step_callback: Passed to :class:`~hyper_parallel.train.Trainer`.
        prog: The command's name in messages (``hyper-parallel train``).
    """
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    # Every problem of the run (the mesh against the ranks torchrun started, axes the
    # trainer cannot run, the model's shapes, outputs that would clobber something, a
    # damaged checkpoint) is reported before any process group. Every rank finds the
    # same from the same options and files: rank 0 alone says it.
    first = int(os.environ.get("RANK", "0")) == 0
    try:
        cfg = config_from_args(args, int(os.environ.get("WORLD_SIZE", "1")))
        # A Hugging Face source's config.json, read once for the run (the trainer takes it).
        replaced = run_hooks.replaced_model_note(cfg)
        cfg, hf = run_hooks.resolve_model(cfg)
        problems = check_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        if not problems:
            files = {"--metrics-out": args.metrics_out, "--grads-out": args.grads_out}
            if cfg.resume and cfg.checkpoint_dir and checkpoint_steps(cfg.checkpoint_dir):
                # The first step's gradients are not this run's (a restarting launcher's
                # second start finds the file its first one wrote): nothing is written.
                files.pop("--grads-out")
            report.check_files(cfg, files=files, config_file=getattr(args, "config", None))
    except ValueError as e:
        if first:
            print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    if problems:
        lines = "\n".join(f"  {f}" for f in problems)
        if first:
            print(f"{parser.prog}: error: {len(problems)} problem(s):\n{lines}", file=sys.stderr)
        return 2
    if first and replaced:
        print(replaced, flush=True)
    _init_process_group()
    try:
        try:
            grad_callback = (
                _first_grads_writer(args.grads_out, cfg.layout.pp) if args.grads_out else None
            )
            trainer = Trainer(cfg, step_callback=step_callback, grad_callback=grad_callback, hf=hf)
        except ValueError as e:  # a run that cannot start: say why, no traceback
            rank = dist.get_rank() if dist.is_initialized() else 0
            # An error every rank meets alike (the same files) is said once, by rank 0.
            if rank == 0 or not getattr(e, "same_on_every_rank", False):
                where = f"[rank {rank}] " if rank else ""
                print(f"{parser.prog}: error: {where}{e}", file=sys.stderr)
            return 2
        rank = dist.get_rank() if dist.is_initialized() else 0
        folder = report.log_path(cfg)
        if rank == 0 and folder is not None:
            # The run directory keeps what ran: the resolved options, version and commit.
            world = dist.get_world_size() if dist.is_initialized() else 1
            per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            write_run_record(
                os.path.dirname(folder) or ".",
                trainer.cfg,
                RUN_OPTIONS,
                world_size=world,
                ranks_per_node=per_node,
                resumed_from=trainer.resumed_from,
                # The command this run was given (a caller's own sys.argv is not it).
                argv=list(sys.argv) if argv is None else [prog, *argv],
            )
        result = trainer.fit()
        rank = dist.get_rank() if dist.is_initialized() else 0
        # A resumed run with no step to train (resumed at --steps: a complete run's
        # command run again) keeps the metrics there; it had replaced them with none.
        keep = not result.steps and os.path.exists(args.metrics_out or "")
        if rank == 0 and args.metrics_out and not keep:
            metrics = {
                "config": cfg.to_dict(),
                "steps": result.steps,
                "losses": result.losses,
                "grad_norms": result.grad_norms,
                "final_step": result.final_step,
                "resumed_from": result.resumed_from,
                "seconds": result.seconds,
            }
            with open(args.metrics_out, "w", encoding="utf-8") as f:
                json.dump(metrics, f, indent=1)
        if dist.is_initialized():
            # Every rank done (rank 0's files written) before any tears its groups down:
            # a gloo group destroyed while a peer still talks to it aborts the process.
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
