"""Loading a Hugging Face checkpoint on a mesh: ours vs DCP's ``HuggingFaceStorageReader``.

A Llama checkpoint of ``--size-mb`` (fp32, in several safetensors files) is written
once (with :func:`~hyper_parallel.checkpoint_hf.save_hf` from a random model: the
same files ``save_pretrained`` writes), then loaded on ``--mesh`` (default
dp_shard=2 x tp=2, spawned gloo ranks) into the model built for that mesh (FSDP2 over
the tensor-parallel shards), alternating the two contenders:

- *ours*: :func:`~hyper_parallel.checkpoint_hf.load_hf` (names and rotary layout
  mapped, each parameter's slice read with safetensors' ``get_slice``);
- *DCP*: ``torch.distributed.checkpoint.load`` with ``HuggingFaceStorageReader`` into a
  state dict of the same DTensors keyed by Hugging Face names (no layout mapping: a
  lower bound on what DCP needs), as torchtitan does.

Per rank: wall time, bytes requested from the files (the slices each contender asks
safetensors for; DCP's counted from its read items), and the peak resident memory
above the state (``VmHWM`` reset before each load). Then the data path: tokens/s of
:class:`~hyper_parallel.train.tokens.TokenBatches` over a memory-mapped ``.bin``,
against the tokens/s one training step of ``llama3-debug`` consumes.

Run::

    .venv/bin/python benchmarks/bench_hf_load.py --size-mb 64 --json out.json
    .venv/bin/python benchmarks/bench_hf_load.py --size-mb 1024   # ~1 GB in >= 2 files
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _dims(size_mb: int) -> dict[str, Any]:
    """Llama sizes whose fp32 parameters take about ``size_mb`` MB (at least 2 layers)."""
    from hyper_parallel.models.llama.config import llama3_config, num_params

    dim = 512 if size_mb <= 128 else 1024
    base = dict(
        vocab_size=8192, dim=dim, num_heads=8, num_kv_heads=4, ffn_dim=3 * dim, max_seq_len=256
    )
    one, two = (4 * num_params(llama3_config(**base, num_layers=n)) for n in (1, 2))
    layers = max(2, round((size_mb * 1e6 - (2 * one - two)) / (two - one)))
    return {**base, "num_layers": layers}


def write_checkpoint(path: str, size_mb: int) -> dict[str, Any]:
    import torch

    from hyper_parallel.checkpoint_hf import hf_config_from_model, save_hf
    from hyper_parallel.checkpoint_hf.specs import llama_hf_config

    dims = _dims(size_mb)
    config = llama_hf_config(**dims)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    save_hf(
        model, path, hf_config=hf_config_from_model(config), max_shard_size=f"{size_mb // 3 + 1}MB"
    )
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    total = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    return {"dims": dims, "files": len(files), "bytes": total}


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rss() -> tuple[int, int]:
    current = peak = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
            elif line.startswith("VmRSS:"):
                current = int(line.split()[1]) * 1024
    return current, peak


def _rank(
    rank: int, world: int, init: str, path: str, mesh: dict[str, int], reps: int, out: str
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader, hf_storage

    from hyper_parallel.checkpoint_hf import load_hf, read_hf_config
    from hyper_parallel.checkpoint_hf.mapping import family_maps
    from hyper_parallel.train import TrainConfig, build_mesh, build_parallel_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    cfg = read_hf_config(path)
    run = TrainConfig(model=cfg.spec, model_overrides=cfg.model_overrides, mesh=mesh)
    model = build_parallel_model(run, build_mesh(run.mesh, "cpu"), "cpu")
    params = dict(model.named_parameters())
    maps = family_maps(cfg.family, cfg.model_config())
    hf_state = {m.hf[0]: params[m.ours] for m in maps}  # same DTensors, Hugging Face names

    counted = {"bytes": 0}
    original = HuggingFaceStorageReader._process_read_request

    def counting(self, f, req, planner):  # DCP's read items, counted as they are served
        sl = f.get_slice(req.storage_index.fqn)
        itemsize = {"F32": 4, "BF16": 2, "F16": 2}[sl.get_dtype()]
        counted["bytes"] += math.prod(req.lengths) * itemsize
        return original(self, f, req, planner)

    hf_storage.HuggingFaceStorageReader._process_read_request = counting
    results: dict[str, dict[str, list[float]]] = {
        name: {"seconds": [], "bytes": [], "peak_bytes": []} for name in ("ours", "dcp")
    }
    for rep in range(reps):
        order = ("ours", "dcp") if rep % 2 == 0 else ("dcp", "ours")
        for name in order:
            dist.barrier()
            base, _ = _rss()
            _reset_peak()
            t0 = time.perf_counter()
            if name == "ours":
                nbytes = load_hf(model, path).bytes_read
            else:
                counted["bytes"] = 0
                dcp.load(hf_state, storage_reader=HuggingFaceStorageReader(path))
                nbytes = counted["bytes"]
            seconds = time.perf_counter() - t0
            _, peak = _rss()
            results[name]["seconds"].append(seconds)
            results[name]["bytes"].append(nbytes)
            results[name]["peak_bytes"].append(max(0, peak - base))
    state_bytes = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in params.values()
    )
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"rank": rank, "state_bytes": state_bytes, **results}, f)
    dist.destroy_process_group()


def data_path(seconds: float = 3.0) -> dict[str, Any]:
    """Tokens/s of TokenBatches over a memory-mapped .bin vs one training step's consumption."""
    import numpy as np

    from hyper_parallel.train import TrainConfig, Trainer
    from hyper_parallel.train.tokens import TokenBatches, load_token_file, write_token_file

    with tempfile.TemporaryDirectory() as tmp:
        path = write_token_file(
            np.random.default_rng(0).integers(0, 256, 20_000_000).astype(np.uint16),
            os.path.join(tmp, "tokens.bin"),
        )
        batches = TokenBatches(load_token_file(path), global_batch_size=8, seq_len=64)
        count, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            inputs, _ = batches.next_batch(0, 2)
            count += inputs.numel()
        data_rate = count / (time.perf_counter() - t0)
    trainer = Trainer(TrainConfig(num_steps=4, log_every=0, progress=False), device="cpu")
    trainer.train_step()  # warm-up
    t0 = time.perf_counter()
    for _ in range(3):
        trainer.train_step()
    step_rate = 3 * 8 * 64 / (time.perf_counter() - t0)
    # A dp=2 rank reads half the rows; the step consumes the global batch.
    return {"data_tokens_per_s_per_rank": data_rate, "train_tokens_per_s": step_rate}


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    from hyper_parallel.train.run import parse_mesh

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=64, help="checkpoint size (default 64)")
    parser.add_argument("--mesh", default="dp_shard=2,tp=2")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    mesh = parse_mesh(args.mesh)
    world = math.prod(mesh.values())
    with tempfile.TemporaryDirectory(prefix="hp_bench_hf_") as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        info = write_checkpoint(ckpt, args.size_mb)
        print(f"checkpoint: {info['bytes'] / 1e6:.0f} MB in {info['files']} files", flush=True)
        out = os.path.join(tmp, "rank")
        mp.start_processes(
            _rank,
            args=(world, os.path.join(tmp, "init"), ckpt, mesh, args.reps, out),
            nprocs=world,
            start_method="spawn",
        )
        ranks = []
        for r in range(world):
            with open(f"{out}.{r}") as f:
                ranks.append(json.load(f))
    result = {"checkpoint": info, "mesh": mesh, "ranks": ranks, "data": data_path()}
    for r in ranks:
        o, d = r["ours"], r["dcp"]
        print(
            f"rank {r['rank']}: ours {statistics.median(o['seconds']):.3f}s "
            f"{statistics.median(o['bytes']) / 1e6:.1f} MB peak +{statistics.median(o['peak_bytes']) / 1e6:.1f} MB | "
            f"DCP {statistics.median(d['seconds']):.3f}s {statistics.median(d['bytes']) / 1e6:.1f} MB "
            f"peak +{statistics.median(d['peak_bytes']) / 1e6:.1f} MB | shards {r['state_bytes'] / 1e6:.1f} MB"
        )
    print(json.dumps(result["data"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
