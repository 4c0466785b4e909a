"""Analyses that need no accelerator: plan validation and dry runs at any scale.

Example::

    from hyper_parallel.analysis import dry_run, validate
    from hyper_parallel.dmodule import get_spec

    spec = get_spec("llama3-70b")
    config = spec.extras["tp"](spec.config())
    print(validate(config, {"dp": 128, "tp": 8}).to_table())
"""

from hyper_parallel.analysis.dry_run import DryRunReport as DryRunReport
from hyper_parallel.analysis.dry_run import ModuleShards as ModuleShards
from hyper_parallel.analysis.dry_run import ParamShard as ParamShard
from hyper_parallel.analysis.dry_run import dry_run as dry_run
from hyper_parallel.analysis.validate import Redistribution as Redistribution
from hyper_parallel.analysis.validate import ValidationReport as ValidationReport
from hyper_parallel.analysis.validate import validate as validate

__all__ = [
    "DryRunReport",
    "ModuleShards",
    "ParamShard",
    "Redistribution",
    "ValidationReport",
    "dry_run",
    "validate",
]
