"""``check_equivalence`` on two gloo ranks: correct plans pass, lying plans are caught.

Each worker returns ``report.to_dict()`` and ``str(report)`` from every rank; the
tests assert the verdict, the worst parameter, and that all ranks agree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as c10d
import torch.nn.functional as F
from torch import nn

from hyper_parallel.analysis import find_first_drift
from hyper_parallel.analysis.equivalence import check_equivalence
from hyper_parallel.core.dtensor.device_mesh import init_device_mesh
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate, Shard
from hyper_parallel.dmodule import (
    LocalMapConfig,
    Module,
    Sequential,
    ShardingConfig,
    parallelize_module,
)
from hyper_parallel.dmodule.presets import colwise, rowwise

pytestmark = pytest.mark.distributed
WORLD_SIZE = 2
PLANS = Path(__file__).resolve().parents[2] / "examples" / "plans"
DIM, HIDDEN = 16, 32


def _mesh():
    return init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("tp",))


class _MLP(nn.Module):
    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN, bias=bias)
        self.down = nn.Linear(HIDDEN, DIM, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class _TwoOutputs(_MLP):
    """``(down(gelu(h)), h)`` with ``h = up(x)``: a replicated and a sharded output."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        h = self.up(x)
        return self.down(F.gelu(h)), h


def _result(report: Any) -> dict:
    return {"report": report.to_dict(), "text": str(report)}


def _same_on_every_rank(results: list[dict]) -> dict:
    r0 = results[0]
    for r in results[1:]:
        assert r == r0, "every rank returns the same report"
    json.dumps(r0["report"], allow_nan=False)  # strict JSON, also for failing reports
    return r0


def _rows(report: dict) -> dict[str, dict]:
    return {r["name"]: r for r in report["rows"]}


def _outputs(report: dict) -> dict[str, dict]:
    return {r["name"]: r for r in report["outputs"]}


# --------------------------------------------------------------------------- correct plans


def _col_row_mlp() -> Any:
    # Each rank initializes and draws its input with its own seed: the check
    # broadcasts rank 0's values so both models see one model and one input.
    torch.manual_seed(c10d.get_rank())
    model = _MLP()
    x = torch.randn(4, DIM)
    plan = {"up": colwise(), "down": rowwise()}
    return _result(check_equivalence(model, lambda m: parallelize_module(m, _mesh(), plan), (x,)))


def test_col_row_mlp_passes_with_tiny_diffs(dist):
    r0 = _same_on_every_rank(dist.run(_col_row_mlp))
    report = r0["report"]
    assert report["passed"], r0["text"]
    assert report["max_abs_output_diff"] < 1e-5 and report["max_abs_grad_diff"] < 1e-5, r0["text"]
    rows = _rows(report)
    assert list(rows) == ["up.weight", "up.bias", "down.weight", "down.bias"]
    assert rows["up.weight"]["placements"] == "tp=Shard(0)"
    assert rows["down.weight"]["placements"] == "tp=Shard(1)"
    assert rows["down.bias"]["placements"] == "tp=Replicate()"
    assert rows["up.weight"]["shape"] == [HIDDEN, DIM]
    # rowwise() hands on a replicated DTensor: gathered with full_tensor and compared.
    outputs = _outputs(report)
    assert list(outputs) == ["loss", "output"]
    assert outputs["output"]["placements"] == "tp=Replicate()"
    assert set(report["synced"]) >= {"param:up.weight", "inputs[0]"}
    assert report["worst_param"] in rows
    assert "PASSED" in r0["text"] and "gradients, worst first (4 of 4)" in r0["text"]


def _tuple_outputs() -> Any:
    torch.manual_seed(0)
    model = _TwoOutputs()
    x = torch.randn(2, 3, DIM)
    plan = {"up": colwise(), "down": rowwise()}
    return _result(
        check_equivalence(
            model,
            lambda m: parallelize_module(m, _mesh(), plan),
            (x,),
            loss_fn=lambda out: out[0].pow(2).mean() + out[1].sum(),
        )
    )


def test_tuple_of_dtensor_outputs_gathered_and_compared(dist):
    r0 = _same_on_every_rank(dist.run(_tuple_outputs))
    report = r0["report"]
    assert report["passed"], r0["text"]
    outputs = _outputs(report)
    assert list(outputs) == ["loss", "output[0]", "output[1]"]
    assert outputs["output[0]"]["placements"] == "tp=Replicate()"
    assert outputs["output[1]"]["placements"] == "tp=Shard(2)"  # colwise Shard(-1) on 3-D
    assert outputs["output[1]"]["shape"] == [2, 3, HIDDEN]  # the full, gathered shape


