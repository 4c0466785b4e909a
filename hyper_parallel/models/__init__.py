"""Reference models built from ``Module`` configs; each registers its presets as ``ModelSpec``s.

Reach them through the registry (``hyper_parallel.dmodule.get_spec("llama3-8b")``) or
import a family package directly (``hyper_parallel.models.llama``).
"""

__all__: list[str] = []
