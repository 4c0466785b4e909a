"""The model contract, on the lowest floor of the package.

:class:`ModelFamily` (what the infrastructure needs to know about a model family),
:class:`PipelineLayoutProtocol` (how a family is cut into pipeline stages) and
:class:`HFAdapter` (a family's Hugging Face edge). ``dmodule``, ``distributed``,
``checkpoint_hf`` and ``analysis`` read models only through these; this package
imports none of them.
"""

from hyper_parallel.contract.family import SHARDING_AXES as SHARDING_AXES
from hyper_parallel.contract.family import ModelFamily as ModelFamily
from hyper_parallel.contract.family import ShardingFn as ShardingFn
from hyper_parallel.contract.hf import HFAdapter as HFAdapter
from hyper_parallel.contract.pipeline import PipelineLayoutProtocol as PipelineLayoutProtocol
from hyper_parallel.contract.pipeline import PipelineUnit as PipelineUnit

__all__ = [
    "SHARDING_AXES",
    "HFAdapter",
    "ModelFamily",
    "PipelineLayoutProtocol",
    "PipelineUnit",
    "ShardingFn",
]
