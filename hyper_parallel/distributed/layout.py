"""One N-D mesh for every axis: sizes, checks, and the DeviceMesh views each axis needs.

Users give sizes for the axes ``pp, dp_replicate, dp_shard, cp, tp, ep`` (``dp`` is
accepted as a synonym of ``dp_shard``). The ranks are laid out outermost first as
``pp, dp_replicate, dp_shard, cp, tp`` (tp innermost, on the fastest links, as
torchtitan does), so the world size is ``pp * dp_replicate * dp_shard * cp * tp``.
``ep`` adds no ranks: it borrows them from ``dp_shard * cp * tp`` (innermost first,
so from tp before cp before dp_shard) and must divide that product. Derived axes:

- ``fsdp`` = dp_shard x cp: what FSDP2 shards dense states over;
- ``efsdp`` = dp_shard x cp x tp / ep: what FSDP2 shards expert states over (with
  ``dp_replicate``, HSDP over ``(edp_replicate, efsdp)``, ``edp_replicate`` being the
  replica ranks on the experts' own mesh: :meth:`ParallelMesh.expert_fsdp_mesh`);
- ``batch`` = dp_replicate x dp_shard: ranks that read different rows of the batch;
- ``loss`` = dp_replicate x dp_shard x cp: ranks whose partial losses make the mean.

:class:`MeshLayout` is a plain value (no process group needed): :meth:`MeshLayout.parse`
reads ``"dp_shard=2,tp=2"``, :meth:`MeshLayout.findings` returns every problem as a
:class:`~hyper_parallel.dmodule.Finding` with its fix, and :meth:`MeshLayout.build`
makes the :class:`ParallelMesh` (torch's ``init_device_mesh`` and its flatten /
unflatten; no hand-made process groups) on a running process group — the trainer's
real one or the dry run's fake one.

Example::

    layout = MeshLayout.parse("dp_replicate=2,dp_shard=2,tp=2")
    layout.check(world_size=8)            # raises LayoutError listing every problem
    mesh = layout.build("cpu")           # under torchrun with 8 ranks
    mesh["tp"], mesh["fsdp"], mesh.fsdp_mesh()  # 1-D tp, 1-D fsdp, 2-D (replicate, shard)
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Iterable, Mapping

import torch.distributed as dist

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh, init_device_mesh
from hyper_parallel.dmodule.findings import Finding

__all__ = [
    "DATA_AXES",
    "DENSE_AXES",
    "DERIVED_AXES",
    "USER_AXES",
    "LayoutError",
    "MeshLayout",
    "ParallelMesh",
    "as_layout",
]

DENSE_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The axes that multiply to the world size, outermost first."""

USER_AXES = (*DENSE_AXES, "ep")
"""Every axis a user gives a size for (plus the alias ``dp`` of ``dp_shard``)."""

ALIASES = {"dp": "dp_shard"}
"""Accepted synonyms: ``dp`` is ``dp_shard`` (FSDP2 over the data-parallel ranks)."""

_DERIVED = ("fsdp", "efsdp")

DERIVED_AXES = ("fsdp", "efsdp", "batch", "loss")
"""Views made from the user axes: FSDP's dense and expert groups, the batch and loss groups."""

DATA_AXES = ("dp_replicate", "dp_shard", "fsdp", "batch", "loss")
"""Axes over which the batch is split or gradients are averaged: FSDP's, never a plan's."""


class LayoutError(ValueError):
    """A mesh layout was refused. ``findings`` lists every problem, each with its fix."""

    def __init__(self, findings: Iterable[Finding]) -> None:
        self.findings = list(findings)
        lines = "\n".join(f"  {f}" for f in self.findings)
        super().__init__(f"{len(self.findings)} problem(s) in the mesh:\n{lines}")


