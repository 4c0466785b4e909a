"""Declarative modules: sharding specs, the module runtime and plans for any model."""

from hyper_parallel.dmodule._fast import fast_path as fast_path
from hyper_parallel.dmodule._fast import set_fast_path as set_fast_path
from hyper_parallel.dmodule._fast import tokenwise_norm as tokenwise_norm
from hyper_parallel.dmodule._regather import keep_gathered as keep_gathered
from hyper_parallel.dmodule.findings import Finding as Finding
from hyper_parallel.dmodule.findings import ParallelizeError as ParallelizeError
from hyper_parallel.dmodule.findings import PlanEntry as PlanEntry
from hyper_parallel.dmodule.model import BaseModel as BaseModel
from hyper_parallel.dmodule.model import ModelConfigConverter as ModelConfigConverter
from hyper_parallel.dmodule.model_spec import ModelFamily as ModelFamily
from hyper_parallel.dmodule.model_spec import ModelSpec as ModelSpec
from hyper_parallel.dmodule.model_spec import family_of as family_of
from hyper_parallel.dmodule.model_spec import get_spec as get_spec
from hyper_parallel.dmodule.model_spec import list_specs as list_specs
from hyper_parallel.dmodule.model_spec import register_spec as register_spec
from hyper_parallel.dmodule.module import Module as Module
from hyper_parallel.dmodule.module import ModuleDict as ModuleDict
from hyper_parallel.dmodule.module import ModuleList as ModuleList
from hyper_parallel.dmodule.module import Sequential as Sequential
from hyper_parallel.dmodule.plan import parallelize_module as parallelize_module
from hyper_parallel.dmodule.plan_file import dump_plan as dump_plan
from hyper_parallel.dmodule.plan_file import load_plan as load_plan
from hyper_parallel.dmodule.presets import colwise as colwise
from hyper_parallel.dmodule.presets import prepare_input as prepare_input
from hyper_parallel.dmodule.presets import replicate_input as replicate_input
from hyper_parallel.dmodule.presets import rowwise as rowwise
from hyper_parallel.dmodule.presets import sequence_parallel_norm as sequence_parallel_norm
from hyper_parallel.dmodule.presets import vocab_parallel_embedding as vocab_parallel_embedding
from hyper_parallel.dmodule.sharding import LocalMapConfig as LocalMapConfig
from hyper_parallel.dmodule.sharding import ShardingConfig as ShardingConfig
from hyper_parallel.dmodule.sharding import resolve_placements as resolve_placements
from hyper_parallel.dmodule.types import MeshAxisName as MeshAxisName
from hyper_parallel.dmodule.types import NamedPlacement as NamedPlacement

__all__ = [
    "BaseModel",
    "Finding",
    "LocalMapConfig",
    "MeshAxisName",
    "ModelConfigConverter",
    "ModelFamily",
    "ModelSpec",
    "Module",
    "ModuleDict",
    "ModuleList",
    "NamedPlacement",
    "ParallelizeError",
    "PlanEntry",
    "Sequential",
    "ShardingConfig",
    "colwise",
    "dump_plan",
    "family_of",
    "fast_path",
    "get_spec",
    "keep_gathered",
    "list_specs",
    "load_plan",
    "parallelize_module",
    "prepare_input",
    "register_spec",
    "replicate_input",
    "resolve_placements",
    "rowwise",
    "sequence_parallel_norm",
    "set_fast_path",
    "tokenwise_norm",
    "vocab_parallel_embedding",
]
