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

Per rank: wall time (medians and min-max over ``--reps``, the contenders' order
alternated each repetition, after one untimed load of each); bytes read, counted in
that untimed load by wrapping ``safetensors.safe_open`` for both contenders alike:

- *requested*: the bytes of every slice asked of a file (``get_slice(name)[box]``):
  what is copied out of it;
- *mapped*: the file's pages resident in the rank's memory map when it closes the
  file (``Rss`` of its mappings in ``/proc/self/smaps``): what the kernel brought
  into the rank's address space, in 4 KiB pages (a slice of half of each row maps
  every page of the tensor) plus the kernel's fault-around;
- ``rchar`` of ``/proc/self/io`` over the load: ~0 for both, since safetensors
  reads through ``mmap`` rather than ``read()``;

and the peak resident memory above the state (``VmHWM`` reset before each load; it
counts the mapped file pages too). After the timed loads, the values each contender
loaded are compared on every parameter without rotary rows (DCP's copy of ``wq`` /
``wk`` is in Hugging Face's row order by design). Then the data path: tokens/s of
:class:`~hyper_parallel.train.tokens.TokenBatches` over a memory-mapped ``.bin``,
against the tokens/s one training step of ``llama3-debug`` consumes.

Run::

    .venv/bin/python benchmarks/bench_hf_load.py --size-mb 64 --json out.json
    .venv/bin/python benchmarks/bench_hf_load.py --size-mb 1024   # ~1 GB in >= 2 files
    .venv/bin/python benchmarks/bench_hf_load.py --checkpoint DIR  # an existing one
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
    from hyper_parallel.models.llama import llama_hf_config

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


def _mapped_bytes(path: str) -> int:
    """Resident bytes of this process's memory maps of ``path`` (``/proc/self/smaps``)."""
    total, current = 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            _CountingOpen.counts["own_reads"] += len(line.encode())
            head = line.split(maxsplit=5)
            if "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
                current = head[5].strip() if len(head) == 6 else None
            elif head[0] == "Rss:" and current == path:
                total += int(head[1]) * 1024
    return total


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


class _CountingOpen:
    """``safetensors.safe_open`` that counts the slices asked for and the pages mapped."""

    real: Any = None
    counts = {"requested": 0, "mapped": 0, "own_reads": 0}

    def __init__(self, filename: Any, framework: str, *args: Any, **kwargs: Any) -> None:
        self._path = os.path.realpath(os.fspath(filename))
        self._handle = _CountingOpen.real(filename, framework, *args, **kwargs)
        self._counted = False

    def __enter__(self) -> _CountingOpen:
        self._handle.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        self._count()
        return self._handle.__exit__(*exc)

    def __del__(self) -> None:
        self._count()

    def _count(self) -> None:
        if not self._counted:
            self._counted = True
            _CountingOpen.counts["mapped"] += _mapped_bytes(self._path)

    def get_slice(self, name: str) -> _CountingSlice:
        return _CountingSlice(self._handle.get_slice(name))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


class _CountingSlice:
    def __init__(self, sl: Any) -> None:
        self._slice = sl

    def __getitem__(self, box: Any) -> Any:
        data = self._slice[box]
        _CountingOpen.counts["requested"] += data.numel() * data.element_size()
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._slice, name)