@dataclasses.dataclass(frozen=True, slots=True)
class MeshLayout:
    """Sizes of the user-given mesh axes; every size defaults to 1.

    Build it with :meth:`parse` (text) or :meth:`from_sizes` (a mapping), which collect
    every problem before raising; the constructor itself only stores the sizes, so call
    :meth:`check` before using a hand-made one.
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    # ------------------------------------------------------------------ construction

    @classmethod
    def parse(cls, text: str) -> MeshLayout:
        """Read ``"dp_shard=2,tp=2"`` (any order; ``""`` is one device).

        Raises:
            LayoutError: Every malformed entry, unknown axis (with the nearest name),
                repeated axis and size below 1, in one error.
        """
        findings: list[Finding] = []
        sizes: dict[str, int] = {}
        given: dict[str, str] = {}
        parts = [part.strip() for part in text.split(",")] if text.strip() else []
        for item in parts:
            if not item:
                findings.append(
                    _error(
                        f"{text!r} has an empty entry (two commas in a row, or a comma at an end).",
                        "write the mesh as axis=size pairs separated by single commas, "
                        "e.g. 'dp_shard=2,tp=2'.",
                    )
                )
                continue
            name, sep, size = item.partition("=")
            name, size = name.strip(), size.strip()
            if not sep or not name or not size.lstrip("-").isdigit():
                findings.append(
                    _error(
                        f"entry {item!r} of {text!r} is not 'axis=size'.",
                        "write the mesh as axis=size pairs, e.g. 'dp_shard=2,tp=2'.",
                    )
                )
                continue
            _add_size(name, int(size), sizes, given, findings)
        return cls._finish(sizes, findings)

    @classmethod
    def from_sizes(cls, sizes: Mapping[str, int]) -> MeshLayout:
        """A layout from ``{"dp_shard": 2, "tp": 2}`` (enum keys accepted).

        Raises:
            LayoutError: Every unknown axis, repeated axis (``dp`` and ``dp_shard``
                both given) and size that is not an integer >= 1, in one error.
        """
        if isinstance(sizes, MeshLayout):
            return sizes
        findings: list[Finding] = []
        out: dict[str, int] = {}
        given: dict[str, str] = {}
        for axis, size in sizes.items():
            name = str(getattr(axis, "value", axis))
            if isinstance(size, bool) or not isinstance(size, int):
                findings.append(
                    _error(
                        f"axis {name!r} has size {size!r}, which is not an integer.",
                        f"give {name} a whole number >= 1.",
                    )
                )
                continue
            _add_size(name, size, out, given, findings)
        return cls._finish(out, findings)

    @classmethod
    def _finish(cls, sizes: dict[str, int], findings: list[Finding]) -> MeshLayout:
        if findings:
            raise LayoutError(findings)
        layout = cls(**sizes)
        errors = [f for f in layout.findings() if f.severity == "error"]
        if errors:
            raise LayoutError(errors)
        return layout

    # ------------------------------------------------------------------ sizes

    @property
    def world_size(self) -> int:
        """Ranks the layout needs: pp x dp_replicate x dp_shard x cp x tp."""
        return math.prod(self.size(a) for a in DENSE_AXES)

    @property
    def fsdp(self) -> int:
        """dp_shard x cp: the ranks FSDP2 shards dense states over."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """dp_shard x cp x tp / ep: the ranks FSDP2 shards expert states over."""
        return self.dp_shard * self.cp * self.tp // self.ep

    def size(self, axis: str) -> int:
        """The size of a user axis or a derived one (``fsdp``, ``efsdp``, ``batch``, ``loss``)."""
        axis = ALIASES.get(axis, axis)
        if axis in USER_AXES:
            return getattr(self, axis)
        if axis in _DERIVED:
            return getattr(self, axis)
        if axis == "batch":
            return self.dp_replicate * self.dp_shard
        if axis == "loss":
            return self.dp_replicate * self.dp_shard * self.cp
        raise KeyError(
            f"{axis!r} is not a mesh axis ({', '.join(USER_AXES)}, fsdp, efsdp, batch, loss)"
        )

    def active(self) -> dict[str, int]:
        """The user axes of size > 1, in layout order (``{"dp_shard": 2, "tp": 2}``)."""
        return {a: getattr(self, a) for a in USER_AXES if getattr(self, a) > 1}

    def to_dict(self, *, derived: bool = False) -> dict[str, int]:
        """All user axes with their sizes (JSON-friendly); ``derived`` adds
        ``fsdp``, ``efsdp``, ``batch``, ``loss`` and ``world_size``."""
        out = {a: getattr(self, a) for a in USER_AXES}
        if derived:
            out.update({a: self.size(a) for a in DERIVED_AXES})
            out["world_size"] = self.world_size
        return out

    def describe(self) -> str:
        """``"dp_shard=2 x tp=2 (fsdp=2, batch=2, loss=2)"``: the active axes and the
        derived sizes that differ from 1; ``"one device"`` for the empty layout."""
        derived = {a: self.size(a) for a in ("fsdp", "batch", "loss") if self.size(a) > 1}
        if self.ep > 1:
            derived["efsdp"] = self.efsdp
        text = " x ".join(f"{a}={s}" for a, s in self.active().items()) or "one device"
        if derived:
            text += " (" + ", ".join(f"{a}={s}" for a, s in derived.items()) + ")"
        return text

    def __str__(self) -> str:
        active = self.active()
        return ",".join(f"{a}={s}" for a, s in active.items()) if active else "one device"

    # ------------------------------------------------------------------ checks

    def findings(
        self, world_size: int | None = None, gpus_per_node: int | None = None
    ) -> list[Finding]:
        """Every problem of this layout (and, when given, against ``world_size``).

        Args:
            world_size: The ranks the job has.
            gpus_per_node: The job is launched on nodes of this many ranks (``launch``):
                a mesh of another size is told the nodes it needs, not a one-node
                ``torchrun``.

        Returns:
            ``Finding``s with path ``"mesh"``; empty when the layout is usable.
        """
        out: list[Finding] = []
        for axis in USER_AXES:
            size = getattr(self, axis)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                out.append(
                    _error(
                        f"axis {axis!r} has size {size!r}; sizes are integers >= 1.",
                        f"give {axis} a size >= 1, or leave it out (size 1).",
                        axis,
                    )
                )
        if out:
            return out
        borrow = self.dp_shard * self.cp * self.tp
        if borrow % self.ep:
            out.append(
                _error(
                    f"ep={self.ep} does not divide dp_shard x cp x tp = {self.dp_shard} x "
                    f"{self.cp} x {self.tp} = {borrow}; expert parallelism borrows its ranks "
                    "from those axes.",
                    f"pick ep among the divisors of {borrow} ({_divisors(borrow)}), or grow "
                    "dp_shard so that ep divides it.",
                    "ep",
                )
            )
        if world_size is not None and world_size != self.world_size:
            needed = self.world_size
            if gpus_per_node is None:
                launch = f"{needed} ranks (torchrun --nproc-per-node {needed})."
            elif needed % gpus_per_node == 0:
                launch = f"{needed} ranks: --nodes {needed // gpus_per_node} --gpus-per-node {gpus_per_node}."
            else:
                launch = f"{needed} ranks on nodes of a size that divides it."
            out.append(
                _error(
                    f"the mesh {self} needs pp x dp_replicate x dp_shard x cp x tp = "
                    f"{needed} ranks, but the world has {world_size}.",
                    f"make the sizes multiply to {world_size} (e.g. "
                    f"{' or '.join(map(str, self._resized(world_size)))}), or launch {launch}",
                )
            )
        return out

    def _resized(self, world_size: int) -> list[MeshLayout]:
        """Up to two layouts near this one whose dense sizes multiply to ``world_size``:
        one axis resized (dp_shard first, then the axes given), else each axis cut to
        what still divides the world and the rest put on dp_shard; ``ep`` kept where it
        still divides the axes it borrows from."""
        out: list[MeshLayout] = []
        order = ["dp_shard"] + [a for a in DENSE_AXES if a != "dp_shard" and self.size(a) > 1]
        for axis in order:
            rest = self.world_size // self.size(axis)
            if world_size % rest == 0:
                candidate = dataclasses.replace(self, **{axis: world_size // rest})
                if not candidate.findings() and candidate not in out:
                    out.append(candidate)
        if not out:
            sizes, left = {}, world_size
            for axis in DENSE_AXES:
                sizes[axis] = math.gcd(self.size(axis), left)
                left //= sizes[axis]
            sizes["dp_shard"] *= left
            borrow = sizes["dp_shard"] * sizes["cp"] * sizes["tp"]
            out.append(MeshLayout(**sizes, ep=math.gcd(self.ep, borrow)))
        return out[:2]

    def check(self, world_size: int | None = None) -> None:
        """Raise :class:`LayoutError` with every error of :meth:`findings`."""
        errors = [f for f in self.findings(world_size) if f.severity == "error"]
        if errors:
            raise LayoutError(errors)

    # ------------------------------------------------------------------ meshes

    def build(self, device_type: str = "cpu") -> ParallelMesh:
        """The :class:`ParallelMesh` of this layout on the running process group.

        Every rank must call it (it creates process groups). Works on a real group
        (gloo, NCCL) and on the fake one of the dry run alike. Under ``torchrun`` with no
        group running yet it joins torchrun's (as torch's ``init_device_mesh`` does:
        :func:`~hyper_parallel.distributed.process_group.init_process_group`).

        Raises:
            LayoutError: No process group is running and this process was not launched
                by ``torchrun``, or the world size differs from :attr:`world_size`.
        """
        if not dist.is_initialized():
            from hyper_parallel.distributed.process_group import init_process_group

            init_process_group()  # torchrun's group, when launched by it
        if not dist.is_initialized():
            raise LayoutError(
                [
                    _error(
                        f"the mesh {self} needs {self.world_size} ranks but no process "
                        "group is running.",
                        f"launch with `torchrun --nproc-per-node {self.world_size} ...` "
                        "(or call dist.init_process_group first).",
                    )
                ]
            )
        self.check(dist.get_world_size())
        return ParallelMesh(self, device_type)


class ParallelMesh:
    """The DeviceMesh views of one :class:`MeshLayout`, created once on every rank.

    ``mesh[axis]`` is a 1-D mesh for a user axis (``pp``, ``dp_replicate``,
    ``dp_shard`` — alias ``dp`` —, ``cp``, ``tp``, ``ep``) or a derived one: ``fsdp``,
    ``efsdp``, ``batch`` (dp_replicate x dp_shard: ranks that read different rows) and
    ``loss`` (dp_replicate x dp_shard x cp: ranks whose losses are averaged); :attr:`dense` is the 5-D ``(pp, dp_replicate, dp_shard, cp, tp)`` mesh and
    :meth:`submesh` slices it. Size-1 axes are kept, so every name always resolves.
    """

    def __init__(self, layout: MeshLayout, device_type: str) -> None:
        self.layout = layout
        self.device_type = device_type
        sizes = tuple(layout.size(a) for a in DENSE_AXES)
        self.dense: DeviceMesh = init_device_mesh(device_type, sizes, mesh_dim_names=DENSE_AXES)
        # Flattened views are kept here (torch deprecates slicing them from the root).
        self._views: dict[str, DeviceMesh] = {
            "fsdp": self.dense["dp_shard", "cp"]._flatten("fsdp"),
            "batch": self.dense["dp_replicate", "dp_shard"]._flatten("batch"),
            "loss": self.dense["dp_replicate", "dp_shard", "cp"]._flatten("loss"),
        }
        # ep takes the innermost ranks of dp_shard x cp x tp; efsdp the outer ones. With
        # replicas, expert states are HSDP over (edp_replicate, efsdp): the same ranks as
        # dp_replicate, named apart so that one mesh holds all three expert axes.
        self._expert_hsdp: DeviceMesh | None = None
        if layout.dp_replicate > 1 and layout.ep > 1:
            borrowed = self.dense["dp_replicate", "dp_shard", "cp", "tp"]._flatten(
                "dp_replicate_dp_shard_cp_tp"
            )
            self.sparse: DeviceMesh = borrowed._unflatten(
                0,
                (layout.dp_replicate, layout.efsdp, layout.ep),
                ("edp_replicate", "efsdp", "ep"),
            )
            self._expert_hsdp = self.sparse["edp_replicate", "efsdp"]
        else:
            borrowed = self.dense["dp_shard", "cp", "tp"]._flatten("dp_shard_cp_tp")
            self.sparse = borrowed._unflatten(0, (layout.efsdp, layout.ep), ("efsdp", "ep"))
        self._views["efsdp"] = self.sparse["efsdp"]
        self._views["ep"] = self.sparse["ep"]
        self._hsdp: DeviceMesh | None = None
        if layout.dp_replicate > 1:
            # HSDP: FSDP2 takes a 2-D (replicate, shard) mesh; shard = dp_shard x cp.
            self._hsdp = self._views["loss"]._unflatten(
                0, (layout.dp_replicate, layout.fsdp), ("dp_replicate", "fsdp")
            )

    def __getitem__(self, axis: str) -> DeviceMesh:
        axis = ALIASES.get(axis, axis)
        if axis in self._views:
            return self._views[axis]
        if axis in DENSE_AXES:
            return self.dense[axis]
        raise KeyError(
            f"{axis!r} is not an axis of this mesh; axes are {', '.join(DENSE_AXES)}, ep, "
            "and the derived fsdp, efsdp, batch (dp_replicate x dp_shard) and loss "
            "(dp_replicate x dp_shard x cp)."
        )

    def submesh(self, axes: Iterable[str]) -> DeviceMesh:
        """The dense mesh sliced to ``axes`` (in layout order), e.g. ``("cp", "tp")``."""
        names = tuple(a for a in DENSE_AXES if a in set(axes))
        return self.dense[names] if len(names) > 1 else self.dense[names[0]]

    def fsdp_mesh(self) -> DeviceMesh | None:
        """What ``fully_shard`` takes for dense states: the 1-D ``fsdp`` mesh, the 2-D
        ``(dp_replicate, fsdp)`` mesh for HSDP, or ``None`` when neither axis is > 1."""
        if self._hsdp is not None:
            return self._hsdp
        if self.layout.fsdp > 1:
            return self._views["fsdp"]
        return None

    def expert_fsdp_mesh(self) -> DeviceMesh:
        """What ``fully_shard`` takes for routed-expert states: the 1-D ``efsdp`` mesh, or
        with ``dp_replicate`` the 2-D ``(edp_replicate, efsdp)`` mesh (HSDP)."""
        return self._expert_hsdp if self._expert_hsdp is not None else self._views["efsdp"]

    def local_rank(self, axis: str) -> int:
        """This rank's coordinate along ``axis``."""
        return self[axis].get_local_rank()

    def axis_meshes(self) -> list[tuple[str, DeviceMesh]]:
        """Every named 1-D view as ``(axis, mesh)``, for labelling process groups.

        Ordered so that, where two views are the same group of ranks, the name most
        telling of what runs on it comes last (a caller building ``{group: axis}``
        keeps the last one): loss and batch groups, then the user axes, then the
        FSDP views (and the dims of the HSDP mesh).
        """
        out = [(a, self._views[a]) for a in ("loss", "batch", "efsdp", "ep")]
        out += [(a, self.dense[a]) for a in DENSE_AXES]
        out.append(("fsdp", self._views["fsdp"]))
        if self._hsdp is not None:
            out += [(a, self._hsdp[a]) for a in ("dp_replicate", "fsdp")]
        if self._expert_hsdp is not None:  # the replicas of the expert states
            out.append(("edp_replicate", self._expert_hsdp["edp_replicate"]))
        return out


