"""What a check reports and what it checks: :class:`Finding`, :class:`PlanEntry`.

Public: every layer of the library (the plan checks, the mesh layout, each axis, the
run plan, ``validate`` and the dry run) reports problems as :class:`Finding`\\ s and
refuses a plan with :class:`ParallelizeError`. (They used to live in the private
``hyper_parallel.dmodule._checks``, which still re-exports them.)

Example::

    from hyper_parallel.dmodule.findings import Finding

    f = Finding("error", "layers.0.attention.wq", "state_shardings['weight']",
                "names 'wieght', which is not a parameter.", "write 'weight'.")
    print(f)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from hyper_parallel.dmodule.sharding import ShardingConfig
from hyper_parallel.dmodule.types import NamedPlacement

__all__ = ["Finding", "ParallelizeError", "PlanEntry", "named_placements"]


@dataclass(frozen=True)
class PlanEntry:
    """One module of a plan: where it is, what it is, and its config."""

    path: str
    module: nn.Module
    config: ShardingConfig


@dataclass(frozen=True)
class Finding:
    """One problem (or warning) found in a plan.

    Attributes:
        severity: ``"error"`` (``parallelize`` refuses the plan) or ``"warning"``.
        path: Module path in the model (``layers.3.attention.wq``); ``""`` for the root.
        field: The config field (and key) concerned, e.g. ``state_shardings['weight']``.
        message: What is wrong, with what was received.
        fix: How to fix it.
    """

    severity: str
    path: str
    field: str
    message: str
    fix: str

    def __str__(self) -> str:
        where = self.path or "<root>"
        field = f" {self.field}:" if self.field else ""
        return f"{where}:{field} {self.message} Fix: {self.fix}"

    def to_dict(self) -> dict[str, str]:
        """JSON-friendly form."""
        return {
            "severity": self.severity,
            "path": self.path,
            "field": self.field,
            "message": self.message,
            "fix": self.fix,
        }


class ParallelizeError(ValueError):
    """A plan was refused; nothing was changed. ``findings`` lists every error."""

    def __init__(self, findings: Sequence[Finding]) -> None:
        self.findings = list(findings)
        lines = "\n".join(f"  {f}" for f in self.findings)
        super().__init__(
            f"{len(self.findings)} problem(s) in the sharding plan; the model was not changed:\n"
            f"{lines}"
        )


def named_placements(config: ShardingConfig) -> Iterable[tuple[str, NamedPlacement]]:
    """Every NamedPlacement in a config, with the field text that names it."""
    for key, named in config.state_shardings.items():
        yield f"state_shardings[{key!r}]", named
    for name in ("in_src_shardings", "in_dst_shardings"):
        for key, named in (getattr(config, name) or {}).items():
            yield f"{name}[{key!r}]", named
    out_src = config.out_src_shardings
    if isinstance(out_src, tuple):
        for i, named in enumerate(out_src):
            yield f"out_src_shardings[{i}]", named
    elif out_src is not None:
        yield "out_src_shardings", out_src
    if config.out_dst_shardings is not None:
        yield "out_dst_shardings", config.out_dst_shardings
    if config.local_map is not None:
        for i, named in enumerate(config.local_map.in_grad_placements):
            yield f"local_map.in_grad_placements[{i}]", named
