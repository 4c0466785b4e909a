"""``hyper-parallel verify-hf DIR --mesh AXES``: our model on a mesh vs ``transformers``.

The checkpoint is loaded on local gloo ranks (``torchrun --standalone``, as the demo
launches them) into the model built for the mesh (:func:`load_hf`); each rank runs
its share of one batch (its data-parallel rows, its context-parallel chunks, its
pipeline stages) and rank 0 assembles the logits. This process then runs
``transformers``' ``AutoModelForCausalLM`` on the same batch and prints::

    parity: max_abs_logit_diff=3.58e-07 loss_diff=0.00e+00 tol=1e-5 PASS

(exit status 0 only on PASS). :func:`mesh_logits` is the per-rank part, callable
from any process group (the tests' rank pools).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from hyper_parallel.checkpoint_hf.config import read_hf_config
from hyper_parallel.checkpoint_hf.io import (
    HFCheckpointError,
    checkpoint_files,
    load_hf,
    safetensors_problem,
)
from hyper_parallel.dmodule.findings import Finding

__all__ = [
    "DEFAULT_TOL",
    "LoadedModel",
    "batch_tokens",
    "hf_logits",
    "load_on_mesh",
    "main",
    "mesh_logits",
    "parity",
]

DEFAULT_TOL = 1e-5


def batch_tokens(vocab_size: int, batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """The verification batch: ``(batch, seq_len)`` token ids drawn with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq_len), generator=generator)


def _run_config(
    path: str, mesh: dict[str, int], batch: int, seq_len: int, sequence_parallel: bool = False
) -> Any:
    from hyper_parallel.train.trainer import TrainConfig

    cfg = read_hf_config(path)
    return TrainConfig(
        model=cfg.spec,
        model_overrides=cfg.model_overrides,
        mesh=mesh,
        sp=sequence_parallel,
        batch_size=batch,
        seq_len=seq_len,
        microbatches=None,
        log_every=0,
        progress=False,
    )


def _replicate_but_cp(logits: torch.Tensor) -> torch.Tensor:
    """Local logits with the whole vocabulary: every shard but the sequence's over ``cp``."""
    if not isinstance(logits, DTensor):
        return logits
    names = logits.device_mesh.mesh_dim_names or ()
    placements = [
        p if isinstance(p, Shard) and names[i] == "cp" and p.dim == 1 else Replicate()
        for i, p in enumerate(logits.placements)
    ]
    return logits.redistribute(logits.device_mesh, placements).to_local()


@dataclasses.dataclass
class LoadedModel:
    """A checkpoint loaded on a mesh: this rank's model parts and how they run.

    Args:
        parts: The model (one part) or this rank's pipeline stages.
        run: The run config the parts were built from.
        mesh: The mesh (``None`` in one process).
        schedule: The pipeline schedule under ``pp > 1``.
        plan: The pipeline plan under ``pp > 1``.
        report: What :func:`load_hf` did on this rank.
    """

    parts: list[Any]
    run: Any
    mesh: Any
    schedule: Any
    plan: Any
    report: Any


def load_on_mesh(
    path: str,
    mesh: dict[str, int],
    *,
    batch: int = 4,
    seq_len: int = 16,
    sequence_parallel: bool = False,
) -> LoadedModel:
    """Build the checkpoint's model for ``mesh`` (the running process group) and load it.

    Call on every rank. ``batch`` and ``seq_len`` size the pipeline's micro-batches.
    """
    from hyper_parallel.train.trainer import (
        build_mesh,
        build_parallel_model,
        build_pipeline_stages,
    )

    run = _run_config(path, mesh, batch, seq_len, sequence_parallel)
    layout = run.layout
    device = torch.device("cpu")
    pmesh = build_mesh(layout, device)
    schedule = plan = None
    if layout.pp > 1:
        from hyper_parallel.distributed.pipeline import build_schedule

        parts, plan = build_pipeline_stages(run, pmesh, device)
        schedule = build_schedule(
            parts, plan, pmesh["pp"], device, lambda out, tgt: out.float().sum()
        )
    else:
        parts = [build_parallel_model(run, pmesh, device)]
    report = load_hf(parts, path)
    return LoadedModel(
        parts=parts, run=run, mesh=pmesh, schedule=schedule, plan=plan, report=report
    )


