"""Context parallelism on gloo: one global sequence split over cp = 1, 2, 4 ranks.

For ``llama3-debug`` at a fixed global sequence (``--seq``, default 512) and batch,
each cp size runs on its own spawned gloo ranks (cp = 1 is the model on one process,
no layout) and reports, per rank:

- **step time**: forward + loss + backward, median (min-max) over ``--reps``
  repetitions of the slowest rank (a collective step is as slow as it);
- **peak activation bytes**: the bytes of the tensors the forward saves for backward
  (``torch.autograd.graph.saved_tensors_hooks``, each storage counted once; for a
  DTensor its local shard; parameters excluded) — what one rank holds at the end of
  the forward, the activation peak of a training step without activation checkpointing;
- **collective bytes** on ``cp`` per step (``CollectiveRecorder``: the per-rank buffer
  each collective fills or reduces) against the analytical minimum of all-gather
  context parallelism (Llama 3, Dubey et al., 2024, §3.3.2; Megatron-LM's and
  torchtitan's all-gather variant): in each of the ``L`` layers the keys and values of
  the whole sequence are gathered once in forward (2 all-gathers of ``B·S·Hkv·Dh``
  values) and their gradients reduce-scattered once in backward (2 reduce-scatters of
  the same size). Our layout adds one all-gather of the ``S`` int64 positions per
  forward (for the causal mask), reported separately.

Nothing here is a test: times depend on the machine and its load.

Run::

    .venv/bin/python benchmarks/bench_cp.py                 # cp = 1, 2, 4; seq 512
    .venv/bin/python benchmarks/bench_cp.py --seq 256 --reps 5 --json cp.json
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
POSITION_BYTES = 8  # int64


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
        "positions_bytes": seq * POSITION_BYTES,
    }


def run(cp_sizes: list[int], batch: int, seq: int, reps: int) -> dict[str, Any]:
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
    return {"batch": batch, "seq": seq, "reps": reps, "results": results}


def format_result(result: dict[str, Any]) -> str:
    base = result["results"][0]["activation_bytes"]
    lines = [
        f"llama3-debug, batch {result['batch']} x global seq {result['seq']}, fp32, gloo; "
        f"step = forward + loss + backward, median (min-max) of {result['reps']}, slowest rank",
        f"  {'cp':>3} {'step ms':>22} {'act. KiB/rank':>14} {'vs cp=1':>8} "
        f"{'cp KiB/step':>12} {'k/v KiB':>9} {'minimum':>9} {'k/v / min':>9} {'total / min':>11}",
    ]
    for r in result["results"]:
        t = r["step_ms"]
        step = f"{t['median']:.1f} ({t['min']:.1f}-{t['max']:.1f})"
        on_cp = [c for c in r["comms"] if c["axis"] == "cp"]
        total = sum(c["bytes"] for c in on_cp)
        # Everything on cp but the one positions gather is the keys' and values' traffic.
        kv = total - r["positions_bytes"] if on_cp else 0
        minimum = sum(r["minimum"].values()) if r["cp"] > 1 else 0
        ratio = f"{kv / minimum:.2f}" if minimum else "-"
        total_ratio = f"{total / minimum:.3f}" if minimum else "-"
        lines.append(
            f"  {r['cp']:>3} {step:>22} {r['activation_bytes'] / 1024:>14.1f} "
            f"{r['activation_bytes'] / base:>8.2f} {total / 1024:>12.1f} {kv / 1024:>9.1f} "
            f"{minimum / 1024:>9.1f} {ratio:>9} {total_ratio:>11}"
        )
        for c in r["comms"]:
            lines.append(
                f"        {c['phase']:<8} {c['kind']:<14} on {c['axis']:<3} x{c['count']:<3} "
                f"{c['bytes'] / 1024:.1f} KiB"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    result = run(args.cp, args.batch, args.seq, args.reps)
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
