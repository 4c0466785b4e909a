"""Context parallelism on gloo: one global sequence split over cp = 1, 2, 4 ranks, at
growing sequence lengths; and the dry run's per-rank bytes for Llama-3-8B at 32K and 128K.

For ``llama3-debug`` at each global sequence length (``--seq``, default 256 512 1024)
and batch, each cp size runs on its own spawned gloo ranks (cp = 1 is the model on one
process, no layout) and reports, per rank:

- **step time**: forward + loss + backward, median (min-max) over ``--reps``
  repetitions of the slowest rank (a collective step is as slow as it);
- **peak activation bytes**: the bytes of the tensors the forward saves for backward
  (``torch.autograd.graph.saved_tensors_hooks``, each storage counted once; for a
  DTensor its local shard; parameters excluded) — what one rank holds at the end of
  the forward, the activation peak of a training step without activation checkpointing.
  *x cp* is that over cp=1's, times cp: 1.00 is an exact ``1 / cp``; what is above it is
  what every rank holds of the whole sequence (each layer's gathered keys and values);
- **collective bytes** on ``cp`` per step (``CollectiveRecorder``: the per-rank buffer
  each collective fills or reduces) against the analytical minimum of all-gather
  context parallelism (Llama 3, Dubey et al., 2024, §3.3.2; Megatron-LM's and
  torchtitan's all-gather variant): in each of the ``L`` layers the keys and values of
  the whole sequence are gathered once in forward (2 all-gathers of ``B·S·Hkv·Dh``
  values) and their gradients reduce-scattered once in backward (2 reduce-scatters of
  the same size). Attention runs by chunks without a mask, so nothing else moves.

Then (``--dry-run-seq``, default 32768 131072; ``--dry-run-seq`` with no value skips it)
the dry run of ``llama3-8b`` (``max_seq_len`` raised to the sequence), bf16 compute, no
activation checkpointing, one sequence per data-parallel rank: per-rank activation and
total bytes at ``dp_shard=8`` and ``cp=8`` (8 ranks), and ``cp=32`` (32 ranks).

Nothing here is a test: times depend on the machine and its load.

Run::

    .venv/bin/python benchmarks/bench_cp.py                 # cp = 1, 2, 4; seq 256..1024
    .venv/bin/python benchmarks/bench_cp.py --seq 256 --reps 5 --dry-run-seq --json cp.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from _common import gloo_ranks, slowest_rank, summary

DTYPE_BYTES = 4  # float32
DRY_RUN_MODEL = "llama3-8b"
DRY_RUN_MESHES = ("dp_shard=8", "cp=8", "cp=32")


def minimum(layers: int, batch: int, seq: int, kv_dim: int) -> dict[str, int]:
    """Bytes on ``cp`` per step of all-gather context parallelism (module docstring)."""
    kv = batch * seq * kv_dim * DTYPE_BYTES  # the gathered keys (or values) of one layer
    return {
        "forward all_gather (k, v)": 2 * layers * kv,
        "backward reduce_scatter (k, v)": 2 * layers * kv,
    }


def _storage(t: torch.Tensor) -> Any:
    return (t._local_tensor if hasattr(t, "_local_tensor") else t).untyped_storage()


class _SavedBytes:
    """Sum of the bytes autograd saves for backward, each storage once, parameters excluded."""

    def __init__(self, model: torch.nn.Module) -> None:
        # Parameters are saved by reference (a linear saves its weight): not activations.
        self.seen: set[int] = {_storage(p).data_ptr() for p in model.parameters()}
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = _storage(t)
        key = storage.data_ptr()
        if key not in self.seen and storage.nbytes():
            self.seen.add(key)
            self.bytes += storage.nbytes()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


def _rank(rank: int, cp_size: int, batch: int, seq: int, reps: int) -> dict[str, Any]:
    from hyper_parallel.analysis.collectives import CollectiveRecorder, axis_groups, summarize
    from hyper_parallel.distributed import MeshLayout
    from hyper_parallel.distributed import context_parallel as cp
    from hyper_parallel.models.llama import PRESETS, apply_cp, cross_entropy_loss, preset_config

    config = preset_config("llama3-debug", max_seq_len=max(seq, 512))
    tokens = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if cp_size == 1:
        model = config.build()
        groups: dict[str, str] = {}
        args, kwargs, local_targets = (inputs,), {}, targets
    else:
        mesh = MeshLayout.from_sizes({"cp": cp_size}).build("cpu")
        model = apply_cp(config, cp_size=cp_size).build()
        model.parallelize(mesh["cp"])
        groups = axis_groups(mesh["cp"])
        r = mesh.local_rank("cp")
        args = (cp.shard_sequence(inputs, r, cp_size),)
        kwargs = {"positions": cp.positions(seq, r, cp_size)}
        local_targets = cp.shard_sequence(targets, r, cp_size)
    torch.manual_seed(0)
    model.init_states()

    def step() -> None:
        loss = cross_entropy_loss(model(*args, **kwargs), local_targets)
        loss.backward()

    # Activations: what the forward saves for backward.
    saved = _SavedBytes(model)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        loss = cross_entropy_loss(model(*args, **kwargs), local_targets)
    loss.backward()
    model.zero_grad(set_to_none=True)

    recorder = CollectiveRecorder(groups)
    with recorder:
        loss = cross_entropy_loss(model(*args, **kwargs), local_targets)
        recorder.phase = "backward"
        loss.backward()
    comms = [
        {"phase": s.phase, "kind": s.kind, "axis": s.axis, "count": s.count, "bytes": s.bytes}
        for s in summarize(recorder.records)
    ]

    barrier = dist.barrier if cp_size > 1 else (lambda: None)
    for _ in range(2):  # warm-up: DTensor's sharding decisions are cached after one step
        step()
    times = []
    for _ in range(reps):
        barrier()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    times = slowest_rank({"step": times})["step"] if cp_size > 1 else times
    params = PRESETS["llama3-debug"]
    head_dim = params["dim"] // params["num_heads"]
    return {
        "cp": cp_size,
        "step_ms": summary(times),
        "activation_bytes": saved.bytes,
        "comms": comms,
        "minimum": minimum(params["num_layers"], batch, seq, params["num_kv_heads"] * head_dim),
    }


def dry_run_bytes(seq: int, mesh: str) -> dict[str, Any]:
    """Per-rank bytes of ``DRY_RUN_MODEL`` at ``seq`` on ``mesh``: the dry run, bf16 compute,
    one sequence per data-parallel rank, no activation checkpointing."""
    from hyper_parallel.analysis import dry_run
    from hyper_parallel.distributed import MeshLayout
    from hyper_parallel.distributed.axes import apply_model_axes
    from hyper_parallel.dmodule import get_spec

    spec = get_spec(DRY_RUN_MODEL)
    layout = MeshLayout.parse(mesh)
    config = apply_model_axes(spec, spec.config(max_seq_len=seq), layout)
    start = time.process_time()
    report = dry_run(config, layout, seq_len=seq, dtype="bf16", loss_fn=spec.family.loss_fn)
    return {
        "seq": seq,
        "mesh": mesh,
        "activations": report.per_rank.activations,
        "total": report.per_rank.total,
        "activations_by_ac": dict(report.activations_by_ac),
        "cpu_s": time.process_time() - start,
    }


def run(
    cp_sizes: list[int], batch: int, seqs: list[int], reps: int, dry_run_seqs: list[int]
) -> dict[str, Any]:
    by_seq = []
    for seq in seqs:
        results = []
        for n in cp_sizes:
            if n == 1:
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
                try:
                    results.append(_rank(0, 1, batch, seq, reps))
                finally:
                    dist.destroy_process_group()
            else:
                results.append(gloo_ranks(_rank, n, n, batch, seq, reps))
        by_seq.append({"seq": seq, "results": results})
    dry = [dry_run_bytes(seq, mesh) for seq in dry_run_seqs for mesh in DRY_RUN_MESHES]
    return {"batch": batch, "reps": reps, "by_seq": by_seq, "dry_run": dry}


def times_cp(r: dict[str, Any], base: dict[str, Any]) -> float:
    """Activation bytes per rank over cp=1's, times cp (1.00: exactly 1 / cp)."""
    return r["activation_bytes"] / base["activation_bytes"] * r["cp"]