def mesh_logits(
    path: str, mesh: dict[str, int], tokens: torch.Tensor, sequence_parallel: bool = False
) -> tuple[torch.Tensor | None, float]:
    """Load ``path`` on ``mesh`` (the running process group) and run ``tokens`` through it.

    Call on every rank. Returns, on rank 0, the whole batch's logits ``(B, S, V)``
    assembled from the ranks that computed them (``None`` elsewhere), and the
    seconds :func:`load_hf` took on this rank.
    """
    from hyper_parallel.distributed import context_parallel

    loaded = load_on_mesh(
        path,
        mesh,
        batch=tokens.shape[0],
        seq_len=tokens.shape[1],
        sequence_parallel=sequence_parallel,
    )
    parts, schedule, plan, pmesh = loaded.parts, loaded.schedule, loaded.plan, loaded.mesh
    layout, report = loaded.run.layout, loaded.report
    dp_size = layout.size("batch")
    dp_rank = pmesh.local_rank("batch") if pmesh is not None else 0
    rows = tokens.shape[0] // dp_size
    row_slice = slice(dp_rank * rows, (dp_rank + 1) * rows)
    inputs = tokens[row_slice]
    seq_len = tokens.shape[1]
    positions = torch.arange(seq_len)
    kwargs: dict[str, Any] = {}
    if layout.cp > 1:
        cp_rank = pmesh.local_rank("cp")
        inputs = context_parallel.shard_sequence(inputs, cp_rank, layout.cp)
        positions = context_parallel.positions(seq_len, cp_rank, layout.cp)
        kwargs["positions"] = positions
    local: torch.Tensor | None = None
    with torch.no_grad():
        if schedule is not None:
            for part in parts:
                if hasattr(part, "set_positions"):
                    part.set_positions(kwargs.get("positions"))
            local_stages = plan.stages_of_rank(pmesh.local_rank("pp"))
            args = (inputs,) if 0 in local_stages else ()
            last = plan.num_stages - 1 in local_stages
            target = {"target": torch.zeros(inputs.shape[:2])} if last else {}
            out = schedule.eval(*args, **target)
            if last:
                local = _replicate_but_cp(out)
        else:
            local = _replicate_but_cp(parts[0](inputs, **kwargs))
    piece = None if local is None else (row_slice, positions, local.float())
    rank = dist.get_rank() if dist.is_initialized() else 0
    if not dist.is_initialized():
        return local.float(), report.seconds
    gathered: list[Any] = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(piece, gathered, dst=0)
    if rank != 0:
        return None, report.seconds
    vocab = next(p[2].shape[-1] for p in gathered if p is not None)
    full = torch.full((*tokens.shape, vocab), float("nan"))
    for p in gathered:
        if p is not None:
            rows_of, pos, values = p
            full[rows_of, pos] = values
    return full, report.seconds


def hf_logits(path: str, tokens: torch.Tensor) -> torch.Tensor:
    """``transformers``' logits of ``tokens`` from the checkpoint, fp32, one process."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def parity(ours: torch.Tensor, theirs: torch.Tensor, tokens: torch.Tensor) -> tuple[float, float]:
    """``(max |logit diff|, |loss diff|)``; the loss is next-token cross entropy of the batch."""

    def loss(logits: torch.Tensor) -> float:
        return float(F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()))

    diff = (ours - theirs).abs().max()
    return float(diff), abs(loss(ours) - loss(theirs))


def _worker(args: argparse.Namespace) -> int:
    from hyper_parallel.distributed.process_group import init_process_group

    init_process_group()
    tokens = torch.load(args.tokens)
    try:
        logits, _ = mesh_logits(args.dir, json.loads(args.mesh_json), tokens, args.sp)
        if logits is not None:
            torch.save(logits, args.out)
        # Every rank done before any tears its groups down: a gloo group destroyed while
        # a peer's send to it is still in flight aborts the process.
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _format_tol(tol: float) -> str:
    mantissa, exponent = f"{tol:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _verify_fix(finding: Finding, cfg: Any) -> Finding:
    """``finding`` with a fix verify-hf can take: it has no ``--model-overrides``, so a
    sequence longer than the checkpoint's positions is fixed by a shorter ``--seq-len``."""
    if (finding.path, finding.field) != ("rope", "max_seq_len"):
        return finding
    limit = cfg.model_overrides.get("max_seq_len")
    most = f"{limit:,}" if limit else "the checkpoint's max_position_embeddings"
    return dataclasses.replace(finding, fix=f"give --seq-len {most} or less (default 16).")


