"""One training step of the debug Llama at dp=2 x tp=2: ours vs torch's styles + fully_shard.

Four gloo ranks (spawned, ``file://`` rendezvous). Every contender is the same
``llama3-debug`` model, built on the meta device, tensor-parallelized over
``mesh["tp"]``, each block and the root wrapped with FSDP2's ``fully_shard`` over
``mesh["dp"]``, then materialized and initialized with the same seed (so all start
from the same weights):

- ``ours (fast)`` / ``ours (DTensor)``: :func:`hyper_parallel.train.build_parallel_model`
  (the model's ``apply_tp`` / ``apply_tp_sp`` configs) with the fast path on / off;
- ``torch styles``: torch's ``parallelize_module`` with torchtitan's plan
  (``benchmarks/_common.py``).

With ``--compile inductor`` every contender also compiles each block
(``torch.compile(fullgraph=True)``, per block, after the TP plan and before
``fully_shard``, as torchtitan does): ours through the trainer's ``compile`` switch,
torch's styles with :func:`_common.compile_torch_blocks`. Compilation happens in the
first (untimed) step.

A step is ``zero_grad`` → forward → vocab-parallel cross entropy → backward →
global-norm clipping → AdamW, each contender on its own copy; contenders are
interleaved, a repetition is as slow as its slowest rank. The first-step losses are
printed to show all three compute the same thing.

Run::

    .venv/bin/python benchmarks/bench_train_step.py --reps 8 --json train.json
    .venv/bin/python benchmarks/bench_train_step.py --compile none inductor --layout tp
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    apply_torch_llama_plan,
    compile_torch_blocks,
    gloo_ranks,
    interleaved,
    slowest_rank,
    summary,
)

CONTENDERS = ("ours (fast)", "ours (DTensor)", "torch styles")
MESH = {"dp": 2, "tp": 2}


def _build(contender: str, cfg: Any, mesh: Any, backend: str) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    from hyper_parallel.distributed.pipeline import init_states_by_unit
    from hyper_parallel.dmodule import fast_path, get_spec
    from hyper_parallel.train.trainer import build_parallel_model, model_config

    if contender != "torch styles":
        with fast_path(contender == "ours (fast)"):
            return build_parallel_model(cfg, mesh, "cpu")  # compiles per cfg.compile
    with torch.device("meta"):
        model = model_config(cfg, tp=1).build()  # no sharding configs attached
    apply_torch_llama_plan(model, mesh["tp"], cfg.sp)
    if backend != "none":
        compile_torch_blocks(model, backend)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    # The trainer's init (per pipeline unit), so every contender starts from the same values.
    init_states_by_unit(model, get_spec(cfg.model).pipeline(), cfg.seed)
    return model


def _rank(
    rank: int, sequence_parallel: bool, reps: int, inner: int, seq: int, backend: str
) -> dict[str, Any]:
    import torch._dynamo

    from hyper_parallel.models.llama import cross_entropy_loss
    from hyper_parallel.train.trainer import TrainConfig, build_mesh, clip_grad_norm_

    if backend not in ("none", "inductor"):
        # The trainer compiles with inductor; other backends only for torch's contender
        # would compare different things.
        raise ValueError(f"bench_train_step: --compile {backend!r}: use 'none' or 'inductor'.")
    cfg = TrainConfig(
        mesh=dict(MESH),
        sp=sequence_parallel,
        seq_len=seq,
        compile=backend != "none",
    )
    mesh = build_mesh(cfg.mesh, "cpu")
    assert mesh is not None
    dp_rank = mesh["dp"].get_local_rank()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (cfg.batch_size, seq + 1), generator=generator)
    rows = tokens.chunk(MESH["dp"])[dp_rank]
    inputs, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    first_losses: dict[str, float] = {}
    steps = {}
    for name in CONTENDERS:
        model = _build(name, cfg, mesh, backend)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

        def step(model: Any = model, optimizer: Any = optimizer) -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            loss = cross_entropy_loss(model(inputs), targets)
            loss.backward()
            clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            return loss

        loss = step().detach()
        first_losses[name] = float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
        steps[name] = step
    times = interleaved(steps, reps=reps, inner=inner, warmup=1, barrier=dist.barrier, scale=1e3)
    out = {"times_ms": slowest_rank(times), "first_step_loss": first_losses}
    out["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
    return out


def run(sequence_parallel: bool, reps: int, inner: int, seq: int, backend: str) -> dict[str, Any]:
    result = gloo_ranks(
        _rank, MESH["dp"] * MESH["tp"], sequence_parallel, reps, inner, seq, backend
    )
    result["layout"] = "TP+SP" if sequence_parallel else "TP"
    result["compile"] = backend
    result["mesh"] = dict(MESH)
    result["seq"] = seq
    return result


def format_result(result: dict[str, Any]) -> str:
    times = result["times_ms"]
    ours = summary(times["ours (fast)"])["median"]
    torch_median = summary(times["torch styles"])["median"]
    compiled = "" if result["compile"] == "none" else f", compiled per block ({result['compile']})"
    lines = [
        f"llama3-debug training step, dp=2 x tp=2 ({result['layout']}{compiled}), gloo, "
        f"global batch 8 x seq {result['seq']}",
        f"  {'contender':<16} {'median ms':>10} {'min-max ms':>17} {'vs torch':>9} {'1st loss':>9}",
    ]
    for name in CONTENDERS:
        s = summary(times[name])
        lines.append(
            f"  {name:<16} {s['median']:>10.1f} {s['min']:>8.1f}-{s['max']:<8.1f} "
            f"{s['median'] / torch_median:>9.2f} {result['first_step_loss'][name]:>9.5f}"
        )
    lines.append(f"  ratio ours(fast)/torch = {ours / torch_median:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--inner", type=int, default=2, help="steps per timed block")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layout", choices=("tp", "tp_sp", "both"), default="both")
    parser.add_argument(
        "--compile",
        nargs="+",
        choices=("none", "inductor"),
        default=["none"],
        help="eager ('none') and/or every block compiled with inductor, for every contender",
    )
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    layouts = {"tp": (False,), "tp_sp": (True,), "both": (False, True)}[args.layout]
    results = []
    for backend in args.compile:
        for sp in layouts:
            result = run(sp, args.reps, args.inner, args.seq, backend)
            results.append(result)
            print(format_result(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
