"""Command-line entry for training: one script for a laptop and for a cluster.

Under ``torchrun`` each rank runs this module; it joins the process group torchrun
set up (NCCL on GPUs, gloo on CPUs), builds the N-D mesh and trains::

    # 4 local CPU ranks: FSDP x TP, or HSDP (2 replicas of 2-way FSDP)
    torchrun --standalone --nproc-per-node 4 -m hyper_parallel.train.run --mesh dp=2,tp=2
    torchrun --standalone --nproc-per-node 4 -m hyper_parallel.train.run \\
        --mesh dp_replicate=2,dp_shard=2

    # 2 nodes x 8 GPUs (run on every node; same code path, NCCL picked from the device)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 -m hyper_parallel.train.run \\
        --mesh dp=2,tp=8 --checkpoint-dir /shared/ckpt --checkpoint-every 100 --resume

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
from torch.distributed.constants import default_pg_timeout

from hyper_parallel.distributed.layout import LayoutError, MeshLayout
from hyper_parallel.train import run_hooks
from hyper_parallel.train.trainer import TrainConfig, Trainer, check_config, default_device

__all__ = ["add_train_arguments", "config_from_args", "main", "parse_mesh"]


def parse_mesh(text: str) -> dict[str, int]:
    """Parse ``"dp=2,tp=2"`` into ``{"dp_shard": 2, "tp": 2}``: the axes of size > 1.

    Any user axis of :class:`~hyper_parallel.distributed.MeshLayout` is accepted
    (``dp`` is ``dp_shard``); ``""`` is ``{}`` (one device).

    Raises:
        LayoutError: (a ``ValueError``) every malformed entry, unknown axis (with the
            nearest name), repeated axis, size < 1 and ``ep`` not dividing
            dp_shard x cp x tp, in one error.
    """
    return MeshLayout.parse(text).active()


def _mesh_argument(text: str) -> dict[str, int]:
    try:
        return parse_mesh(text)
    except LayoutError as e:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(e)) from None


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"not valid JSON ({e.msg}); quote the keys, e.g. '{{\"num_layers\": 4}}'"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, e.g. '{\"num_layers\": 4}'")
    return value


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the training options (each maps to a :class:`TrainConfig` field)."""
    parser.add_argument("--config", help="JSON file of TrainConfig fields (options override it)")
    parser.add_argument("--model", help="registered model name (default llama3-debug)")
    parser.add_argument(
        "--model-overrides",
        type=_json_object,
        metavar="JSON",
        help="model config overrides, e.g. '{\"num_layers\": 4}'",
    )
    parser.add_argument(
        "--mesh",
        type=_mesh_argument,
        help="mesh axis sizes over pp, dp_replicate, dp_shard (alias dp), cp, tp, ep, e.g. "
        "dp=2,tp=2 or dp_replicate=2,dp_shard=2 (default: dp_shard = number of ranks)",
    )
    parser.add_argument(
        "--sp",
        dest="sequence_parallel",
        action="store_true",
        default=None,
        help="sequence parallel on top of tensor parallel",
    )
    parser.add_argument("--steps", dest="num_steps", type=int, help="optimizer steps")
    parser.add_argument(
        "--batch-size", dest="global_batch_size", type=int, help="global batch size (sequences)"
    )
    parser.add_argument("--seq-len", type=int, help="tokens per sequence")
    parser.add_argument("--lr", type=float, help="peak learning rate")
    parser.add_argument("--weight-decay", type=float, help="AdamW weight decay")
    parser.add_argument("--warmup-steps", type=int, help="linear warm-up steps")
    parser.add_argument("--max-grad-norm", type=float, help="gradient clipping norm (0: off)")
    parser.add_argument("--seed", type=int, help="initialization seed")
    parser.add_argument("--text", help="shipped text to train on")
    parser.add_argument("--checkpoint-dir", help="directory for DCP checkpoints")
    parser.add_argument("--checkpoint-every", type=int, help="save every N steps")
    parser.add_argument(
        "--resume",
        action="store_true",
        default=None,
        help="continue from the latest checkpoint in --checkpoint-dir",
    )
    parser.add_argument(
        "--schedule",
        help="pipeline schedule under pp > 1: GPipe, 1F1B (default), Interleaved1F1B, "
        "InterleavedZeroBubble, ZBVZeroBubble",
    )
    parser.add_argument(
        "--microbatches",
        dest="num_microbatches",
        type=int,
        help="pipeline micro-batches per step (default: one sequence each)",
    )
    parser.add_argument(
        "--pipeline-split",
        type=_json_object,
        metavar="JSON",
        help="pipeline stage split, e.g. '{\"units_per_stage\": 2}' (default: balanced)",
    )
    parser.add_argument("--log-every", type=int, help="log every N steps (0: never)")
    parser.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help="torch.compile each transformer block (fullgraph, after TP, before FSDP)",
    )
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        help="fp32, or bf16 mixed precision with fp32 master weights (default fp32)",
    )
    parser.add_argument(
        "--ac",
        choices=("none", "full", "selective"),
        help="activation checkpointing: none (default), full (every block), "
        "selective (every second block)",
    )
    parser.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        default=None,
        help="no progress bar",
    )
    run_hooks.add_arguments(parser)


