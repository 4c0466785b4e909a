"""Declarative sharding specs and placement resolution.

:class:`ShardingConfig` says, for one module, how its states, forward inputs and
outputs are placed per named mesh axis; :func:`resolve_placements` turns one
:data:`~hyper_parallel.dmodule.types.NamedPlacement` into the mesh-ordered
placement list that DTensor APIs take.

Example:
    Column-parallel weight with replicated activations::

        from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
        from hyper_parallel.dmodule.sharding import ShardingConfig
        from hyper_parallel.dmodule.types import MeshAxisName

        ShardingConfig(
            state_shardings={"weight": {MeshAxisName.TP: Shard(0)}},
            in_dst_shardings={"x": {MeshAxisName.TP: Replicate()}},
        )
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, Shard
from hyper_parallel.dmodule.types import MeshAxisName, NamedPlacement

__all__ = [
    "LocalMapConfig",
    "NamedPlacement",
    "ShardingConfig",
    "resolve_placements",
]

_REDUCE_OPS = ("sum", "avg", "max", "min", "product")


# --------------------------------------------------------------------------- placements as text


def placement_to_str(placement: Placement) -> str:
    """Write a placement as text: ``Shard(0)``, ``Replicate()``, ``Partial(sum)``.

    Raises:
        ValueError: For a placement type that has no text form (e.g. strided shards).
    """
    if type(placement) is Shard:
        return f"Shard({placement.dim})"
    if type(placement) is Replicate:
        return "Replicate()"
    if type(placement) is Partial:
        return f"Partial({placement.reduce_op})"
    raise ValueError(
        f"cannot write placement {placement!r} as text: only Shard, Replicate and Partial "
        "have a text form."
    )


# torch's own reprs too: Shard(dim=0), Partial(reduce_op=sum) (what a printed plan shows).
_SHARD_RE = re.compile(r"^(?:Shard|S)\(\s*(?:dim\s*=\s*)?(-?\d+)\s*\)$")
_REPLICATE_RE = re.compile(r"^(?:Replicate\(\s*\)|Replicate|R)$")
_PARTIAL_RE = re.compile(r"^(?:Partial|P)(?:\(\s*(?:reduce_op\s*=\s*)?['\"]?(\w*)['\"]?\s*\))?$")


def placement_from_str(text: str) -> Placement:
    """Parse placement text: ``Shard(0)``/``S(0)``, ``Replicate()``/``R``, ``Partial(sum)``/``P``.

    torch's reprs read too (``Shard(dim=0)``, ``Partial(reduce_op=avg)``).

    Raises:
        ValueError: Quoting the text, when it is none of the forms above.
    """
    if not isinstance(text, str):
        raise TypeError(f"placement text must be a str, got {type(text).__name__}: {text!r}")
    s = text.strip()
    if m := _SHARD_RE.match(s):
        return Shard(int(m.group(1)))
    if _REPLICATE_RE.match(s):
        return Replicate()
    if m := _PARTIAL_RE.match(s):
        op = m.group(1) or "sum"
        if op not in _REDUCE_OPS:
            raise ValueError(
                f"invalid placement {text!r}: Partial reduce op {op!r} is not one of {_REDUCE_OPS}."
            )
        return Partial(op)
    raise ValueError(
        f"invalid placement {text!r}: write Shard(<dim>), Replicate() or Partial(<op>) "
        "(short forms S(<dim>), R, P)."
    )


# --------------------------------------------------------------------------- validation helpers


def _axis_key(axis: MeshAxisName | str) -> str:
    """Normalize a mesh axis key to a plain string for lookup."""
    if isinstance(axis, MeshAxisName):
        return axis.value
    return str(axis)


def _check_named(named: Any, where: str) -> None:
    """Type-check one NamedPlacement; ``where`` names the field (and key) for the message."""
    if not isinstance(named, Mapping):
        raise TypeError(
            f"{where}: expected a NamedPlacement (a dict mesh axis -> Placement), "
            f"got {type(named).__name__}: {named!r}."
        )
    for axis, placement in named.items():
        if not isinstance(axis, str):  # MeshAxisName is a str
            raise TypeError(
                f"{where}: mesh axis key {axis!r} is a {type(axis).__name__}; keys must be "
                "MeshAxisName members or axis-name strings such as 'tp'."
            )
        if not isinstance(placement, Placement):
            hint = (
                f" (parse text with placement_from_str({placement!r}))"
                if isinstance(placement, str)
                else ""
            )
            raise TypeError(
                f"{where}[{_axis_key(axis)!r}]: expected a Placement such as Shard(0), "
                f"Replicate() or Partial(), got {type(placement).__name__}: {placement!r}{hint}."
            )


def _check_named_map(value: Any, field_name: str, key_kind: str) -> None:
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{field_name}: expected a dict {key_kind} -> NamedPlacement, "
            f"got {type(value).__name__}: {value!r}."
        )
    for key, named in value.items():
        if not isinstance(key, str):
            raise TypeError(
                f"{field_name}: key {key!r} is a {type(key).__name__}; keys are {key_kind} strings."
            )
        _check_named(named, f"{field_name}[{key!r}]")


def _named_to_dict(named: NamedPlacement) -> dict[str, str]:
    return {_axis_key(axis): placement_to_str(p) for axis, p in named.items()}


def _named_from_dict(data: Any, where: str) -> dict[str, Placement]:
    if not isinstance(data, Mapping):
        raise TypeError(f"{where}: expected a mapping axis -> placement, got {data!r}.")
    out: dict[str, Placement] = {}
    for axis, p in data.items():
        if not isinstance(axis, str):
            raise TypeError(f"{where}: axis key {axis!r} must be a string such as 'tp'.")
        try:
            out[axis] = p if isinstance(p, Placement) else placement_from_str(p)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}[{axis!r}]: {e}") from None
    return out


def _named_map_from_dict(data: Any, where: str) -> dict[str, dict[str, Placement]] | None:
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise TypeError(f"{where}: expected a mapping name -> {{axis: placement}}, got {data!r}.")
    return {str(k): _named_from_dict(v, f"{where}[{k!r}]") for k, v in data.items()}


def _check_keys(data: Any, allowed: Sequence[str], cls_name: str) -> None:
    if not isinstance(data, Mapping):
        raise TypeError(f"{cls_name}.from_dict: expected a dict, got {type(data).__name__}.")
    unknown = sorted(set(data) - set(allowed) - {"repr"})
    if unknown:
        raise ValueError(
            f"{cls_name}.from_dict: unknown key(s) {unknown}; allowed keys: {sorted(allowed)}."
        )


# --------------------------------------------------------------------------- configs


@dataclass(kw_only=True, slots=True)
class LocalMapConfig:
    """Gradient placement specs for a module whose ``forward`` runs under ``local_map``.

    Args:
        in_grad_placements: One :class:`~hyper_parallel.dmodule.types.NamedPlacement`
            per forward tensor input that goes through ``local_map``, in argument order:
            the placement the input's gradient is given when it leaves the region.

    Example::

        from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
        from hyper_parallel.dmodule.sharding import LocalMapConfig, ShardingConfig
        from hyper_parallel.dmodule.types import MeshAxisName

        sharding = ShardingConfig(
            state_shardings={"weight": {MeshAxisName.TP: Shard(0)}},
            local_map=LocalMapConfig(
                in_grad_placements=({MeshAxisName.TP: Replicate()},),
            ),
        )
    """

    in_grad_placements: tuple[NamedPlacement, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.in_grad_placements, tuple):
            raise TypeError(
                "LocalMapConfig.in_grad_placements: expected a tuple of NamedPlacement (one per "
                f"tensor input), got {type(self.in_grad_placements).__name__}: "
                f"{self.in_grad_placements!r}; wrap it in a tuple, e.g. ({{'tp': Replicate()}},)."
            )
        for i, named in enumerate(self.in_grad_placements):
            _check_named(named, f"LocalMapConfig.in_grad_placements[{i}]")

    def to_dict(self) -> dict:
        """Serialize to a JSON-friendly dict.

        Returns:
            Dict with a ``repr`` field for the whole spec and the structured
            ``in_grad_placements`` (axes as strings, placements as text).
        """
        return {
            "repr": repr(self),
            "in_grad_placements": [_named_to_dict(n) for n in self.in_grad_placements],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LocalMapConfig:
        """Rebuild a config from :meth:`to_dict` output (the ``repr`` key is ignored)."""
        _check_keys(data, ("in_grad_placements",), cls.__name__)
        if "in_grad_placements" not in data:
            raise ValueError("LocalMapConfig.from_dict: missing key 'in_grad_placements'.")
        grads = data["in_grad_placements"]
        if not isinstance(grads, (list, tuple)):
            raise TypeError(
                f"LocalMapConfig.from_dict: in_grad_placements must be a list, got {grads!r}."
            )
        return cls(
            in_grad_placements=tuple(
                _named_from_dict(g, f"in_grad_placements[{i}]") for i, g in enumerate(grads)
            )
        )


@dataclass(kw_only=True, slots=True)
class DispatchConfig:
    """A token dispatch that runs a module's ``forward``, chosen by name at parallelize time.

    Some layouts are not a placement of a tensor but a data-dependent exchange: routed
    experts send each token to the rank holding its expert. A dispatch is registered
    under a ``kind`` (:func:`hyper_parallel.dmodule.dispatch.register_dispatch`; the
    built-in ``"routed_experts"`` lives in :mod:`hyper_parallel.distributed.expert_parallel`)
    and takes over the module's forward on mesh axis ``axis``.

    Args:
        kind: Registered dispatch name, e.g. ``"routed_experts"``.
        axis: The mesh axis the dispatch exchanges tokens over, e.g. ``"ep"``.

    Example::

        from hyper_parallel.core.dtensor.placement_types import Shard
        from hyper_parallel.dmodule.sharding import DispatchConfig, ShardingConfig

        ShardingConfig(
            state_shardings={"w1": {"ep": Shard(0)}},
            dispatch=DispatchConfig(kind="routed_experts", axis="ep"),
        )
    """

    kind: str
    axis: str

    def __post_init__(self) -> None:
        for name in ("kind", "axis"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise TypeError(
                    f"DispatchConfig.{name}: expected a non-empty str, got "
                    f"{type(value).__name__}: {value!r}."
                )
        if isinstance(self.axis, MeshAxisName):
            object.__setattr__(self, "axis", self.axis.value)

    def to_dict(self) -> dict:
        """Serialize to a JSON-friendly dict (``kind``, ``axis``)."""
        return {"kind": self.kind, "axis": self.axis}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DispatchConfig:
        """Rebuild a config from :meth:`to_dict` output.

        Raises:
            ValueError: For a missing or unknown key.
        """
        _check_keys(data, ("kind", "axis"), cls.__name__)
        missing = [k for k in ("kind", "axis") if k not in data]
        if missing:
            raise ValueError(
                f"DispatchConfig.from_dict: missing key(s) {missing}; write e.g. "
                "{kind: routed_experts, axis: ep}."
            )
        return cls(kind=data["kind"], axis=data["axis"])


@dataclass(kw_only=True, slots=True)
class ShardingConfig:
    """Declarative sharding for one module.

    Field names for ``in_*`` must match ``forward`` argument names (positional
    arguments are mapped by name when the module is parallelized).

    Args:
        state_shardings: Parameter or buffer path (e.g. ``"weight"``, ``"norm.weight"``)
            → :data:`NamedPlacement`.
        in_src_shardings: Optional source layout of each forward input, used to wrap a
            plain tensor input as a DTensor.
        in_dst_shardings: Target layout of each forward input (redistributed if needed).
        out_src_shardings: Optional source layout(s) of the forward output(s): one
            NamedPlacement, or a tuple with one per element of a tuple output.
        out_dst_shardings: Target layout for a single tensor output (applied to each
            tensor of a tuple output). A plain-tensor output with no ``out_src_shardings``
            is taken to be laid out this way already, as inputs are with ``in_dst``.
        local_map: Optional :class:`LocalMapConfig`: run ``forward`` on local tensors.
        use_local_output: Hand plain local tensors back to the caller instead of DTensors.
        dispatch: Optional :class:`DispatchConfig`: a registered token dispatch runs
            ``forward`` (e.g. routed experts over ``ep``); it takes and returns plain
            local tensors, so it goes with ``state_shardings`` only.

    Example:
        TP column-parallel weight with replicated activations::

            from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
            from hyper_parallel.dmodule.sharding import ShardingConfig
            from hyper_parallel.dmodule.types import MeshAxisName

            ShardingConfig(
                state_shardings={
                    "weight": {MeshAxisName.TP: Shard(0)},
                },
                in_dst_shardings={
                    "x": {MeshAxisName.TP: Replicate()},
                },
                out_dst_shardings={MeshAxisName.TP: Shard(-1)},
            )
    """

    state_shardings: dict[str, NamedPlacement] = field(default_factory=dict)
    in_src_shardings: dict[str, NamedPlacement] | None = None
    in_dst_shardings: dict[str, NamedPlacement] | None = None
    out_src_shardings: NamedPlacement | tuple[NamedPlacement, ...] | None = None
    out_dst_shardings: NamedPlacement | None = None
    local_map: LocalMapConfig | None = None
    use_local_output: bool = False
    dispatch: DispatchConfig | None = None

    def __post_init__(self) -> None:
        _check_named_map(self.state_shardings, "ShardingConfig.state_shardings", "state path")
        for name in ("in_src_shardings", "in_dst_shardings"):
            value = getattr(self, name)
            if value is not None:
                _check_named_map(value, f"ShardingConfig.{name}", "forward argument name")
        out_src = self.out_src_shardings
        if isinstance(out_src, tuple):
            for i, named in enumerate(out_src):
                _check_named(named, f"ShardingConfig.out_src_shardings[{i}]")
        elif out_src is not None:
            if not isinstance(out_src, Mapping):
                raise TypeError(
                    "ShardingConfig.out_src_shardings: expected a NamedPlacement or a tuple of "
                    f"NamedPlacement (one per output), got {type(out_src).__name__}: {out_src!r}."
                )
            _check_named(out_src, "ShardingConfig.out_src_shardings")
        if self.out_dst_shardings is not None:
            _check_named(self.out_dst_shardings, "ShardingConfig.out_dst_shardings")
        if self.local_map is not None and not isinstance(self.local_map, LocalMapConfig):
            raise TypeError(
                "ShardingConfig.local_map: expected a LocalMapConfig or None, got "
                f"{type(self.local_map).__name__}: {self.local_map!r}."
            )
        if not isinstance(self.use_local_output, bool):
            raise TypeError(
                "ShardingConfig.use_local_output: expected a bool, got "
                f"{type(self.use_local_output).__name__}: {self.use_local_output!r}."
            )
        if self.dispatch is not None and not isinstance(self.dispatch, DispatchConfig):
            raise TypeError(
                "ShardingConfig.dispatch: expected a DispatchConfig or None, got "
                f"{type(self.dispatch).__name__}: {self.dispatch!r}."
            )

    def to_dict(self) -> dict:
        """Serialize to a JSON-friendly dict.

        Returns:
            Dict with a ``repr`` field for the whole spec plus one key per field, axes
            written as strings and placements as text (``"Shard(0)"``).
        """
        out_src = self.out_src_shardings
        if isinstance(out_src, tuple):
            out_src_data: Any = [_named_to_dict(n) for n in out_src]
        else:
            out_src_data = None if out_src is None else _named_to_dict(out_src)
        return {
            "repr": repr(self),
            "state_shardings": {k: _named_to_dict(v) for k, v in self.state_shardings.items()},
            "in_src_shardings": _opt_map_to_dict(self.in_src_shardings),
            "in_dst_shardings": _opt_map_to_dict(self.in_dst_shardings),
            "out_src_shardings": out_src_data,
            "out_dst_shardings": (
                None if self.out_dst_shardings is None else _named_to_dict(self.out_dst_shardings)
            ),
            "local_map": None if self.local_map is None else self.local_map.to_dict(),
            "use_local_output": self.use_local_output,
            "dispatch": None if self.dispatch is None else self.dispatch.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardingConfig:
        """Rebuild a config from :meth:`to_dict` output, or a hand-written plan entry.

        Placements may be text (``"Shard(0)"``, ``"S(0)"``, ``"R"``, ``"P"``) or
        Placement objects; missing keys take their defaults; ``repr`` is ignored.

        Raises:
            ValueError: For an unknown key or invalid placement text.
            TypeError: For a value of the wrong shape.
        """
        _check_keys(data, _SHARDING_FIELDS, cls.__name__)
        if "repr" in data and not set(data) & set(_SHARDING_FIELDS):
            empty = repr(cls())
            if str(data["repr"]).strip() != empty:
                # The repr is what to_dict writes for people; the fields are what is read.
                raise ValueError(
                    f"{cls.__name__}.from_dict: the entry holds only 'repr' "
                    f"({data['repr']!r}), which is not read: an empty config would be built. "
                    f"Write its fields ({', '.join(_SHARDING_FIELDS[:2])}, ...), as "
                    "to_dict() does beside the repr."
                )
        out_src = data.get("out_src_shardings")
        if isinstance(out_src, (list, tuple)):
            out_src = tuple(
                _named_from_dict(n, f"out_src_shardings[{i}]") for i, n in enumerate(out_src)
            )
        elif out_src is not None:
            out_src = _named_from_dict(out_src, "out_src_shardings")
        out_dst = data.get("out_dst_shardings")
        local_map = data.get("local_map")
        if local_map is not None:
            try:
                local_map = LocalMapConfig.from_dict(local_map)
            except (TypeError, ValueError) as e:
                # Prefix the field so a plan-file error reads local_map: in_grad_placements[0]...
                raise type(e)(f"local_map: {e}") from None
        dispatch = data.get("dispatch")
        if dispatch is not None:
            if not isinstance(dispatch, Mapping):
                raise TypeError(
                    f"dispatch: expected a mapping such as {{kind: routed_experts, axis: ep}}, "
                    f"got {type(dispatch).__name__}: {dispatch!r}."
                )
            try:
                dispatch = DispatchConfig.from_dict(dispatch)
            except (TypeError, ValueError) as e:
                raise type(e)(f"dispatch: {e}") from None
        return cls(
            state_shardings=_named_map_from_dict(data.get("state_shardings"), "state_shardings")
            or {},
            in_src_shardings=_named_map_from_dict(data.get("in_src_shardings"), "in_src_shardings"),
            in_dst_shardings=_named_map_from_dict(data.get("in_dst_shardings"), "in_dst_shardings"),
            out_src_shardings=out_src,
            out_dst_shardings=(
                None if out_dst is None else _named_from_dict(out_dst, "out_dst_shardings")
            ),
            local_map=local_map,
            use_local_output=data.get("use_local_output", False),
            dispatch=dispatch,
        )


_SHARDING_FIELDS = (
    "state_shardings",
    "in_src_shardings",
    "in_dst_shardings",
    "out_src_shardings",
    "out_dst_shardings",
    "local_map",
    "use_local_output",
    "dispatch",
)


def _opt_map_to_dict(value: dict[str, NamedPlacement] | None) -> dict | None:
    return None if value is None else {k: _named_to_dict(v) for k, v in value.items()}


# --------------------------------------------------------------------------- resolution


def mesh_axis_names_of(mesh: DeviceMesh | Sequence[str]) -> tuple[str, ...]:
    """Axis names of a mesh, or of a name tuple given in its place.

    Raises:
        ValueError: For a DeviceMesh created without ``mesh_dim_names``.
        TypeError: For a bare string (``"tp"`` instead of ``("tp",)``).
    """
    if isinstance(mesh, DeviceMesh):
        names = mesh.mesh_dim_names
        if names is None:
            raise ValueError(
                f"DeviceMesh {mesh} has no mesh_dim_names, so named placements cannot be "
                "resolved; create it with init_device_mesh(..., mesh_dim_names=('dp', 'tp'))."
            )
        return tuple(names)
    if isinstance(mesh, str):
        # A bare string is a Sequence[str] too; iterating it would split "tp" into "t", "p".
        raise TypeError(
            f"mesh axis names must be a tuple of axis names or a DeviceMesh, got the string "
            f"{mesh!r}; write ({mesh!r},) for a one-axis mesh."
        )
    return tuple(_axis_key(a) for a in mesh)


def resolve_placements(
    named: NamedPlacement,
    mesh_axis_names: tuple[str, ...] | DeviceMesh,
) -> list[Placement]:
    """Convert :data:`NamedPlacement` to an ordered placement list for DTensor APIs.

    The returned list aligns with ``mesh_axis_names`` (same order and length).
    Axes listed on the mesh but omitted from *named* default to
    :class:`~hyper_parallel.core.dtensor.placement_types.Replicate`. Keys in *named*
    that are not present on the mesh (including case mismatches) raise
    :class:`ValueError`.

    Args:
        named: Placement per mesh axis name (:class:`MeshAxisName` or lowercase str).
        mesh_axis_names: Names from ``DeviceMesh.mesh_dim_names`` in axis order, or
            the ``DeviceMesh`` itself.

    Returns:
        One Placement per mesh axis, suitable for
        :func:`~hyper_parallel.core.dtensor.dtensor.distribute_tensor` and
        ``DTensor.redistribute``.

    Raises:
        ValueError: If *named* declares an axis that does not appear on the mesh, or a
            DeviceMesh without axis names is passed.
        TypeError: If a key is not an axis name, a value is not a Placement, or
            ``mesh_axis_names`` is a bare string.

    Example:
        Partial TP spec on a ``(dp, tp)`` mesh — ``dp`` is filled with ``Replicate``::

            from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
            from hyper_parallel.dmodule.sharding import resolve_placements
            from hyper_parallel.dmodule.types import MeshAxisName

            mesh_axis_names = ("dp", "tp")
            named = {MeshAxisName.TP: Shard(0)}
            placements = resolve_placements(named, mesh_axis_names)
            assert placements[0].is_replicate()
            assert placements[1].is_shard(0)

        Case-sensitive matching — ``"TP"`` does not match ``"tp"``::

            resolve_placements({"TP": Shard(0)}, ("tp",))  # raises ValueError
    """
    axes = mesh_axis_names_of(mesh_axis_names)
    _check_named(named, "resolve_placements: named")
    normalized = {_axis_key(axis): placement for axis, placement in named.items()}
    extra = [a for a in normalized if a not in axes]
    if extra:
        hints = [
            f"{a!r} -> {m!r}?" for a in extra for m in axes if a.lower() == m.lower() and a != m
        ]
        hint = f" Axis names are case-sensitive: {', '.join(hints)}" if hints else ""
        raise ValueError(
            f"NamedPlacement has axes not in mesh: {sorted(extra)} (mesh axes: {list(axes)}). "
            f"Use only the mesh's axis names.{hint}"
        )
    return [normalized.get(axis, Replicate()) for axis in axes]
