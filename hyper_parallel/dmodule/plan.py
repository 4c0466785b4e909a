"""Plans for any model: ``parallelize_module(model, mesh, plan)``.

A plan maps module paths to :class:`ShardingConfig`s; ``*`` in a path matches one
path segment. It applies to any ``nn.Module`` tree (a Hugging Face model, a
torchvision model) through the same machinery as :meth:`Module.parallelize`.

Example::

    from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
    from hyper_parallel.dmodule import ShardingConfig, parallelize_module

    plan = {
        "layers.*.up": ShardingConfig(
            state_shardings={"weight": {"tp": Shard(0)}, "bias": {"tp": Shard(0)}},
            in_dst_shardings={"input": {"tp": Replicate()}},
        ),
        "layers.*.down": ShardingConfig(
            state_shardings={"weight": {"tp": Shard(1)}},
            in_dst_shardings={"input": {"tp": Shard(-1)}},
            out_dst_shardings={"tp": Replicate()},
        ),
    }
    # parallelize_module(model, mesh, plan)  # or a plan file: "plan.yaml"
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path

from torch import nn

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dmodule._boundary import parallelize_entries
from hyper_parallel.dmodule.findings import Finding, PlanEntry
from hyper_parallel.dmodule.plan_file import load_plan
from hyper_parallel.dmodule.sharding import ShardingConfig

__all__ = ["match_plan", "parallelize_module"]

Plan = Mapping[str, ShardingConfig]


def _matches(pattern: list[str], path: list[str]) -> bool:
    return len(pattern) == len(path) and all(p in ("*", s) for p, s in zip(pattern, path))


def _placement(p: object) -> str:
    dim = getattr(p, "dim", None)
    return f"Shard({dim})" if isinstance(dim, int) else f"{type(p).__name__}()"


def _torch_style_equivalent(style: object, module: nn.Module | None) -> str | None:
    """The preset call that places ``module`` as torch's tensor-parallel ``style``
    (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``) does, with the
    arguments that differ from the preset's defaults; ``None`` for anything else."""
    kind = type(style).__name__
    if type(style).__module__.split(".")[:4] != ["torch", "distributed", "tensor", "parallel"]:
        return None

    def first(name: str) -> str | None:
        layouts = getattr(style, name, None)
        return _placement(layouts[0]) if layouts else None

    local = bool(getattr(style, "use_local_output", False))
    inp, out = first("input_layouts"), first("output_layouts")
    args: list[str] = []
    if kind == "SequenceParallel":
        seq = first("sequence_sharding")
        if seq and seq != "Shard(1)":
            args += [f"input={seq}", f"output={seq}"]
        name = "sequence_parallel_norm"
    elif isinstance(module, nn.Embedding) and kind == "RowwiseParallel":
        args += [f"output={out}"] if out and out != "Replicate()" else []
        name = "vocab_parallel_embedding"
    elif isinstance(module, nn.Linear) and kind in ("ColwiseParallel", "RowwiseParallel"):
        colwise = kind == "ColwiseParallel"
        # The preset's own defaults (torch's too): only arguments that differ are written.
        default_in, default_out = (
            ("Replicate()", "Shard(-1)") if colwise else ("Shard(-1)", "Replicate()")
        )
        args += [f"input={inp}"] if inp and inp != default_in else []
        args += [f"output={out}"] if out and out != default_out else []
        if colwise and module.bias is None:
            args.append("bias=False")
        name = "colwise" if colwise else "rowwise"
    else:
        return None
    if local:
        args.append("use_local_output=True")
    return f"{name}({', '.join(args)})"


