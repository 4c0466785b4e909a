"""Mixture of experts on gloo: our expert-parallel dispatch vs a hand-written one, and a step.

1. **MoE layer forward + backward** at ep = 2 and 4 (one gloo rank per expert shard,
   every rank with its own tokens). Both contenders run the same router weights, the
   same expert maths (:func:`~hyper_parallel.models.qwen3_moe.expert_ffn`, grouped GEMM
   or loop alike) on the same tokens:

   - *ours*: ``MoE`` of the Qwen3-MoE model with its experts parallelized by the plan
     entry ``expert_parallel(("w1", "w2", "w3"))`` on a 1-D ``ep`` mesh;
   - *hand-written*: plain tensors, the count exchange with
     ``torch.distributed.all_to_all_single``, dispatch and combine with
     ``all_to_all_single`` wrapped in a minimal autograd function (the transposed
     exchange in backward), the same sort / permute / weighted-sum steps.

   Reported: per-call median (min-max) of the slowest rank and the ratio of medians
   (goal <= 1.1). The outputs of the two are compared once (max abs difference).
2. **Training step** of ``qwen3-moe-debug`` through the trainer's build
   (``build_parallel_model``: experts on ``ep``, FSDP2 on ``fsdp`` / ``efsdp``,
   AdamW) at ``dp_shard=2,ep=2`` and ``dp_shard=2,tp=2,ep=2``: tokens per second over
   the whole mesh (global batch x sequence / median step time).

Nothing here is a test: times depend on the machine and its load.

Run::

    .venv/bin/python benchmarks/bench_moe.py
    .venv/bin/python benchmarks/bench_moe.py --reps 5 --json moe.json
    .venv/bin/python benchmarks/bench_moe.py --step-reps 0   # the layer only (~1 minute)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import torch
import torch.distributed as dist
from _common import gloo_ranks, interleaved, slowest_rank, summary

OURS, HAND = "ours", "hand-written"
LAYER = dict(num_experts=8, top_k=2, dim=64, hidden_dim=128)
BATCH, SEQ = 4, 128  # tokens per rank: BATCH x SEQ


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with uneven splits; backward sends the gradients back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list, in_splits: list, group: Any):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def hand_written_moe(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    *,
    top_k: int,
    num_experts: int,
    group: Any,
) -> torch.Tensor:
    """The MoE layer with a hand-written expert-parallel dispatch (plain tensors)."""
    from hyper_parallel.models.qwen3_moe import expert_ffn

    bsz, seq_len, dim = x.shape
    tokens = x.reshape(-1, dim)
    ep = dist.get_world_size(group)
    num_local = num_experts // ep
    probs = torch.nn.functional.linear(tokens, router_weight).float().softmax(dim=-1)
    top_w, top_i = probs.topk(top_k, dim=-1)
    top_w = (top_w / top_w.sum(dim=-1, keepdim=True)).to(x.dtype)
    flat = top_i.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat, minlength=num_experts)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    send_splits = counts.view(ep, -1).sum(1).tolist()
    recv_splits = recv_counts.view(ep, -1).sum(1).tolist()
    received = _AllToAll.apply(tokens[token_of], recv_splits, send_splits, group)
    local_ids = torch.repeat_interleave(
        torch.arange(num_local).repeat(ep), recv_counts, output_size=sum(recv_splits)
    )
    perm = torch.argsort(local_ids, stable=True)
    y = expert_ffn(received[perm], recv_counts.view(ep, -1).sum(0), w1, w2, w3)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel())
    back = _AllToAll.apply(y[inverse], send_splits, recv_splits, group)
    weighted = back * top_w.reshape(-1)[order].unsqueeze(-1)
    return torch.zeros_like(tokens).index_add(0, token_of, weighted).view(bsz, seq_len, dim)


def _layer_rank(rank: int, reps: int, inner: int) -> dict[str, Any]:
    from hyper_parallel.core.dtensor.dtensor import DTensor
    from hyper_parallel.distributed import MeshLayout
    from hyper_parallel.distributed.expert_parallel import expert_parallel
    from hyper_parallel.models.qwen3_moe import MoE, Router
    from hyper_parallel.models.qwen3_moe.model import GroupedExperts

    ep = dist.get_world_size()
    mesh = MeshLayout.parse(f"dp_shard={ep},ep={ep}").build("cpu")
    e, k, d, h = (LAYER[n] for n in ("num_experts", "top_k", "dim", "hidden_dim"))
    config = MoE.Config(
        router=Router.Config(dim=d, num_experts=e, top_k=k),
        experts=GroupedExperts.Config(
            num_experts=e, dim=d, hidden_dim=h, sharding_config=expert_parallel(("w1", "w2", "w3"))
        ),
        aux_loss_coef=0.0,
    )
    torch.manual_seed(0)
    full = {
        "router": torch.randn(e, d) * 0.5,
        "w1": torch.randn(e, h, d) * d**-0.5,
        "w2": torch.randn(e, d, h) * h**-0.5,
        "w3": torch.randn(e, h, d) * d**-0.5,
    }
    ours = config.build()
    with torch.no_grad():
        ours.router.weight.copy_(full["router"])
        for w in ("w1", "w2", "w3"):
            getattr(ours.experts, w).copy_(full[w])
    ours.experts.parallelize(mesh["ep"])
    per = e // ep
    local = slice(rank * per, (rank + 1) * per)
    hand = {n: (t[local] if n != "router" else t).clone().requires_grad_() for n, t in full.items()}
    group = mesh["ep"].get_group()
    x = torch.randn(BATCH, SEQ, d, generator=torch.Generator().manual_seed(10 + rank))
    x.requires_grad_()

    # Gradients are dropped before each call, as a training step's zero_grad does (so
    # neither contender pays for accumulating into the previous call's gradients).
    def run_ours() -> torch.Tensor:
        ours.zero_grad(set_to_none=True)
        x.grad = None
        out = ours(x)
        out.sum().backward()
        return out

    def run_hand() -> torch.Tensor:
        for t in hand.values():
            t.grad = None
        x.grad = None
        out = hand_written_moe(
            x, hand["router"], hand["w1"], hand["w2"], hand["w3"],
            top_k=k, num_experts=e, group=group,
        )  # fmt: skip
        out.sum().backward()
        return out

    diff = (run_ours() - run_hand()).abs().max().item()
    w1 = ours.experts.w1
    grad_ours = w1.grad.to_local() if isinstance(w1.grad, DTensor) else w1.grad
    # Each contender ran backward once: the gradients of the same weights must agree.
    grad_diff = (grad_ours - hand["w1"].grad).abs().max().item()
    times = interleaved(
        {OURS: run_ours, HAND: run_hand}, reps=reps, inner=inner, warmup=2, barrier=dist.barrier
    )
    return {
        "ep": ep,
        "times_us": slowest_rank(times),
        "max_out_diff": diff,
        "w1_grad_diff": grad_diff,
    }


def _step_rank(rank: int, mesh_text: str, reps: int, seq: int) -> dict[str, Any]:
    from hyper_parallel.core.dtensor.dtensor import DTensor
    from hyper_parallel.distributed import MeshLayout
    from hyper_parallel.distributed.expert_parallel import rescale_expert_grads
    from hyper_parallel.models.qwen3_moe import cross_entropy_loss
    from hyper_parallel.train.trainer import TrainConfig, build_mesh, build_parallel_model

    layout = MeshLayout.parse(mesh_text)
    cfg = TrainConfig(model="qwen3-moe-debug", mesh=layout.active(), seq_len=seq)
    mesh = build_mesh(layout, device="cpu")
    model = build_parallel_model(cfg, mesh, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = mesh["batch"]
    tokens = torch.randint(
        0, 256, (cfg.batch_size, seq + 1), generator=torch.Generator().manual_seed(1)
    )
    rows = tokens.chunk(batch.size())[batch.get_local_rank()]

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = cross_entropy_loss(model(rows[:, :-1]), rows[:, 1:])
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        loss.backward()
        rescale_expert_grads(model, layout)
        optimizer.step()

    times = interleaved({"step": step}, reps=reps, inner=1, warmup=1, barrier=dist.barrier)
    slow = slowest_rank(times)["step"]
    median_s = statistics.median(slow) / 1e6
    return {
        "mesh": mesh_text,
        "global_batch": cfg.batch_size,
        "seq": seq,
        "step_ms": [t / 1e3 for t in slow],
        "tokens_per_s": cfg.batch_size * seq / median_s,
    }


def run(reps: int, inner: int, step_reps: int, seq: int) -> dict[str, Any]:
    layers = [gloo_ranks(_layer_rank, ep, reps, inner) for ep in (2, 4)]
    steps = [
        gloo_ranks(_step_rank, 4 if "tp" in m else 2, m, step_reps, seq)
        for m in ("dp_shard=2,ep=2", "dp_shard=2,tp=2,ep=2")
        if step_reps > 0
    ]
    return {"layer": layers, "step": steps, "shape": dict(LAYER, batch=BATCH, seq=SEQ)}


def format_result(result: dict[str, Any]) -> str:
    shape = result["shape"]
    lines = [
        f"MoE layer fwd+bwd, {shape['num_experts']} experts top-{shape['top_k']}, dim "
        f"{shape['dim']}, hidden {shape['hidden_dim']}, {shape['batch']}x{shape['seq']} "
        "tokens per rank (us per call, slowest rank)",
    ]
    for r in result["layer"]:
        ours, hand = (summary(r["times_us"][n]) for n in (OURS, HAND))
        lines.append(
            f"  ep={r['ep']}: ours {ours['median']:.0f} ({ours['min']:.0f}-{ours['max']:.0f})  "
            f"hand {hand['median']:.0f} ({hand['min']:.0f}-{hand['max']:.0f})  ratio "
            f"{ours['median'] / hand['median']:.2f}  max|out diff| {r['max_out_diff']:.1e}  "
            f"max|w1 grad diff| {r['w1_grad_diff']:.1e}"
        )
    for s in result["step"]:
        lines.append(
            f"  train step qwen3-moe-debug {s['mesh']}: "
            f"{statistics.median(s['step_ms']):.1f} ms, {s['tokens_per_s']:.0f} tokens/s "
            f"(global batch {s['global_batch']} x seq {s['seq']})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15, help="layer repetitions")
    parser.add_argument("--inner", type=int, default=5, help="layer calls per timed block")
    parser.add_argument(
        "--step-reps", type=int, default=6, help="training steps timed (0: layer only)"
    )
    parser.add_argument("--seq", type=int, default=128, help="training sequence length")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    result = run(args.reps, args.inner, args.step_reps, args.seq)
    print(format_result(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
