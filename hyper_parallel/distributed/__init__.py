"""The N-D mesh and how each parallelism axis composes on it.

``layout`` holds the one mesh every axis plugs into (:class:`MeshLayout`,
:class:`ParallelMesh`); ``axes`` says which submesh a plan is applied on and
checks axes against plans and callers; each axis lives in a file of its own
beside them (``fsdp``: FSDP2 and HSDP over the data axes; ``context_parallel``,
``expert_parallel``, ``pipeline``; the training switches ``compile``,
``precision``, ``activation_checkpoint``). ``run_plan`` decides a whole run once
(:class:`RunPlan`: submeshes, gradient convention, micro-batches, every check) and
``builder`` applies it, in one order, to a model, a pipeline stage or a fake model.
"""

from hyper_parallel.distributed.axes import axis_support_findings as axis_support_findings
from hyper_parallel.distributed.axes import declared_axes as declared_axes
from hyper_parallel.distributed.axes import plan_axis_findings as plan_axis_findings
from hyper_parallel.distributed.axes import plan_mesh as plan_mesh
from hyper_parallel.distributed.fsdp import apply_fsdp as apply_fsdp
from hyper_parallel.distributed.fsdp import fsdp_mesh_findings as fsdp_mesh_findings
from hyper_parallel.distributed.layout import DENSE_AXES as DENSE_AXES
from hyper_parallel.distributed.layout import USER_AXES as USER_AXES
from hyper_parallel.distributed.layout import LayoutError as LayoutError
from hyper_parallel.distributed.layout import MeshLayout as MeshLayout
from hyper_parallel.distributed.layout import ParallelMesh as ParallelMesh
from hyper_parallel.distributed.layout import as_layout as as_layout
from hyper_parallel.distributed.run_plan import RunPlan as RunPlan

__all__ = [
    "DENSE_AXES",
    "USER_AXES",
    "LayoutError",
    "MeshLayout",
    "ParallelMesh",
    "RunPlan",
    "apply_fsdp",
    "as_layout",
    "axis_support_findings",
    "declared_axes",
    "fsdp_mesh_findings",
    "plan_axis_findings",
    "plan_mesh",
]