def match_plan(model: nn.Module, plan: Plan) -> tuple[list[PlanEntry], list[Finding]]:
    """Expand a plan's patterns against a model's module paths.

    Args:
        model: The model whose ``named_modules()`` paths the patterns are matched to.
        plan: Module path pattern (``*`` matches one segment) → ShardingConfig.

    Returns:
        The entries (one per matched module, in model order) and the problems: a
        pattern that matches nothing (with the nearest real paths), two patterns
        claiming one module, a value that is not a ShardingConfig.

    Example::

        from torch import nn
        from hyper_parallel.dmodule.plan import match_plan
        from hyper_parallel.dmodule.presets import colwise

        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        entries, problems = match_plan(model, {"*": colwise()})
        assert [e.path for e in entries] == ["0", "1"] and problems == []
    """
    modules = dict(model.named_modules())
    findings: list[Finding] = []
    claimed: dict[str, str] = {}
    configs: dict[str, ShardingConfig] = {}
    for pattern, config in plan.items():
        if not isinstance(config, ShardingConfig):
            parts = pattern.split(".") if pattern else []
            hit = next((m for p, m in modules.items() if _matches(parts, p.split("."))), None)
            same = _torch_style_equivalent(config, hit)
            fix = (
                f"write {same} instead: the preset (hyper_parallel.dmodule.presets) that "
                f"places this module as torch's {type(config).__name__} does; axis='tp' "
                "names the mesh axis torch's 1-D mesh was (the default)."
                if same
                else "map each module path to a ShardingConfig (or a preset such as colwise())."
            )
            findings.append(
                Finding(
                    "error",
                    pattern,
                    "plan",
                    f"the plan maps {pattern!r} to a {type(config).__name__}, not a "
                    "ShardingConfig.",
                    fix,
                )
            )
            continue
        parts = pattern.split(".") if pattern else []
        hits = [p for p in modules if _matches(parts, p.split(".") if p else [])]
        aliases = {} if hits else _second_paths(model, modules)
        alias_hits = [p for p in aliases if _matches(parts, p.split("."))]
        if alias_hits:
            # torch's parallelize_module reaches these through get_submodule; a module
            # shared at two paths is configured once, at the path named_modules gives it.
            pairs = ", ".join(f"{a!r} is {aliases[a]!r}" for a in alias_hits[:3])
            findings.append(
                Finding(
                    "error",
                    pattern,
                    "plan",
                    f"pattern {pattern!r} matches only second paths of modules reached at two "
                    f"paths ({pairs}); a shared module is configured once, at its first path.",
                    f"name it by its first path ({aliases[alias_hits[0]]!r}).",
                )
            )
        elif not hits:
            near = difflib.get_close_matches(pattern, list(modules), n=3, cutoff=0.5)
            hint = f"nearest module paths: {near}" if near else "no similar module paths"
            findings.append(
                Finding(
                    "error",
                    pattern,
                    "plan",
                    f"pattern {pattern!r} matches no module of {type(model).__name__} ({hint}).",
                    "use a real module path; '*' matches exactly one path segment.",
                )
            )
        for path in hits:
            if path in claimed:
                findings.append(
                    Finding(
                        "error",
                        path,
                        "plan",
                        f"claimed by two plan patterns: {claimed[path]!r} and {pattern!r}.",
                        "make the patterns disjoint so each module has one config.",
                    )
                )
                continue
            claimed[path] = pattern
            configs[path] = config
    entries = [PlanEntry(p, m, configs[p]) for p, m in modules.items() if p in configs]
    return entries, findings


def parallelize_module(model: nn.Module, mesh: DeviceMesh, plan: Plan | str | Path) -> nn.Module:
    """Apply a plan to any ``nn.Module`` tree, in place.

    Args:
        model: The model (it need not be built from hyper_parallel Modules).
        mesh: A DeviceMesh with ``mesh_dim_names``.
        plan: Module path pattern → ShardingConfig, or a ``.yaml``/``.json`` plan file.

    Returns:
        ``model``, parallelized in place.

    Raises:
        ValueError: Listing every problem (patterns, paths, placements, arguments),
            each with its module path; the model is left unchanged.
        TypeError: If ``plan`` is neither a mapping nor a file path, or ``mesh`` is
            not a DeviceMesh.

    Example:
        Run under ``torchrun --nproc-per-node 2``::

            import torch
            from torch import nn
            from hyper_parallel.core.dtensor.device_mesh import init_device_mesh
            from hyper_parallel.dmodule import parallelize_module
            from hyper_parallel.dmodule.presets import colwise, rowwise

            model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
            parallelize_module(model, mesh, {"0": colwise(), "2": rowwise()})
            y = model(torch.randn(4, 8))  # a replicated DTensor
    """
    if isinstance(plan, (str, Path)):
        plan = load_plan(plan)
    if not isinstance(plan, Mapping):
        raise TypeError(
            f"parallelize_module: plan must be a dict of module path -> ShardingConfig or a "
            f"plan file path, got {type(plan).__name__}."
        )
    entries, findings = match_plan(model, plan)
    parallelize_entries(model, mesh, entries, findings)
    return model


def _second_paths(model: nn.Module, modules: dict[str, nn.Module]) -> dict[str, str]:
    """A shared module's other paths (shared blocks, ``self.b = self.a``) -> its first
    (``modules``: ``named_modules()``); asked only for a pattern that matches nothing."""
    first = {id(m): path for path, m in modules.items()}
    return {
        path: first[id(m)]
        for path, m in model.named_modules(remove_duplicate=False)
        if path not in modules
    }
