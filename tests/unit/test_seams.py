"""Seams of the package: no import cycles, private torch APIs in one module, no leaked
process-wide torch settings."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import torch

import hyper_parallel
from hyper_parallel import _torch_private

PACKAGE = pathlib.Path(hyper_parallel.__file__).parent
ROOT = PACKAGE.parent


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """Every module of the package ``name`` imports, anywhere in the file (function-level
    imports included: a cycle hidden inside a function is still a cycle)."""
    deps: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            deps.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                here = here[: len(here) - node.level + 1]
                base = ".".join(here + ([node.module] if node.module else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                deps.add(full if full in modules else base)
    return {d for d in deps if d in modules and d != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_cycles() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == []


def test_every_module_imports_in_a_fresh_interpreter() -> None:
    # The leaves of the old cycles first, then every module of the package.
    names = ["hyper_parallel.distributed.expert_parallel", "hyper_parallel.dmodule._known_layouts"]
    names += sorted(_modules())
    code = f"import importlib\nfor n in {names!r}:\n    importlib.import_module(n)\n"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_private_torch_apis_resolve_in_this_torch() -> None:
    missing = _torch_private.missing()
    assert not missing, "\n".join(missing)


def test_private_torch_apis_are_imported_in_one_module() -> None:
    offenders = []
    for name, path in _modules().items():
        if name == "hyper_parallel._torch_private":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for n in names:
                parts = n.split(".")
                if parts[0] == "torch" and any(p.startswith("_") for p in parts[1:]):
                    offenders.append(f"{name}:{node.lineno}: {n}")
    assert offenders == [], "import these through hyper_parallel._torch_private:\n" + "\n".join(
        offenders
    )


def test_missing_names_the_torch_version(monkeypatch) -> None:
    monkeypatch.setitem(_torch_private.ATTRIBUTES, "torch.Tensor", ("_no_such_private_api",))
    (line,) = _torch_private.missing()
    assert torch.__version__ in line and "torch.Tensor._no_such_private_api" in line


def test_the_axes_use_dmodule_through_public_modules() -> None:
    offenders = []
    for name, path in _modules().items():
        if not name.startswith("hyper_parallel.distributed."):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "hyper_parallel.dmodule._"
            ):
                offenders.append(f"{name}:{node.lineno}: {node.module}")
    assert offenders == [], "use hyper_parallel.dmodule.entries / findings:\n" + "\n".join(
        offenders
    )