def format_result(result: dict[str, Any]) -> str:
    lines = [
        f"llama3-debug, batch {result['batch']}, fp32, gloo; step = forward + loss + backward, "
        f"median (min-max) of {result['reps']}, slowest rank",
        f"  {'seq':>6} {'cp':>3} {'step ms':>22} {'act. KiB/rank':>14} {'vs cp=1':>8} "
        f"{'x cp':>6} {'cp KiB/step':>12} {'minimum':>9} {'cp / min':>9}",
    ]
    for part in result["by_seq"]:
        base = part["results"][0]
        for r in part["results"]:
            t = r["step_ms"]
            step = f"{t['median']:.1f} ({t['min']:.1f}-{t['max']:.1f})"
            total = sum(c["bytes"] for c in r["comms"] if c["axis"] == "cp")
            minimum = sum(r["minimum"].values()) if r["cp"] > 1 else 0
            ratio = f"{total / minimum:.3f}" if minimum else "-"
            lines.append(
                f"  {part['seq']:>6} {r['cp']:>3} {step:>22} "
                f"{r['activation_bytes'] / 1024:>14.1f} "
                f"{r['activation_bytes'] / base['activation_bytes']:>8.3f} "
                f"{times_cp(r, base):>6.3f} {total / 1024:>12.1f} {minimum / 1024:>9.1f} "
                f"{ratio:>9}"
            )
    if result["dry_run"]:
        lines += [
            "",
            f"dry run, {DRY_RUN_MODEL}, bf16 compute, one sequence per data-parallel rank, "
            "no activation checkpointing; GiB per rank",
            f"  {'seq':>7} {'mesh':>11} {'activations':>12} {'full AC':>8} {'total':>8} "
            f"{'act. vs dp_shard':>17} {'CPU s':>6}",
        ]
        by_seq: dict[int, dict[str, Any]] = {}
        for d in result["dry_run"]:
            by_seq.setdefault(d["seq"], {})[d["mesh"]] = d
        for seq, rows in by_seq.items():
            dp = rows.get("dp_shard=8")
            for mesh, d in rows.items():
                vs = f"{d['activations'] / dp['activations']:.3f}" if dp else "-"
                lines.append(
                    f"  {seq:>7} {mesh:>11} {d['activations'] / 2**30:>12.2f} "
                    f"{d['activations_by_ac']['full'] / 2**30:>8.2f} {d['total'] / 2**30:>8.2f} "
                    f"{vs:>17} {d['cpu_s']:>6.1f}"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dry-run-seq", type=int, nargs="*", default=[32768, 131072])
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    result = run(args.cp, args.batch, args.seq, args.reps, args.dry_run_seq)
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
