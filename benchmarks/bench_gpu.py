"""The planner's GPU prediction beside a measured GPU run of this package's trainer.

Two halves, run on two machines:

- ``--measure FILE`` (a CUDA machine): measures and writes FILE (JSON):

  - **kernels**: bf16 matrix products at a Llama-3-8B block's shapes (8,192 tokens) and
    ``scaled_dot_product_attention`` (causal, bf16, 32 query and 8 key/value heads of
    128) forward and forward + backward at 4K … 128K tokens, called as the model calls it
    (``enable_gqa=True``) and with keys/values repeated to 32 heads, under each SDPA
    backend torch offers (default choice, flash, cuDNN, memory-efficient; a backend
    that refuses is recorded with its error). Times are CUDA events over ``--reps``
    after warm-up; achieved TFLOP/s count attention at its causal half (the cost
    model's convention: ``4 S^2 d h / 2`` forward, 2.5x that backward).
  - **trainer**: ``Trainer`` (this package's one-device build, eager and compiled) of
    ``llama3-8b`` cut to ``--layers`` blocks, bf16 mixed precision, one sequence of
    ``--seq`` tokens per step, each ``--ac`` mode: median step seconds over the timed
    steps (``train_step`` returns the loss as a float: the step is finished), CUDA's peak
    allocated and reserved bytes, the bytes held after the build (states). Each run is
    a process of its own (fresh allocator statistics); then one more step with the
    allocator read at the end of each phase (forward, loss, backward, optimizer).
  - **chunked** (``--parts chunked``): the trainer's context-parallel attention on each
    CUDA kernel it runs (FlashAttention-2 where torch's flash kernel takes the inputs,
    else the memory-efficient kernel): first every cp rank together against one causal
    attention in fp32 (output and gradients, beside torch's own bf16 SDPA's error), then
    one cp rank's forward + backward at cp = 2, 4, 8 (its first run, torch 2.11 on an
    H200, before the trainer called the flash kernel, stopped with an illegal memory
    access in the memory-efficient kernel's backward: see
    ``hyper_parallel/models/common/chunked_attention.py``).

- no ``--measure`` (here, no GPU needed): reads the measurement (default
  ``benchmarks/results/gpu_h200.json``) and sets beside each trainer run the planner's
  prediction for the same run (``plan --gpu``'s :func:`LayoutScorer`, the shipped
  hardware file of the GPU measured), and beside each kernel rate the hardware file's
  assumption (``compute_efficiency``, ``attention_efficiency``).

Nothing here is a test: it measures and prints.

Run::

    python benchmarks/bench_gpu.py --measure gpu.json     # on the GPU machine (~4 minutes)
    .venv/bin/python benchmarks/bench_gpu.py               # the table, here
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RESULT = ROOT / "benchmarks" / "results" / "gpu_h200.json"
MATMULS = {  # (tokens, in, out) of one Llama-3-8B block at 8,192 tokens, and the output
    "wq/wo": (8192, 4096, 4096),
    "wk/wv": (8192, 4096, 1024),
    "w1/w3": (8192, 4096, 14336),
    "w2": (8192, 14336, 4096),
    "output": (8192, 4096, 128256),
}
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
ATTENTION_SEQS = (4096, 8192, 32768, 131072)


def _time_cuda(fn: Any, reps: int, warmup: int = 2) -> list[float]:
    """Seconds per call of ``fn`` (CUDA events, one pair per call) after ``warmup``."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


def measure_matmuls(reps: int) -> list[dict[str, Any]]:
    import torch

    rows = []
    for name, (m, k, n) in MATMULS.items():
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        times = _time_cuda(lambda a=a, b=b: torch.nn.functional.linear(a, b), reps)
        s = statistics.median(times)
        rows.append(
            {"name": name, "m": m, "k": k, "n": n, "s": s, "tflops": 2 * m * k * n / s / 1e12}
        )
        print(f"matmul {name:7s} {m}x{k}x{n}: {rows[-1]['tflops']:.0f} TFLOP/s", flush=True)
        del a, b
    return rows