def run(args: argparse.Namespace) -> int:
    """``verify-hf`` with parsed options; returns the exit status (0 on PASS)."""
    from hyper_parallel.distributed.layout import MeshLayout
    from hyper_parallel.train.trainer import check_config

    tol_text = _format_tol(args.tol)
    try:
        cfg = read_hf_config(args.dir)
        layout = MeshLayout.from_sizes(args.mesh)
        run_cfg = _run_config(args.dir, layout.active(), args.batch, args.seq_len, args.sp)
        problems = [_verify_fix(f, cfg) for f in check_config(run_cfg, layout.world_size)]
        if not problems:
            damaged = [
                p for p in map(safetensors_problem, set(checkpoint_files(args.dir).values()))
            ]
            damaged = sorted(p for p in damaged if p)
            if damaged:
                raise HFCheckpointError(f"checkpoint {args.dir}", damaged)
    except (ValueError, FileNotFoundError) as e:
        # Refused before anything ran: no numbers were compared, so no parity line.
        print(f"verify-hf: error: {e}", file=sys.stderr)
        return 2
    if problems:
        lines = "\n".join(f"  {f}" for f in problems)
        print(
            f"verify-hf: {len(problems)} problem(s) with the run on --mesh {layout}:\n{lines}",
            file=sys.stderr,
        )
        return 2
    vocab = cfg.model_overrides["vocab_size"]
    tokens = batch_tokens(vocab, args.batch, args.seq_len, args.seed)
    with tempfile.TemporaryDirectory(prefix="hp_verify_") as tmp:
        tokens_path = os.path.join(tmp, "tokens.pt")
        out_path = os.path.join(tmp, "logits.pt")
        torch.save(tokens, tokens_path)
        mesh = layout.active()
        label = ",".join(f"{a}={s}" for a, s in mesh.items()) or "one process"
        # A config.json written by code may name only its model_type.
        name = (cfg.raw.get("architectures") or [None])[0] or cfg.raw.get("model_type", "?")
        print(f"verify-hf: {args.dir} ({name}) on {label}", flush=True)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(layout.world_size),
            "-m",
            "hyper_parallel.hf_commands.verify",
            "--worker",
            "--dir",
            args.dir,
            "--mesh-json",
            json.dumps(mesh),
            "--tokens",
            tokens_path,
            "--out",
            out_path,
            *(["--sp"] if args.sp else []),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        status = subprocess.run(cmd, env=env, check=False).returncode
        if status != 0 or not os.path.exists(out_path):
            # No logits to compare: say so instead of a parity line of NaNs.
            print(
                f"verify-hf: the ranks failed (exit status {status}; see above); nothing was "
                "compared.",
                file=sys.stderr,
            )
            return status or 1
        ours = torch.load(out_path)
    theirs = hf_logits(args.dir, tokens)
    logit_diff, loss_diff = parity(ours, theirs, tokens)
    ok = logit_diff <= args.tol and loss_diff <= args.tol
    print(
        f"parity: max_abs_logit_diff={logit_diff:.2e} loss_diff={loss_diff:.2e} "
        f"tol={tol_text} {'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``verify-hf``'s options."""
    from hyper_parallel.distributed.mesh_arguments import mesh_argument

    parser.add_argument("dir", help="Hugging Face checkpoint directory (config.json + safetensors)")
    parser.add_argument(
        "--mesh",
        type=mesh_argument,
        default={"tp": 2},
        help="mesh of local ranks, e.g. tp=2, dp_shard=2,tp=2, pp=2, cp=2, dp_shard=2,ep=2 "
        "(MoE) (default tp=2)",
    )
    parser.add_argument("--sp", action="store_true", help="sequence parallel on top of tp")
    parser.add_argument("--batch", type=int, default=4, help="sequences in the batch (default 4)")
    parser.add_argument("--seq-len", type=int, default=16, help="tokens per sequence (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random batch")
    parser.add_argument("--tol", type=float, default=DEFAULT_TOL, help="largest allowed difference")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hyper_parallel.hf_commands.verify``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--worker" in argv:
        worker = argparse.ArgumentParser()
        worker.add_argument("--worker", action="store_true")
        worker.add_argument("--sp", action="store_true")
        for name in ("--dir", "--mesh-json", "--tokens", "--out"):
            worker.add_argument(name, required=True)
        return _worker(worker.parse_args(argv))
    parser = argparse.ArgumentParser(
        prog="hyper-parallel verify-hf",
        description="Load a Hugging Face checkpoint on a mesh of local ranks and compare "
        "logits and loss with transformers on one process.",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