def _rank(
    rank: int, world: int, init: str, path: str, mesh: dict[str, int], reps: int, out: str
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import safetensors
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

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

    def load(name: str) -> None:
        if name == "ours":
            load_hf(model, path)
        else:
            dcp.load(hf_state, storage_reader=HuggingFaceStorageReader(path))

    def local(p: Any) -> Any:
        return p.to_local() if hasattr(p, "to_local") else p

    results: dict[str, dict[str, Any]] = {}
    # Bytes: one untimed load of each with safe_open wrapped (also their warm-up).
    _CountingOpen.real = safetensors.safe_open
    safetensors.safe_open = _CountingOpen
    try:
        for name in ("ours", "dcp"):
            _CountingOpen.counts.update(requested=0, mapped=0, own_reads=0)
            dist.barrier()
            rchar = _rchar()
            load(name)
            rchar = _rchar() - rchar - _CountingOpen.counts["own_reads"]  # less smaps' text
            results[name] = {
                "seconds": [],
                "peak_bytes": [],
                "bytes": [_CountingOpen.counts["requested"]],
                "mapped_bytes": [_CountingOpen.counts["mapped"]],
                "rchar_bytes": [rchar],
            }
    finally:
        safetensors.safe_open = _CountingOpen.real
    for rep in range(reps):
        order = ("ours", "dcp") if rep % 2 == 0 else ("dcp", "ours")
        for name in order:
            dist.barrier()
            base, _ = _rss()
            _reset_peak()
            t0 = time.perf_counter()
            load(name)
            seconds = time.perf_counter() - t0
            _, peak = _rss()
            results[name]["seconds"].append(seconds)
            results[name]["peak_bytes"].append(max(0, peak - base))
    # The same values? Every parameter without rotary rows, ours then DCP's.
    plain = [m.ours for m in maps if not m.rotary_head_dim]
    load("ours")
    with torch.no_grad():
        ours = {n: local(params[n]).clone() for n in plain}
    load("dcp")
    same = all(torch.equal(ours[n], local(params[n])) for n in plain)
    state_bytes = sum(local(p).numel() * 4 for p in params.values())
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"rank": rank, "state_bytes": state_bytes, "same_values": same, **results}, f)
    dist.barrier()  # no rank tears the group down while a peer still talks to it
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
    trainer = Trainer(TrainConfig(steps=4, log_every=0, progress=False), device="cpu")
    trainer.train_step()  # warm-up
    t0 = time.perf_counter()
    for _ in range(3):
        trainer.train_step()
    step_rate = 3 * 8 * 64 / (time.perf_counter() - t0)
    # A dp=2 rank reads half the rows; the step consumes the global batch.
    return {"data_tokens_per_s_per_rank": data_rate, "train_tokens_per_s": step_rate}


def _checkpoint_info(path: str) -> dict[str, Any]:
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    total = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    return {"dims": None, "files": len(files), "bytes": total}


def _span(values: list[float], scale: float = 1.0, fmt: str = ".3f") -> str:
    lo, mid, hi = (x / scale for x in (min(values), statistics.median(values), max(values)))
    return f"{mid:{fmt}} [{lo:{fmt}}-{hi:{fmt}}]"


def report(result: dict[str, Any]) -> str:
    """Per-rank lines: time median [min-max] s, bytes requested / mapped / rchar MB, peak."""
    lines = [
        "time: median [min-max] s over the timed loads; bytes (one untimed load each, "
        "safe_open wrapped): requested = slices asked of the files, mapped = file pages "
        "resident in the rank's memory maps at close, rchar = read() bytes; peak = VmHWM "
        "above the state (includes mapped file pages)"
    ]
    for r in result["ranks"]:
        parts = []
        for name in ("ours", "dcp"):
            c = r[name]
            parts.append(
                f"{name} {_span(c['seconds'])} s, requested {c['bytes'][0] / 1e6:.1f} MB, "
                f"mapped {c['mapped_bytes'][0] / 1e6:.1f} MB, rchar {c['rchar_bytes'][0] / 1e6:.2f} MB, "
                f"peak +{statistics.median(c['peak_bytes']) / 1e6:.0f} MB"
            )
        o, d = r["ours"], r["dcp"]
        ratio = statistics.median(o["seconds"]) / statistics.median(d["seconds"])
        lines.append(
            f"rank {r['rank']} (shards {r['state_bytes'] / 1e6:.1f} MB): "
            + " | ".join(parts)
            + f" | ours/DCP: time {ratio:.2f}x, requested "
            f"{o['bytes'][0] / max(d['bytes'][0], 1):.2f}x, mapped "
            f"{o['mapped_bytes'][0] / max(d['mapped_bytes'][0], 1):.2f}x; "
            f"same values (non-rotary): {r['same_values']}"
        )
    load = result.get("loadavg")
    if load:
        lines.append(f"load average before/after: {load[0]} / {load[1]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    from hyper_parallel.train.run import parse_mesh

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=64, help="checkpoint size (default 64)")
    parser.add_argument("--checkpoint", help="load this checkpoint instead of writing one")
    parser.add_argument("--mesh", default="dp_shard=2,tp=2")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    mesh = parse_mesh(args.mesh)
    world = math.prod(mesh.values())
    before = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="hp_bench_hf_") as tmp:
        if args.checkpoint:
            ckpt = os.path.abspath(args.checkpoint)
            info = _checkpoint_info(ckpt)
        else:
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
    after = [round(x, 2) for x in os.getloadavg()]
    result = {
        "checkpoint": info,
        "mesh": mesh,
        "ranks": ranks,
        "loadavg": [before, after],
        "bytes_method": (
            "one untimed load per contender with safetensors.safe_open wrapped: requested = "
            "bytes of each get_slice(name)[box]; mapped = Rss of the file's mappings in "
            "/proc/self/smaps when the file is closed; rchar from /proc/self/io"
        ),
    }
    print(report(result), flush=True)
    result["data"] = data_path()
    print(json.dumps(result["data"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
