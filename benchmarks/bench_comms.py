"""Collectives and bytes per training step of the debug Llama: TP and TP+SP, three ways.

One forward + backward (loss included) of ``llama3-debug`` on a fake process group
of ``--tp`` ranks, recorded with :class:`hyper_parallel.analysis.collectives.
CollectiveRecorder` (every functional and c10d collective: kind, phase, per-rank
buffer bytes), for:

- ``ours (fast)`` / ``ours (DTensor)``: the model's own ``apply_tp`` / ``apply_tp_sp``
  configs with the fast path on / off;
- ``torch styles``: the same model parallelized with torch's styles (torchtitan's plan,
  ``benchmarks/_common.py``);
- ``minimum``: the analytical minimum for Megatron tensor (+ sequence) parallelism;
- ``minimum, shards kept``: the same where each gathered input is kept for backward as
  its shard and gathered again there (Megatron-LM's sequence parallelism, and ours:
  less activation memory for more all-gathers).

The minimum, per step, for ``L`` layers and activations ``A = B·S·D`` elements
(Shoeybi et al., 2019, §3; Korthikanti et al., 2022, §4.2.2, Table 2):

- TP: forward ``2L + 1`` all-reduces of ``A`` (two per block, one after the
  vocab-parallel embedding); backward ``2L + 1`` all-reduces of ``A`` (two block
  inputs per layer, the output projection's input).
- TP+SP: forward ``2L + 1`` reduce-scatters (embedding, two per block) and ``2L + 1``
  all-gathers (two per block, the output projection) of ``A``; backward the same
  counts with the kinds swapped. With shards kept, backward gathers each of those
  ``2L + 1`` inputs again for the weight gradients: ``2L + 1`` more all-gathers of ``A``.
- Both: the vocab-parallel cross entropy needs three all-reduces of ``B·S`` values in
  the forward (max logit, target logit, sum of exponentials; Megatron-LM's
  ``_VocabParallelCrossEntropy``) and none in the backward.

Not counted: reductions deferred to the optimizer step (the Partial gradients of the
replicated norm weights under SP, on every path).

Run::

    .venv/bin/python benchmarks/bench_comms.py --tp 4 --json comms.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from _common import apply_torch_llama_plan

CONTENDERS = ("ours (fast)", "ours (DTensor)", "torch styles")
DTYPE_BYTES = 4  # float32 activations
_PHASE = {"forward": "fwd", "backward": "bwd"}


def minimum(
    layers: int,
    batch: int,
    seq: int,
    dim: int,
    sequence_parallel: bool,
    keep_shards: bool = False,
) -> list[dict[str, Any]]:
    """The analytical minimum (see the module docstring): rows of phase, kind, count, bytes.

    ``keep_shards``: gathered inputs are kept as shards and gathered again in backward
    (changes nothing without sequence parallelism).
    """
    act = batch * seq * dim * DTYPE_BYTES
    per_token = batch * seq * DTYPE_BYTES
    n = 2 * layers + 1
    rows = [{"phase": "forward", "kind": "all_reduce", "count": 3, "bytes": 3 * per_token}]
    if sequence_parallel:
        for phase in ("forward", "backward"):
            for kind in ("all_gather", "reduce_scatter"):
                count = 2 * n if keep_shards and (phase, kind) == ("backward", "all_gather") else n
                rows.append({"phase": phase, "kind": kind, "count": count, "bytes": count * act})
    else:
        rows[0] = {
            "phase": "forward",
            "kind": "all_reduce",
            "count": n + 3,
            "bytes": n * act + 3 * per_token,
        }
        rows.append({"phase": "backward", "kind": "all_reduce", "count": n, "bytes": n * act})
    return rows


def _build(contender: str, mesh: Any, sequence_parallel: bool) -> Any:
    from hyper_parallel.dmodule import fast_path
    from hyper_parallel.models.llama import preset_config
    from hyper_parallel.models.llama.sharding import apply_tp, apply_tp_sp

    config = preset_config("llama3-debug")
    if contender == "torch styles":
        model = config.build()
        apply_torch_llama_plan(model, mesh, sequence_parallel)
    else:
        shard = apply_tp_sp if sequence_parallel else apply_tp
        model = shard(config, tp_size=mesh.size()).build()
        with fast_path(contender == "ours (fast)"):
            model.parallelize(mesh)
    torch.manual_seed(0)
    model.init_states()
    return model


def record(
    contender: str, mesh: Any, sequence_parallel: bool, batch: int, seq: int
) -> list[dict[str, Any]]:
    """Collectives of one forward + backward: rows of phase, kind, count, bytes."""
    from hyper_parallel.analysis.collectives import CollectiveRecorder, axis_groups, summarize
    from hyper_parallel.models.llama import cross_entropy_loss

    model = _build(contender, mesh, sequence_parallel)
    tokens = torch.randint(0, 256, (batch, seq + 1))
    recorder = CollectiveRecorder(axis_groups(mesh))
    with recorder:
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
        recorder.phase = "backward"
        loss.backward()
    return [
        {"phase": s.phase, "kind": s.kind, "count": s.count, "bytes": s.bytes}
        for s in summarize(recorder.records)
    ]


def run(tp: int, batch: int, seq: int) -> dict[str, Any]:
    """Every contender and the minimum, for TP and TP+SP, on a fake group of ``tp`` ranks."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hyper_parallel.core.dtensor.device_mesh import init_device_mesh
    from hyper_parallel.models.llama import PRESETS

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    dim, num_layers = PRESETS["llama3-debug"]["dim"], PRESETS["llama3-debug"]["num_layers"]
    out: dict[str, Any] = {
        "tp": tp,
        "batch": batch,
        "seq": seq,
        "dim": dim,
        "layers": num_layers,
        "layouts": {},
    }
    for sp in (False, True):
        rows = {c: record(c, mesh, sp, batch, seq) for c in CONTENDERS}
        rows["minimum"] = minimum(num_layers, batch, seq, dim, sp)
        rows["minimum, shards kept"] = minimum(num_layers, batch, seq, dim, sp, keep_shards=True)
        out["layouts"]["TP+SP" if sp else "TP"] = rows
    return out


def totals(rows: list[dict[str, Any]]) -> tuple[int, int]:
    return sum(r["count"] for r in rows), sum(r["bytes"] for r in rows)


def format_result(result: dict[str, Any]) -> str:
    lines = [
        f"llama3-debug, {result['layers']} layers, tp={result['tp']} (fake group), "
        f"batch {result['batch']} x seq {result['seq']}, one forward + backward"
    ]
    for layout, by_contender in result["layouts"].items():
        _, min_bytes = totals(by_contender["minimum"])
        lines.append(f"  {layout}")
        lines.append(
            f"    {'contender':<21} {'collectives':>11} {'KiB':>9} {'bytes/min':>10}  breakdown"
        )
        for name, rows in by_contender.items():
            count, num_bytes = totals(rows)
            detail = ", ".join(
                f"{_PHASE[r['phase']]} {r['kind']} x{r['count']}" for r in rows if r["count"]
            )
            lines.append(
                f"    {name:<21} {count:>11} {num_bytes / 1024:>9.1f} "
                f"{num_bytes / min_bytes:>10.2f}  {detail}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    result = run(args.tp, args.batch, args.seq)
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
