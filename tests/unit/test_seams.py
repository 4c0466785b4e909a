"""Seams of the package: no import cycles (between files, and between the top-level
packages: ``dmodule``, ``distributed``, ``checkpoint_hf``, ``train``, ...), no private
name imported across packages, private torch APIs in one module, no leaked
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


def _package(name: str) -> str:
    """The top-level package of a module (``hyper_parallel.train.run`` -> ``hyper_parallel.train``);
    a module directly under the root is its own."""
    return ".".join(name.split(".")[:2])


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between top-level packages (an edge per file-level import)."""
    out: dict[str, set[str]] = {_package(n): set() for n in graph}
    for name, deps in graph.items():
        for dep in deps:
            if _package(dep) != _package(name):
                out[_package(name)].add(_package(dep))
                out.setdefault(_package(dep), set())
    return out


def test_the_top_level_packages_have_no_import_cycles() -> None:
    # Every import counts: module level, inside functions (lazy) and under TYPE_CHECKING.
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    packages = _package_graph(graph)
    cycles = _cycles(packages)
    edges = [f"{a} -> {b}" for cycle in cycles for a in cycle for b in cycle if b in packages[a]]
    assert cycles == [], "cycles between packages:\n" + "\n".join(edges)


def test_a_cycle_between_packages_is_found_through_a_lazy_import(tmp_path) -> None:
    # The detector itself: a function-level import is an edge, and two packages importing
    # each other (through different files) are a cycle.
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    from hyper_parallel.train import run\n")
    modules = _modules()
    assert _imports("hyper_parallel.checkpoint_hf.x", lazy, modules) == {"hyper_parallel.train.run"}
    graph = {"p.a.x": {"p.b.y"}, "p.b.y": set(), "p.b.z": {"p.a.w"}, "p.a.w": set()}
    assert _cycles(_package_graph(graph)) == [["p.a", "p.b"]]


def _private_imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> list[str]:
    """``module:line: name`` of each private name (leading underscore, not a dunder) or
    private module of another top-level package that ``name`` imports. Modules directly
    under the root (``hyper_parallel._torch_private``) are the package's shared ones."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        if not node.module.startswith("hyper_parallel."):
            continue
        for a in node.names:
            full = f"{node.module}.{a.name}"
            target = full if full in modules else node.module
            if _package(target) == _package(name) or target.count(".") < 1:
                continue
            below = target.split(".")[2:]  # the path inside the other package
            private_name = a.name.startswith("_") and not a.name.startswith("__")
            if private_name or any(p.startswith("_") and p != "__init__" for p in below):
                found.append(f"{name}:{node.lineno}: from {node.module} import {a.name}")
    return found


def test_no_private_name_is_imported_across_packages() -> None:
    modules = _modules()
    offenders = [o for name, path in modules.items() for o in _private_imports(name, path, modules)]
    assert offenders == [], "import a public name (re-export it where it lives):\n" + "\n".join(
        offenders
    )


def test_a_private_import_across_packages_is_found(tmp_path) -> None:
    # The detector itself, on a file importing a private name and a private module.
    source = tmp_path / "m.py"
    source.write_text(
        "def f():\n"
        "    from hyper_parallel.train.run import _init_process_group\n"
        "    from hyper_parallel.dmodule._checks import Finding\n"
        "    from hyper_parallel.hf_commands.verify import mesh_logits\n"
    )
    modules = _modules()
    found = _private_imports("hyper_parallel.hf_commands.x", source, modules)
    assert [f.split(": ", 1)[1] for f in found] == [
        "from hyper_parallel.train.run import _init_process_group",
        "from hyper_parallel.dmodule._checks import Finding",
    ]


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
