"""Presets: the usual tensor-parallel layouts as :class:`ShardingConfig` values.

Each function returns a plain :class:`ShardingConfig` (so a plan stays data and
can be written to a plan file), named after PyTorch's tensor-parallel styles::

    from hyper_parallel.dmodule import parallelize_module
    from hyper_parallel.dmodule.presets import colwise, rowwise

    plan = {
        "model.layers.*.self_attn.q_proj": colwise(bias=False, use_local_output=True),
        "model.layers.*.self_attn.o_proj": rowwise(use_local_output=True),
    }
    # parallelize_module(hf_model, mesh, plan)

Inputs are keyed by ``forward`` argument name: ``nn.Linear``, ``nn.Embedding`` and
``nn.LayerNorm`` call theirs ``input``; Hugging Face norms call it ``hidden_states``
and its ``Conv1D`` calls it ``x`` — pass ``input_name=`` for those. ``input`` is the
layout the argument *arrives* in (a plain tensor is read as that layout); the preset
redistributes it to what the layer needs. ``output`` is the layout handed on;
``use_local_output=True`` hands on the plain local tensor instead of a DTensor, for
code that does not speak DTensor (Hugging Face attention reshapes with ``-1`` heads).
"""

from __future__ import annotations

from hyper_parallel.core.dtensor.placement_types import Placement, Replicate, Shard
from hyper_parallel.dmodule.sharding import ShardingConfig
from hyper_parallel.dmodule.types import MeshAxisName, NamedPlacement

__all__ = [
    "colwise",
    "prepare_input",
    "replicate_input",
    "rowwise",
    "sequence_parallel_norm",
    "vocab_parallel_embedding",
]

Axis = MeshAxisName | str

# Defaults as module-level values: placements are immutable.
_REPLICATE = Replicate()
_SHARD_LAST = Shard(-1)
_SHARD_SEQUENCE = Shard(1)


def _check_placement(value: object, arg: str, preset: str) -> Placement:
    if not isinstance(value, Placement):
        raise TypeError(
            f"{preset}({arg}=...): expected a Placement such as Shard(-1) or Replicate(), "
            f"got {type(value).__name__}: {value!r}."
        )
    return value


def _inputs(
    name: str, axis: Axis, arrives: Placement, needs: Placement
) -> tuple[dict[str, NamedPlacement] | None, dict[str, NamedPlacement]]:
    """in_src (only when the arriving layout differs from the needed one) and in_dst."""
    src = None if arrives == needs else {name: {axis: arrives}}
    return src, {name: {axis: needs}}


def colwise(
    *,
    axis: Axis = "tp",
    input: Placement = _REPLICATE,
    output: Placement = _SHARD_LAST,
    use_local_output: bool = False,
    bias: bool = True,
    transposed_weight: bool = False,
    input_name: str = "input",
) -> ShardingConfig:
    """Column-wise linear: output features sharded, input replicated.

    Args:
        axis: Mesh axis to shard over.
        input: Layout the input arrives in; it is redistributed to ``Replicate()``
            (``Shard(1)`` for a sequence-parallel input: an all-gather).
        output: Layout handed on; ``Shard(-1)`` keeps the column shards, ``Replicate()``
            all-gathers them.
        use_local_output: Hand on the local tensor instead of a DTensor.
        bias: Shard the bias too; ``False`` for a layer built with ``bias=False``.
        transposed_weight: The weight is stored ``(in, out)`` (Hugging Face ``Conv1D``)
            rather than ``(out, in)`` like ``nn.Linear``.
        input_name: The ``forward`` argument that carries the input.

    Returns:
        The config: ``weight`` sharded on its output-feature dim, ``bias`` on dim 0.

    Example::

        colwise(bias=False, use_local_output=True)  # HF q_proj: local heads on each rank
    """
    input = _check_placement(input, "input", "colwise")
    output = _check_placement(output, "output", "colwise")
    states: dict[str, NamedPlacement] = {"weight": {axis: Shard(1 if transposed_weight else 0)}}
    if bias:
        states["bias"] = {axis: Shard(0)}
    src, dst = _inputs(input_name, axis, input, Replicate())
    return ShardingConfig(
        state_shardings=states,
        in_src_shardings=src,
        in_dst_shardings=dst,
        out_dst_shardings={axis: output},
        use_local_output=use_local_output,
    )


def rowwise(
    *,
    axis: Axis = "tp",
    input: Placement = _SHARD_LAST,
    output: Placement = _REPLICATE,
    use_local_output: bool = False,
    transposed_weight: bool = False,
    input_name: str = "input",
) -> ShardingConfig:
    """Row-wise linear: input features sharded, partial sums reduced on the way out.

    The bias (if any) is replicated: a configured module's unnamed states are.

    Args:
        axis: Mesh axis to shard over.
        input: Layout the input arrives in (a plain tensor from a ``colwise`` layer
            with ``use_local_output`` is read as ``Shard(-1)``); redistributed to
            ``Shard(-1)``.
        output: ``Replicate()`` (all-reduce) or ``Shard(1)`` for sequence parallel
            (reduce-scatter).
        use_local_output: Hand on the local tensor instead of a DTensor.
        transposed_weight: The weight is stored ``(in, out)`` (Hugging Face ``Conv1D``).
        input_name: The ``forward`` argument that carries the input.

    Returns:
        The config: ``weight`` sharded on its input-feature dim.

    Example::

        rowwise(use_local_output=True)  # HF o_proj / down_proj: plain residual stream
    """
    input = _check_placement(input, "input", "rowwise")
    output = _check_placement(output, "output", "rowwise")
    src, dst = _inputs(input_name, axis, input, Shard(-1))
    return ShardingConfig(
        state_shardings={"weight": {axis: Shard(0 if transposed_weight else 1)}},
        in_src_shardings=src,
        in_dst_shardings=dst,
        out_dst_shardings={axis: output},
        use_local_output=use_local_output,
    )


