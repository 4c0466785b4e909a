"""Compose the sharding configs of two axes into one config on their N-D mesh.

Each axis' layout function (``apply_tp``, ``apply_cp``, ...) writes placements for its
own axis only; where a module already carries a config from another axis, the two are
combined here, placement by placement, so the axes can be applied in either order.
A placement is keyed by axis name, so combining is a union of the per-axis entries;
an axis placed by both configs is an error (the same layout applied twice).

Inputs and outputs follow the boundary's own reading of a config: an input given only
in ``in_dst`` arrives in that layout (its source *is* its destination), an output given
only in ``out_dst`` leaves in it; so when one axis declares a source the other leaves
implicit, the other axis' destination fills it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hyper_parallel.distributed.layout import USER_AXES
from hyper_parallel.dmodule.sharding import LocalMapConfig, ShardingConfig
from hyper_parallel.dmodule.types import NamedPlacement

__all__ = ["ComposeError", "merge_sharding_configs"]


class ComposeError(ValueError):
    """Two configs place the same axis of the same entry (a layout applied twice)."""


def _key(axis: object) -> str:
    return str(getattr(axis, "value", axis))


def _union(a: NamedPlacement | None, b: NamedPlacement | None, where: str) -> NamedPlacement:
    out: dict[str, object] = {_key(k): v for k, v in (a or {}).items()}
    for k, v in (b or {}).items():
        name = _key(k)
        if name in out:
            raise ComposeError(
                f"{where}: axis {name!r} is placed by both configs ({out[name]!r} and {v!r}); "
                f"each axis' layout is applied once: build the config again from the plain "
                "model config and apply each axis once."
            )
        out[name] = v
    # Mesh order (outermost first), so the result does not depend on which axis came first.
    rank = {a: i for i, a in enumerate(USER_AXES)}
    ordered = sorted(out, key=lambda a: rank.get(a, len(rank)))
    return {a: out[a] for a in ordered}  # type: ignore[misc]


def _merge_inputs(
    a: ShardingConfig, b: ShardingConfig, where: str
) -> tuple[dict[str, NamedPlacement] | None, dict[str, NamedPlacement] | None]:
    a_src, a_dst = a.in_src_shardings or {}, a.in_dst_shardings or {}
    b_src, b_dst = b.in_src_shardings or {}, b.in_dst_shardings or {}
    names = list(dict.fromkeys([*a_dst, *a_src, *b_dst, *b_src]))
    src: dict[str, NamedPlacement] = {}
    dst: dict[str, NamedPlacement] = {}
    for n in names:
        if n in a_dst or n in b_dst:
            dst[n] = _union(
                a_dst.get(n, a_src.get(n)), b_dst.get(n, b_src.get(n)), f"{where} in_dst[{n!r}]"
            )
        if n in a_src or n in b_src:
            src[n] = _union(
                a_src.get(n, a_dst.get(n)), b_src.get(n, b_dst.get(n)), f"{where} in_src[{n!r}]"
            )
    return src or None, dst or None


def _merge_outputs(a: ShardingConfig, b: ShardingConfig, where: str) -> tuple[object, object]:
    a_src, b_src = a.out_src_shardings, b.out_src_shardings
    a_dst, b_dst = a.out_dst_shardings, b.out_dst_shardings
    if isinstance(a_src, tuple) or isinstance(b_src, tuple):
        if (
            a_src is not None
            and b_src is not None
            and (
                not isinstance(a_src, tuple)
                or not isinstance(b_src, tuple)
                or len(a_src) != len(b_src)
            )
        ):
            raise ComposeError(
                f"{where} out_src_shardings: one config gives {a_src!r}, the other "
                f"{b_src!r}; both must give one placement per output."
            )
        src = (
            a_src
            if b_src is None
            else b_src
            if a_src is None
            else tuple(
                _union(x, y, f"{where} out_src[{i}]") for i, (x, y) in enumerate(zip(a_src, b_src))
            )
        )
        dst = None
        if a_dst is not None or b_dst is not None:
            dst = _union(a_dst, b_dst, f"{where} out_dst")
        return src, dst
    src = None
    if a_src is not None or b_src is not None:
        src = _union(
            a_src if a_src is not None else a_dst,
            b_src if b_src is not None else b_dst,
            f"{where} out_src",
        )
    dst = None
    if a_dst is not None or b_dst is not None:
        dst = _union(
            a_dst if a_dst is not None else a_src,
            b_dst if b_dst is not None else b_src,
            f"{where} out_dst",
        )
    return src, dst


def _input_names(config: ShardingConfig, order: Sequence[str]) -> list[str]:
    """A local_map region's inputs in the order its ``in_grad_placements`` follow."""
    declared = set(config.in_dst_shardings or {}) | set(config.in_src_shardings or {})
    return [n for n in order if n in declared] + sorted(declared.difference(order))


