"""Commands that start a run on one or several nodes: ``torchrun`` lines and SLURM scripts.

``hyper-parallel launch`` prints them (it never starts anything), and ``suggest`` prints
them for the layouts it finds. One node is ``torchrun --standalone``; several nodes
run the same ``torchrun`` line on each node with a c10d rendezvous at node 0
(``$MASTER_ADDR:$MASTER_PORT``). The SLURM script starts one ``torchrun`` agent per
node with ``srun`` (``--ntasks-per-node=1``); the rendezvous comes from SLURM's
variables: the first host of ``$SLURM_JOB_NODELIST`` is the endpoint and
``$SLURM_JOB_ID`` the rendezvous id, so no node needs its own rank.

Examples::

    hyper-parallel launch --nodes 4 --gpus-per-node 8 --mesh dp=4,tp=8 --steps 1000
    hyper-parallel launch --nodes 2 --gpus-per-node 8 --slurm job.sbatch --config job.toml

Exit status: 0 with the commands printed; 2 for a usage error (the train options are
checked as ``train`` checks them, the mesh against nodes x GPUs per node).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from hyper_parallel.train.job import TRAIN_MODULE, node_command
from hyper_parallel.train.job import quoted_args as _quoted

__all__ = ["build_parser", "job_file", "main", "node_command", "slurm_script", "train_options"]

DEFAULT_PORT = 29500


def slurm_script(
    train_args: Sequence[str],
    *,
    nodes: int,
    gpus_per_node: int,
    job_name: str = "hyper-parallel",
    port: int = DEFAULT_PORT,
) -> str:
    """A SLURM batch script: ``srun`` starts one ``torchrun`` agent per node.

    The rendezvous is c10d at the first host of the allocation
    (``scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1``) with the job id as
    its id, so every node runs the same line.

    Example::

        print(slurm_script(["--mesh", "dp=4,tp=8"], nodes=4, gpus_per_node=8))
    """
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(
            f"launch: nodes ({nodes}) and GPUs per node ({gpus_per_node}) must be >= 1."
        )
    if not 1 <= port <= _MAX_PORT:
        raise ValueError(f"launch: port {port} {_PORT_RANGE}.")
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={gpus_per_node}",
        # No pipefail: head leaving early may end scontrol with SIGPIPE, which is fine.
        "set -eu",
        "",
        "# Node 0 of the allocation holds the rendezvous; every node runs the same torchrun.",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        ': "${MASTER_ADDR:?scontrol show hostnames gave no host}"',
        f"MASTER_PORT=${{MASTER_PORT:-{port}}}",
        "export MASTER_ADDR MASTER_PORT",
        "",
        f"srun --nodes={nodes} --ntasks-per-node=1 \\",
        f"  torchrun --nnodes {nodes} --nproc-per-node {gpus_per_node} \\",
        '  --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d \\',
        '  --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \\',
        f"  -m {TRAIN_MODULE} {_quoted(train_args)}".rstrip(),
    ]
    return "\n".join(lines) + "\n"


def train_options(command: str) -> list[str]:
    """The train options of a :func:`node_command` line (what follows ``-m
    hyper_parallel.train.run``)."""
    words = shlex.split(command)
    at = words.index(TRAIN_MODULE)
    return words[at + 1 :]


def job_file(train_args: Sequence[str], comment: str = "") -> str:
    """The job file (TOML, read by ``--config``) holding the train options ``train_args``.

    Raises:
        ValueError: An option the trainer does not take, or a bad value.
    """
    import contextlib
    import io

    from hyper_parallel.train.arguments import RUN_OPTIONS
    from hyper_parallel.train.job import to_toml
    from hyper_parallel.train.run import build_parser as train_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = train_parser().parse_args(list(train_args))
    except SystemExit:
        raise ValueError(err.getvalue().strip().splitlines()[-1]) from None
    head = "".join(f"# {line}\n" for line in comment.splitlines())
    return head + to_toml(args, RUN_OPTIONS)


_MAX_PORT = 65535
_PORT_RANGE = f"is not a TCP port; give one in 1..{_MAX_PORT} (default {DEFAULT_PORT})"


def _port(text: str) -> int:
    """``argparse`` type of ``--port``: a TCP port, 1..65535."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= _MAX_PORT:
        raise argparse.ArgumentTypeError(f"{text!r} {_PORT_RANGE}")
    return value


