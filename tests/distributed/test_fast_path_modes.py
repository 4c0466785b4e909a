"""The fast path in the modes a training or serving loop uses, against one device.

Each mode runs the column→row MLP and the sequence-parallel block (vocab-parallel
embedding, SP norm, column and row projections) on the fast path and on the DTensor
path, next to a single-device deepcopy run the same way: ``torch.no_grad``,
``torch.inference_mode`` (the non-autograd, in-place collectives), bf16 parameters,
fp32 under bf16 ``autocast``, non-contiguous inputs and activation checkpointing
(``torch.utils.checkpoint`` around the parallelized model). Every mode runs on a 2x2
``("dp", "tp")`` mesh whose placements are all on ``tp`` (``dp`` replicated): the
N-D case, whose ``tp`` sub-group collectives are those of a 1-D mesh. Each asserts the output and, where there is a backward,
every parameter and input gradient, and which path each module's calls actually ran.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hyper_parallel.core.dtensor.device_mesh import init_device_mesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.dmodule import ShardingConfig, fast_path, parallelize_module
from tests.distributed.models import PathLog
from tests.distributed.test_fast_path import (
    MLP,
    SequenceParallelBlock,
    _colwise,
    _rowwise,
    _sequence_parallel_plan,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORLD_SIZE = 4

MODES = ("grad", "no_grad", "inference_mode", "bf16", "autocast", "non_contiguous", "checkpoint")
BACKWARD = frozenset({"grad", "bf16", "autocast", "non_contiguous", "checkpoint"})
MESHES = {"dp2_tp2": ((2, 2), ("dp", "tp"))}
FAST_KINDS = {
    "mlp": {"up": "colwise", "down": "rowwise"},
    "sequence_parallel": {
        "emb": "vocab_embedding_sequence_parallel",
        "norm": "sequence_parallel_norm",
        "mlp.up": "colwise_sequence_parallel",
        "mlp.down": "rowwise_sequence_parallel",
    },
}


def tolerance(mode: str) -> float:
    """fp32: 1e-5. bf16 (8 bits of mantissa): a few units in the last place of O(1) values."""
    return 4e-2 if mode in ("bf16", "autocast") else 1e-5


# ---------------------------------------------------------------------------- rank side


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float()


def _call(model: nn.Module, x: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "no_grad":
        with torch.no_grad():
            return model(x)
    if mode == "inference_mode":
        with torch.inference_mode():
            return model(x)
    if mode == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)
    if mode == "checkpoint":
        return checkpoint(model, x, use_reentrant=False)
    return model(x)


def _input(case: str, mode: str) -> torch.Tensor:
    """The leaf input, laid out (sequence, batch, ...); the same on every rank."""
    generator = torch.Generator().manual_seed(1)
    if case == "mlp":
        x = torch.randn(4, 2, 8, generator=generator)
        if mode == "bf16":
            x = x.to(torch.bfloat16)
        return x.requires_grad_(mode in BACKWARD)
    return torch.randint(0, 32, (8, 2), generator=generator)


def _feed(leaf: torch.Tensor, mode: str) -> torch.Tensor:
    """(batch, sequence, ...): a transposed, non-contiguous view in that mode, else a copy."""
    view = leaf.transpose(0, 1)
    return view if mode == "non_contiguous" else view.contiguous()


def _one(
    base: nn.Module, plan: dict[str, ShardingConfig] | None, case: str, mode: str, mesh: Any
) -> dict[str, Any]:
    """One run: parallelized on a path (``plan``), or the single-device twin (``None``)."""
    model = copy.deepcopy(base)
    if mode == "bf16":
        model = model.to(torch.bfloat16)
    log = None
    if plan is not None:
        parallelize_module(model, mesh, plan)
        log = PathLog(model)
    leaf = _input(case, mode)
    fed = _feed(leaf, mode)
    assert fed.is_contiguous() == (mode != "non_contiguous")
    out = _call(model, fed, mode)
    result: dict[str, Any] = {"out": _full(out), "dtype": out.dtype}
    if mode in BACKWARD:
        local = out.to_local() if isinstance(out, DTensor) else out
        local.float().pow(2).sum().backward()
        result["grads"] = {n: _full(p.grad) for n, p in model.named_parameters()}
        if leaf.requires_grad:
            result["input_grad"] = leaf.grad.detach().float()
    if log is not None:
        result["ran"] = {p: "/".join(sorted(k)) for p, k in log.ran().items()}
    return result


def _mode_runs(mesh_name: str) -> dict[str, Any]:
    shape, names = MESHES[mesh_name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    cases: dict[str, tuple[nn.Module, Callable[[], dict[str, ShardingConfig]]]] = {
        "mlp": (MLP(), lambda: {"up": _colwise(False), "down": _rowwise(False)}),
        "sequence_parallel": (SequenceParallelBlock(), lambda: _sequence_parallel_plan(False)),
    }
    out: dict[str, Any] = {}
    for case, (base, plan) in cases.items():
        for mode in MODES:
            runs = {"reference": _one(base, None, case, mode, mesh)}
            for fast in (True, False):
                with fast_path(fast):
                    runs["fast" if fast else "dtensor"] = _one(base, plan(), case, mode, mesh)
            out[f"{case}/{mode}"] = runs
    return out


# ---------------------------------------------------------------------------- tests


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_modes_against_one_device(dist, mesh_name):
    for rank, results in enumerate(dist.run(_mode_runs, mesh_name)):
        assert set(results) == {f"{c}/{m}" for c in FAST_KINDS for m in MODES}
        for key, runs in results.items():
            case, mode = key.split("/")
            ref, tol = runs["reference"], tolerance(mode)
            assert runs["fast"]["ran"] == FAST_KINDS[case], (rank, key)
            assert set(runs["dtensor"]["ran"].values()) == {"dtensor"}, (rank, key)
            for path in ("fast", "dtensor"):
                run, where = runs[path], f"rank {rank} {key} {path}"
                assert run["dtype"] == ref["dtype"], where
                _close(run["out"], ref["out"], tol, f"{where} output")
                if mode not in BACKWARD:
                    assert "grads" not in run
                    continue
                assert run["grads"].keys() == ref["grads"].keys(), where
                for name, grad in ref["grads"].items():
                    _close(run["grads"][name], grad, tol, f"{where} grad {name}")
                if "input_grad" in ref:
                    _close(run["input_grad"], ref["input_grad"], tol, f"{where} input grad")