def _grads_by_name(config: ShardingConfig, order: Sequence[str]) -> dict[str, NamedPlacement]:
    if config.local_map is None:
        return {}
    return dict(zip(_input_names(config, order), config.local_map.in_grad_placements))


def merge_sharding_configs(
    a: ShardingConfig | None,
    b: ShardingConfig,
    *,
    input_order: Sequence[str] = (),
    where: str = "",
) -> ShardingConfig:
    """One config with the placements of ``a`` and ``b`` (which place different axes).

    Args:
        a: The config a module already has (``None``: ``b`` is returned).
        b: The config of another axis.
        input_order: The module's ``forward`` argument names, in order; needed when
            either config is a ``local_map`` region, whose ``in_grad_placements`` follow
            that order.
        where: The module's path in the model config, for errors.

    Returns:
        A new :class:`ShardingConfig`.

    Raises:
        ComposeError: Both configs place the same axis of one entry.

    Example:
        >>> from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
        >>> tp = ShardingConfig(state_shardings={"weight": {"tp": Shard(0)}})
        >>> cp = ShardingConfig(state_shardings={"weight": {"cp": Replicate()}})
        >>> merge_sharding_configs(tp, cp).state_shardings["weight"]
        {'cp': Replicate(), 'tp': Shard(dim=0)}
    """
    if a is None:
        return b
    states = {
        k: _union(a.state_shardings.get(k), b.state_shardings.get(k), f"{where} state[{k!r}]")
        for k in dict.fromkeys([*a.state_shardings, *b.state_shardings])
    }
    in_src, in_dst = _merge_inputs(a, b, where)
    out_src, out_dst = _merge_outputs(a, b, where)
    local_map = None
    if a.local_map is not None or b.local_map is not None:
        merged = ShardingConfig(in_src_shardings=in_src, in_dst_shardings=in_dst)
        names = _input_names(merged, input_order)
        grads_a, grads_b = _grads_by_name(a, input_order), _grads_by_name(b, input_order)
        # An input one region leaves undeclared on its axis is as it arrives there.
        local_map = LocalMapConfig(
            in_grad_placements=tuple(
                _union(
                    grads_a.get(n, _arrival(a, n)),
                    grads_b.get(n, _arrival(b, n)),
                    f"{where} in_grad_placements[{n!r}]",
                )
                for n in names
            )
        )
    return ShardingConfig(
        state_shardings=states,
        in_src_shardings=in_src,
        in_dst_shardings=in_dst,
        out_src_shardings=out_src,  # type: ignore[arg-type]
        out_dst_shardings=out_dst,  # type: ignore[arg-type]
        local_map=local_map,
        use_local_output=a.use_local_output or b.use_local_output,
    )


def _arrival(config: ShardingConfig, name: str) -> Mapping[str, object] | None:
    dst = (config.in_dst_shardings or {}).get(name)
    return dst if dst is not None else (config.in_src_shardings or {}).get(name)