Linear = Module.from_nn_module(nn.Linear)


def _module_parallelize() -> Any:
    torch.manual_seed(0)
    up = ShardingConfig(
        state_shardings={"weight": {"tp": Shard(0)}, "bias": {"tp": Shard(0)}},
        in_dst_shardings={"input": {"tp": Replicate()}},
    )
    down = ShardingConfig(
        state_shardings={"weight": {"tp": Shard(1)}},
        in_dst_shardings={"input": {"tp": Shard(-1)}},
        out_dst_shardings={"tp": Replicate()},
    )
    model = Sequential(
        Linear.Config(in_features=DIM, out_features=HIDDEN, sharding_config=up).build(),
        nn.GELU(),
        Linear.Config(in_features=HIDDEN, out_features=DIM, sharding_config=down).build(),
    )
    report = check_equivalence(model, lambda m: m.parallelize(_mesh()), torch.randn(4, DIM))
    return _result(report)


def test_module_parallelize_in_place(dist):
    r0 = _same_on_every_rank(dist.run(_module_parallelize))
    assert r0["report"]["passed"], r0["text"]
    assert _rows(r0["report"])["0.weight"]["placements"] == "tp=Shard(0)"


def _hf_llama() -> Any:
    from hyper_parallel.hf import build_hf_model

    model = build_hf_model("llama")
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))

    def loss_fn(out: Any) -> torch.Tensor:
        logits = out.logits[:, :-1].reshape(-1, vocab).float()
        return F.cross_entropy(logits, ids[:, 1:].reshape(-1))

    plan = str(PLANS / "hf_llama_tp.yaml")
    report = check_equivalence(
        model,
        lambda m: parallelize_module(m, _mesh(), plan),
        {"input_ids": ids, "use_cache": False},
        loss_fn=loss_fn,
    )
    return _result(report)


def test_hf_llama_with_shipped_plan_passes(dist):
    pytest.importorskip("transformers", reason="transformers is in the test extra")
    r0 = _same_on_every_rank(dist.run(_hf_llama))
    report = r0["report"]
    assert report["passed"], r0["text"]
    assert list(_outputs(report)) == ["loss", "output.logits"]
    rows = _rows(report)
    assert rows["model.layers.0.self_attn.q_proj.weight"]["placements"] == "tp=Shard(0)"
    assert rows["model.layers.0.input_layernorm.weight"]["placements"] == "plain"
    assert report["synced"] == []  # same seed everywhere: nothing to overwrite


# --------------------------------------------------------------------------- lying plans


def _partial_leak() -> Any:
    torch.manual_seed(0)
    model = _MLP(bias=False)
    # Row-wise handing its Partial sums on as a plain local tensor (use_local_output), so
    # each rank returns only its half of the sum. Left implicit (no out_dst) the boundary
    # refuses it at the call; declared Partial() it is the user's word, and wrong.
    leaky_down = ShardingConfig(
        state_shardings={"weight": {"tp": Shard(1)}},
        in_dst_shardings={"input": {"tp": Shard(-1)}},
        out_dst_shardings={"tp": Partial()},
        use_local_output=True,
    )
    plan = {"up": colwise(bias=False), "down": leaky_down}
    x = torch.randn(4, DIM)
    # A loss that is not linear in the output, so the wrong sums reach the gradients too.
    report = check_equivalence(
        model,
        lambda m: parallelize_module(m, _mesh(), plan),
        x,
        loss_fn=lambda out: out.pow(2).sum(),
    )
    return _result(report)


def test_leaked_partial_is_caught(dist):
    r0 = _same_on_every_rank(dist.run(_partial_leak))
    report = r0["report"]
    assert not report["passed"]
    assert report["max_abs_output_diff"] > 1e-2, r0["text"]
    assert not _outputs(report)["output"]["passed"]
    assert report["max_abs_grad_diff"] > 1e-2, r0["text"]
    worst = _rows(report)[report["worst_param"]]
    assert not worst["passed"] and worst["max_abs_diff"] > 1e-2
    assert "FAILED" in r0["text"] and report["worst_param"] in r0["text"]


def _batch_declared_sharded() -> Any:
    torch.manual_seed(0)
    model = _MLP()
    # in_src claims each rank holds half the batch; every rank holds all of it, so the
    # all-gather to Replicate doubles the batch (and every gradient).
    lying_up = colwise(input=Shard(0))
    plan = {"up": lying_up, "down": rowwise()}
    x = torch.randn(4, DIM)
    return _result(check_equivalence(model, lambda m: parallelize_module(m, _mesh(), plan), (x,)))