def as_layout(mesh: MeshLayout | Mapping[str, int] | DeviceMesh) -> MeshLayout:
    """The :class:`MeshLayout` of a layout, an ``{axis: size}`` mapping or a named DeviceMesh.

    A DeviceMesh's dim names must be user axes (``dp`` for ``dp_shard`` allowed).

    Raises:
        LayoutError: Every problem of the sizes (unknown axis with the nearest name,
            axis given twice, size < 1, ep not dividing), in one error.
    """
    if isinstance(mesh, MeshLayout):
        return mesh
    if isinstance(mesh, DeviceMesh):
        if mesh.mesh_dim_names is None:
            raise LayoutError(
                [
                    _error(
                        "the DeviceMesh has no mesh_dim_names, so its axes cannot be read.",
                        "create it with init_device_mesh(..., mesh_dim_names=('dp_shard', "
                        "'tp')), or pass the sizes as {axis: size}.",
                    )
                ]
            )
        return MeshLayout.from_sizes(dict(zip(mesh.mesh_dim_names, mesh.shape)))
    if not isinstance(mesh, Mapping):
        raise TypeError(
            f"mesh must be a MeshLayout, an {{axis: size}} mapping or a DeviceMesh, got "
            f"{type(mesh).__name__}; e.g. {{'dp_shard': 2, 'tp': 2}}."
        )
    return MeshLayout.from_sizes(mesh)


