"""The model contract on the lowest floor: one ModelFamily, the pipeline-layout protocol,
and the reads the planner and the dry run make through it."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import hyper_parallel.contract as contract
from hyper_parallel.contract import ModelFamily, PipelineLayoutProtocol, PipelineUnit
from hyper_parallel.distributed.pipeline import PipelineUnit as DistributedUnit
from hyper_parallel.dmodule import ModelFamily as DModuleFamily
from hyper_parallel.dmodule import get_spec
from hyper_parallel.dmodule.model_spec import ModelFamily as SpecFamily


def test_the_old_import_paths_name_the_one_contract() -> None:
    assert DModuleFamily is ModelFamily and SpecFamily is ModelFamily
    assert DistributedUnit is PipelineUnit


def test_the_contract_imports_no_other_package_of_ours() -> None:
    folder = pathlib.Path(contract.__file__).parent
    found = []
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("hyper_parallel.")
                and not node.module.startswith("hyper_parallel.contract")
            ):
                found.append(f"{path.name}: {node.module}")
    assert found == []


@pytest.mark.parametrize("name", ["llama3-debug", "qwen3-debug", "qwen3-moe-debug"])
def test_each_family_pipeline_is_the_typed_protocol(name: str) -> None:
    layout = get_spec(name).family.pipeline
    assert isinstance(layout, PipelineLayoutProtocol)


@pytest.mark.parametrize("name", ["llama3-debug", "qwen3-debug", "qwen3-moe-debug", "llama3.1-8b"])
def test_layers_experts_and_positions_are_read_through_the_family(name: str) -> None:
    spec = get_spec(name)
    config = spec.config()
    # Compared with the model the config builds (on meta): what the contract says is
    # what the built model has.
    with torch.device("meta"):
        model = config.build()
    assert spec.family.num_layers(config) == len(model.layers)
    assert spec.family.max_seq_len(config) == model.rope.max_seq_len
    # The experts' stacked weights hold one expert per row of dim 0.
    moe = [m for _, m in spec.family.expert_modules(model)]
    expected = next(moe[0].parameters()).shape[0] if moe else 0
    assert spec.family.num_experts(config) == expected


def test_a_family_with_other_block_names_is_read_by_its_declaration() -> None:
    from types import SimpleNamespace

    family = ModelFamily(
        name="toy", blocks="blocks", experts=lambda c: c.n, positions=lambda c: c.limit
    )
    config = SimpleNamespace(blocks=[1, 2, 3], n=4, limit=64)
    assert (family.num_layers(config), family.num_experts(config)) == (3, 4)
    assert family.max_seq_len(config) == 64
    assert ModelFamily(name="dense").num_experts(config) == 0
    assert ModelFamily(name="dense").max_seq_len(config) is None


def test_a_family_without_blocks_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"'toy' declares no blocks \(ModelFamily.blocks\)"):
        ModelFamily(name="toy").num_layers(object())
