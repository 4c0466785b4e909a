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
from hyper_parallel.dmodule._fast import FastPath
from hyper_parallel.models.llama import (
    apply_cp,
    apply_tp,
    apply_tp_sp,
    cross_entropy_loss,
    preset_config,
)
from tests.distributed.llama_checks import _KINDS

TP_LAYOUTS = {"tp": apply_tp, "tp_sp": apply_tp_sp}


class AxisCommMode(CommDebugMode):
    """``CommDebugMode`` that also counts each collective by the mesh axis it runs on."""

    def __init__(self, groups: dict[str, str]) -> None:
        super().__init__()
        self._axis_of = {name: axis for axis, name in groups.items()}
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
            self.by_axis[(axis, kind)] += 1
        return out


def _counts(mode: AxisCommMode) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for (axis, kind), n in sorted(mode.by_axis.items()):
        out.setdefault(axis, {})[kind] = n
    return out


def build(mesh_text: str, tp_layout: str | None, order: str = "cp_last") -> Any:
    """The layout's ParallelMesh, model-mesh and config (cp applied last or first)."""
    layout = MeshLayout.parse(mesh_text)
    mesh = layout.build("cpu")
    axes = [a for a in ("cp", "tp") if layout.size(a) > 1]
    config = preset_config("llama3-debug")
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
) -> dict[str, Any]:
    """Parallelize on the (cp[, tp]) mesh; compare logits, loss and every gradient.

    The rank's loss is the mean over its tokens; the global loss is their mean over
    ``cp`` and the gradient the mean of the ranks' gradients over ``cp`` (what FSDP2
    over ``dp_shard x cp`` computes), both compared with one device.
    """
    layout, mesh, model_mesh, config = build(mesh_text, tp_layout, order)
    cp_size, cp_rank = layout.cp, mesh.local_rank("cp")

    reference = preset_config("llama3-debug").build()
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
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    local_inputs = cp.shard_sequence(inputs, cp_rank, cp_size)
    local_targets = cp.shard_sequence(targets, cp_rank, cp_size)
    pos = cp.positions(seq_len, cp_rank, cp_size)
    if batch_positions:
        pos = pos.expand(2, -1).contiguous()

    groups = {a: mesh[a].get_group().group_name for a in ("cp", "tp") if layout.size(a) > 1}
    with AxisCommMode(groups) as forward:
        logits = model(local_inputs, positions=pos)
    with AxisCommMode(groups) as loss_mode:
        loss = cross_entropy_loss(logits, local_targets)
    with AxisCommMode(groups) as backward:
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
        grad_diffs[name] = (full / cp_size - p.grad).abs().max().item()

    # Which runtime path each configured module took: a fast-path pattern, or DTensor.
    paths = {
        path: m.forward.kind if isinstance(m.forward, FastPath) else "dtensor"
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
    """The rank's loss vs one device's mean over the same tokens (the rank's part)."""
    mine = cp.shard_sequence(ref_logits, rank, size)
    expected = torch.nn.functional.cross_entropy(
        mine.flatten(0, -2), cp.shard_sequence(targets, rank, size).flatten()
    )
    return abs(loss.item() - expected.item())
