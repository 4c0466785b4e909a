"""``parallelize`` on four gloo ranks: tp=4, and a 2-D mesh dp=2 x tp=2.

Same three checks as the two-rank tests: numerics against a single-device deepcopy
(forward, every parameter gradient, input gradients), collective counts per
direction, and placements.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hyper_parallel.core.dtensor.device_mesh import init_device_mesh
from hyper_parallel.core.dtensor.dtensor import DTensor, distribute_tensor
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate, Shard
from tests.distributed.models import (
    PATHS,
    assert_numerics,
    attention_core_config,
    build_with_twin,
    compare,
    mesh_1d,
    mlp_config,
    on_both_paths,
    parallelize_on,
    placements_of,
    tied_lm_config,
)

pytestmark = pytest.mark.distributed
WORLD_SIZE = 4

R, S0, S1 = (Replicate(),), (Shard(0),), (Shard(1),)


def _tp4_runs(fast: bool) -> dict[str, Any]:
    mesh = mesh_1d(4)
    rank = mesh.get_local_rank("tp")
    out: dict[str, Any] = {}
    torch.manual_seed(1)
    x = torch.randn(4, 8)
    # 16 splits 4+4+4+4; 10 splits 3+3+3+1; 6 splits 2+2+2+0 (the last rank holds nothing).
    for hidden in (16, 10, 6):
        model, ref = build_with_twin(mlp_config(8, hidden))
        parallelize_on(model, mesh, fast)
        out[f"mlp{hidden}"] = compare(model, ref, [x])
        out[f"mlp{hidden}_placements"] = placements_of(model)
        out[f"mlp{hidden}_rows"] = model.up.weight.to_local().shape[0]

    model, ref = build_with_twin(tied_lm_config(10, 8))
    parallelize_on(model, mesh, fast)
    tokens = torch.randint(0, 10, (3, 5), generator=torch.Generator().manual_seed(0))
    out["tied"] = compare(model, ref, [tokens])
    out["tied_is_tied"] = model.emb.weight is model.out.weight

    model, ref = build_with_twin(attention_core_config(num_heads=4))
    parallelize_on(model, mesh, fast)
    q, k, v = torch.randn(3, 2, 4, 5, 8).unbind(0)
    out["local_map"] = compare(
        model,
        ref,
        [q, k, v.chunk(4, 1)[rank]],
        [q, k, v],
        kwargs={"is_causal": False},
        local_grad=lambda i, g: g if i < 2 else g.chunk(4, 1)[rank],
    )
    return out


def _dp_tp_runs(fast: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    out: dict[str, Any] = {}
    torch.manual_seed(2)
    x = torch.randn(4, 8)
    model, ref = build_with_twin(mlp_config(8, 16, dp=True))
    parallelize_on(model, mesh, fast)
    out["mlp"] = compare(
        model,
        ref,
        [x.chunk(2, 0)[dp_rank]],  # each dp group holds its half of the batch
        [x],
        local_grad=lambda i, g: g.chunk(2, 0)[dp_rank],
    )
    out["mlp_placements"] = placements_of(model)

    # Meta build → parallelize → to_empty → init_states on the 2-D mesh.
    config = mlp_config(8, 12, dp=True)
    with torch.device("meta"):
        model = config.build()
    parallelize_on(model, mesh, fast)
    model.to_empty(device="cpu")
    torch.manual_seed(9)
    model.init_states()
    ref = config.build()
    torch.manual_seed(9)
    ref.init_states()
    ref_params = dict(ref.named_parameters())
    mismatched = []
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor)
        expected = distribute_tensor(ref_params[name], mesh, p.placements, src_data_rank=None)
        if not torch.equal(p.to_local(), expected.to_local()):
            mismatched.append(name)
    out["meta_mismatched"] = mismatched
    return out


def _results(dist: Any, case: Callable[[bool], dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(path, res[path]) for res in dist.run(on_both_paths, case) for path in PATHS]


def test_tp4_mlp_even_and_uneven_tied_and_local_map(dist):
    """tp=4: col→row MLP (hidden 16, 10 and 6), tied vocab-parallel LM, attention local_map.

    A hidden size that does not divide by 4 still matches the single-device model:
    ``distribute_tensor`` splits like ``torch.chunk`` (10 → 3+3+3+1, 6 → 2+2+2+0, a
    rank with an empty shard included), and DTensor tracks the uneven pieces.
    """
    rows: dict[str, list[int]] = {path: [] for path in PATHS}
    for path, res in _results(dist, _tp4_runs):
        for hidden in (16, 10, 6):
            result = res[f"mlp{hidden}"]
            assert_numerics(result, path)
            assert result["fwd"] == {"all_reduce": 1}, (path, hidden)
            assert result["bwd"] == {"all_reduce": 1}, (path, hidden)
            assert result["out_placements"] == [R]
            assert res[f"mlp{hidden}_placements"] == {
                "up.weight": S0,
                "up.bias": S0,
                "down.weight": S1,
                "down.bias": R,
            }
        rows[path].append([res[f"mlp{h}_rows"] for h in (16, 10, 6)])
        assert_numerics(res["tied"], path)
        assert res["tied_is_tied"]
        assert res["tied"]["fwd"] == {"all_reduce": 1, "all_gather_into_tensor": 1}
        assert_numerics(res["local_map"], path)
        assert res["local_map"]["fwd"] == {"all_gather_into_tensor": 1}
        assert res["local_map"]["bwd"] == {"all_gather_into_tensor": 2}
    for path in PATHS:
        assert rows[path] == [[4, 3, 2], [4, 3, 2], [4, 3, 2], [4, 1, 0]]


def test_dp_tp_mesh_mlp(dist):
    """dp=2 x tp=2: batch on dp, col→row on tp; placements on both axes.

    One all-reduce (over tp) each way. Parameters are ``Replicate`` on dp; their
    gradients come out ``Partial`` on dp — DTensor leaves the data-parallel sum to
    whoever reduces gradients (FSDP, an optimizer step, ``full_tensor()``).
    """
    for path, res in _results(dist, _dp_tp_runs):
        result = res["mlp"]
        assert_numerics(result, path)
        assert result["fwd"] == {"all_reduce": 1}, path
        assert result["bwd"] == {"all_reduce": 1}, path
        assert result["out_placements"] == [(Shard(0), Replicate())]
        assert res["mlp_placements"] == {
            "up.weight": (Replicate(), Shard(0)),
            "up.bias": (Replicate(), Shard(0)),
            "down.weight": (Replicate(), Shard(1)),
            "down.bias": (Replicate(), Replicate()),
        }
        assert result["grad_placements"] == {
            "up.weight": (Partial(), Shard(0)),
            "up.bias": (Partial(), Shard(0)),
            "down.weight": (Partial(), Shard(1)),
            "down.bias": (Partial(), Replicate()),
        }
        assert res["meta_mismatched"] == [], path