def build_parser(prog: str = "hyper-parallel launch") -> argparse.ArgumentParser:
    """The launch options; every other option is a train option, passed on as given."""
    parser = argparse.ArgumentParser(
        prog=prog,
        allow_abbrev=False,  # a train option is never read as an abbreviated launch option
        description="Print the torchrun command each node runs and, with --slurm, write a "
        "SLURM batch script; nothing is started. Every other option is a train option "
        "(see 'hyper-parallel train --help', --config job.toml included), checked as "
        "train checks it and passed on unchanged.",
    )
    from hyper_parallel.train.arguments import positive_int

    parser.add_argument("--nodes", type=positive_int, required=True, help="number of nodes")
    parser.add_argument(
        "--gpus-per-node", type=positive_int, required=True, help="ranks (GPUs) per node"
    )
    parser.add_argument(
        "--slurm",
        metavar="FILE",
        help="also write a SLURM batch script here ('-': print it); submit with sbatch FILE",
    )
    parser.add_argument("--job-name", default="hyper-parallel", help="the SLURM job name")
    parser.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_PORT,
        help=f"rendezvous port on node 0 in the SLURM script (default {DEFAULT_PORT})",
    )
    return parser


def _check_train_options(
    train_args: list[str], world_size: int, gpus_per_node: int = 1
) -> str | None:
    """What is wrong with the train options on ``world_size`` ranks, or ``None``; a mesh
    of another size is told the nodes it needs (``--nodes``), not a one-node torchrun."""
    import contextlib
    import io

    from hyper_parallel.train.arguments import config_from_args
    from hyper_parallel.train.run import build_parser as train_parser
    from hyper_parallel.train.trainer import check_config

    parser = train_parser("hyper-parallel launch")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(train_args)
    except SystemExit:
        return (
            err.getvalue().strip().splitlines()[-1].removeprefix("hyper-parallel launch: error: ")
        )
    try:
        cfg = config_from_args(args, world_size)
    except ValueError as e:
        return str(e)
    # The mesh against nodes x GPUs per node, said in nodes; then the rest of the gate.
    problems = check_config(cfg)
    sized = cfg.layout.findings(world_size, gpus_per_node)
    problems = [f for f in sized if f not in problems] + problems
    if problems:
        lines = "\n".join(f"  {f}" for f in problems)
        return f"{len(problems)} problem(s) on {world_size} ranks:\n{lines}"
    return _split_across_nodes(cfg.layout, gpus_per_node) if world_size > gpus_per_node else None


def _split_across_nodes(layout: Any, gpus_per_node: int) -> str | None:
    """A warning when a tensor-parallel group would span nodes (``tp`` is the innermost
    axis: its groups are runs of ``tp`` consecutive ranks, whole within a node only when
    ``tp`` divides the GPUs per node)."""
    if layout.tp == 1 or gpus_per_node % layout.tp == 0:
        return None
    within = [d for d in range(1, gpus_per_node + 1) if gpus_per_node % d == 0]
    return (
        f"warning: tp={layout.tp} does not divide the {gpus_per_node} GPUs per node, so its "
        "groups span nodes: tensor parallelism's collectives, several per layer, would cross "
        "the inter-node network. Keep tp within a node (tp in "
        f"{', '.join(map(str, within))}) and give the other ranks to dp_shard, cp or pp."
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Print the per-node command (and write the SLURM script); returns the exit status.

    Example::

        main(["--nodes", "2", "--gpus-per-node", "8", "--mesh", "dp=2,tp=8"])
    """
    parser = build_parser()
    args, train_args = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    world_size = args.nodes * args.gpus_per_node
    if args.slurm not in (None, "-") and os.path.lexists(args.slurm):
        # A batch script is often edited by hand (account, partition): not replaced.
        print(
            f"{parser.prog}: error: --slurm {args.slurm}: a file is there already; give "
            "another path, or remove it (--slurm - prints the script instead).",
            file=sys.stderr,
        )
        return 2
    problem = _check_train_options(train_args, world_size, args.gpus_per_node)
    if problem is not None and not problem.startswith("warning: "):
        print(f"{parser.prog}: error: {problem}", file=sys.stderr)
        return 2
    if problem is not None:  # the commands are still printed: the user decides
        print(f"{parser.prog}: {problem}", file=sys.stderr)
    command = node_command(train_args, nodes=args.nodes, gpus_per_node=args.gpus_per_node)
    if args.nodes > 1:
        print(
            f"# On each of the {args.nodes} nodes, with NODE_RANK=0..{args.nodes - 1} and "
            "MASTER_ADDR / MASTER_PORT of node 0:"
        )
    print(command)
    if args.slurm is not None:
        script = slurm_script(
            train_args,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            job_name=args.job_name,
            port=args.port,
        )
        if args.slurm == "-":
            print()
            print(script, end="")
        else:
            os.makedirs(os.path.dirname(args.slurm) or ".", exist_ok=True)
            with open(args.slurm, "w", encoding="utf-8") as f:
                f.write(script)
            os.chmod(args.slurm, 0o755)
            print(f"# SLURM batch script written to {args.slurm}: sbatch {args.slurm}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
