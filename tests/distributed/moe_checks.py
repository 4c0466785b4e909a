"""Rank-side checks shared by the expert-parallel tests (module-level, so ranks can run them).

Every check builds the single-device reference on each rank from the same seed, runs
the expert-parallel model on the rank's rows of the batch, and returns the largest
differences of outputs, loss and every gradient (plus collective counts) to the test.
Gradient convention (as a data-parallel trainer): each rank's loss is the mean over
its tokens; dense gradients are averaged over the batch ranks; expert gradients are
summed over the ranks holding the same experts and divided by the number of batch
ranks (``expert_grad_divisor``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.distributed import MeshLayout
from hyper_parallel.distributed.expert_parallel import expert_grad_divisor
from hyper_parallel.models.qwen3_moe import (
    GroupedExperts,
    apply_ep,
    cross_entropy_loss,
    preset_config,
)
from tests._compare import Diff, diff, worst_abs
from tests.distributed.models import comm_counts

BATCH, SEQ = 4, 12
PLANS = Path(__file__).resolve().parents[2] / "examples" / "plans"


def _batch_rows(mesh: Any, batch: int) -> slice:
    group = mesh["batch"]
    size, rank = group.size(), group.get_local_rank()
    per = batch // size
    return slice(rank * per, (rank + 1) * per)


def _all_reduce(t: torch.Tensor, mesh_1d: Any) -> torch.Tensor:
    t = t.clone()
    if mesh_1d.size() > 1:
        dist.all_reduce(t, group=mesh_1d.get_group())
    return t


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _max_diffs(model: torch.nn.Module, reference: torch.nn.Module, mesh: Any) -> dict[str, Diff]:
    """Largest |grad - reference grad| per parameter, after the data-parallel reduction.

    Expert weights (DTensors on ``ep``) are this rank's experts; dense DTensors (on
    ``tp``) are made full with ``full_tensor`` (which reduces ``Partial`` gradients).
    """
    ref = dict(reference.named_parameters())
    num_batch = mesh["batch"].size()
    diffs = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        if isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("ep",):
            grad = _all_reduce(p.grad.to_local(), mesh["efsdp"]) / expert_grad_divisor(num_batch)
            per = p.to_local().shape[0]
            start = mesh["ep"].get_local_rank() * per
            expected = ref[name].grad[start : start + per]
        else:
            grad = _all_reduce(_full(p.grad), mesh["batch"]) / num_batch
            expected = ref[name].grad
        diffs[name] = diff(grad, expected)
    assert set(diffs) == set(ref)
    return diffs


def _compare(model: torch.nn.Module, reference: torch.nn.Module, mesh: Any) -> dict[str, Any]:
    """One step of ``model`` on the rank's rows against ``reference`` on the whole batch."""
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    ref_logits = reference(inputs)
    ref_loss = cross_entropy_loss(ref_logits, targets)
    ref_loss.backward()

    rows = _batch_rows(mesh, BATCH)
    with CommDebugMode() as forward_comms:
        logits = model(inputs[rows])
    loss = _full(cross_entropy_loss(logits, targets[rows]))
    with CommDebugMode() as backward_comms:
        loss.backward()
    num_batch = mesh["batch"].size()
    global_loss = _all_reduce(loss.detach(), mesh["batch"]) / num_batch
    aux = [_all_reduce(layer.moe.aux_loss, mesh["batch"]) / num_batch for layer in model.layers]
    return {
        "logits": (_full(logits) - ref_logits[rows]).abs().max().item(),
        "loss": (global_loss - ref_loss.detach()).abs().item(),
        "aux": worst_abs(
            [(a - r.moe.aux_loss).abs().item() for a, r in zip(aux, reference.layers)]
        ),
        "grads": _max_diffs(model, reference, mesh),
        "forward_comms": _counts(forward_comms),
        "backward_comms": _counts(backward_comms),
        "placements": {
            n: (p.device_mesh.mesh_dim_names, repr(list(p.placements)))
            for n, p in model.named_parameters()
            if isinstance(p, DTensor)
        },
        "num_layers": len(model.layers),
    }


