"""Expert parallelism at ep=2 on real gloo ranks, against one device.

Outputs, loss, the router balance loss and every gradient at 1e-5; the collectives of
each MoE layer (forward: count exchange, dispatch and combine all-to-alls; backward:
the two transposes; nothing else); routings where experts and whole ranks receive no
tokens; the Hugging Face plan files.
"""

from __future__ import annotations

import pytest
import torch

from tests._compare import BF16_GRAD_RTOL, FP32_RTOL, check, merge_ranks
from tests.distributed import moe_checks

pytestmark = pytest.mark.distributed
WORLD_SIZE = 2
TOL = 1e-5


def _assert_close(result: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        assert result[key] < TOL, (key, result[key])
    check(result["grads"], atol=TOL, rtol=FP32_RTOL)


def test_debug_moe_at_ep2_equals_one_device(dist) -> None:
    results = dist.run(moe_checks.model_parity, "dp_shard=2,ep=2")
    for r in results:
        _assert_close(r, ("logits", "loss", "aux"))
        layers = r["num_layers"]
        # Per MoE layer: counts + dispatch + combine forward, their two transposes backward.
        assert r["forward_comms"] == {"all_to_all_single": 3 * layers}
        assert r["backward_comms"] == {"all_to_all_single": 2 * layers}
        expert_params = {n for n in r["placements"]}
        assert expert_params == {
            f"layers.{i}.moe.experts.{w}" for i in range(layers) for w in ("w1", "w2", "w3")
        }
        assert set(r["placements"].values()) == {(("ep",), "[Shard(dim=0)]")}


def test_loop_experts_at_ep2_equal_one_device(dist) -> None:
    results = dist.run(moe_checks.model_parity, "dp_shard=2,ep=2", {"use_grouped_mm": False})
    for r in results:
        _assert_close(r, ("logits", "loss", "aux"))


# rank 0 holds experts 0-3, rank 1 experts 4-7.
_SKEWED = [
    [[0, 1], [1, 2], [2, 0], [0, 3]],  # rank 0 sends nothing to rank 1
    [[4, 0], [5, 1], [0, 4], [1, 5], [4, 5]],  # experts 6, 7 and 2, 3 get nothing from rank 1
]
_ALL_TO_RANK0 = [[[0, 1], [2, 3], [1, 2]], [[3, 0], [0, 2]]]  # rank 1 receives zero tokens


@pytest.mark.parametrize("routes", [_SKEWED, _ALL_TO_RANK0], ids=["skewed", "one_rank_idle"])
def test_experts_with_zero_tokens_for_some_experts_and_ranks(dist, routes) -> None:
    results = dist.run(moe_checks.experts_parity, "dp_shard=2,ep=2", routes)
    # A rank that receives no tokens has zero expert gradients (so has the reference):
    # the ranks' gradients are judged together (zero must then be exactly zero).
    check(merge_ranks([r["grads"] for r in results]), atol=TOL, rtol=FP32_RTOL)
    for r in results:
        for key in ("out", "x_grad"):
            assert r[key] < TOL, (key, r[key])
        assert r["forward_comms"] == {"all_to_all_single": 3}
        assert r["backward_comms"] == {"all_to_all_single": 2}
        assert r["paths_equal"], "grouped_forward and the module's forward differ"


def test_experts_module_called_by_its_own_keyword_names_equals_one_device(dist) -> None:
    # The dispatch took (x, top_k_index, top_k_weights) by those names only: a block
    # calling experts(h, router_indices=..., routing_weights=...) met a raw TypeError.
    for r in dist.run(moe_checks.experts_called_by_keyword, "dp_shard=2,ep=2"):
        check({"out": r["out"], **r["grads"]}, atol=TOL, rtol=FP32_RTOL)
        swapped, extra = r["refused"]["swapped"], r["refused"]["extra"]
        # Indices and weights swapped: index_add_'s dtype error, naming nothing.
        assert swapped.startswith("ValueError: experts: the routed-experts dispatch takes"), swapped
        assert "router_indices (6, 2) torch.float32" in swapped, swapped
        # As Python refuses it for the module's own forward, with the module's path.
        assert extra.startswith("TypeError: experts: got an unexpected keyword argument 'scale'")


def test_rank_whose_experts_get_no_tokens_and_return_no_graph_still_runs_backward(dist) -> None:
    # An experts forward that returns a fresh zeros_like without tokens (Hugging Face's
    # eager experts) left rank 1 off the graph: its x.grad was None, and it skipped the
    # two backward all-to-alls rank 0 waits in (a hang).
    results = dist.run(moe_checks.idle_rank_with_skipping_experts, "dp_shard=2,ep=2")
    check(merge_ranks([r["grads"] for r in results]), atol=TOL, rtol=FP32_RTOL)
    for r in results:
        check({k: r[k] for k in ("out", "x_grad", "weights_grad")}, atol=TOL, rtol=FP32_RTOL)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_hugging_face_moe_from_plan_file_equals_one_device(dist, family) -> None:
    pytest.importorskip("transformers", reason="transformers is in the test extra")
    plan = moe_checks.PLANS / f"hf_{family}_ep.yaml"
    results = dist.run(moe_checks.hf_plan_parity, family, str(plan))
    for r in results:
        _assert_close(r, ("logits", "loss"))
        layers = r["num_layers"]
        assert r["forward_comms"] == {"all_to_all_single": 3 * layers}
        assert set(r["placements"]) == {
            f"model.layers.{i}.mlp.experts.{w}"
            for i in range(layers)
            for w in ("gate_up_proj", "down_proj")
        }
        assert set(r["placements"].values()) == {"[Shard(dim=0)]"}


def test_trainer_build_at_dp_shard2_ep2_equals_one_device(dist) -> None:
    for diffs in dist.run(moe_checks.trainer_parity, "dp_shard=2,ep=2"):
        check(diffs, atol=TOL, rtol=FP32_RTOL)


def test_trainer_build_in_bf16_casts_the_experts_too(dist) -> None:
    # FSDP2's bf16 policy on the experts' own unit: their weights meet bf16 tokens.
    for r in dist.run(moe_checks.trainer_bf16_loss, "dp_shard=2,ep=2"):
        assert r["expert_dtype"] == torch.bfloat16
        assert r["loss_diff"] < 2e-2, r["loss_diff"]  # the demo's bf16 tolerance
        # Every gradient against the fp32 one-device one: a 2x or zero gradient fails.
        check(r["grads"], rtol=BF16_GRAD_RTOL, expect_count=len(r["grads"]))


def _assert_tp_layout(r: dict, ep: bool) -> None:
    layers = r["num_layers"]
    for i in range(layers):
        for w in ("w1", "w2", "w3"):
            # Dispatched over ep, else replicated on tp (each rank runs its own tokens).
            expected = (("ep",), "[Shard(dim=0)]") if ep else (("tp",), "[Replicate()]")
            assert r["placements"][f"layers.{i}.moe.experts.{w}"] == expected
        assert r["placements"][f"layers.{i}.moe.router.weight"] == (("tp",), "[Replicate()]")
        assert r["placements"][f"layers.{i}.attention.wq.weight"] == (("tp",), "[Shard(dim=0)]")
    a2a = ({"all_to_all_single": 3 * layers}, {"all_to_all_single": 2 * layers}) if ep else ({}, {})
    forward = {k: v for k, v in r["forward_comms"].items() if k == "all_to_all_single"}
    backward = {k: v for k, v in r["backward_comms"].items() if k == "all_to_all_single"}
    assert (forward, backward) == a2a


@pytest.mark.parametrize(
    ("mesh", "sequence_parallel", "overrides"),
    [
        ("tp=2,ep=2", False, None),
        ("tp=2,ep=2", True, None),
        ("tp=2", False, {"num_kv_heads": 1}),  # experts replicated; keys/values repeated
    ],
    ids=["tp2_ep2", "tp2_ep2_sp", "tp2_one_kv_head"],
)
def test_tensor_parallel_moe_with_ep_borrowing_tp_equals_one_device(
    dist, mesh, sequence_parallel, overrides
) -> None:
    results = dist.run(moe_checks.tp_model_parity, mesh, sequence_parallel, overrides)
    for r in results:
        _assert_close(r, ("logits", "loss", "aux"))
        _assert_tp_layout(r, ep="ep" in mesh)


@pytest.mark.parametrize("mesh", ["cp=2", "cp=2,ep=2"], ids=["cp2", "cp2_ep2_borrowing_cp"])
def test_context_parallel_moe_with_ep_borrowing_cp_equals_one_device(dist, mesh) -> None:
    results = dist.run(moe_checks.cp_model_parity, mesh)
    for r in results:
        _assert_close(r, ("logits", "loss", "aux"))
        layers = r["num_layers"]
        for i in range(layers):
            expected = (("ep",), "[Shard(dim=0)]") if "ep" in mesh else (("cp",), "[Replicate()]")
            for w in ("w1", "w2", "w3"):
                assert r["placements"][f"layers.{i}.moe.experts.{w}"] == expected
            assert r["placements"][f"layers.{i}.moe.router.weight"] == (("cp",), "[Replicate()]")
        a2a = r["forward_comms"].get("all_to_all_single", 0)
        assert a2a == (3 * layers if "ep" in mesh else 0)


def test_trainer_build_at_cp2_ep2_equals_one_device(dist) -> None:
    # FSDP2 over dp_shard x cp averages the dense gradients; experts rescaled by ep / tp.
    for diffs in dist.run(moe_checks.trainer_cp_parity, "cp=2,ep=2"):
        check(diffs, atol=TOL, rtol=FP32_RTOL)
