"""Rank-side checks of the reference Llama's context-parallel layout against one device.

Module-level functions, run on every rank through ``dist.run`` by ``test_llama_cp.py``
(2 ranks) and ``test_llama_cp4.py`` (4 ranks: cp=4 and cp=2 x tp=2).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as c10d
from torch.distributed.tensor.debug import CommDebugMode

from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.distributed import MeshLayout
from hyper_parallel.distributed import context_parallel as cp
from hyper_parallel.dmodule import fast_path
from hyper_parallel.dmodule._boundary import installed_forward
from hyper_parallel.dmodule._fast import FastPath
from hyper_parallel.models.llama import (
    apply_cp,
    apply_tp,
    apply_tp_sp,
    cross_entropy_loss,
    preset_config,
)
from tests._compare import diff, diffs
from tests.distributed.llama_checks import _KINDS

TP_LAYOUTS = {"tp": apply_tp, "tp_sp": apply_tp_sp}


# Process-group name -> mesh axis, for every mesh built in this process. DTensor caches
# output specs by mesh *equality*, so a DTensor may carry an earlier, equal mesh (same
# ranks and names) and run its collectives on that mesh's groups.
_AXIS_OF_GROUP: dict[str, str] = {}


def _record_groups(mesh: Any) -> None:
    for axis in ("cp", "tp"):
        _AXIS_OF_GROUP[mesh[axis].get_group().group_name] = axis


class AxisCommMode(CommDebugMode):
    """``CommDebugMode`` that also counts each collective by the mesh axis it runs on."""

    def __init__(self) -> None:
        super().__init__()
        self._axis_of = _AXIS_OF_GROUP
        self.by_axis: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = sum(self.comm_counts.values())
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented and sum(self.comm_counts.values()) > before:
            kind = _KINDS.get(str(func._overloadpacket).rsplit(".", 1)[-1], str(func))
            axis = "?"
            for a in [*args, *(kwargs or {}).values()]:
                name = a if isinstance(a, str) else getattr(a, "group_name", None)
                if isinstance(name, str) and name in self._axis_of:
                    axis = self._axis_of[name]
                elif isinstance(name, str):
                    axis = f"?{name}"
            self.by_axis[(axis, kind)] += 1
        return out


def _counts(mode: AxisCommMode) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for (axis, kind), n in sorted(mode.by_axis.items()):
        out.setdefault(axis, {})[kind] = n
    return out


def build(mesh_text: str, tp_layout: str | None, order: str = "cp_last", **overrides: Any) -> Any:
    """The layout's ParallelMesh, model-mesh and config (cp applied last or first)."""
    layout = MeshLayout.parse(mesh_text)
    mesh = layout.build("cpu")
    _record_groups(mesh)
    axes = [a for a in ("cp", "tp") if layout.size(a) > 1]
    config = preset_config("llama3-debug", **overrides)
    if order == "cp_last":
        if tp_layout is not None:
            config = TP_LAYOUTS[tp_layout](config, tp_size=layout.tp)
        config = apply_cp(config, cp_size=layout.cp)
    else:
        config = apply_cp(config, cp_size=layout.cp)
        if tp_layout is not None:
            config = TP_LAYOUTS[tp_layout](config, tp_size=layout.tp)
    return layout, mesh, mesh.submesh(axes), config