def test_input_layout_lie_is_caught_with_shape_mismatch(dist):
    r0 = _same_on_every_rank(dist.run(_batch_declared_sharded))
    report = r0["report"]
    assert not report["passed"]
    out = _outputs(report)["output"]
    assert out["note"] == "shape differs from the reference" and out["max_abs_diff"] == "inf"
    assert out["shape"] == [4, DIM]  # the reference's shape
    rows = _rows(report)
    assert all(not r["passed"] for r in rows.values()), r0["text"]  # all gradients doubled
    assert report["worst_param"] in rows
    assert report["max_abs_grad_diff"] > 1e-2


# --------------------------------------------------------------------------- refusals


def _refusals() -> dict[str, str]:
    mesh = _mesh()
    errors: dict[str, str] = {}
    model = _MLP()
    parallelize_module(model, mesh, {"up": colwise(), "down": rowwise()})
    try:
        check_equivalence(model, lambda m: None, (torch.randn(2, DIM),))
    except ValueError as e:
        errors["parallelized"] = str(e)
    rows = 2 + c10d.get_rank()  # a different input shape per rank
    try:
        check_equivalence(_MLP(), lambda m: None, (torch.randn(rows, DIM),))
    except ValueError as e:
        errors["structure"] = str(e)
    try:
        check_equivalence(_MLP(), lambda m: None, (torch.randn(2, DIM),), loss_fn=lambda o: o)
    except ValueError as e:
        errors["scalar"] = str(e)
    return errors


def test_refusals_name_the_fix(dist):
    errors = dist.run(_refusals)[0]
    assert "already a DTensor" in errors["parallelized"]
    assert "up.weight" in errors["parallelized"]
    assert "rank 1" in errors["structure"] and "same input shapes" in errors["structure"]
    assert "must be a scalar" in errors["scalar"] and "(2, 16)" in errors["scalar"]


def test_needs_a_process_group():
    assert not c10d.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        check_equivalence(_MLP(), lambda m: None, (torch.randn(2, DIM),))


class _Stack(nn.Module):
    def __init__(self, num_layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_MLP() for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def _stack_plan(planted: str | None) -> dict[str, ShardingConfig]:
    plan = {}
    for i in range(4):
        plan[f"layers.{i}.up"] = colwise()
        plan[f"layers.{i}.down"] = rowwise(use_local_output=True)  # a plain residual
    if planted is not None:
        # A row-wise local_map region that declares its output Replicate: the local
        # result is a per-rank partial sum, so the declaration is a lie.
        plan[planted] = ShardingConfig(
            state_shardings={"weight": {"tp": Shard(1)}, "bias": {"tp": Replicate()}},
            in_dst_shardings={"input": {"tp": Shard(-1)}},
            out_src_shardings={"tp": Replicate()},
            local_map=LocalMapConfig(in_grad_placements=({"tp": Shard(-1)},)),
            use_local_output=True,
        )
    return plan


def _planted_drift(planted: str | None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Stack()
    x = torch.randn(3, DIM)
    plan = _stack_plan(planted)
    report = check_equivalence(model, lambda m: parallelize_module(m, _mesh(), plan), (x,))
    torch.manual_seed(0)
    drift = find_first_drift(_Stack(), lambda m: parallelize_module(m, _mesh(), plan), (x,))
    return {
        **_result(report),
        "drift": None if drift is None else drift.to_dict(),
    }


@pytest.mark.parametrize("planted", ["layers.2.down", "layers.0.down", None])
def test_parity_bisector_finds_the_planted_module(dist, planted):
    r0 = _same_on_every_rank(dist.run(_planted_drift, planted))
    report, drift = r0["report"], r0["drift"]
    assert report["first_drift"] == drift
    if planted is None:
        assert report["passed"] and drift is None, r0["text"]
        return
    assert not report["passed"]
    assert drift["path"] == planted, r0["text"]
    assert (drift["call"], drift["output"]) == (0, "output")
    assert drift["placements"] == "tp=Replicate()"
    assert drift["tolerance_ratio"] > 1
    # Every module that finished earlier was compared and matched: each layer's up,
    # down and block, plus the planted layer's up.
    earlier = 3 * int(planted.split(".")[1]) + 1
    assert drift["num_compared"] >= earlier + 1
    assert f"first module whose output drifts: {planted} output" in r0["text"]
