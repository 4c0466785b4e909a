"""Peak memory per rank to initialize a Llama larger than one rank's share.

Each measurement runs in a fresh subprocess and reports its peak resident set size
(the kernel's ``VmHWM``, reset just before building) above the resident size it had
at that point (after imports and process-group setup):

- ``whole``: build the model on the CPU and ``init_states()`` — what one process
  needs to hold all of it;
- ``meta -> shard -> init (tp=N)``: build on the meta device with the ``apply_tp``
  configs, ``parallelize`` over a fake process group of N ranks, ``to_empty`` and
  ``init_states()`` — rank 0 keeps only its own shards, but while a module is
  initialized its *full* parameters exist on every rank (so that a sharded model
  starts from the values the whole model would have), plus the initializer's
  temporaries (torch's ``trunc_normal_`` takes a few times the tensor) and what the
  allocator keeps of them. The bound is therefore the rank's shards plus a few times
  the largest module's full parameters, not the shards alone; the largest module of
  ``llama3-405b`` (reported below) shows what that means at scale;
- ``whole -> shard (tp=N)``: build and initialize whole, then ``parallelize`` — the
  usual way without a meta build.

Run::

    .venv/bin/python benchmarks/bench_init_memory.py --tp 8 --json memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from typing import Any

MODEL = dict(
    vocab_size=8192, dim=768, num_layers=12, num_heads=16, num_kv_heads=8, ffn_dim=3072,
    max_seq_len=2048,
)  # fmt: skip
MODES = ("whole", "meta -> shard -> init", "whole -> shard")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    """Reset the kernel's peak-RSS mark (``VmHWM``) so imports do not count (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _measure(mode: str, tp: int) -> dict[str, Any]:
    """Runs in the subprocess: build the model one way, return bytes."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hyper_parallel.core.dtensor.device_mesh import init_device_mesh
    from hyper_parallel.core.dtensor.dtensor import DTensor
    from hyper_parallel.models.llama import llama3_config
    from hyper_parallel.models.llama.sharding import apply_tp

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    config = apply_tp(llama3_config(**MODEL), tp_size=tp)
    before = _rss_bytes()
    _reset_peak()
    torch.manual_seed(0)
    if mode == "meta -> shard -> init":
        with torch.device("meta"):
            model = config.build()
        model.parallelize(mesh)
        model.to_empty(device="cpu")
        model.init_states()
    else:
        model = config.build()
        model.init_states()
        if mode == "whole -> shard":
            model.parallelize(mesh)
    peak = _peak_bytes()
    local = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
        for p in model.parameters()
    )
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    largest, largest_bytes = largest_module(model)
    dist.destroy_process_group()
    return {
        "mode": mode,
        "peak_bytes": peak - before,
        "rank_param_bytes": local,
        "model_param_bytes": total,
        "largest_module": largest,
        "largest_module_bytes": largest_bytes,
    }


def largest_module(model: Any) -> tuple[str, int]:
    """The module whose own parameters are largest in full (global) size, and their bytes.

    ``init_states`` materializes one module's full parameters at a time, so this is
    the transient on top of a rank's shards (before the initializer's temporaries).
    """
    best = ("", 0)
    for name, module in model.named_modules():
        size = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        if size > best[1]:
            best = (name, size)
    return best


def at_scale(model_name: str = "llama3-405b") -> dict[str, Any]:
    """The largest module of a registered model, built on the meta device (no memory)."""
    import torch

    from hyper_parallel.dmodule import get_spec

    with torch.device("meta"):
        model = get_spec(model_name).config().build()
    name, size = largest_module(model)
    return {"model": model_name, "largest_module": name, "largest_module_bytes": size}


def run(tp: int) -> dict[str, Any]:
    """Every mode in its own subprocess."""
    rows = []
    for mode in MODES:
        out = subprocess.run(
            [sys.executable, __file__, "--child", mode, "--tp", str(tp)],
            check=True,
            capture_output=True,
            text=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {"tp": tp, "model": dict(MODEL), "rows": rows, "at_scale": at_scale()}


def format_result(result: dict[str, Any]) -> str:
    mib = 1024 * 1024
    total = result["rows"][0]["model_param_bytes"]
    lines = [
        f"Llama ({result['model']['dim']} dim, {result['model']['num_layers']} layers, "
        f"{total / 4 / 1e6:.0f}M params = {total / mib:.0f} MiB fp32), peak RSS above "
        f"baseline, rank 0 of tp={result['tp']}",
        f"  {'mode':<24} {'peak MiB':>9} {'params held MiB':>16} {'peak / whole':>13} "
        f"{'peak - held MiB':>16}",
    ]
    whole = result["rows"][0]["peak_bytes"]
    for row in result["rows"]:
        lines.append(
            f"  {row['mode']:<24} {row['peak_bytes'] / mib:>9.0f} "
            f"{row['rank_param_bytes'] / mib:>16.0f} {row['peak_bytes'] / whole:>13.2f} "
            f"{(row['peak_bytes'] - row['rank_param_bytes']) / mib:>16.0f}"
        )
    first = result["rows"][0]
    scale = result["at_scale"]
    lines += [
        f"  largest module ({first['largest_module']}): "
        f"{first['largest_module_bytes'] / mib:.0f} MiB in full, held whole on every rank "
        "while it is initialized (plus the initializer's temporaries)",
        f"  {scale['model']}: largest module ({scale['largest_module']}) "
        f"{scale['largest_module_bytes'] / 1e9:.1f} GB in full",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_measure(args.child, args.tp)))
        return 0
    result = run(args.tp)
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