_FIELDS_FROM_ARGS = (
    "model",
    "model_overrides",
    "mesh",
    "sequence_parallel",
    "num_steps",
    "global_batch_size",
    "seq_len",
    "lr",
    "weight_decay",
    "warmup_steps",
    "max_grad_norm",
    "seed",
    "text",
    "checkpoint_dir",
    "checkpoint_every",
    "resume",
    "log_every",
    "progress",
    "schedule",
    "num_microbatches",
    "pipeline_split",
    "compile",
    "dtype",
    "ac",
    *run_hooks.HF_ARGUMENT_FIELDS,
)


def config_from_args(args: argparse.Namespace, world_size: int = 1) -> TrainConfig:
    """The :class:`TrainConfig` of parsed options: ``--config`` file, then the options.

    Without a mesh, all ``world_size`` ranks are data parallel.
    """
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        try:
            with open(args.config, encoding="utf-8") as f:
                loaded = json.load(f)
        except OSError as e:
            raise ValueError(f"--config {args.config!r}: cannot read it ({e.strerror}).") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"--config {args.config!r}: not valid JSON ({e}).") from None
        if not isinstance(loaded, dict):
            raise ValueError(
                f"--config {args.config!r}: expected a JSON object of TrainConfig fields, "
                f"got {type(loaded).__name__}."
            )
        values.update(loaded)
    for name in _FIELDS_FROM_ARGS:
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    if "mesh" not in values and world_size > 1:
        values["mesh"] = {"dp_shard": world_size}
    return TrainConfig.from_dict(values)


def _attempt_store() -> dist.Store | None:
    """torchrun's shared rendezvous store, with keys scoped to this restart attempt.

    torchrun (torch 2.13) lets workers share its agent's TCP store and keeps that
    store across restarts, while ``env://`` initialization adds no per-attempt
    prefix: after a restart, ranks read the previous attempt's gloo addresses and
    fail with "connectFullMesh ... Connection refused". Prefixing the keys with
    ``TORCHELASTIC_RESTART_COUNT`` (the same on every worker of an attempt) keeps
    attempts apart. ``None`` when workers do not use the agent's store.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=default_pg_timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"hyper_parallel/attempt_{attempt}", store)


def _init_process_group() -> int:
    """Join torchrun's process group when launched by it; returns the world size.

    The backend follows the device: NCCL on CUDA, gloo on CPU.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not dist.is_initialized():
        device = default_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        store = _attempt_store()
        if store is None:
            dist.init_process_group(backend=backend)
        else:
            rank = int(os.environ["RANK"])
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size)
    return world_size


def main(
    argv: Sequence[str] | None = None,
    *,
    step_callback: Callable[[int, float], None] | None = None,
) -> int:
    """Train from command-line options; returns the exit status.

    Args:
        argv: Options (default ``sys.argv[1:]``).
        step_callback: Passed to :class:`~hyper_parallel.train.Trainer`.
    """
    parser = argparse.ArgumentParser(
        prog="python -m hyper_parallel.train.run",
        description="Train a registered model on an N-D mesh (TP (+SP) x FSDP2 / HSDP) "
        "with DCP checkpoints.",
    )
    add_train_arguments(parser)
    parser.add_argument("--metrics-out", help="rank 0 writes steps, losses and timing here (JSON)")
    args = parser.parse_args(argv)
    # Every problem of the run (the mesh against the ranks torchrun started, axes the
    # trainer cannot run, the model's shapes) is reported before any process group.
    try:
        cfg = config_from_args(args, int(os.environ.get("WORLD_SIZE", "1")))
        problems = check_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    if problems:
        lines = "\n".join(f"  {f}" for f in problems)
        print(f"{parser.prog}: error: {len(problems)} problem(s):\n{lines}", file=sys.stderr)
        return 2
    _init_process_group()
    try:
        try:
            trainer = Trainer(cfg, step_callback=step_callback)
        except ValueError as e:  # a run that cannot start: say why, no traceback
            print(f"{parser.prog}: error: {e}", file=sys.stderr)
            return 2
        result = trainer.fit()
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0 and args.metrics_out:
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
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