def attention_flops(seq: int) -> tuple[float, float]:
    """Forward and backward FLOPs of causal attention's score matmuls (the causal half)."""
    fwd = 4 * seq * seq * HEAD_DIM * HEADS / 2
    return fwd, 2.5 * fwd


def measure_attention(reps: int) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {
        "default": None,
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    rows = []
    for seq in ATTENTION_SEQS:
        q = torch.randn(1, HEADS, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, KV_HEADS, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        fwd_flops, bwd_flops = attention_flops(seq)
        n = reps if seq <= 32768 else max(2, reps // 3)
        for gqa in (True, False):
            if gqa:
                qq, kk, vv = q, k, v
            else:
                rep = HEADS // KV_HEADS
                kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
                qq = q
            for name, backend in backends.items():
                row: dict[str, Any] = {"seq": seq, "enable_gqa": gqa, "backend": name}
                qg = qq.detach().requires_grad_()
                kg = kk.detach().requires_grad_()
                vg = vv.detach().requires_grad_()

                def fwd(qg=qg, kg=kg, vg=vg, gqa=gqa) -> Any:
                    return F.scaled_dot_product_attention(
                        qg, kg, vg, is_causal=True, enable_gqa=gqa
                    )

                def fwd_bwd(fwd=fwd, qg=qg, kg=kg, vg=vg) -> None:
                    out = fwd()
                    out.backward(torch.ones_like(out))
                    qg.grad = kg.grad = vg.grad = None

                try:
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    if backend is None:
                        f_s = statistics.median(_time_cuda(fwd, n))
                        fb_s = statistics.median(_time_cuda(fwd_bwd, n))
                    else:
                        with sdpa_kernel([backend]):
                            f_s = statistics.median(_time_cuda(fwd, n))
                            fb_s = statistics.median(_time_cuda(fwd_bwd, n))
                    row.update(
                        fwd_s=f_s,
                        fwd_bwd_s=fb_s,
                        fwd_tflops=fwd_flops / f_s / 1e12,
                        fwd_bwd_tflops=(fwd_flops + bwd_flops) / fb_s / 1e12,
                        peak_extra_bytes=torch.cuda.max_memory_allocated() - base,
                    )
                    print(
                        f"sdpa seq {seq:6d} gqa={gqa!s:5s} {name:9s}: fwd {row['fwd_tflops']:.0f}, "
                        f"fwd+bwd {row['fwd_bwd_tflops']:.0f} TFLOP/s, "
                        f"peak +{row['peak_extra_bytes'] / 2**30:.2f} GiB",
                        flush=True,
                    )
                except Exception as e:  # a backend that refuses is a result
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                    print(f"sdpa seq {seq:6d} gqa={gqa!s:5s} {name:9s}: {row['error']}", flush=True)
                rows.append(row)
                torch.cuda.empty_cache()
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def _torch_compat() -> None:
    """torch < 2.13 (a GPU image's own torch): nothing measured here calls FSDP2, whose
    mesh-dims type the package imports; a placeholder lets the package import."""
    import torch.distributed.fsdp as torch_fsdp

    if not hasattr(torch_fsdp, "DataParallelMeshDims"):
        torch_fsdp.DataParallelMeshDims = type("DataParallelMeshDims", (), {})


# The chunk pairs' CUDA kernels, the trainer's choice first, by their SDPBackend names.
CHUNKED_KERNELS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def _chunked_check(kernel: str, seq: int, cp: int) -> dict[str, Any]:
    """Every cp rank's ``chunked_causal_attention`` on ``kernel`` together against one
    causal attention of the whole sequence, from the same bf16 inputs: the largest
    |error| of the output and of each gradient against an fp32 reference (math kernel),
    beside torch's own bf16 SDPA's (its choice of kernel) against the same reference."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hyper_parallel.distributed import context_parallel as cpm
    from hyper_parallel.models.common.chunked_attention import (
        CausalChunks,
        chunked_causal_attention,
    )

    gen = torch.Generator(device="cuda").manual_seed(seq + cp)
    shape_q, shape_kv = (1, HEADS, seq, HEAD_DIM), (1, KV_HEADS, seq, HEAD_DIM)
    q, k, v, g = (
        torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen)
        for s in (shape_q, shape_kv, shape_kv, shape_q)
    )

    def grads(fn: Any, *inputs: torch.Tensor) -> list[torch.Tensor]:
        xs = [x.detach().requires_grad_() for x in inputs]
        out = fn(*xs)
        return [out.detach(), *torch.autograd.grad(out, xs, g.to(out.dtype))]

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    with sdpa_kernel([SDPBackend.MATH]):
        ref = grads(sdpa, q.float(), k.float(), v.float())
    torch_bf16 = grads(sdpa, q, k, v)

    def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys = torch.cat([cpm.shard_sequence(k, r, cp, dim=2) for r in range(cp)], dim=2)
        vals = torch.cat([cpm.shard_sequence(v, r, cp, dim=2) for r in range(cp)], dim=2)
        outs, order = [], []
        for r in range(cp):
            pos = torch.as_tensor(cpm.positions(seq, r, cp), device=q.device)
            chunks = CausalChunks(queries=(r, 2 * cp - 1 - r), keys=tuple(cpm.chunk_order(cp)))
            outs.append(chunked_causal_attention(q[:, :, pos], keys, vals, chunks))
            order.append(pos)
        return torch.cat(outs, dim=2)[:, :, torch.argsort(torch.cat(order))]

    with sdpa_kernel([getattr(SDPBackend, CHUNKED_KERNELS[kernel])]):
        ours = grads(chunked, q, k, v)

    def err(xs: list[torch.Tensor]) -> list[float]:
        return [float((x.float() - r).abs().max()) for x, r in zip(xs, ref)]

    return {
        "kernel": kernel,
        "seq": seq,
        "cp": cp,
        "max_error": err(ours),
        "torch_sdpa_max_error": err(torch_bf16),
    }


def measure_chunked(reps: int) -> list[dict[str, Any]]:
    """The trainer's context-parallel attention as one cp rank runs it
    (``chunked_causal_attention``: its two query chunks against every gathered key
    chunk, block by block, merged by log-sum-exp) on each CUDA kernel it can run
    (``torch.nn.attention.sdpa_kernel`` picks), forward + backward; FLOPs: the rank's
    equal share (1 / cp) of the causal scores. First each kernel's numbers (every rank
    together against one causal attention: :func:`_chunked_check`)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _torch_compat()
    from hyper_parallel.distributed.context_parallel import chunk_order
    from hyper_parallel.models.common.chunked_attention import (
        CausalChunks,
        chunked_causal_attention,
    )

    rows: list[dict[str, Any]] = []
    for kernel in CHUNKED_KERNELS:
        for seq, cp in ((4096, 2), (4096, 4), (8192, 2)):
            row = _chunked_check(kernel, seq, cp)
            print(
                f"chunked {kernel:9s} check seq {seq} cp={cp}: max |error| out/dq/dk/dv "
                + "/".join(f"{e:.1e}" for e in row["max_error"])
                + " (torch's bf16 SDPA: "
                + "/".join(f"{e:.1e}" for e in row["torch_sdpa_max_error"])
                + ")",
                flush=True,
            )
            rows.append(row)
            torch.cuda.empty_cache()
    for kernel in CHUNKED_KERNELS:
        backend = getattr(SDPBackend, CHUNKED_KERNELS[kernel])
        for seq in (8192, 32768, 131072):
            for cp in (2, 4, 8):
                chunks = CausalChunks(queries=(0, 2 * cp - 1), keys=tuple(chunk_order(cp)))
                q = torch.randn(1, HEADS, seq // cp, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(1, KV_HEADS, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                v = torch.randn_like(k)
                q.requires_grad_()
                k.requires_grad_()
                v.requires_grad_()

                def fwd_bwd(q=q, k=k, v=v, chunks=chunks) -> None:
                    out = chunked_causal_attention(q, k, v, chunks)
                    out.backward(torch.ones_like(out))
                    q.grad = k.grad = v.grad = None

                fwd, bwd = attention_flops(seq)
                n = reps if seq <= 32768 else max(2, reps // 3)
                with sdpa_kernel([backend]):
                    s = statistics.median(_time_cuda(fwd_bwd, n))
                row = {
                    "kernel": kernel,
                    "seq": seq,
                    "cp": cp,
                    "fwd_bwd_s": s,
                    "fwd_bwd_tflops": (fwd + bwd) / cp / s / 1e12,
                }
                print(
                    f"chunked {kernel:9s} seq {seq:6d} cp={cp}: "
                    f"{row['fwd_bwd_tflops']:.0f} TFLOP/s",
                    flush=True,
                )
                rows.append(row)
                del q, k, v
                torch.cuda.empty_cache()
    return rows


def trainer_configs(layers: int, seq: int) -> list[dict[str, Any]]:
    base = {
        "model": "llama3-8b",
        "model_overrides": {"num_layers": layers, "max_seq_len": seq},
        "seq_len": seq,
        "batch_size": 1,
        "dtype": "bf16",
    }
    out = [base | {"ac": ac, "compile": False} for ac in ("none", "op", "full")]
    out.append(base | {"ac": "none", "compile": True})
    return out


def measure_one(cfg_json: str, steps: int, warmup: int) -> dict[str, Any]:
    """One trainer run in this process (called in a child process)."""
    import torch

    _torch_compat()
    from hyper_parallel.train import TrainConfig, Trainer

    fields = json.loads(cfg_json)
    cfg = TrainConfig(**fields, steps=steps + warmup, log_every=0, progress=False)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer = Trainer(cfg, device="cuda")
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    states = torch.cuda.memory_allocated()
    times, losses = [], []
    for i in range(steps + warmup):
        t = time.perf_counter()
        loss, _ = trainer.train_step()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t)
        losses.append(loss)
    peaks = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    phases = _phase_memory(trainer)
    return {
        "config": fields,
        "phases": phases,
        "build_s": build_s,
        "step_s": statistics.median(times),
        "step_s_all": times,
        "losses": losses,
        "states_bytes": states,
        "peak_allocated_bytes": peaks[0],
        "peak_reserved_bytes": peaks[1],
        "tokens_per_s": cfg.batch_size * cfg.seq_len / statistics.median(times),
    }


def _phase_memory(trainer: Any) -> dict[str, list[int]]:
    """One more step with the allocator read at its phases: ``{phase: [allocated at its
    end, peak allocated within it]}`` for the forward, the loss, the backward and the
    optimizer step (the trainer's own calls, wrapped; the step synchronizes at each)."""
    import torch

    out: dict[str, list[int]] = {}

    def mark(name: str) -> None:
        torch.cuda.synchronize()
        out[name] = [torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()]
        torch.cuda.reset_peak_memory_stats()

    loss_fn, finish, opt_step = (
        trainer.loss_fn,
        trainer.run.finish_gradients,
        trainer.optimizer.step,
    )

    def wrapped_loss(*a: Any, **k: Any) -> Any:
        mark("forward")
        r = loss_fn(*a, **k)
        mark("loss")
        return r

    def wrapped_finish(*a: Any, **k: Any) -> Any:
        mark("backward")
        return finish(*a, **k)

    def wrapped_step(*a: Any, **k: Any) -> Any:
        mark("before_optimizer")
        r = opt_step(*a, **k)
        mark("optimizer")
        return r

    trainer.loss_fn = wrapped_loss
    object.__setattr__(trainer.run, "finish_gradients", wrapped_finish)  # a frozen dataclass
    trainer.optimizer.step = wrapped_step
    mark("start")
    trainer.train_step()
    return out


def measure(path: Path, args: argparse.Namespace) -> int:
    import torch

    out: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "memory_bytes": torch.cuda.get_device_properties(0).total_memory,
        "command": " ".join(sys.argv),
    }

    def save() -> None:
        path.write_text(json.dumps(out, indent=1))

    print(json.dumps(out), flush=True)
    if "trainer" in args.parts:
        runs = []
        configs = [c for seq in args.seq for c in trainer_configs(args.layers, seq)]
        for cfg in configs:
            cmd = [sys.executable, __file__, "--one", json.dumps(cfg)]
            cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            t = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout)
            line = [x for x in p.stdout.splitlines() if x.startswith("{")]
            if p.returncode == 0 and line:
                r = json.loads(line[-1])
                print(
                    f"trainer {cfg['ac']:4s} compile={cfg['compile']!s:5s}: "
                    f"{r['step_s']:.3f} s/step, {r['tokens_per_s']:,.0f} tokens/s, "
                    f"peak {r['peak_allocated_bytes'] / 2**30:.2f} GiB allocated / "
                    f"{r['peak_reserved_bytes'] / 2**30:.2f} reserved, states "
                    f"{r['states_bytes'] / 2**30:.2f} GiB ({time.perf_counter() - t:.0f} s)",
                    flush=True,
                )
            else:
                r = {"config": cfg, "error": (p.stderr or p.stdout)[-3000:]}
                print(f"trainer {cfg}: FAILED rc={p.returncode}\n{r['error']}", flush=True)
            runs.append(r)
            out["trainer"] = runs
            save()
    if "kernels" in args.parts:
        out["matmuls"] = measure_matmuls(args.reps)
        save()
        out["attention"] = measure_attention(args.reps)
        save()
    if "chunked" in args.parts:
        # A process of its own: a fault in a kernel ends only it (its first run did).
        cmd = [sys.executable, __file__, "--one-chunked", "--reps", str(args.reps)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout)
        line = [x for x in p.stdout.splitlines() if x.startswith("[")]
        print("\n".join(x for x in p.stdout.splitlines() if not x.startswith("[")), flush=True)
        if p.returncode == 0 and line:
            out["chunked"] = json.loads(line[-1])
        else:
            out["chunked_error"] = (p.stderr or p.stdout)[-3000:]
            print(f"chunked attention: FAILED rc={p.returncode}\n{out['chunked_error']}")
        save()
    return 0


PARTS = ("trainer", "kernels", "chunked")
TRAINER_CHANGES = (
    (
        "2026-12-04 23:00 UTC",
        "the models' RMSNorm keeps only its bf16 input and one fp32 rstd per token for "
        "backward, and SwiGLU two of its three wide tensors; the trainer measured kept the "
        "norms' two fp32 copies (autocast) and silu's output too",
    ),
)
"""Changes to what the trainer keeps for backward, with the time they landed: a
measurement older than one was of a trainer that kept more than the one predicted."""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--measure", type=Path, help="measure on this CUDA machine; write FILE")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, default=DEFAULT_RESULT)
    p.add_argument("--hardware", default="h200-141gb", help="the hardware file to predict with")
    p.add_argument("--write", type=Path, help="also write the report (markdown) here")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--run-timeout", type=float, default=240)
    p.add_argument("--parts", nargs="+", default=["trainer", "kernels", "chunked"], choices=PARTS)
    p.add_argument("--one-chunked", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one_chunked:
        _torch_compat()
        print(json.dumps(measure_chunked(args.reps)), flush=True)
        return 0
    if args.one is not None:
        try:
            print(json.dumps(measure_one(args.one, args.steps, args.warmup)), flush=True)
        except Exception:
            traceback.print_exc()
            return 1
        return 0
    if args.measure is not None:
        return measure(args.measure, args)
    return report(args)


def predictions(result: dict[str, Any], hardware: str) -> list[dict[str, Any]]:
    """The planner's prediction of each measured trainer run (one GPU; ``plan --gpu``'s
    scorer on the shipped hardware file)."""
    from hyper_parallel.analysis.suggest import Candidate, LayoutScorer, ModelSource

    out = []
    for run in result.get("trainer", []):
        cfg = run["config"]
        source = ModelSource(cfg["model"], tuple(sorted(cfg["model_overrides"].items())))
        scorer = LayoutScorer(
            source,
            gpus=1,
            gpu=hardware,
            seq_len=cfg["seq_len"],
            global_batch_tokens=cfg["batch_size"] * cfg["seq_len"],
            dtype=cfg["dtype"],
            compile=cfg["compile"],
        )
        c = Candidate(1, 1, 1, 1, 1, 1, cfg["batch_size"], None, cfg["ac"], False)
        out.append(scorer.predict(c).to_dict())
    return out


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f}"


def _pct(x: float) -> str:
    return f"{100 * x:+.0f}%"


def format_report(result: dict[str, Any], predicted: list[dict[str, Any]], hw: Any) -> str:
    lines = [
        f"# {result['device']} (torch {result['torch']}) beside the planner's `{hw.name}`",
        "",
        "Measured with `benchmarks/bench_gpu.py --measure` on "
        + "; ".join(f"{k}: {v}" for k, v in result["when"].items())
        + "; predicted here from the shipped hardware file (no GPU).",
        "",
        "## The trainer on one GPU",
        "",
        "`llama3-8b` cut to the blocks named, bf16 mixed precision (fp32 master weights, "
        "AdamW), one sequence per step, eager unless compiled. Step: median of the timed "
        "steps; memory: CUDA's peak allocated (reserved) bytes of the run.",
        "",
        "| layers x seq | ac | compile | step s measured | predicted | error "
        "| peak GiB allocated (reserved) | predicted | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    measured = min((v for k, v in result["when"].items() if k.startswith("trainer")), default=None)
    for when, what in TRAINER_CHANGES:
        if measured is not None and measured < when:
            lines[-2:-2] = [
                f"**Measured before a change to the trainer** ({when}: {what}). The memory "
                "predicted is the current trainer's, so the memory errors below are not a "
                "check of it until `bench_gpu.py --measure` runs again.",
                "",
            ]
    for run, p in zip(result["trainer"], predicted):
        cfg = run["config"]
        if "error" in run:
            lines.append(f"| {cfg} | failed: {run['error'].splitlines()[-1]} |")
            continue
        lines.append(
            f"| {cfg['model_overrides']['num_layers']} x {cfg['seq_len']:,} | {cfg['ac']} "
            f"| {'yes' if cfg['compile'] else 'no'} | {run['step_s']:.3f} | {p['step_s']:.3f} "
            f"| {_pct(p['step_s'] / run['step_s'] - 1)} "
            f"| {_gib(run['peak_allocated_bytes'])} ({_gib(run['peak_reserved_bytes'])}) "
            f"| {_gib(p['memory_bytes_per_gpu'])} "
            f"| {_pct(p['memory_bytes_per_gpu'] / run['peak_allocated_bytes'] - 1)} |"
        )
    phased = [(r, p) for r, p in zip(result["trainer"], predicted) if r.get("phases")]
    if phased:
        lines += [
            "",
            "## Where the memory peaks",
            "",
            "Allocated GiB at the end of each phase / the peak within it, on one more step "
            "after the timed ones (the trainer's own calls, wrapped).",
            "",
            "| run | between steps | forward | loss | backward | before optimizer | optimizer "
            "| planner: states + grads + activations + loss |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for run, p in phased:
            cfg, ph = run["config"], run["phases"]
            m = p["memory"]
            # Between steps: what stays (params, AdamW; gradients were set to None).
            cells = [_gib(ph["start"][0])]
            cells += [f"{_gib(ph[k][0])} / {_gib(ph[k][1])}" for k in PHASES[1:]]
            states = m["params"] + m["optimizer"]
            lines.append(
                f"| {cfg['seq_len']:,} {cfg['ac']}{' compiled' if cfg['compile'] else ''} | "
                + " | ".join(cells)
                + f" | {_gib(states)} + {_gib(m['grads'])} + {_gib(m['activations'])} + "
                f"{_gib(m['loss'])} |"
            )
    peak = hw.peak_flops["bf16"]
    lines += [
        "",
        f"## Kernels against the datasheet's dense bf16 peak ({peak / 1e12:.0f} TFLOP/s)",
        "",
        f"The hardware file's matmul efficiency is {hw.compute_efficiency['bf16']:g} (fitted "
        "on published runs); its attention efficiencies are these measurements: "
        f"{hw.attention_efficiency:g} (torch's choice, forward + backward) and "
        f"{hw.chunked_attention_efficiency:g} under context parallelism (FlashAttention-2 "
        "over the whole sequence, the kernel the trainer's chunk pairs run where torch "
        "allows it; the chunk pairs themselves: the last section).",
        "",
        "| matmul (tokens x in x out) | TFLOP/s | share of peak |",
        "|---|---|---|",
    ]
    for m in result.get("matmuls", []):
        lines.append(
            f"| {m['name']} {m['m']}x{m['k']}x{m['n']} | {m['tflops']:.0f} | "
            f"{m['tflops'] * 1e12 / peak:.2f} |"
        )
    lines += [
        "",
        "Causal SDPA, 32 query / 8 key-value heads of 128, forward + backward, TFLOP/s (share "
        "of peak), FLOPs at the causal half; called as the model calls it "
        "(`enable_gqa=True`; the memory-efficient kernel refuses that, so its column has the "
        "keys and values expanded to 32 heads, as the trainer's context parallelism calls it):",
        "",
        "| seq | " + " | ".join(label for _, _, label in ATTENTION_COLUMNS) + " |",
        "|---|" + "---|" * len(ATTENTION_COLUMNS),
    ]
    rows = result.get("attention", [])
    for seq in sorted({a["seq"] for a in rows}):
        cells = []
        for backend, gqa, _ in ATTENTION_COLUMNS:
            a = next(
                (
                    a
                    for a in rows
                    if a["seq"] == seq and a["backend"] == backend and a["enable_gqa"] == gqa
                ),
                None,
            )
            if a is None or "error" in a:
                cells.append("refused" if a is not None else "-")
            else:
                share = a["fwd_bwd_tflops"] * 1e12 / peak
                cells.append(f"{a['fwd_bwd_tflops']:.0f} ({share:.2f})")
        lines.append(f"| {seq:,} | " + " | ".join(cells) + " |")
    lines += ["", "## Context-parallel attention (the trainer's chunked blocks)", ""]
    if result.get("chunked"):
        checks = [r for r in result["chunked"] if "max_error" in r]
        timed = [r for r in result["chunked"] if "fwd_bwd_tflops" in r]
        lines += [
            "Every cp rank's `chunked_causal_attention` together (bf16) against one causal "
            "attention in fp32 (the math kernel), beside torch's bf16 SDPA against the same "
            "reference: the largest |error| of the output and of each gradient.",
            "",
            "| kernel | seq | cp | out / dq / dk / dv | torch's bf16 SDPA |",
            "|---|---|---|---|---|",
        ]
        for r in checks:
            lines.append(
                f"| {r['kernel']} | {r['seq']:,} | {r['cp']} | "
                + " / ".join(f"{e:.1e}" for e in r["max_error"])
                + " | "
                + " / ".join(f"{e:.1e}" for e in r["torch_sdpa_max_error"])
                + " |"
            )
        lines += [
            "",
            "One cp rank's `chunked_causal_attention` (its two query chunks against every "
            "gathered key chunk, merged by log-sum-exp) on each kernel, forward + backward, "
            "FLOPs the rank's 1 / cp of the causal scores; the file: "
            f"{hw.chunked_attention_efficiency:g} of peak.",
            "",
            "| kernel | seq | cp | TFLOP/s | share of peak |",
            "|---|---|---|---|---|",
        ]
        for r in timed:
            lines.append(
                f"| {r.get('kernel', 'efficient')} | {r['seq']:,} | {r['cp']} | "
                f"{r['fwd_bwd_tflops']:.0f} | {r['fwd_bwd_tflops'] * 1e12 / peak:.2f} |"
            )
    else:
        lines.append(
            "Not measured: " + result.get("chunked_error", "no `--parts chunked` run.").strip()
        )
    return "\n".join(lines) + "\n"


PHASES = ("start", "forward", "loss", "backward", "before_optimizer", "optimizer")
ATTENTION_COLUMNS = (
    ("default", True, "torch's choice"),
    ("cudnn", True, "cuDNN"),
    ("flash", True, "FlashAttention-2"),
    ("efficient", False, "memory-efficient (keys expanded)"),
)


def report(args: argparse.Namespace) -> int:
    from hyper_parallel.analysis.cost_model import load_hardware

    result = json.loads(args.result.read_text())
    hw = load_hardware(args.hardware)
    text = format_report(result, predictions(result, args.hardware), hw)
    print(text)
    if args.write is not None:
        args.write.write_text(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