def compare_with_one_device(
    mesh_text: str,
    tp_layout: str | None,
    local_fast_path: bool,
    seq_len: int,
    batch_positions: bool = False,
    order: str = "cp_last",
    num_kv_heads: int | None = None,
    num_ignored: int = 0,
) -> dict[str, Any]:
    """Parallelize on the (cp[, tp]) mesh; compare logits, loss and every gradient.

    The rank's loss is its share of the global mean; the global loss is their mean over
    ``cp`` and the gradient the mean of the ranks' gradients over ``cp`` (what FSDP2
    over ``dp_shard x cp`` computes), both compared with one device. ``num_kv_heads``
    overrides the model's key/value heads (1: multi-query attention); ``num_ignored``
    sets each sequence's first targets to -100 (``ignore_index``: a prompt or padding),
    which the head-tail split leaves to the ranks in different numbers.
    """
    overrides = {} if num_kv_heads is None else {"num_kv_heads": num_kv_heads}
    layout, mesh, model_mesh, config = build(mesh_text, tp_layout, order, **overrides)
    cp_size, cp_rank = layout.cp, mesh.local_rank("cp")

    reference = preset_config("llama3-debug", **overrides).build()
    torch.manual_seed(0)
    reference.init_states()

    with torch.device("meta"):
        model = config.build()
    with fast_path(local_fast_path):
        model.parallelize(model_mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_states()

    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (2, seq_len + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[:, :num_ignored] = -100
    local_inputs = cp.shard_sequence(inputs, cp_rank, cp_size)
    local_targets = cp.shard_sequence(targets, cp_rank, cp_size)
    pos = cp.positions(seq_len, cp_rank, cp_size)
    if batch_positions:
        pos = pos.expand(2, -1).contiguous()

    with AxisCommMode() as forward:
        logits = model(local_inputs, positions=pos)
    with AxisCommMode() as loss_mode:
        loss = cross_entropy_loss(logits, local_targets)
    with AxisCommMode() as backward:
        loss.backward()

    ref_logits = reference(inputs)
    ref_loss = cross_entropy_loss(ref_logits, targets)
    ref_loss.backward()

    cp_group = mesh["cp"].get_group()
    local_loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
    global_loss = local_loss.detach().clone()
    c10d.all_reduce(global_loss, group=cp_group)
    global_loss /= cp_size

    full_logits = cp.unshard_sequence(logits, mesh["cp"])
    params = dict(model.named_parameters())
    grad_diffs = {}
    for name, p in reference.named_parameters():
        grad = params[name].grad
        # The ranks' gradients, summed by full_tensor() over cp (Partial), then averaged.
        full = grad.full_tensor() if isinstance(grad, DTensor) else grad
        if not any(pl.is_partial() for pl in grad.placements):
            c10d.all_reduce(full, group=cp_group)  # replicated per rank: sum the ranks'
        grad_diffs[name] = diff(full / cp_size, p.grad)

    # Which runtime path each configured module took: a fast-path pattern, or DTensor.
    paths = {
        path: installed_forward(m).kind if isinstance(installed_forward(m), FastPath) else "dtensor"
        for path, m in model.named_modules()
        if getattr(m, "sharding_config", None) is not None
    }
    return {
        "logits_diff": (full_logits - ref_logits).abs().max().item(),
        "local_loss_diff_to_local_reference": _local_reference_loss_diff(
            ref_logits, targets, local_loss, cp_rank, cp_size
        ),
        "loss_diff": abs(global_loss.item() - ref_loss.item()),
        "grad_diffs": grad_diffs,
        "counts": {
            "forward": _counts(forward),
            "loss": _counts(loss_mode),
            "backward": _counts(backward),
        },
        "logits_placements": [str(p) for p in logits.placements],
        "param_placements": {n: [str(x) for x in p.placements] for n, p in params.items()},
        "grad_placements": {n: [str(x) for x in p.grad.placements] for n, p in params.items()},
        "fast_paths": paths,
        "local_seq": local_inputs.shape[1],
    }


def _local_reference_loss_diff(
    ref_logits: torch.Tensor, targets: torch.Tensor, loss: torch.Tensor, rank: int, size: int
) -> float:
    """The rank's loss vs one device's sum over the same tokens (the rank's part) times
    ``cp`` over the whole sequence's non-ignored targets (the rank's share of the mean)."""
    mine = cp.shard_sequence(ref_logits, rank, size)
    total = torch.nn.functional.cross_entropy(
        mine.flatten(0, -2), cp.shard_sequence(targets, rank, size).flatten(), reduction="sum"
    )
    expected = total * size / (targets != -100).sum()
    return abs(loss.item() - expected.item())


def expected_cp_collectives(num_layers: int) -> dict[str, dict[str, int]]:
    """Collectives on ``cp`` per phase of one step: the declared ones and nothing else.

    Forward: in each layer the attention core all-gathers its keys and values (2 per
    layer); nothing else (positions stay each rank's own: attention is computed by
    chunks, without a mask of every position). Backward: the keys' and values'
    gradients, declared ``Partial`` on ``cp``, are reduce-scattered back to their
    sequence shards (2 per layer). The loss all-reduces one count over ``cp``: the
    non-ignored targets of the whole sequence, which divide each rank's sum.
    """
    return {
        "forward": {"all_gather": 2 * num_layers},
        "loss": {"all_reduce": 1},
        "backward": {"reduce_scatter": 2 * num_layers},
    }


def forward_without_positions(mesh_text: str, tp_layout: str | None) -> str:
    """A cp model called without positions: the error every rank raises."""
    _, _, model_mesh, config = build(mesh_text, tp_layout)
    model = config.build()
    torch.manual_seed(0)
    model.init_states()
    model.parallelize(model_mesh)
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    try:
        model(tokens)
    except ValueError as e:
        return str(e)
    return ""


def positions_not_the_split(mesh_text: str) -> str:
    """A cp model given positions that are not its rank's head-tail part: the error."""
    layout, mesh, model_mesh, config = build(mesh_text, None)
    model = config.build()
    model.init_states()
    model.parallelize(model_mesh)
    tokens = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    rank = mesh.local_rank("cp")
    wrong = cp.positions(16, rank, layout.cp).flip(0)  # this rank's positions, reversed
    try:
        model(tokens, positions=wrong)
    except ValueError as e:
        return str(e)
    return ""


def unshard_round_trip(seq_len: int) -> dict[str, Any]:
    """shard_sequence on every rank, then unshard_sequence: the input back, with gradients."""
    layout = MeshLayout.from_sizes({"cp": c10d.get_world_size()})
    mesh = layout.build("cpu")
    rank, size = mesh.local_rank("cp"), layout.cp
    full = torch.randn(2, seq_len, 3, generator=torch.Generator().manual_seed(0))
    full.requires_grad_(True)
    local = cp.shard_sequence(full, rank, size)
    back = cp.unshard_sequence(local, mesh["cp"])
    # Every rank holds the whole tensor; its gradient reaches each rank's own part.
    (back * torch.arange(seq_len).view(1, -1, 1)).sum().backward()
    pos = cp.unshard_sequence(cp.positions(seq_len, rank, size), mesh["cp"], dim=0)
    return {
        "equal": torch.equal(back, full),
        "positions": pos.tolist(),
        "grad": full.grad.tolist(),
        "mine": cp.positions(seq_len, rank, size).tolist(),
    }


def unshard_placed_otherwise() -> dict[str, str]:
    """unshard_sequence given DTensors that are not Shard(seq) on cp: the errors."""
    from hyper_parallel.core.dtensor.dtensor import distribute_tensor
    from hyper_parallel.core.dtensor.placement_types import Replicate, Shard

    mesh = MeshLayout.from_sizes({"cp": c10d.get_world_size()}).build("cpu")
    full = torch.arange(16.0).view(2, 8)
    out = {}
    for name, placement, dim in (
        ("replicated", Replicate(), 1),
        ("batch_split", Shard(0), 1),
        ("wrong_dim", Shard(1), 0),
    ):
        try:
            got = cp.unshard_sequence(
                distribute_tensor(full, mesh["cp"], [placement]), mesh["cp"], dim
            )
            out[name] = f"returned {got.tolist()}"
        except ValueError as e:
            out[name] = str(e)
    return out


def compare_with_fsdp(mesh_text: str, tp_layout: str | None, seq_len: int) -> dict[str, Any]:
    """CP under FSDP2 sharding over ``cp``: the gradients FSDP leaves equal one device's.

    The model's parameters are DTensors on the (cp[, tp]) mesh, so FSDP2 takes that mesh
    with ``DataParallelMeshDims(shard="cp")`` (its SPMD form): it shards the states over
    ``cp`` and averages the ranks' gradients there, which, with each rank's loss the mean
    over its tokens, is the one-device gradient. No averaging by the test.
    """
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard

    layout, mesh, model_mesh, config = build(mesh_text, tp_layout)
    cp_size, cp_rank = layout.cp, mesh.local_rank("cp")
    reference = preset_config("llama3-debug").build()
    torch.manual_seed(0)
    reference.init_states()
    model = config.build()
    torch.manual_seed(0)
    model.init_states()
    model.parallelize(model_mesh)
    # FSDP2 wants the very mesh object the parameters carry. DTensor caches sharding
    # decisions by mesh *equality*, so in a process that built an equal mesh before (this
    # pool), parameters may carry that earlier object (same ranks, names and groups).
    spmd_mesh = model.tok_embeddings.weight.device_mesh
    assert spmd_mesh == model_mesh
    assert all(p.device_mesh is spmd_mesh for p in model.parameters())
    dims = DataParallelMeshDims(shard="cp")
    for layer in model.layers:
        fully_shard(layer, mesh=spmd_mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=spmd_mesh, dp_mesh_dims=dims)

    tokens = torch.randint(0, 256, (2, seq_len + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = model(
        cp.shard_sequence(inputs, cp_rank, cp_size),
        positions=cp.positions(seq_len, cp_rank, cp_size),
    )
    loss = cross_entropy_loss(logits, cp.shard_sequence(targets, cp_rank, cp_size))
    loss.backward()
    ref_loss = cross_entropy_loss(reference(inputs), targets)
    ref_loss.backward()
    params = dict(model.named_parameters())
    return {
        "grad_diffs": diffs(
            {n: params[n].grad for n in params},
            {n: p.grad for n, p in reference.named_parameters()},
        ),
        "param_placements": {n: [str(x) for x in p.placements] for n, p in params.items()},
    }
