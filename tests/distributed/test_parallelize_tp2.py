"""``parallelize`` on two gloo ranks, checked against single-device math.

Every scenario compares the parallelized model with a deepcopy taken before
``parallelize``: the forward output and every parameter gradient (and the input
gradients), collectives counted with ``CommDebugMode`` for forward and backward
separately, and the placements the states and outputs end up with.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as c10d

from hyper_parallel.core.dtensor.dtensor import DTensor, distribute_tensor
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate, Shard
from hyper_parallel.dmodule import fast_path, parallelize_module
from tests.distributed.models import (
    PATHS,
    PlainFanOut,
    PlainStack,
    assert_numerics,
    assert_paths,
    attention_core_config,
    build_with_twin,
    colwise,
    compare,
    fan_out_plan,
    gated_config,
    mesh_1d,
    mlp_config,
    on_both_paths,
    parallelize_on,
    placements_of,
    projected_attention_config,
    rowwise,
    sequence_parallel_config,
    sharded_buffer_config,
    tempered_attention_config,
    tied_lm_config,
    two_outputs_config,
)

pytestmark = pytest.mark.distributed
WORLD_SIZE = 2

R, S0, S1 = (Replicate(),), (Shard(0),), (Shard(1),)


def _local_chunk(dim: int):
    """Expected local gradient of an input this rank holds a ``dim``-chunk of."""
    rank, size = c10d.get_rank(), c10d.get_world_size()
    return lambda i, grad: grad.chunk(size, dim)[rank]


# --------------------------------------------------------------------------- rank functions


def _mlp_runs(fast: bool) -> dict[str, Any]:
    mesh = mesh_1d(2)
    out: dict[str, Any] = {}
    torch.manual_seed(1)
    x = torch.randn(4, 8)

    model, ref = build_with_twin(mlp_config(8, 16))
    parallelize_on(model, mesh, fast)
    out["module"] = compare(model, ref, [x])
    out["module_again"] = compare(model, ref, [x])  # grads accumulate on both sides
    out["placements"] = placements_of(model)

    model, ref = build_with_twin(mlp_config(8, 16))
    parallelize_on(model, mesh, fast)
    out["no_input_grad"] = compare(model, ref, [x], input_grads=False)

    torch.manual_seed(0)
    plain = PlainStack(8, 16, num_layers=2)
    plain_ref = copy.deepcopy(plain)
    with fast_path(fast):
        parallelize_module(plain, mesh, {"layers.*.up": colwise(), "layers.*.down": rowwise()})
    out["plan"] = compare(plain, plain_ref, [x])
    out["plan_placements"] = placements_of(plain)

    torch.manual_seed(0)
    fan_out = PlainStack(8, 16, num_layers=2, block=PlainFanOut)
    fan_out_ref = copy.deepcopy(fan_out)
    with fast_path(fast):
        parallelize_module(fan_out, mesh, fan_out_plan())
    out["fan_out"] = compare(fan_out, fan_out_ref, [x])
    return out


def _sequence_parallel_runs(fast: bool) -> dict[str, Any]:
    mesh = mesh_1d(2)
    out: dict[str, Any] = {}
    torch.manual_seed(2)
    x = torch.randn(2, 6, 8)  # (batch, sequence, hidden)
    mine = x.chunk(2, 1)[c10d.get_rank()]
    for norm in ("rms", "layer"):
        model, ref = build_with_twin(sequence_parallel_config(8, norm=norm))
        parallelize_on(model, mesh, fast)
        out[norm] = compare(model, ref, [mine], [x], local_grad=_local_chunk(1))
        out[f"{norm}_placements"] = placements_of(model)
    return out


def _state_runs(fast: bool) -> dict[str, Any]:
    mesh = mesh_1d(2)
    out: dict[str, Any] = {}
    torch.manual_seed(3)
    x = torch.randn(3, 8)

    model, ref = build_with_twin(sharded_buffer_config(8, 6))
    parallelize_on(model, mesh, fast)
    out["buffer"] = compare(model, ref, [x])
    out["buffer_placements"] = placements_of(model)
    out["buffer_state_dict"] = {k: type(v).__name__ for k, v in model.state_dict().items()}
    out["buffer_values"] = {
        n: (b.full_tensor() - getattr(ref, n)).abs().max().item() for n, b in model.named_buffers()
    }
    # init_states recomputes the buffers and keeps them sharded and non-persistent.
    with torch.no_grad():
        model.scale.to_local().zero_()
    model.init_states()
    out["buffer_after_init"] = {
        n: (type(b).__name__, tuple(b.placements), (b.full_tensor() - getattr(ref, n)).abs().max())
        for n, b in model.named_buffers()
    }
    out["buffer_state_dict_after_init"] = sorted(model.state_dict())

    model, ref = build_with_twin(tied_lm_config(10, 8))
    parallelize_on(model, mesh, fast)
    tokens = torch.randint(0, 10, (3, 5), generator=torch.Generator().manual_seed(0))
    out["tied"] = compare(model, ref, [tokens])
    out["tied_placements"] = placements_of(model)
    out["tied_is_tied"] = model.emb.weight is model.out.weight
    out["tied_num_params"] = len(list(model.parameters()))
    return out


def _argument_runs(fast: bool) -> dict[str, Any]:
    mesh = mesh_1d(2)
    rank = c10d.get_rank()
    out: dict[str, Any] = {}
    torch.manual_seed(4)
    x = torch.randn(3, 8)
    mask = (torch.arange(6) % 3 != 0).float()

    model, ref = build_with_twin(gated_config(8, 6))
    parallelize_on(model, mesh, fast)
    out["kw_mask"] = compare(model, ref, [x], kwargs={"scale": 2.0, "mask": mask})
    out["kw_no_mask"] = compare(model, ref, [x], kwargs={"scale": 0.5, "mask": None})
    out["kw_all_keyword"] = compare(model, ref, [], kwargs={"x": x, "scale": 1.5})
    out["kw_placements"] = placements_of(model)

    model, ref = build_with_twin(two_outputs_config(8, 6))
    parallelize_on(model, mesh, fast)
    out["tuple"] = compare(model, ref, [x])
    out["tuple_placements"] = placements_of(model)

    model, ref = build_with_twin(attention_core_config(num_heads=4))
    parallelize_on(model, mesh, fast)
    q, k, v = torch.randn(3, 2, 4, 5, 8).unbind(0)  # (batch, heads, sequence, head_dim)
    # q and k arrive whole (in_src Replicate); v has no in_src, so each rank passes its
    # own heads and the boundary wraps them with in_dst.
    out["local_map"] = compare(
        model,
        ref,
        [q, k, v.chunk(2, 1)[rank]],
        [q, k, v],
        kwargs={"is_causal": True},
        local_grad=lambda i, g: g if i < 2 else g.chunk(2, 1)[rank],
    )
    out["local_map_placements"] = placements_of(model)
    return out


def _local_map_attention(fast: bool, config: Any, seed: int) -> dict[str, Any]:
    """A local_map attention on tp=2 (heads split) against its single-device twin."""
    mesh = mesh_1d(2)
    rank = c10d.get_rank()
    model, ref = build_with_twin(config)
    parallelize_on(model, mesh, fast)
    q, k, v = torch.randn(3, 2, 4, 5, 8, generator=torch.Generator().manual_seed(seed)).unbind(0)

    def mine(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(2, 1)[rank]

    result = compare(
        model, ref, [mine(q), mine(k), mine(v)], [q, k, v], local_grad=lambda i, g: mine(g)
    )
    result["placements"] = placements_of(model)
    return result


def _replicated_state_in_local_map(fast: bool) -> dict[str, Any]:
    return _local_map_attention(fast, tempered_attention_config(num_heads=4), seed=6)


def _child_states_in_local_map(fast: bool) -> dict[str, Any]:
    return _local_map_attention(fast, projected_attention_config(num_heads=4, head_dim=8), seed=8)


def _uneven_runs(fast: bool) -> dict[str, Any]:
    mesh = mesh_1d(2)
    out: dict[str, Any] = {}
    torch.manual_seed(5)
    x = torch.randn(3, 8)
    model, ref = build_with_twin(mlp_config(8, 5))
    parallelize_on(model, mesh, fast)
    out["mlp"] = compare(model, ref, [x])
    out["mlp_local_shapes"] = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}

    model, ref = build_with_twin(sharded_buffer_config(8, 5))
    parallelize_on(model, mesh, fast)
    out["buffer"] = compare(model, ref, [x])

    model, ref = build_with_twin(tied_lm_config(11, 8))
    parallelize_on(model, mesh, fast)
    tokens = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(0))
    out["tied"] = compare(model, ref, [tokens])
    return out


def _meta_init_runs(fast: bool) -> dict[str, Any]:
    mesh = mesh_1d(2)
    out: dict[str, Any] = {}
    configs = {
        "mlp": mlp_config(8, 12),
        "mlp_uneven": mlp_config(8, 5),
        "buffer": sharded_buffer_config(8, 6),
        "tied": tied_lm_config(10, 8),
        "dotted": gated_config(8, 6),
        "attention": attention_core_config(num_heads=4),
        "local_map_child": projected_attention_config(num_heads=4, head_dim=8),
        "sequence_parallel": sequence_parallel_config(8, norm="layer"),
    }
    for name, config in configs.items():
        with torch.device("meta"):
            model = config.build()
        parallelize_on(model, mesh, fast)
        model.to_empty(device="cpu")
        local_shapes = {n: p.to_local().shape for n, p in model.named_parameters()}
        torch.manual_seed(7)
        model.init_states()
        states = {
            **dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False)),
        }
        ref = config.build()
        torch.manual_seed(7)
        ref.init_states()
        ref_states = {
            **dict(ref.named_parameters(remove_duplicate=False)),
            **dict(ref.named_buffers(remove_duplicate=False)),
        }
        mismatched = []
        for state_name, value in states.items():
            assert isinstance(value, DTensor), f"{name}.{state_name} is not a DTensor"
            # This rank's shard of the single-device value: no communication.
            expected = distribute_tensor(
                ref_states[state_name], mesh, value.placements, src_data_rank=None
            ).to_local()
            local = value.to_local()
            if local.shape != expected.shape or not torch.equal(local, expected):
                mismatched.append(state_name)
        out[name] = {
            "mismatched": mismatched,
            "states": sorted(states),
            "ref_states": sorted(ref_states),
            "tied": getattr(model, "emb", None) is not None
            and model.emb.weight is model.out.weight,
            # to_empty allocated only this rank's shards, before any initialization.
            "to_empty_shapes_are_shards": all(
                local_shapes[n] == states[n].to_local().shape for n in local_shapes
            ),
        }
    return out


# --------------------------------------------------------------------------- tests


def _results(dist: Any, case: Callable[[bool], dict[str, Any]]) -> list[tuple[str, Any]]:
    """``(path, result)`` for every rank and both boundary paths, from one round trip.

    Every comparison in a result is checked to have run on the path it claims: all
    DTensor when the fast path is off, and each module on the path it installed.
    """
    out = [(path, res[path]) for res in dist.run(on_both_paths, case) for path in PATHS]
    for path, res in out:
        for value in res.values() if isinstance(res, dict) else ():
            if isinstance(value, dict) and "paths" in value:
                assert_paths(value, path, expect_fast=False)
        if isinstance(res, dict) and "paths" in res:
            assert_paths(res, path, expect_fast=False)
    return out


def _fast_kinds(result: dict[str, Any]) -> dict[str, str]:
    return {module: kind for module, (kind, _) in result["paths"].items()}


def test_colwise_rowwise_mlp(dist):
    """Col→row MLP: one all-reduce forward, one backward only when the input needs a grad.

    Also through ``parallelize_module`` on a plain ``nn.Module`` stack (two blocks,
    so two all-reduces each way), a second call on the same parallelized model, and
    blocks whose input feeds three column-parallel projections: their ``Partial``
    input gradients add up and are reduced once per block, not once per projection.
    """
    for path, res in _results(dist, _mlp_runs):
        for key in ("module", "module_again", "no_input_grad", "plan", "fan_out"):
            assert_numerics(res[key], path)
        assert res["module"]["fwd"] == {"all_reduce": 1}
        assert res["module"]["bwd"] == {"all_reduce": 1}
        assert res["module_again"]["fwd"] == {"all_reduce": 1}
        assert res["no_input_grad"]["fwd"] == {"all_reduce": 1}
        assert res["no_input_grad"]["bwd"] == {}
        assert res["plan"]["fwd"] == {"all_reduce": 2}
        assert res["plan"]["bwd"] == {"all_reduce": 2}
        # Three projections read each block's input: still one reduction per block.
        assert res["fan_out"]["fwd"] == {"all_reduce": 2}, path
        assert res["fan_out"]["bwd"] == {"all_reduce": 2}, path
        expected = {"up.weight": S0, "up.bias": S0, "down.weight": S1, "down.bias": R}
        assert res["placements"] == expected
        assert res["plan_placements"] == {
            f"layers.{i}.{n}": p for i in range(2) for n, p in expected.items()
        }
        assert res["module"]["out_placements"] == [R]
        assert res["module"]["grad_placements"] == expected
        if path == "fast":
            assert _fast_kinds(res["module"]) == {"up": "colwise", "down": "rowwise"}
            assert set(_fast_kinds(res["plan"]).values()) == {"colwise", "rowwise"}
            assert set(_fast_kinds(res["fan_out"]).values()) == {"dtensor", "colwise", "rowwise"}


def test_sequence_parallel_norm(dist):
    """RMSNorm and LayerNorm on sequence shards: no collective inside the norm.

    The following column-parallel projection gathers the sequence (all-gather forward,
    reduce-scatter backward) and keeps the shard for its weight gradient, gathered
    again in backward (Megatron-LM's sequence parallelism). The norm's replicated
    weight gets a ``Partial`` gradient: DTensor defers that sum, ``full_tensor()``
    performs it.
    """
    for path, res in _results(dist, _sequence_parallel_runs):
        for norm in ("rms", "layer"):
            result = res[norm]
            assert_numerics(result, path)
            assert result["fwd"] == {"all_gather_into_tensor": 1}
            assert result["bwd"] == {"reduce_scatter_tensor": 1, "all_gather_into_tensor": 1}
            assert result["out_placements"] == [(Shard(2),)]
            assert result["grad_placements"]["norm.weight"] == (Partial(),)
            if path == "fast":
                kinds = {"norm": "sequence_parallel_norm", "proj": "colwise"}
                assert _fast_kinds(result) == kinds, norm
        assert res["rms_placements"] == {"norm.weight": R, "proj.weight": S0, "proj.bias": S0}
        assert res["layer_placements"] == {
            "norm.weight": R,
            "norm.bias": R,
            "proj.weight": S0,
            "proj.bias": S0,
        }


def test_sharded_buffer_and_tied_embedding(dist):
    """Sharded buffers keep persistence; a tied embedding/output weight stays one tensor.

    The vocab-parallel embedding's masked-partial output is all-reduced forward; the
    output projection's logits are all-gathered; the tied weight's gradient (both
    uses summed) is left sharded with no collective, since the tokens need no grad.
    """
    for path, res in _results(dist, _state_runs):
        assert_numerics(res["buffer"], path)
        assert res["buffer"]["fwd"] == {"all_gather_into_tensor": 1}
        assert res["buffer"]["bwd"] == {"all_reduce": 1}
        assert res["buffer_placements"] == {"weight": S0, "scale": S0, "shift": S0}
        assert res["buffer_state_dict"] == {"weight": "DTensor", "scale": "DTensor"}
        assert res["buffer_values"] == {"scale": 0.0, "shift": 0.0}
        for name in ("scale", "shift"):
            kind, placements, diff = res["buffer_after_init"][name]
            assert (kind, placements, float(diff)) == ("DTensor", S0, 0.0), name
        assert res["buffer_state_dict_after_init"] == ["scale", "weight"]

        assert_numerics(res["tied"], path)
        assert res["tied_is_tied"]
        assert res["tied_num_params"] == 1
        assert res["tied_placements"] == {"emb.weight": S0, "out.weight": S0}
        assert res["tied"]["fwd"] == {"all_reduce": 1, "all_gather_into_tensor": 1}
        assert res["tied"]["bwd"] == {"all_reduce": 1}
        assert res["tied"]["grad_placements"] == {"emb.weight": S0}


def test_keyword_tuple_and_local_map(dist):
    """Keyword-only and non-tensor arguments, per-element tuple outputs, a local_map region.

    - ``forward(x, *, scale: float, mask=None)``: ``scale`` passes untouched, ``mask``
      is split to the output's layout with no collective, ``mask=None`` passes, and
      ``x`` may be given by keyword.
    - A module returning two plain local tensors, declared ``Shard(-1)`` and
      ``Partial()``: one all-gather and one all-reduce to the replicated ``out_dst``.
    - Attention core under ``local_map`` on head shards: q/k split from replicated
      inputs with no collective, the output gathered once; ``in_grad_placements``
      keeps their gradients head-sharded, so only q's and k's way back to replicated
      costs an all-gather each, and v (passed as this rank's heads) none.
    """
    for path, res in _results(dist, _argument_runs):
        for key in ("kw_mask", "kw_no_mask", "kw_all_keyword", "tuple", "local_map"):
            assert_numerics(res[key], path)
        for key in ("kw_mask", "kw_no_mask", "kw_all_keyword"):
            assert res[key]["fwd"] == {"all_gather_into_tensor": 1}, key
            assert res[key]["out_placements"] == [R]
        assert res["kw_mask"]["bwd"] == {"all_reduce": 1}
        assert res["kw_all_keyword"]["bwd"] == {}  # x given by keyword: not a grad leaf here
        assert res["kw_placements"] == {"proj.weight": S0, "proj.bias": S0}

        assert res["tuple"]["fwd"] == {"all_gather_into_tensor": 1, "all_reduce": 1}
        assert res["tuple"]["bwd"] == {"all_reduce": 1}
        assert res["tuple"]["out_placements"] == [R, R]
        assert res["tuple_placements"] == {"proj.weight": S0, "proj.bias": S0}

        assert res["local_map"]["fwd"] == {"all_gather_into_tensor": 1}
        assert res["local_map"]["bwd"] == {"all_gather_into_tensor": 2}
        assert res["local_map"]["out_placements"] == [R]
        assert res["local_map_placements"] == {"head_scale": S0}
        assert res["local_map"]["grad_placements"] == {"head_scale": S0}


@pytest.mark.parametrize("path", ["dtensor", "fast"])
def test_local_map_replicated_state_gradient_is_summed(dist, path):
    """A state the config does not name is replicated; inside a local_map region whose
    output is split across ranks, its gradient is each rank's partial sum (``Partial``).
    """
    for res in dist.run(_replicated_state_in_local_map, path == "fast"):
        assert_numerics(res)
        assert res["fwd"] == {} and res["bwd"] == {}  # all inputs local: no collective
        assert res["placements"] == {"head_scale": S0, "temperature": R}
        assert res["grad_placements"] == {"head_scale": S0, "temperature": (Partial(),)}


@pytest.mark.parametrize("path", ["dtensor", "fast"])
def test_local_map_child_state_gradients_are_summed(dist, path):
    """A plain child's states inside a local_map region are replicated like the module's
    own: their gradients are summed over the ranks that split the output. (They were
    left plain tensors, each rank keeping the gradient of its own heads: post.weight's
    gradient missed the other rank's heads: off by 12.7 for post.weight, 6.4 for post.bias.)
    """
    for res in dist.run(_child_states_in_local_map, path == "fast"):
        assert_numerics(res)
        assert res["fwd"] == {} and res["bwd"] == {}  # all inputs local: no collective
        assert res["placements"] == {"head_scale": S0, "post.weight": R, "post.bias": R}
        assert res["grad_placements"] == {
            "head_scale": S0,
            "post.weight": (Partial(),),
            "post.bias": (Partial(),),
        }


def test_dimension_not_divisible_by_axis(dist):
    """Sizes not divisible by the axis size give correct results, via uneven DTensor shards.

    States are split by ``distribute_tensor`` (``torch.chunk`` sizes: 5 → 3 + 2), and
    every activation derived from them is a DTensor that knows its global shape, so
    a hidden size of 5, a vocabulary of 11 or a buffer of 5 on two ranks match the
    single-device model exactly. (The validator warns about uneven shards; it is not
    an error.) What the boundary cannot size is a *plain* tensor wrapped with a
    ``Shard`` ``in_src``: ``DTensor.from_local`` assumes equal local pieces, so such
    inputs must divide evenly.
    """
    results = list(_results(dist, _uneven_runs))
    for path, res in results:
        for key in ("mlp", "buffer", "tied"):
            assert_numerics(res[key], path)
        assert res["mlp"]["fwd"] == {"all_reduce": 1}, path
        assert res["mlp"]["bwd"] == {"all_reduce": 1}, path
    for path in PATHS:
        shapes = [res["mlp_local_shapes"] for p, res in results if p == path]
        assert [s["up.weight"] for s in shapes] == [(3, 8), (2, 8)]
        assert [s["down.weight"] for s in shapes] == [(8, 3), (8, 2)]


def test_meta_build_parallelize_to_empty_init_states(dist):
    """Meta build → parallelize → to_empty → init_states equals a single-device init.

    Each rank holds only its shards (compared with the matching piece of the
    single-device values, no communication), ties survive ``to_empty``.
    """
    for path, res in _results(dist, _meta_init_runs):
        for name, result in res.items():
            assert result["mismatched"] == [], (path, name)
            assert result["states"] == result["ref_states"], (path, name)
            assert result["to_empty_shapes_are_shards"], (path, name)
        assert res["tied"]["tied"]


def _torch_styles_runs(fast: bool) -> dict[str, Any]:
    """A plan of torch's tensor-parallel styles is refused; the presets the refusal names
    run the model as torch's parallelize_module runs it (and as one device)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    from hyper_parallel.dmodule import ParallelizeError, presets

    mesh = mesh_1d(2)
    torch.manual_seed(5)
    ref = torch.nn.Sequential(
        torch.nn.Embedding(16, 8),
        torch.nn.LayerNorm(8),
        torch.nn.Linear(8, 12, bias=False),
        torch.nn.ReLU(),
        torch.nn.Linear(12, 8),
    )
    theirs, ours = copy.deepcopy(ref), copy.deepcopy(ref)
    torch_plan = {
        "0": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "1": SequenceParallel(),
        "2": ColwiseParallel(input_layouts=Shard(1)),
        "4": RowwiseParallel(output_layouts=Shard(1)),
    }
    with pytest.raises(ParallelizeError) as refused:
        parallelize_module(ours, mesh, torch_plan)
    fixes = {f.path: f.fix for f in refused.value.findings}
    named = {p: fixes[p].split("write ", 1)[1].split(" instead", 1)[0] for p in torch_plan}
    scope = {**vars(presets), "Shard": Shard, "Replicate": Replicate}
    plan = {p: eval(expr, scope) for p, expr in named.items()}
    torch_parallelize(theirs, mesh, torch_plan)
    with fast_path(fast):
        parallelize_module(ours, mesh, plan)
    ids = torch.randint(0, 16, (2, 6))
    rank = c10d.get_rank()
    outs, grads = {}, {}
    for name, model in (("ref", ref), ("torch", theirs), ("ours", ours)):
        out = model(ids)  # ref: the whole sequence; the others: this rank's half
        out.square().sum().backward()  # summed over the ranks: the whole sequence's
        outs[name] = (out.chunk(2, 1)[rank] if name == "ref" else out).detach()
        grads[name] = {
            n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
            for n, p in model.named_parameters()
        }
    return {"named": named, "outs": outs, "grads": grads}


@pytest.mark.parametrize("path", ["dtensor", "fast"])
def test_a_plan_of_torch_styles_names_presets_that_run_as_torch_does(dist, path):
    """torch's ColwiseParallel / RowwiseParallel / SequenceParallel in a plan: the refusal
    named only "a ShardingConfig (or a preset such as colwise())"; it names the preset
    call, and that call runs as torch's style does: outputs and every gradient."""
    for res in dist.run(_torch_styles_runs, path == "fast"):
        assert res["named"] == {
            "0": "vocab_parallel_embedding(output=Shard(1), use_local_output=True)",
            "1": "sequence_parallel_norm()",
            "2": "colwise(input=Shard(1), bias=False, use_local_output=True)",
            "4": "rowwise(output=Shard(1), use_local_output=True)",
        }
        outs, grads = res["outs"], res["grads"]
        for got, want in [(outs["ours"], outs["torch"]), (outs["ours"], outs["ref"])] + [
            (grads["ours"][n], grads[other][n]) for n in grads["ref"] for other in ("torch", "ref")
        ]:
            _close_to_fp32_rounding(got, want)
        assert set(grads["ours"]) == set(grads["ref"])


def _close_to_fp32_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but for the order of fp32 sums: each value is a sum of at most 16 terms (12
    features, 8 positions, 2 ranks), each rounding at most one eps of the tensor's scale."""
    bound = 16 * torch.finfo(torch.float32).eps * want.abs().max().item()
    assert (got - want).abs().max().item() <= bound, ((got - want).abs().max(), bound)
