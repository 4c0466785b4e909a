"""The N-D mesh and how each parallelism axis composes on it.

``layout`` holds the one mesh every axis plugs into (:class:`MeshLayout`,
:class:`ParallelMesh`); each axis lives in a file of its own beside it.
"""

from hyper_parallel.distributed.layout import (
    DENSE_AXES as DENSE_AXES,
)
from hyper_parallel.distributed.layout import (
    USER_AXES as USER_AXES,
)
from hyper_parallel.distributed.layout import (
    LayoutError as LayoutError,
)
from hyper_parallel.distributed.layout import (
    MeshLayout as MeshLayout,
)
from hyper_parallel.distributed.layout import (
    ParallelMesh as ParallelMesh,
)

__all__ = ["DENSE_AXES", "USER_AXES", "LayoutError", "MeshLayout", "ParallelMesh"]
