"""Rank-side checks of the reference Llama's TP and TP+SP layouts against one device.

Module-level functions, run on every rank through ``dist.run`` by
``test_llama_tp.py`` (2 ranks) and ``test_llama_tp4.py`` (4 ranks).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as c10d
from torch.distributed.tensor.debug import CommDebugMode

from hyper_parallel.core.dtensor.device_mesh import init_device_mesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.dmodule import fast_path
from hyper_parallel.models.llama import apply_tp, apply_tp_sp, cross_entropy_loss, preset_config
from tests._compare import diffs, worst_abs
from tests.distributed.models import PathLog

LAYOUTS = {"tp": apply_tp, "tp_sp": apply_tp_sp}

# Collective op names (functional and in-place c10d spellings) by kind.
_KINDS = {
    "all_reduce": "all_reduce",
    "allreduce_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
}


def collective_counts(mode: CommDebugMode) -> dict[str, int]:
    """Collectives seen by ``mode``, by kind (``all_reduce``, ``all_gather``, ...)."""
    counts: dict[str, int] = {}
    for op, n in mode.get_comm_counts().items():
        name = str(op).rsplit(".", 1)[-1]
        kind = _KINDS.get(name, name)
        counts[kind] = counts.get(kind, 0) + n
    return {k: n for k, n in counts.items() if n}


def expected_collectives(layout: str, num_layers: int) -> dict[str, dict[str, int]]:
    """The analytical minimum per phase of one training step (Megatron-LM's schedule).

    TP (Shoeybi et al., 2019, §3): each block (attention, feed-forward) has one "g"
    (all-reduce of the row-parallel output in forward, identity in backward) and one
    "f" (identity in forward, all-reduce of the column-parallel input gradient in
    backward): 2 per layer each way. The vocab-parallel embedding adds a "g" in
    forward; the column-parallel output projection an "f" in backward.

    TP+SP (Korthikanti et al., 2022, §4.2.2): "g" becomes a reduce-scatter into the
    sequence-sharded residual stream and "f" an all-gather out of it (their
    backwards swap): 2 all-gathers and 2 reduce-scatters per layer each way; the
    embedding's reduction is a reduce-scatter (backward all-gather), the output
    projection's input an all-gather (backward reduce-scatter). As in Megatron-LM, each
    block and the output projection keep their input's shard for the weight gradients,
    not the gathered input, and all-gather it again in backward: 2 more all-gathers per
    layer there, and 1 at the end.

    The vocab-parallel loss (``loss_parallel``) adds three all-reduces of one value
    per token in forward (max, sum of exponentials, target logit) and none in
    backward; the sequence-parallel norm weights' gradients stay ``Partial`` and are
    reduced once per step where they are consumed (FSDP, the optimizer), as in
    Megatron, outside the backward pass.
    """
    per_layer, ends = 2 * num_layers, 1
    if layout == "tp":
        forward = {"all_reduce": per_layer + ends}
        backward = {"all_reduce": per_layer + ends}
    else:
        forward = {"all_gather": per_layer + ends, "reduce_scatter": per_layer + ends}
        backward = {"all_gather": 2 * (per_layer + ends), "reduce_scatter": per_layer + ends}
    return {"forward": forward, "loss": {"all_reduce": 3}, "backward": backward}


def compare_with_one_device(
    layout: str, local_fast_path: bool, overrides: dict[str, Any], seq_len: int
) -> dict[str, Any]:
    """Build ``layout`` on meta, parallelize, materialize, init; compare with one device.

    ``local_fast_path`` chooses the runtime's path: local shards with exactly the
    collectives the configs fix (the default), or DTensor dispatch throughout.

    Returns:
        Largest differences (init, logits, loss, every gradient), collective counts
        per phase, and placements, for the test process to assert on.
    """
    world = c10d.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    config = preset_config("llama3-debug", **overrides)

    reference = config.build()
    torch.manual_seed(0)
    reference.init_states()

    with torch.device("meta"):
        model = LAYOUTS[layout](config, tp_size=world).build()
    with fast_path(local_fast_path):
        model.parallelize(mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_states()

    params = dict(model.named_parameters())
    ref_params = dict(reference.named_parameters())
    init_diff = worst_abs(
        [(params[n].full_tensor() - p).abs().max().item() for n, p in ref_params.items()]
    )

    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (2, seq_len + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    log = PathLog(model)
    with CommDebugMode() as forward:
        logits = model(inputs)
    log.close()
    with CommDebugMode() as loss_mode:
        loss = cross_entropy_loss(logits, targets)
    with CommDebugMode() as backward:
        loss.backward()

    ref_logits = reference(inputs)
    ref_loss = cross_entropy_loss(ref_logits, targets)
    ref_loss.backward()

    return {
        "init_diff": init_diff,
        "logits_diff": (logits.full_tensor() - ref_logits).abs().max().item(),
        "loss_diff": abs(loss.full_tensor().item() - ref_loss.item()),
        "grad_diffs": diffs(
            {n: params[n].grad for n in ref_params}, {n: p.grad for n, p in ref_params.items()}
        ),
        "counts": {
            "forward": collective_counts(forward),
            "loss": collective_counts(loss_mode),
            "backward": collective_counts(backward),
        },
        "logits_placements": _placements(logits),
        "paths": {p: (log.installed[p], sorted(k)) for p, k in log.ran().items()},
        "param_placements": {n: _placements(p) for n, p in params.items()},
        "grad_placements": {n: _placements(p.grad) for n, p in params.items()},
    }


def _placements(t: torch.Tensor) -> list[str]:
    assert isinstance(t, DTensor), type(t)
    return [str(p) for p in t.placements]


def loss_on_other_placements() -> dict[str, Any]:
    """``cross_entropy_loss`` on replicated DTensor logits, and its error for others."""
    from torch.distributed.tensor import distribute_tensor

    from hyper_parallel.core.dtensor.placement_types import Replicate, Shard

    mesh = init_device_mesh("cpu", (c10d.get_world_size(),), mesh_dim_names=("tp",))
    logits = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 8, (2, 4), generator=torch.Generator().manual_seed(1))
    expected = cross_entropy_loss(logits, targets)
    sharded = cross_entropy_loss(distribute_tensor(logits, mesh, [Shard(2)]), targets)
    replicated = cross_entropy_loss(distribute_tensor(logits, mesh, [Replicate()]), targets)
    try:
        cross_entropy_loss(distribute_tensor(logits, mesh, [Shard(0)]), targets)
        error = ""
    except ValueError as e:
        error = str(e)
    return {
        "sharded_diff": abs(sharded.full_tensor().item() - expected.item()),
        "replicated_diff": abs(replicated.item() - expected.item()),
        "error": error,
    }


def held_after_forward(keep_shards: bool, local_fast_path: bool, seq_len: int) -> dict[str, int]:
    """Bytes autograd keeps for backward after forward + loss of the tp_sp Llama, with
    gathered inputs kept as shards or not (every storage a saved tensor holds, counted
    once, parameters left out), and the model's shape."""
    from unittest import mock

    from hyper_parallel.dmodule import _regather

    world = c10d.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    config = preset_config("llama3-debug")
    with torch.device("meta"):
        model = apply_tp_sp(config, tp_size=world).build()
    with fast_path(local_fast_path):
        model.parallelize(mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_states()
    tokens = torch.randint(0, 256, (2, seq_len + 1), generator=torch.Generator().manual_seed(1))

    def storage(t: torch.Tensor) -> torch.UntypedStorage:
        return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()

    states = {storage(p)._cdata for p in model.parameters()}
    kept: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = storage(t)
        if s._cdata not in states:
            kept[s._cdata] = s  # held: an address is not reused while it is a key
        return t

    applies = _regather.applies if keep_shards else (lambda: False)
    with mock.patch.object(_regather, "applies", applies):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()  # the shards gathered again (every rank, the same order)
    return {
        "held": sum(s.nbytes() for s in kept.values()),
        "layers": len(model.layers),
        "dim": config.layers[0].attention.wq.in_features,
    }