def vocab_parallel_embedding(
    *,
    axis: Axis = "tp",
    input: Placement = _REPLICATE,
    output: Placement = _REPLICATE,
    use_local_output: bool = False,
    input_name: str = "input",
) -> ShardingConfig:
    """Embedding table sharded by vocabulary rows; each rank looks up its own ids.

    Args:
        axis: Mesh axis to shard over.
        input: Layout the token ids arrive in; redistributed to ``Replicate()``.
        output: ``Replicate()`` (all-reduce of the masked partial lookups) or
            ``Shard(1)`` to start a sequence-parallel region (reduce-scatter).
        use_local_output: Hand on the local tensor instead of a DTensor.
        input_name: The ``forward`` argument that carries the ids.

    Returns:
        The config: ``weight`` sharded on dim 0.

    Example::

        vocab_parallel_embedding(use_local_output=True)  # HF embed_tokens
    """
    input = _check_placement(input, "input", "vocab_parallel_embedding")
    output = _check_placement(output, "output", "vocab_parallel_embedding")
    src, dst = _inputs(input_name, axis, input, Replicate())
    return ShardingConfig(
        state_shardings={"weight": {axis: Shard(0)}},
        in_src_shardings=src,
        in_dst_shardings=dst,
        out_dst_shardings={axis: output},
        use_local_output=use_local_output,
    )


def sequence_parallel_norm(
    *,
    axis: Axis = "tp",
    input: Placement = _SHARD_SEQUENCE,
    output: Placement = _SHARD_SEQUENCE,
    use_local_output: bool = False,
    input_name: str = "input",
) -> ShardingConfig:
    """A norm (or any token-wise module) run on sequence shards; its states replicated.

    Args:
        axis: Mesh axis to shard over.
        input: Layout the activations are normalized in (a plain tensor is read as
            it; a DTensor is redistributed to it).
        output: Layout handed on.
        use_local_output: Hand on the local tensor instead of a DTensor.
        input_name: The ``forward`` argument (``"hidden_states"`` for HF RMSNorm).

    Returns:
        The config; the norm's own weight/bias become replicated DTensors.

    Example::

        sequence_parallel_norm(input_name="hidden_states")  # HF input_layernorm
    """
    input = _check_placement(input, "input", "sequence_parallel_norm")
    output = _check_placement(output, "output", "sequence_parallel_norm")
    return ShardingConfig(
        in_dst_shardings={input_name: {axis: input}},
        out_dst_shardings={axis: output},
        use_local_output=use_local_output,
    )


def replicate_input(
    *input_names: str, axis: Axis = "tp", use_local_output: bool = False
) -> ShardingConfig:
    """Make the named ``forward`` arguments replicated DTensors on the way in.

    A plain tensor is wrapped as ``Replicate()``; a sharded DTensor is gathered.

    Args:
        *input_names: ``forward`` argument names (default ``"input"``).
        axis: Mesh axis.
        use_local_output: Hand on the local tensor instead of a DTensor.

    Returns:
        The config (no states named; the module's own states become replicated).

    Example::

        replicate_input("hidden_states")
    """
    names = input_names or ("input",)
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"replicate_input: argument names must be str, got {n!r}.")
    return ShardingConfig(
        in_dst_shardings={n: {axis: Replicate()} for n in names},
        use_local_output=use_local_output,
    )


def prepare_input(
    *,
    axis: Axis = "tp",
    use_local_output: bool = False,
    **arg_placements: Placement | tuple[Placement, Placement],
) -> ShardingConfig:
    """Set the layout of ``forward`` arguments by name.

    Args:
        axis: Mesh axis.
        use_local_output: Hand on the local tensor instead of a DTensor.
        **arg_placements: Argument name → the layout it needs, or a pair
            ``(arrives_as, needs)`` when a plain tensor arrives in another layout.

    Returns:
        The config.

    Example::

        prepare_input(hidden_states=(Shard(1), Replicate()))  # all-gather the sequence
    """
    if not arg_placements:
        raise ValueError(
            "prepare_input: name at least one forward argument, e.g. "
            "prepare_input(hidden_states=Replicate())."
        )
    src: dict[str, NamedPlacement] = {}
    dst: dict[str, NamedPlacement] = {}
    for name, value in arg_placements.items():
        if isinstance(value, tuple) and len(value) == 2:
            arrives = _check_placement(value[0], name, "prepare_input")
            needs = _check_placement(value[1], name, "prepare_input")
        else:
            arrives = needs = _check_placement(value, name, "prepare_input")
        s, d = _inputs(name, axis, arrives, needs)
        src.update(s or {})
        dst.update(d)
    return ShardingConfig(
        in_src_shardings=src or None,
        in_dst_shardings=dst,
        use_local_output=use_local_output,
    )
