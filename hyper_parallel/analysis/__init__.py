"""Analyses: plan validation and dry runs at any scale (no accelerator), equivalence checks.

Example::

    from hyper_parallel.analysis import dry_run, validate
    from hyper_parallel.dmodule import get_spec

    spec = get_spec("llama3-70b")
    config = spec.sharding("tp")(spec.config())
    print(validate(config, {"dp": 128, "tp": 8}).to_table())
"""

from hyper_parallel.analysis._format import table as table
from hyper_parallel.analysis.dry_run import DryRunReport as DryRunReport
from hyper_parallel.analysis.dry_run import ModuleShards as ModuleShards
from hyper_parallel.analysis.dry_run import ParamShard as ParamShard
from hyper_parallel.analysis.dry_run import dry_run as dry_run
from hyper_parallel.analysis.equivalence import EquivalenceReport as EquivalenceReport
from hyper_parallel.analysis.equivalence import EquivalenceRow as EquivalenceRow
from hyper_parallel.analysis.equivalence import ModuleDrift as ModuleDrift
from hyper_parallel.analysis.equivalence import check_equivalence as check_equivalence
from hyper_parallel.analysis.equivalence import find_first_drift as find_first_drift
from hyper_parallel.analysis.validate import Redistribution as Redistribution
from hyper_parallel.analysis.validate import ValidationReport as ValidationReport
from hyper_parallel.analysis.validate import validate as validate

__all__ = [
    "DryRunReport",
    "EquivalenceReport",
    "EquivalenceRow",
    "ModuleDrift",
    "ModuleShards",
    "ParamShard",
    "Redistribution",
    "ValidationReport",
    "check_equivalence",
    "dry_run",
    "find_first_drift",
    "table",
    "validate",
]