def _add_size(
    name: str,
    size: int,
    sizes: dict[str, int],
    given: dict[str, str],
    findings: list[Finding],
) -> None:
    canonical = ALIASES.get(name, name)
    if canonical not in USER_AXES:
        known = [*USER_AXES, *ALIASES]
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close and name not in _DERIVED else ""
        derived = (
            f" {name} is derived from the others ({name} = "
            f"{'dp_shard x cp' if name == 'fsdp' else 'dp_shard x cp x tp / ep'}), not given."
            if name in _DERIVED
            else ""
        )
        findings.append(
            _error(
                f"{name!r} is not a mesh axis.{hint}{derived}",
                f"use axes among {', '.join(USER_AXES)} (dp = dp_shard).",
                name,
            )
        )
        return
    if canonical in sizes:
        first = given[canonical]
        same = (
            f"{first!r} and {name!r} both name the {canonical} axis"
            if first != name
            else f"{name!r} is given more than once"
        )
        findings.append(
            _error(
                f"{same}.",
                f"give {canonical} once.",
                name,
            )
        )
        return
    if size < 1:
        findings.append(
            _error(
                f"axis {name!r} has size {size}; sizes are integers >= 1.",
                f"give {name} a size >= 1, or leave it out (size 1).",
                name,
            )
        )
        return
    sizes[canonical] = size
    given[canonical] = name


def _error(message: str, fix: str, axis: str = "") -> Finding:
    return Finding("error", "mesh", axis, message, fix)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