def model_parity(mesh_text: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The debug MoE at ``mesh_text`` (experts on ``ep``) vs one device."""
    mesh = MeshLayout.parse(mesh_text).build("cpu")
    config = preset_config("qwen3-moe-debug", **(overrides or {}))
    torch.manual_seed(0)
    reference = config.build()
    reference.init_states()
    torch.manual_seed(0)
    model = apply_ep(config).build()
    model.init_states()
    model.parallelize(mesh["ep"])
    return _compare(model, reference, mesh)


def _counts(mode: CommDebugMode) -> dict[str, int]:
    # c10d's in-place collectives (the eager dispatch) under their functional names.
    return comm_counts(mode)


def experts_parity(
    mesh_text: str, routes: list[list[list[int]]], num_experts: int = 8
) -> dict[str, Any]:
    """One ``GroupedExperts`` layer with hand-written routes: ``routes[rank]`` is (T, k).

    Also runs the layer a second time through the module's own ``forward`` (the path of
    experts modules without ``grouped_forward``) and reports whether the output and
    every gradient are bitwise the same (``paths_equal``).
    """
    from hyper_parallel.distributed.expert_parallel import expert_parallel

    mesh = MeshLayout.parse(mesh_text).build("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = GroupedExperts.Config(num_experts=num_experts, dim=16, hidden_dim=12)
    torch.manual_seed(0)
    reference = config.build()
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.3)
    experts = GroupedExperts.Config(
        num_experts=num_experts,
        dim=16,
        hidden_dim=12,
        sharding_config=expert_parallel(("w1", "w2", "w3")),
    ).build()
    experts.load_state_dict(reference.state_dict())
    experts.parallelize(mesh["ep"])
    generator = torch.Generator().manual_seed(2)
    xs = [torch.randn(len(r), 16, generator=generator) for r in routes]
    ws = [torch.rand(len(r), len(r[0]), generator=generator) for r in routes]
    x_all = torch.cat(xs).requires_grad_()
    index_all = torch.tensor([t for r in routes for t in r])
    ref_out = reference(x_all, index_all, torch.cat(ws))
    probe = torch.randn(ref_out.shape, generator=generator)
    (ref_out * probe).sum().backward()

    start = sum(len(r) for r in routes[:rank])
    local = slice(start, start + len(routes[rank]))
    x = xs[rank].clone().requires_grad_()
    with CommDebugMode() as forward_comms:
        out = experts(x, torch.tensor(routes[rank]), ws[rank])
    with CommDebugMode() as backward_comms:
        (out * probe[local]).sum().backward()
    per = num_experts // mesh["ep"].size()
    first = mesh["ep"].get_local_rank() * per
    grads = {
        name: diff(_all_reduce(p.grad.to_local(), mesh["efsdp"]), ref.grad[first : first + per])
        for (name, p), ref in zip(experts.named_parameters(), reference.parameters())
    }
    dispatch = experts.forward
    grouped = dispatch.grouped_forward
    assert grouped is not None, "GroupedExperts runs its grouped_forward under ep"
    first_grads = [p.grad.to_local().clone() for p in experts.parameters()]
    experts.zero_grad(set_to_none=True)
    dispatch.grouped_forward = None
    try:
        x_own = xs[rank].clone().requires_grad_()
        out_own = experts(x_own, torch.tensor(routes[rank]), ws[rank])
        (out_own * probe[local]).sum().backward()
    finally:
        dispatch.grouped_forward = grouped
    same = torch.equal(out, out_own) and torch.equal(x.grad, x_own.grad)
    same = same and all(
        torch.equal(a, p.grad.to_local()) for a, p in zip(first_grads, experts.parameters())
    )
    del world
    return {
        "out": (out - ref_out[local]).abs().max().item(),
        "x_grad": (x.grad - x_all.grad[local]).abs().max().item(),
        "grads": grads,
        "forward_comms": _counts(forward_comms),
        "backward_comms": _counts(backward_comms),
        "paths_equal": same,
    }


class KeywordExperts(torch.nn.Module):
    """A user's experts module: its own argument names, a per-expert bias, a plain loop.

    Experts without tokens are skipped, as Hugging Face's eager experts do: with no
    tokens at all it returns a fresh ``zeros_like``, on no autograd graph.
    """

    def __init__(self, num_experts: int = 4, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w_in = torch.nn.Parameter(torch.randn(num_experts, hidden, dim, generator=g) / 3)
        self.w_out = torch.nn.Parameter(torch.randn(num_experts, dim, hidden, generator=g) / 3)
        self.b_out = torch.nn.Parameter(torch.randn(num_experts, dim, generator=g))

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_indices: torch.Tensor,
        routing_weights: torch.Tensor,
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in range(self.w_in.shape[0]):
            token, choice = torch.where(router_indices == e)
            if token.numel() == 0:
                continue
            h = torch.relu(hidden_states[token] @ self.w_in[e].T) @ self.w_out[e].T + self.b_out[e]
            out.index_add_(0, token, h * routing_weights[token, choice, None])
        return out


def _keyword_experts_on_ep(mesh_text: str) -> tuple[Any, KeywordExperts, KeywordExperts]:
    """The mesh, a single-device :class:`KeywordExperts` and its twin split over ``ep``."""
    from hyper_parallel.distributed.expert_parallel import expert_parallel
    from hyper_parallel.dmodule import parallelize_module

    mesh = MeshLayout.parse(mesh_text).build("cpu")
    reference, model = KeywordExperts(), torch.nn.Module()
    model.experts = experts = KeywordExperts()
    parallelize_module(model, mesh["ep"], {"experts": expert_parallel(("w_in", "w_out", "b_out"))})
    return mesh, reference, experts


def experts_called_by_keyword(mesh_text: str) -> dict[str, Any]:
    """:class:`KeywordExperts` at ep, called with its own keyword names, against one device.

    Also the messages of the calls the dispatch refuses: indices and weights swapped,
    and an argument besides the three.
    """
    mesh, reference, experts = _keyword_experts_on_ep(mesh_text)
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(6 * world, 8, generator=generator)
    weights, index = torch.rand(6 * world, 4, generator=generator).topk(2, dim=-1)
    ref_out = reference(x, router_indices=index, routing_weights=weights)
    probe = torch.randn(ref_out.shape, generator=generator)
    (ref_out * probe).sum().backward()
    rows = slice(rank * 6, (rank + 1) * 6)
    out = experts(x[rows], router_indices=index[rows], routing_weights=weights[rows])
    (out * probe[rows]).sum().backward()
    per = experts.w_in.to_local().shape[0]
    first = mesh["ep"].get_local_rank() * per
    grads = {
        name: diff(p.grad.to_local(), ref.grad[first : first + per])
        for (name, p), ref in zip(experts.named_parameters(), reference.parameters())
    }
    refused = {}
    for case, args, kwargs in (
        ("swapped", (x[rows], weights[rows], index[rows]), {}),
        ("extra", (x[rows], index[rows], weights[rows]), {"scale": 2.0}),
    ):
        try:
            experts(*args, **kwargs)
            refused[case] = ""
        except (TypeError, ValueError) as e:
            refused[case] = f"{type(e).__name__}: {e}"
    return {"out": diff(out, ref_out[rows]), "grads": grads, "refused": refused}


def idle_rank_with_skipping_experts(mesh_text: str) -> dict[str, Any]:
    """:class:`KeywordExperts` at ep=2 with every token routed to rank 0's experts.

    Rank 1's experts receive nothing, so its forward returns a tensor on no graph; its
    own tokens' gradients come back from rank 0's experts.
    """
    mesh, reference, experts = _keyword_experts_on_ep(mesh_text)
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(1)
    x_all = torch.randn(5 * world, 8, generator=generator, requires_grad=True)
    weights_all = torch.rand(5 * world, 2, generator=generator, requires_grad=True)
    index_all = torch.tensor([[0, 1], [1, 0]] * (5 * world // 2) + [[0, 1]] * (5 * world % 2))
    ref_out = reference(x_all, index_all, weights_all)
    probe = torch.randn(ref_out.shape, generator=generator)
    (ref_out * probe).sum().backward()
    rows = slice(rank * 5, (rank + 1) * 5)
    x = x_all.detach()[rows].clone().requires_grad_()
    weights = weights_all.detach()[rows].clone().requires_grad_()
    out = experts(x, index_all[rows], weights)
    (out * probe[rows]).sum().backward()
    per = experts.w_in.to_local().shape[0]
    first = mesh["ep"].get_local_rank() * per
    grads = {
        name: diff(p.grad.to_local() if p.grad is not None else None, ref.grad[first : first + per])
        for (name, p), ref in zip(experts.named_parameters(), reference.parameters())
    }
    return {
        "out": diff(out, ref_out[rows]),
        "x_grad": diff(x.grad, x_all.grad[rows]),
        "weights_grad": diff(weights.grad, weights_all.grad[rows]),
        "grads": grads,
    }


def hf_plan_parity(family: str, plan_file: str) -> dict[str, Any]:
    """An unmodified Hugging Face MoE parallelized from a plan file on a 1-D ``ep`` mesh.

    Convention of a data-parallel wrapper that sums gradients: each rank's loss is
    scaled by its share of the tokens (``1 / ranks``), dense gradients are summed over
    the ranks, expert gradients are used as they are.
    """
    from hyper_parallel.core.dtensor.device_mesh import init_device_mesh
    from hyper_parallel.dmodule import parallelize_module
    from hyper_parallel.hf import build_hf_model

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    reference = build_hf_model(family, seed=0)
    model = build_hf_model(family, seed=0)
    parallelize_module(model, mesh, plan_file)
    tokens = torch.randint(0, 128, (2 * world, 10), generator=torch.Generator().manual_seed(3))
    ref_out = reference(tokens, labels=tokens)
    ref_out.loss.backward()
    per = tokens.shape[0] // world
    rows = slice(dist.get_rank() * per, (dist.get_rank() + 1) * per)
    with CommDebugMode() as comms:
        out = model(tokens[rows], labels=tokens[rows])
    (out.loss / world).backward()
    loss = _all_reduce(out.loss.detach(), mesh) / world
    ref_params = dict(reference.named_parameters())
    grads, placements = {}, {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            placements[name] = repr(list(p.placements))
            local = p.grad.to_local()
            start = mesh.get_local_rank() * local.shape[0]
            expected = ref_params[name].grad[start : start + local.shape[0]]
            grads[name] = diff(local, expected)
        else:
            grads[name] = diff(_all_reduce(p.grad, mesh), ref_params[name].grad)
    return {
        "logits": (out.logits - ref_out.logits[rows]).abs().max().item(),
        "loss": (loss - ref_out.loss.detach()).abs().item(),
        "grads": grads,
        "forward_comms": _counts(comms),
        "placements": placements,
        "num_layers": reference.config.num_hidden_layers,
    }


def _debug_model(mesh: Any, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = apply_ep(preset_config("qwen3-moe-debug")).build()
    model.init_states()
    return model.parallelize(mesh["ep"])


def dcp_save(path: str, mesh_text: str) -> None:
    """Save the seed-0 debug MoE, experts split as ``mesh_text`` says, with DCP."""
    import torch.distributed.checkpoint as dcp

    mesh = MeshLayout.parse(mesh_text).build("cpu")
    dcp.save(_debug_model(mesh, seed=0).state_dict(), checkpoint_id=path)


def dcp_load(path: str, mesh_text: str) -> list[str]:
    """Load it into a seed-1 model at ``mesh_text``; names of states not bitwise seed-0."""
    import torch.distributed.checkpoint as dcp

    mesh = MeshLayout.parse(mesh_text).build("cpu")
    model = _debug_model(mesh, seed=1)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state)
    torch.manual_seed(0)
    reference = preset_config("qwen3-moe-debug").build()
    reference.init_states()
    expected = reference.state_dict()
    wrong = []
    for name, value in model.state_dict().items():
        if isinstance(value, DTensor):
            per = value.to_local().shape[0]
            start = mesh["ep"].get_local_rank() * per
            full = expected[name][start : start + per]
            value = value.to_local()
        else:
            full = expected[name]
        if not torch.equal(value, full):
            wrong.append(name)
    return wrong


def trainer_parity(mesh_text: str, overrides: dict[str, Any] | None = None) -> dict[str, Diff]:
    """The trainer's build (experts on ep, FSDP2 on fsdp/efsdp) vs its one-device build.

    One forward/backward on the same global batch; gradients after the trainer's
    expert-gradient rescaling, gathered with ``full_tensor``. ``overrides``: the
    model's (``TrainConfig.model_overrides``).
    """
    from hyper_parallel.distributed.expert_parallel import rescale_expert_grads
    from hyper_parallel.train import TrainConfig, build_parallel_model
    from hyper_parallel.train.trainer import build_mesh

    layout = MeshLayout.parse(mesh_text)
    cfg = TrainConfig(
        model="qwen3-moe-debug", mesh=layout.active(), model_overrides=overrides or {}
    )
    mesh = build_mesh(layout, device="cpu")
    model = build_parallel_model(cfg, mesh, device="cpu")
    reference = build_parallel_model(cfg, None, device="cpu")
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(5))
    ref_loss = cross_entropy_loss(reference(tokens[:, :-1]), tokens[:, 1:])
    ref_loss.backward()
    rows = _batch_rows(mesh, BATCH)
    loss = _full(cross_entropy_loss(model(tokens[rows, :-1]), tokens[rows, 1:]))
    loss.backward()
    rescale_expert_grads(model, layout)
    ref = dict(reference.named_parameters())
    diffs = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        diffs[name] = diff(grad, ref[name].grad)
    global_loss = _all_reduce(loss.detach(), mesh["batch"]) / mesh["batch"].size()
    diffs["<loss>"] = diff(global_loss, ref_loss.detach())
    return diffs


def trainer_bf16_loss(mesh_text: str) -> dict[str, Any]:
    """The trainer's bf16 build (FSDP2 bf16 policy, experts' unit too) vs one fp32 device.

    Returns the experts' compute dtype inside the forward, the global loss's
    difference from the one-device fp32 loss on the same batch, and every gradient's
    difference (after the trainer's expert rescale) from the fp32 one-device gradient.
    """
    from hyper_parallel.distributed.expert_parallel import rescale_expert_grads
    from hyper_parallel.train import TrainConfig, build_parallel_model
    from hyper_parallel.train.trainer import build_mesh

    layout = MeshLayout.parse(mesh_text)
    cfg = TrainConfig(model="qwen3-moe-debug", mesh=layout.active(), dtype="bf16")
    mesh = build_mesh(layout, device="cpu")
    model = build_parallel_model(cfg, mesh, device="cpu")
    reference = build_parallel_model(cfg.replace(dtype="fp32"), None, device="cpu")
    seen: list[torch.dtype] = []
    experts = model.layers[0].moe.experts
    hook = experts.register_forward_pre_hook(lambda m, args: seen.append(m.w1.dtype))
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(5))
    rows = _batch_rows(mesh, BATCH)
    loss = cross_entropy_loss(model(tokens[rows, :-1]).float(), tokens[rows, 1:])
    loss.backward()
    hook.remove()
    rescale_expert_grads(model, layout)
    ref_loss = cross_entropy_loss(reference(tokens[:, :-1]), tokens[:, 1:])
    ref_loss.backward()
    global_loss = _all_reduce(loss.detach(), mesh["batch"]) / mesh["batch"].size()
    ref = dict(reference.named_parameters())
    grads = {n: diff(_full(p.grad), ref[n].grad) for n, p in model.named_parameters()}
    return {
        "expert_dtype": seen[0],
        "loss_diff": (global_loss - ref_loss.detach()).abs().item(),
        "grads": grads,
    }


def _planned(
    layout: MeshLayout, mesh: Any, overrides: dict[str, Any] | None, sequence_parallel: bool = False
) -> torch.nn.Module:
    """The debug MoE placed as the trainer places it: its run plan (the registered
    sharding of every active axis) applied by the builder — the plan only, no FSDP2 —
    and initialized under seed 0 as the one-device reference is."""
    from hyper_parallel.distributed.builder import apply_run_plan
    from hyper_parallel.distributed.run_plan import RunPlan

    run = RunPlan.for_model(
        "qwen3-moe-debug",
        layout,
        model_overrides=overrides,
        sequence_parallel=sequence_parallel,
        fsdp=False,
        seq_len=SEQ,
    )
    run.raise_for_errors("moe_checks")
    torch.manual_seed(0)
    model = run.subject.build()
    model.init_states()
    apply_run_plan(model, run, mesh)
    return model


def tp_model_parity(
    mesh_text: str, sequence_parallel: bool = False, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The debug MoE with tensor parallelism (and ``ep`` borrowing tp ranks) vs one device.

    Dense states are DTensors on ``tp`` (their gradients made full with ``full_tensor``,
    then averaged over the batch ranks); expert states on ``ep`` as in
    :func:`model_parity`. The model's sharding is the registered one
    (``apply_model_axes``: tp then ep), parallelized as the trainer does.
    """
    from hyper_parallel.dmodule import get_spec

    layout = MeshLayout.parse(mesh_text)
    mesh = layout.build("cpu")
    spec = get_spec("qwen3-moe-debug")
    config = spec.config(**(overrides or {}))
    torch.manual_seed(0)
    reference = config.build()
    reference.init_states()
    model = _planned(layout, mesh, overrides, sequence_parallel)
    return _compare(model, reference, mesh)


def cp_model_parity(mesh_text: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The debug MoE with context parallelism (and ``ep`` borrowing cp ranks) vs one device.

    Each rank runs its batch rows' head-tail part of the sequence with global positions.
    Gradients as the trainer takes them: the rank's loss (the mean over its tokens) is
    scaled by ``1 / cp`` before ``backward()``; dense gradients are summed over ``cp``
    (``Partial`` ones made full, replicated ones all-reduced) and averaged over the
    batch ranks; expert gradients (on ``ep``) are summed over ``efsdp`` and divided by
    the batch ranks. The balance loss is compared per rank: it must be its batch rows'
    single-device value on every cp rank.
    """
    from hyper_parallel.distributed import context_parallel as cp
    from hyper_parallel.dmodule import get_spec

    layout = MeshLayout.parse(mesh_text)
    mesh = layout.build("cpu")
    spec = get_spec("qwen3-moe-debug")
    config = spec.config(**(overrides or {}))
    torch.manual_seed(0)
    reference = config.build()
    reference.init_states()
    model = _planned(layout, mesh, overrides)

    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    rows = _batch_rows(mesh, BATCH)
    ref_logits = reference(inputs[rows])
    ref_aux = [layer.moe.aux_loss for layer in reference.layers]
    reference.zero_grad()
    ref_logits_all = reference(inputs)
    ref_loss = cross_entropy_loss(ref_logits_all, targets)
    ref_loss.backward()

    cp_mesh, cp_rank, cp_size = mesh["cp"], mesh["cp"].get_local_rank(), layout.cp
    local_inputs = cp.shard_sequence(inputs[rows], cp_rank, cp_size)
    local_targets = cp.shard_sequence(targets[rows], cp_rank, cp_size)
    pos = cp.positions(SEQ, cp_rank, cp_size)
    with CommDebugMode() as forward_comms:
        logits = model(local_inputs, positions=pos)
    loss = cross_entropy_loss(logits, local_targets)
    loss = loss.to_local() if isinstance(loss, DTensor) else loss
    with CommDebugMode() as backward_comms:
        (loss / cp_size).backward()
    num_batch = mesh["batch"].size()
    global_loss = _all_reduce(_all_reduce(loss.detach(), mesh["batch"]), cp_mesh)
    global_loss = global_loss / (num_batch * cp_size)

    ref = dict(reference.named_parameters())
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        if isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("ep",):
            grad = _all_reduce(p.grad.to_local(), mesh["efsdp"]) / expert_grad_divisor(num_batch)
            per = p.to_local().shape[0]
            start = mesh["ep"].get_local_rank() * per
            expected = ref[name].grad[start : start + per]
        else:
            full = _full(p.grad)
            if not (isinstance(p.grad, DTensor) and any(x.is_partial() for x in p.grad.placements)):
                full = _all_reduce(full, cp_mesh)  # replicated per rank: sum the ranks'
            grad = _all_reduce(full, mesh["batch"]) / num_batch
            expected = ref[name].grad
        grads[name] = diff(grad, expected)
    assert set(grads) == set(ref)
    return {
        "logits": (cp.unshard_sequence(logits, cp_mesh) - ref_logits).abs().max().item(),
        "loss": (global_loss - ref_loss.detach()).abs().item(),
        "aux": worst_abs(
            [(layer.moe.aux_loss - r).abs().item() for layer, r in zip(model.layers, ref_aux)]
        ),
        "grads": grads,
        "forward_comms": _counts(forward_comms),
        "backward_comms": _counts(backward_comms),
        "placements": {
            n: (p.device_mesh.mesh_dim_names, repr(list(p.placements)))
            for n, p in model.named_parameters()
            if isinstance(p, DTensor)
        },
        "num_layers": len(model.layers),
    }


def trainer_cp_parity(mesh_text: str, seq: int = SEQ) -> dict[str, Diff]:
    """The trainer's build with ``cp`` (FSDP2 over ``dp_shard x cp``, experts on ``ep``)
    vs its one-device build: each rank runs its rows' head-tail part of the sequence with
    global positions; gradients after the trainer's expert-gradient rescaling.
    """
    from hyper_parallel.distributed import context_parallel as cp
    from hyper_parallel.distributed.expert_parallel import rescale_expert_grads
    from hyper_parallel.train import TrainConfig, build_parallel_model
    from hyper_parallel.train.trainer import build_mesh

    layout = MeshLayout.parse(mesh_text)
    cfg = TrainConfig(model="qwen3-moe-debug", mesh=layout.active(), seq_len=seq)
    mesh = build_mesh(layout, device="cpu")
    model = build_parallel_model(cfg, mesh, device="cpu")
    reference = build_parallel_model(cfg, None, device="cpu")
    tokens = torch.randint(0, 256, (BATCH, seq + 1), generator=torch.Generator().manual_seed(5))
    ref_loss = cross_entropy_loss(reference(tokens[:, :-1]), tokens[:, 1:])
    ref_loss.backward()
    rows = _batch_rows(mesh, BATCH)
    cp_rank, cp_size = mesh["cp"].get_local_rank(), layout.cp
    inputs = cp.shard_sequence(tokens[rows, :-1], cp_rank, cp_size)
    targets = cp.shard_sequence(tokens[rows, 1:], cp_rank, cp_size)
    loss = _full(
        cross_entropy_loss(model(inputs, positions=cp.positions(seq, cp_rank, cp_size)), targets)
    )
    # The trainer's backward: the loss scaled by 1 / cp (the cp-partial gradients then
    # sum to the mean; full_tensor reduces them), then its expert-gradient rescaling.
    (loss / cp_size).backward()
    rescale_expert_grads(model, layout)
    ref = dict(reference.named_parameters())
    diffs = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        diffs[name] = diff(grad, ref[name].grad)
    ranks = mesh["batch"].size() * cp_size
    global_loss = _all_reduce(_all_reduce(loss.detach(), mesh["batch"]), mesh["cp"]) / ranks
    diffs["<loss>"] = diff(global_loss, ref_loss.detach())
    return diffs
