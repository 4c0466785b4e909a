"""Gradient accumulation on gloo: a fixed global batch as 1, 2, 4, 8 micro-batches.

For ``llama3-debug`` at ``--mesh`` (default ``dp_shard=2``: FSDP2 over 2 spawned gloo
ranks) and a fixed global batch (``--batch`` sequences of ``--seq`` tokens), the
trainer's step (``Trainer.train_step``) runs with each micro-batch count of
``--microbatches`` (``--microbatches`` of ``train.run``: each data-parallel rank's
batch as sequential micro-batches, FSDP2 reducing once per step). Per count:

- **step time**: median (min-max) over ``--reps`` steps after ``--warmup``, of the
  slowest rank, and the tokens per second it gives (global batch x seq / step);
- **peak memory**: the peak of live tensor storage during one more (untimed) step, the
  largest rank's — what is alive before the step plus the running maximum of its
  allocations less its frees (``torch.profiler``'s CPU allocator records), measured as
  ``bench_suggest.py`` measures it; the GPU analogue is ``max_memory_allocated``;
- **activations**: the bytes one forward saves for backward (saved-tensor hooks, each
  storage once, parameters excluded), per micro-batch.

Expected: activations fall as 1 / micro-batches; the peak falls with them until the
states (and FSDP2's unsharded gradient accumulators, held until the last micro-batch)
dominate; tokens/s unchanged within noise (the same arithmetic, more and smaller
calls: at short sequences and many micro-batches the fixed cost per operator shows —
measured 0.58x at 8 micro-batches of one 128-token sequence; at 512 tokens a CPU ran
the smaller micro-batches faster, 1.07-1.5x, its caches holding their working sets).
All counts run in one process group, one after the other.

Nothing here is a test: times depend on the machine and its load.

Run::

    .venv/bin/python benchmarks/bench_accumulation.py
    .venv/bin/python benchmarks/bench_accumulation.py --microbatches 1 2 4 8 --reps 5 --json acc.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from _common import gloo_ranks, summary
from bench_suggest import _peak_tensor_bytes


class _SavedBytes:
    """Bytes the forward saves for backward, each storage once, parameters excluded."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seen = {_storage(p).data_ptr() for p in model.parameters()}
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = _storage(t)
        if storage.data_ptr() not in self.seen and storage.nbytes():
            self.seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


def _storage(t: torch.Tensor) -> Any:
    return (t._local_tensor if hasattr(t, "_local_tensor") else t).untyped_storage()


def _one_count(
    m: int, mesh: dict[str, int], batch: int, seq: int, reps: int, warmup: int
) -> dict[str, Any]:
    from hyper_parallel.train import TrainConfig, Trainer

    cfg = TrainConfig(
        model="llama3-debug",
        mesh=mesh,
        batch_size=batch,
        seq_len=seq,
        steps=warmup + reps + 2,
        microbatches=m,
        log_every=0,
        progress=False,
    )
    trainer = Trainer(cfg, device="cpu")
    times = []
    for step in range(warmup + reps):
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    dist.barrier()
    peak = _peak_tensor_bytes(trainer.train_step)
    # One micro-batch's saved activations (no optimizer step: gradients dropped after).
    micro = trainer.local_batch().split(m)[0]
    saved = _SavedBytes(trainer.model)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        logits = trainer.model(micro.inputs, **micro.model_kwargs)
        trainer.loss_fn(logits, micro.targets).backward()
    trainer.optimizer.zero_grad(set_to_none=True)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"times": times, "peak": peak, "saved": saved.bytes})
    del trainer, logits
    gc.collect()
    slowest = [max(g["times"][i] for g in gathered) for i in range(len(times))]
    return {
        "microbatches": m,
        "step_s": summary(slowest),
        "tokens_per_s": batch * seq / statistics.median(slowest),
        "peak_bytes": max(g["peak"] for g in gathered),
        "activation_bytes": max(g["saved"] for g in gathered),
    }


def _rank(
    rank: int,
    counts: list[int],
    mesh: dict[str, int],
    batch: int,
    seq: int,
    reps: int,
    warmup: int,
) -> dict[str, Any]:
    del rank
    torch.set_num_threads(1)
    rows = [_one_count(m, mesh, batch, seq, reps, warmup) for m in counts]
    return {"mesh": mesh, "batch": batch, "seq": seq, "reps": reps, "results": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="dp_shard=2", help="axis sizes (default dp_shard=2)")
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)
    from hyper_parallel.distributed.layout import MeshLayout

    layout = MeshLayout.parse(args.mesh)
    out = gloo_ranks(
        _rank,
        layout.world_size,
        args.microbatches,
        layout.active(),
        args.batch,
        args.seq,
        args.reps,
        args.warmup,
    )
    rows = out["results"]
    base = rows[0]
    print(
        f"gradient accumulation: llama3-debug on {args.mesh}, global batch {args.batch} x "
        f"{args.seq} tokens, median (min-max) of {args.reps} steps, slowest rank"
    )
    print(
        f"  {'micro-batches':>13} {'step ms':>22} {'tokens/s':>9} {'vs 1':>5} "
        f"{'peak MiB':>9} {'vs 1':>5} {'activations MiB':>16} {'vs 1':>5}"
    )
    mib = 1024**2
    for r in rows:
        t = r["step_s"]
        step = f"{t['median'] * 1e3:.0f} ({t['min'] * 1e3:.0f}-{t['max'] * 1e3:.0f})"
        print(
            f"  {r['microbatches']:>13} {step:>22} {r['tokens_per_s']:>9,.0f} "
            f"{r['tokens_per_s'] / base['tokens_per_s']:>5.2f} {r['peak_bytes'] / mib:>9.2f} "
            f"{r['peak_bytes'] / base['peak_bytes']:>5.2f} "
            f"{r['activation_bytes'] / mib:>16.2f} "
            f"{r['activation_bytes'] / base['activation_bytes']:>5.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
