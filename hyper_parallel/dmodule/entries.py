"""Applying a plan entry by entry: the public surface the parallelism axes build on.

A plan is a list of :class:`PlanEntry` (module path, module, sharding config). Each
axis of :mod:`hyper_parallel.distributed` checks entries (:func:`check_entries`, every
problem at once as :class:`~hyper_parallel.dmodule.findings.Finding`\\ s), applies them
on a mesh (:func:`parallelize_entries`, nothing changed on any error) and reads what
was installed (:class:`Boundary`, :func:`installed_forward`). The implementations live
in the private modules of :mod:`hyper_parallel.dmodule`; this module is their one
public name, so an axis never imports a private module.

Example::

    from hyper_parallel.dmodule.entries import check_entries, errors_of, parallelize_entries

    errors = errors_of(check_entries(entries, ("tp",), {"tp": 2}))
    if not errors:
        parallelize_entries(model, mesh, entries)
"""

from __future__ import annotations

from hyper_parallel.dmodule._boundary import Boundary as Boundary
from hyper_parallel.dmodule._boundary import installed_forward as installed_forward
from hyper_parallel.dmodule._boundary import parallelize_entries as parallelize_entries
from hyper_parallel.dmodule._checks import BOUNDARY_ATTR as BOUNDARY_ATTR
from hyper_parallel.dmodule._checks import check_entries as check_entries
from hyper_parallel.dmodule._checks import check_mesh as check_mesh
from hyper_parallel.dmodule._checks import errors_of as errors_of
from hyper_parallel.dmodule._checks import forward_signature as forward_signature
from hyper_parallel.dmodule._checks import get_state as get_state
from hyper_parallel.dmodule._checks import state_owner as state_owner
from hyper_parallel.dmodule._fast import _contiguous_stride as contiguous_stride
from hyper_parallel.dmodule._fast import _ParamView as ParamView
from hyper_parallel.dmodule._placements import normalize_placements as normalize_placements
from hyper_parallel.dmodule.findings import ParallelizeError as ParallelizeError
from hyper_parallel.dmodule.findings import PlanEntry as PlanEntry

__all__ = [
    "BOUNDARY_ATTR",
    "Boundary",
    "ParallelizeError",
    "ParamView",
    "PlanEntry",
    "check_entries",
    "check_mesh",
    "contiguous_stride",
    "errors_of",
    "forward_signature",
    "get_state",
    "installed_forward",
    "normalize_placements",
    "parallelize_entries",
    "state_owner",
]
