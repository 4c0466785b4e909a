"""Expert parallelism: routed experts split over ``ep``, tokens sent to their experts.

A *routed-experts* module holds ``num_experts`` experts as stacked weights
``[num_experts, ...]`` and has ``forward(x (T, dim), top_k_index (T, k),
top_k_weights (T, k)) -> (T, dim)``, the router-weighted sum of each token's chosen
experts — the contract of :class:`hyper_parallel.models.qwen3_moe.GroupedExperts` and
of Hugging Face's experts modules (Qwen3-MoE, Mixtral, ...). :func:`expert_parallel`
is its plan entry: the stacked weights ``Shard(0)`` on the ``ep`` axis (each rank
holds ``num_experts / ep`` whole experts) and the ``"routed_experts"`` dispatch,
which replaces the module's forward at parallelize time with:

1. sort the rank's ``(token, choice)`` pairs expert-major and count them per expert;
2. exchange the counts (one ``all_to_all_single`` of ``num_experts`` integers);
3. send each token to the rank holding its expert (``all_to_all_single`` with uneven
   splits, autograd-aware: torch's functional collectives);
4. run the module's own ``forward`` on the local expert weights, each received token
   routed once with weight one to its local expert (the module sorts them
   expert-major and returns them in the order given; the experts' maths is the
   module's, grouped GEMM or loop alike). A module that also defines
   ``grouped_forward(x, num_tokens_per_expert)`` (the experts on tokens already in
   expert-major blocks, as :class:`~hyper_parallel.models.qwen3_moe.GroupedExperts`
   does) gets the received tokens put in local-expert order instead, and its
   outputs put back: the same numbers without routing them a second time;
5. send the results back (the transposed ``all_to_all_single``) and combine them with
   the router weights, in the order the single-device module uses.

Forward: three all-to-alls (counts, dispatch, combine); backward: the two transposes.
In eager mode they are c10d's in-place ``all_to_all_single``; under ``torch.compile``
(or on fake tensors) torch's functional collectives. Zero tokens for an expert, or
for a whole rank, is normal. The three arguments may be passed by position or by the
module's own names for them (``experts(h, router_indices=i, routing_weights=w)``); a
call with indices and weights swapped, or not shaped ``(tokens, top_k)``, is one
``ValueError`` naming the module. Everything that does not depend on the data (group,
shapes, slots, local expert ids, which forward runs, the gradients' specs) is
resolved once; per call only the split sizes are computed.

Gradients: each rank's expert gradient sums the contributions of the tokens every
``ep`` rank sent to it, i.e. of every rank's loss. Where the dense gradients are
*averaged* over the data-parallel ranks (FSDP2), divide the expert gradients by the
same number of ranks (:func:`expert_grad_divisor`); where dense gradients are summed
(each rank's loss already scaled by its share), use them as they are.

Example::

    from hyper_parallel.dmodule import parallelize_module
    from hyper_parallel.distributed.expert_parallel import expert_parallel

    plan = {"model.layers.*.mlp.experts": expert_parallel(("gate_up_proj", "down_proj"))}
    parallelize_module(hf_model, mesh["ep"], plan)   # a 1-D mesh named "ep"
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel._torch_private import DTensorSpec, TensorMeta, funcol, is_fake
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Shard
from hyper_parallel.distributed.layout import MeshLayout, ParallelMesh
from hyper_parallel.dmodule.dispatch import Dispatch, register_dispatch
from hyper_parallel.dmodule.entries import ParamView as _ParamView
from hyper_parallel.dmodule.entries import contiguous_stride as _contiguous_stride
from hyper_parallel.dmodule.entries import state_owner
from hyper_parallel.dmodule.findings import Finding, PlanEntry
from hyper_parallel.dmodule.sharding import DispatchConfig, ShardingConfig, resolve_placements
from hyper_parallel.dmodule.types import MeshAxisName

__all__ = [
    "ROUTED_EXPERTS",
    "RoutedExpertsDispatch",
    "ep_findings",
    "ep_layout_findings",
    "ep_plan_findings",
    "expert_entries",
    "expert_grad_divisor",
    "expert_parallel",
    "expert_parameters",
    "expert_shard_placement",
    "moe_layers",
    "rescale_expert_grads",
    "shard_experts",
]

ROUTED_EXPERTS = "routed_experts"


def expert_parallel(
    params: Sequence[str], *, axis: MeshAxisName | str = MeshAxisName.EP
) -> ShardingConfig:
    """The plan entry of a routed-experts module split over ``axis``.

    Args:
        params: The stacked expert weights (``[num_experts, ...]`` each), e.g.
            ``("w1", "w2", "w3")`` or Hugging Face's ``("gate_up_proj", "down_proj")``.
        axis: The expert-parallel mesh axis.

    Returns:
        A :class:`ShardingConfig`: every weight ``Shard(0)`` on ``axis``, and the
        ``"routed_experts"`` dispatch over ``axis``.

    Example:
        >>> config = expert_parallel(("w1", "w2", "w3"))
        >>> config.dispatch.kind, config.state_shardings["w1"]
        ('routed_experts', {'ep': Shard(dim=0)})
    """
    name = axis.value if isinstance(axis, MeshAxisName) else str(axis)
    if isinstance(params, str) or not params:
        raise ValueError(
            f"expert_parallel: params must be a non-empty sequence of parameter names, got "
            f"{params!r}; e.g. ('w1', 'w2', 'w3')."
        )
    return ShardingConfig(
        state_shardings={p: {name: Shard(0)} for p in params},
        dispatch=DispatchConfig(kind=ROUTED_EXPERTS, axis=name),
    )


def expert_grad_divisor(num_batch_ranks: int) -> int:
    """What to divide expert gradients by so they match dense gradients averaged over ranks.

    A rank's expert gradient is the sum over the ranks that sent it tokens, and (after
    the efsdp reduction) over all ``num_batch_ranks`` data-parallel ranks, of each
    rank's loss gradient; averaging dense gradients divides by ``num_batch_ranks``.

    Example:
        >>> expert_grad_divisor(8)
        8
    """
    if num_batch_ranks < 1:
        raise ValueError(f"expert_grad_divisor: num_batch_ranks={num_batch_ranks} must be >= 1.")
    return num_batch_ranks


def _expert_counts(flat_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    # A scatter-add rather than bincount: a static shape, so fake tensors pass too.
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat_index.device)
    return counts.index_add_(0, flat_index, torch.ones_like(flat_index))


def _even_split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


# --------------------------------------------------------------------------- model checks


def _indivisible(path: str, num_experts: int, axis: str, size: int) -> Finding:
    divisors = ", ".join(str(d) for d in range(1, num_experts + 1) if num_experts % d == 0)
    return Finding(
        "error",
        path,
        axis,
        f"{num_experts} experts cannot be split over {axis}={size} ranks (each rank holds "
        "whole experts).",
        f"use an {axis} size that divides {num_experts} ({divisors}).",
    )


def _router_of(module: nn.Module) -> tuple[str, nn.Module] | None:
    """A child that routes: an int ``top_k`` and a 2-D ``weight`` ``[num_experts, dim]``."""
    for name, child in module.named_children():
        weight = getattr(child, "weight", None)
        routes = isinstance(getattr(child, "top_k", None), int)
        if routes and isinstance(weight, torch.Tensor) and weight.ndim == 2:
            return name, child
    return None


def _experts_of(module: nn.Module) -> tuple[str, nn.Module, dict[str, int]] | None:
    """A child whose own parameters are stacked per expert: 3-D weights
    ``[num_experts, ...]``, and 2-D biases ``[num_experts, out]`` beside them (GPT-OSS)
    whose first dim is the weights' (else it is not taken for the experts)."""
    for name, child in module.named_children():
        params = {n: p for n, p in child.named_parameters(recurse=False)}
        weights = {p.shape[0] for p in params.values() if p.ndim == 3}
        if not weights or not all(p.ndim in (2, 3) for p in params.values()):
            continue
        if all(p.ndim == 3 or p.shape[0] in weights for p in params.values()):
            return name, child, {n: p.shape[0] for n, p in params.items()}
    return None


def moe_layers(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Module]]:
    """Every mixture-of-experts block of ``model``: ``(router path, router, experts path, experts)``.

    Recognised by contract, not by name: a module with a router child (an int
    ``top_k`` and a 2-D ``weight``) and an experts child (stacked 3-D weights, with
    per-expert 2-D biases or none) — our ``MoE`` and Hugging Face's sparse MoE blocks
    (GPT-OSS's too) alike.

    Example::

        layers = moe_layers(get_spec("qwen3-moe-debug").build())
        [path for path, *_ in layers]   # ['layers.0.moe.router', 'layers.1.moe.router']
    """
    out = []
    for path, module in model.named_modules():
        router, experts = _router_of(module), _experts_of(module)
        if router is not None and experts is not None:
            prefix = f"{path}." if path else ""
            out.append((prefix + router[0], router[1], prefix + experts[0], experts[1]))
    return out


def ep_findings(
    model: Any,
    layout: Any,
    *,
    layers: Sequence[tuple[str, nn.Module, str, nn.Module]] | None = None,
) -> list[Finding]:
    """Every expert-parallel problem of ``model`` on ``layout``, before any process group.

    Checks: ``ep`` divides dp_shard x cp x tp (the layout's own finding), ``top_k`` is
    at most the number of experts, the router scores as many experts as the experts
    module holds (and all its stacked weights agree), and ``ep`` divides the number of
    experts of every layer.

    Args:
        model: A model config (built here on the meta device) or a model (any
            ``nn.Module``, e.g. a Hugging Face MoE; a meta-device build is enough).
        layout: A :class:`~hyper_parallel.distributed.MeshLayout`, or the ``ep`` size.
        layers: ``moe_layers(model)``, when the caller already has them (a search
            asking about one model on many layouts).

    Returns:
        Error :class:`~hyper_parallel.dmodule.Finding` s, each with its module path and
        fix; empty when the model splits cleanly.

    Example::

        ep_findings(get_spec("qwen3-30b-a3b").config(), MeshLayout.parse("dp_shard=8,ep=6"))
    """
    if isinstance(layout, MeshLayout):
        out = [f for f in layout.findings() if f.field == "ep"]
        ep = layout.ep
    else:
        out, ep = [], int(layout)
    if not isinstance(model, nn.Module):
        with torch.device("meta"):
            model = model.build()
    for router_path, router, experts_path, experts in (
        layers if layers is not None else moe_layers(model)
    ):
        num_scored, top_k = router.weight.shape[0], router.top_k
        if top_k > num_scored:
            out.append(
                Finding(
                    "error",
                    router_path,
                    "top_k",
                    f"top_k={top_k} is more than the {num_scored} experts the router scores.",
                    f"route each token to at most {num_scored} experts (top_k <= num_experts).",
                )
            )
        counts = {n: p.shape[0] for n, p in experts.named_parameters(recurse=False)}
        if len(set(counts.values())) > 1 or num_scored not in counts.values():
            out.append(
                Finding(
                    "error",
                    experts_path,
                    "num_experts",
                    f"the router {router_path} scores {num_scored} experts but the stacked "
                    f"expert weights hold {counts}.",
                    "build router and experts with the same num_experts.",
                )
            )
            continue
        if ep > 1 and num_scored % ep:
            out.append(_indivisible(experts_path, num_scored, "ep", ep))
    return out


# --------------------------------------------------------------------------- plan checks


def _check(
    path: str,
    module: nn.Module,
    config: ShardingConfig,
    mesh_axes: Sequence[str],
    axis_sizes: Mapping[str, int] | None,
) -> list[Finding]:
    axis = config.dispatch.axis  # type: ignore[union-attr]  # only called with a dispatch
    out: list[Finding] = []

    def error(field: str, message: str, fix: str) -> None:
        out.append(Finding("error", path, field, message, fix))

    if not config.state_shardings:
        error(
            "state_shardings",
            "a routed-experts dispatch needs the stacked expert weights, and names none.",
            "name every [num_experts, ...] weight with {'ep': Shard(0)}, e.g. with "
            "expert_parallel(('w1', 'w2', 'w3')).",
        )
    num_experts: dict[str, int] = {}
    for key, named in config.state_shardings.items():
        try:
            placements = resolve_placements(named, tuple(mesh_axes))
        except ValueError:
            continue  # the generic checks report axes not on the mesh
        on_axis = placements[list(mesh_axes).index(axis)]
        others = [p for a, p in zip(mesh_axes, placements) if a != axis and not p.is_replicate()]
        if on_axis != Shard(0) or others:
            error(
                f"state_shardings[{key!r}]",
                f"is placed {dict(zip(mesh_axes, placements))}; a routed-experts weight is "
                f"split by whole experts: Shard(0) on {axis!r} and Replicate on every other "
                "axis.",
                f"write {{{axis!r}: Shard(0)}} (FSDP over efsdp is applied with fully_shard, "
                "not in the plan).",
            )
        found = state_owner(module, key)
        if found is not None:
            owner, leaf = found
            t = owner._parameters.get(leaf)
            if t is None:
                t = owner._buffers.get(leaf)
            if t is not None and t.ndim >= 1:
                num_experts[key] = t.shape[0]
    if len(set(num_experts.values())) > 1:
        error(
            "state_shardings",
            f"the expert weights disagree on the number of experts (dim 0): {num_experts}.",
            "name only the stacked [num_experts, ...] weights of one set of experts.",
        )
    elif num_experts and axis_sizes and axis in axis_sizes:
        count = next(iter(num_experts.values()))
        ep = axis_sizes[axis]
        if count % ep:
            out.append(_indivisible(path, count, axis, ep))
    out.extend(_unnamed_states(path, module, config, axis, set(num_experts.values())))
    try:
        params = [
            p
            for p in inspect.signature(module.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    if len(params) < 3:
        error(
            "dispatch",
            f"{type(module).__name__}.forward takes {[p.name for p in params]}; a routed-experts "
            "module takes (x, top_k_index, top_k_weights).",
            "apply the dispatch to the experts module itself (the one called with the router's "
            "indices and weights), not to the block around it.",
        )
    return out


def _unnamed_states(
    path: str, module: nn.Module, config: ShardingConfig, axis: str, counts: set[int]
) -> list[Finding]:
    """The module's own states the config leaves out: each one an error.

    The boundary replicates a configured module's unnamed states, but the dispatch
    runs ``forward`` on local expert weights: a replicated DTensor there meets plain
    tensors (torch: "got mixed torch.Tensor and DTensor" at the first call), and a
    per-expert state read whole would index the wrong experts.
    """
    out = []
    for store in (module._parameters, module._buffers):
        for name, t in store.items():
            if t is None or name in config.state_shardings:
                continue
            shape = list(t.shape)
            if t.ndim >= 1 and t.shape[0] in counts:
                fix = (
                    f"it holds one row per expert: name it too, {{{name!r}: {{{axis!r}: "
                    f"Shard(0)}}}} (e.g. expert_parallel((..., {name!r})))."
                )
            else:
                fix = (
                    "a routed-experts module holds only [num_experts, ...] states; move it to "
                    "the module around the experts."
                )
            out.append(
                Finding(
                    "error",
                    path,
                    "state_shardings",
                    f"does not name {type(module).__name__}.{name} (shape {shape}); the "
                    "routed-experts dispatch runs forward on each rank's local experts, where "
                    "an unnamed state would be replicated whole (a DTensor among local "
                    "tensors: torch's 'got mixed torch.Tensor and DTensor' at the first call).",
                    fix,
                )
            )
    return out


# --------------------------------------------------------------------------- the dispatch


class RoutedExpertsDispatch:
    """The forward of a routed-experts module under expert parallelism (built once).

    Args:
        path: The module's path, for error messages.
        module: The experts module (its weights already DTensors ``Shard(0)`` on the axis).
        mesh: The mesh the plan is applied on.
        config: Its ShardingConfig (with ``dispatch``).
        forward: The module's own forward, run on local weights.
    """

    def __init__(
        self,
        path: str,
        module: nn.Module,
        mesh: DeviceMesh,
        config: ShardingConfig,
        forward: Callable[..., Any],
    ) -> None:
        axis = config.dispatch.axis  # type: ignore[union-attr]
        self.path = path
        self.where = path or "<root>"  # for messages
        self.forward = forward
        self.group = mesh.get_group(axis)
        self.ep_size = mesh.size(list(mesh.mesh_dim_names or ()).index(axis))
        self.slots: list[tuple[nn.Module, str]] = []
        num_experts = 0
        for key in config.state_shardings:
            found = state_owner(module, key)
            assert found is not None, "state paths are checked before dispatches are built"
            owner, leaf = found
            self.slots.append((owner, leaf))
            num_experts = owner._parameters[leaf].shape[0]
        self.num_experts = num_experts
        self.num_local = num_experts // self.ep_size
        # Fake weights (the dry run) carry no counts: route uniformly, stated there.
        self.uniform_routing = is_fake(owner._parameters[leaf])
        # Modules that size their own bookkeeping by a `num_experts` attribute (Hugging
        # Face's experts do) see the local count while they run on local weights.
        self.count_attr = getattr(module, "num_experts", None) == num_experts
        self.module = module
        # The forward's own names for (x, top_k_index, top_k_weights): a caller may pass
        # them by keyword, as to the module's forward (checked to take three).
        self.signature = inspect.signature(forward)
        self.arg_names = tuple(
            p.name
            for p in self.signature.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        )[:3]
        self._local_ids: dict[torch.device, torch.Tensor] = {}
        # The module's experts on expert-major tokens, if it has them and its forward is
        # its class's own (a replaced forward is run as it is).
        own = getattr(forward, "__func__", None) is getattr(type(module), "forward", None)
        grouped = getattr(module, "grouped_forward", None)
        self.grouped_forward = grouped if own and callable(grouped) else None
        # Per slot: (the parameter's spec, its gradient's spec), built on first use.
        self._grad_specs: list[tuple[DTensorSpec, DTensorSpec] | None] = [None] * len(self.slots)

    def _local_expert_ids(self, device: torch.device) -> torch.Tensor:
        ids = self._local_ids.get(device)
        if ids is None:  # (source rank, local expert) blocks as they arrive
            ids = torch.arange(self.num_local, device=device).repeat(self.ep_size)
            self._local_ids[device] = ids
        return ids

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if len(args) == 3 and not kwargs:
            x, top_k_index, top_k_weights = args
        else:
            x, top_k_index, top_k_weights = self._bind(args, kwargs)
        if isinstance(x, DTensor) or isinstance(top_k_index, DTensor):
            raise ValueError(
                f"{self.where}: the routed-experts dispatch takes the rank's tokens as plain "
                "tensors, got a DTensor; hand the activations over as local tensors "
                "(use_local_output=True on the module that produces them)."
            )
        self._check_routing(x, top_k_index, top_k_weights)
        top_k = top_k_index.shape[1]
        flat_index = top_k_index.reshape(-1)
        order = torch.argsort(flat_index, stable=True)
        token_of = order // top_k
        counts = _expert_counts(flat_index, self.num_experts)
        # c10d's in-place collectives on plain tensors in eager mode; the functional ones
        # where dynamo traces or the tensors are fake.
        eager = type(x) is torch.Tensor and not torch.compiler.is_compiling()
        # (1) counts: recv_counts[r * num_local + j] = tokens rank r sends to local expert j.
        if eager:
            recv_counts = torch.empty_like(counts)
            dist.all_to_all_single(recv_counts, counts, group=self.group)
        else:
            recv_counts = funcol.wait_tensor(
                funcol.all_to_all_single(counts, None, None, self.group)
            )
        if self.uniform_routing:
            send_splits = recv_splits = _even_split(flat_index.numel(), self.ep_size)
        else:
            splits = torch.stack(
                (counts.view(self.ep_size, -1).sum(1), recv_counts.view(self.ep_size, -1).sum(1))
            ).tolist()
            send_splits, recv_splits = splits
        # (2) dispatch: each token to the rank holding its expert.
        received = self._exchange(x[token_of], recv_splits, send_splits, eager)
        y = self._run_local(received, recv_counts, sum(recv_splits))
        # (3) combine: results back to the ranks the tokens came from.
        back = self._exchange(y, send_splits, recv_splits, eager)
        weighted = back * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, token_of, weighted.to(x.dtype))

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
        """``(x, top_k_index, top_k_weights)`` from a call as the module's forward takes it."""
        try:
            bound = self.signature.bind(*args, **kwargs).arguments
        except TypeError as e:
            raise TypeError(f"{self.where}: {e} (the arguments of {self.signature})") from None
        extra = [name for name in bound if name not in self.arg_names]
        missing = [name for name in self.arg_names if bound.get(name) is None]
        if extra or missing:
            raise ValueError(
                f"{self.where}: the routed-experts dispatch sends each token to its experts "
                f"with ({', '.join(self.arg_names)}) only; got "
                + (f"{extra} besides them" if extra else f"no {missing}")
                + ". Pass exactly those three (the tokens, the chosen experts, their "
                "weights); anything else cannot travel with the tokens."
            )
        return tuple(bound[name] for name in self.arg_names)  # type: ignore[return-value]

    def _check_routing(
        self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> None:
        """The shapes and dtypes the dispatch relies on: a wrong call is one clear error."""
        x_name, index_name, weights_name = self.arg_names
        if (
            x.ndim == 2
            and top_k_index.ndim == 2
            and top_k_index.shape[0] == x.shape[0]
            and not (top_k_index.is_floating_point() or top_k_index.dtype == torch.bool)
            and top_k_weights.shape == top_k_index.shape
        ):
            return
        raise ValueError(
            f"{self.where}: the routed-experts dispatch takes {x_name} (tokens, dim), "
            f"{index_name} (tokens, top_k) integer expert ids and {weights_name} (tokens, "
            f"top_k) router weights, in that order; got {x_name} {tuple(x.shape)} {x.dtype}, "
            f"{index_name} {tuple(top_k_index.shape)} {top_k_index.dtype}, {weights_name} "
            f"{tuple(top_k_weights.shape)} {top_k_weights.dtype}. Flatten the tokens to 2-D "
            "and pass the router's top-k indices and weights as (tokens, top_k) each."
        )

    def _exchange(
        self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], eager: bool
    ) -> torch.Tensor:
        """``all_to_all_single`` with uneven splits; its backward sends the gradients back."""
        if eager:
            return _AllToAll.apply(x, out_splits, in_splits, self.group)
        out = funcol.all_to_all_single_autograd(x, out_splits, in_splits, self.group)
        return funcol.wait_tensor(out)

    def _run_local(
        self, tokens: torch.Tensor, recv_counts: torch.Tensor, num_tokens: int
    ) -> torch.Tensor:
        """The module's experts on the received ``(source rank, local expert)`` blocks.

        Returns their outputs in the order received.
        """
        # Read on every call: FSDP and checkpoint loading swap the parameters.
        params = [owner._parameters[leaf] for owner, leaf in self.slots]
        local_params = self._local_params(params)
        for (owner, leaf), local in zip(self.slots, local_params):
            owner._parameters[leaf] = local
        if self.count_attr:
            self.module.num_experts = self.num_local
        try:
            if self.grouped_forward is not None:
                y = self._run_grouped(tokens, recv_counts, num_tokens)
            else:
                local_ids = torch.repeat_interleave(
                    self._local_expert_ids(tokens.device), recv_counts, output_size=num_tokens
                )
                # The module sorts its tokens expert-major itself and returns them in the
                # order given, so the received blocks go in and come back as they are.
                ones = torch.ones(tokens.shape[0], 1, dtype=tokens.dtype, device=tokens.device)
                y = self.forward(tokens, local_ids.unsqueeze(1), ones)
            return _on_graph(y, (tokens, *local_params))
        finally:
            if self.count_attr:
                self.module.num_experts = self.num_experts
            for (owner, leaf), param in zip(self.slots, params):
                owner._parameters[leaf] = param

    def _run_grouped(
        self, tokens: torch.Tensor, recv_counts: torch.Tensor, num_tokens: int
    ) -> torch.Tensor:
        """``grouped_forward`` on the tokens in local-expert order, outputs put back."""
        per_expert = recv_counts.view(self.ep_size, self.num_local).sum(0)
        if self.num_local == 1 or self.ep_size == 1:  # the blocks are expert-major already
            return self.grouped_forward(tokens, per_expert)
        local_ids = torch.repeat_interleave(
            self._local_expert_ids(tokens.device), recv_counts, output_size=num_tokens
        )
        perm = torch.argsort(local_ids, stable=True)
        y = self.grouped_forward(tokens.index_select(0, perm), per_expert)
        # Every row written once: the inverse permutation of the gather.
        return y.new_empty(y.shape).index_copy(0, perm, y)

    def _local_params(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each DTensor parameter's local tensor, as ``to_local()`` gives it.

        The views that need a gradient are taken together by one autograd node (the
        fast path's ``_ParamView``), whose backward wraps each local gradient into a
        DTensor with a spec made once per parameter: the same ``.grad`` DTensors as
        ``to_local()``'s backward, without its global-shape computation and
        ``from_local`` on every call, and one Python autograd node per call instead of
        one per weight (a measurable share of a small expert layer's call).
        """
        if torch.compiler.is_compiling():
            return [p.to_local() if isinstance(p, DTensor) else p for p in params]
        grad_enabled = torch.is_grad_enabled()
        out = list(params)
        viewed: list[int] = []
        specs: list[DTensorSpec] = []
        for i, param in enumerate(params):
            if not isinstance(param, DTensor):
                continue
            if not (grad_enabled and param.requires_grad):
                out[i] = param._local_tensor
                continue
            viewed.append(i)
            specs.append(self._grad_spec(i, param))
        if viewed:
            views = _ParamView.apply(tuple(specs), *(params[i] for i in viewed))
            for i, view in zip(viewed, views):
                out[i] = view
        return out

    def _grad_spec(self, i: int, param: DTensor) -> DTensorSpec:
        """The spec of slot ``i``'s gradient: the parameter's, with contiguous strides."""
        spec = param._spec
        cached = self._grad_specs[i]
        if cached is None or not (cached[0] is spec or cached[0] == spec):
            meta = spec.tensor_meta
            assert meta is not None, "a DTensor parameter carries its tensor meta"
            grad_meta = TensorMeta(meta.shape, _contiguous_stride(meta.shape), meta.dtype)
            cached = (spec, DTensorSpec(spec.mesh, spec.placements, grad_meta))
            self._grad_specs[i] = cached
        return cached[1]

    def __repr__(self) -> str:
        return (
            f"RoutedExpertsDispatch(path={self.path!r}, num_experts={self.num_experts}, "
            f"ep={self.ep_size})"
        )


def _on_graph(y: torch.Tensor, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``y``, joined to the autograd graph of ``inputs`` when it is not on it already.

    An experts forward that receives no tokens may return a tensor made afresh (Hugging
    Face's eager experts skip every expert without tokens and return ``zeros_like``).
    That rank's combine would then need no gradient, and it would skip the two backward
    all-to-alls the other ranks run (they wait on it: a hang), dropping the gradients
    its own tokens get from the other ranks' experts. Joined, every rank runs them; its
    local experts get zero gradients, as the grouped path gives them.
    """
    if y.requires_grad or not torch.is_grad_enabled():
        return y
    needing = [t for t in inputs if t.requires_grad]
    return _Joined.apply(y, *needing) if needing else y


class _Joined(torch.autograd.Function):
    """Identity on its first input; zero gradients for the others."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.metas = [(t.shape, t.dtype, t.device) for t in inputs]
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        zeros = (
            torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.metas
        )
        return (grad, *zeros)


class _AllToAll(torch.autograd.Function):
    """c10d's ``all_to_all_single`` with uneven splits (eager); backward, the transpose."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


register_dispatch(Dispatch(kind=ROUTED_EXPERTS, check=_check, build=RoutedExpertsDispatch))


# --------------------------------------------------------------------------- training wiring


def expert_entries(model: nn.Module) -> tuple[list[PlanEntry], list[PlanEntry]]:
    """A Module tree's plan entries split into ``(dense, routed experts)``."""
    from hyper_parallel.dmodule.module import Module

    entries = [
        PlanEntry(path, m, m.sharding_config)
        for path, m in model.named_modules()
        if isinstance(m, Module) and m.sharding_config is not None
    ]
    experts = [e for e in entries if e.config.dispatch is not None]
    return [e for e in entries if e.config.dispatch is None], experts


def shard_experts(
    model: nn.Module,
    mesh: ParallelMesh,
    *,
    experts: Sequence[PlanEntry] | None = None,
    **fully_shard_kwargs: Any,
) -> list[str]:
    """``fully_shard`` each routed-experts module over ``mesh["efsdp"]`` (before the blocks).

    Expert states are DTensors on ``ep``; FSDP2 shards them further over ``efsdp`` (a
    2-D (efsdp, ep) layout), and the dense FSDP of the enclosing blocks then leaves them
    alone. Run after the experts are placed on ``ep`` and before the blocks'
    ``fully_shard`` (:func:`~hyper_parallel.distributed.builder.apply_parallelism` does,
    with the run's mixed-precision policy). Returns the wrapped paths.

    Args:
        model: The model (or stage), its experts already on ``ep``.
        mesh: The run's mesh.
        experts: The routed experts' plan entries; default the Module tree's own.
        fully_shard_kwargs: Passed on to ``fully_shard`` (e.g. ``mp_policy``).
    """
    from torch.distributed.fsdp import fully_shard

    if experts is None:
        _, experts = expert_entries(model)
    fsdp_mesh = mesh.expert_fsdp_mesh()  # efsdp, or (edp_replicate, efsdp) with replicas
    for entry in experts:
        fully_shard(
            entry.module,
            mesh=fsdp_mesh,
            shard_placement_fn=expert_shard_placement(entry.module, mesh["efsdp"].size()),
            **fully_shard_kwargs,
        )
    return [e.path for e in experts]


def expert_shard_placement(
    module: nn.Module, efsdp_size: int
) -> Callable[[nn.Parameter], Shard | None] | None:
    """FSDP2's ``shard_placement_fn`` for an experts module: another dim when dim 0 would pad.

    A rank's local experts (``num_experts / ep``) often number fewer than the ``efsdp``
    ranks; sharding them on dim 0 would pad most ranks' shards to a whole expert
    (rank 0 holding ``1 / num_local`` of them instead of ``1 / efsdp``). Each weight is
    then split on its first later dim that ``efsdp`` divides (the expert's hidden or
    model width, as torchtitan's dim 1). FSDP2 splits only dim 0 unevenly (padding
    it), so a weight with no such dim stays on dim 0.
    """
    counts = {_local(p).shape[0] for p in module.parameters(recurse=False)}
    if all(c % efsdp_size == 0 for c in counts):
        return None

    def placement(p: nn.Parameter) -> Shard:
        shape = _local(p).shape
        dim = next((d for d in range(1, len(shape)) if shape[d] % efsdp_size == 0), 0)
        return Shard(dim)

    return placement


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def expert_parameters(model: nn.Module) -> list[torch.Tensor]:
    """The parameters of every routed-experts module (those with a dispatch config)."""
    _, experts = expert_entries(model)
    return [p for e in experts for p in e.module.parameters()]


def rescale_expert_grads(model: nn.Module, layout: MeshLayout) -> None:
    """Bring expert gradients to the dense convention: the mean over the data ranks.

    A rank's expert gradient sums the losses of the ``ep`` ranks that sent it tokens;
    FSDP2 then averages over ``efsdp`` only. Dense gradients are averaged over all
    ``dp_shard`` ranks, so expert gradients are divided by the remaining factor,
    ``dp_shard / efsdp`` = ``ep / tp`` (``ep`` takes whole tp groups, whose ranks
    split one loss's tokens). With ``dp_replicate`` the expert states are HSDP over
    ``(edp_replicate, efsdp)``, which averages over the replicas as the dense HSDP does,
    so the factor is the same. With ``cp`` the trainer scales each rank's loss by
    ``1 / cp`` and sums the dense gradients over ``cp`` (FSDP2 averaging over
    ``dp_shard`` only), while ``efsdp`` may include cp ranks: the factor is still
    ``dp_shard / efsdp`` = ``ep / (cp x tp)``, now possibly below one (a multiplication by
    ``efsdp / dp_shard``). Call after ``backward()``.
    """
    dp_shard, efsdp = layout.dp_shard, layout.efsdp
    if dp_shard == efsdp:
        return
    with torch.no_grad():
        for p in expert_parameters(model):
            if p.grad is None:
                continue
            if dp_shard % efsdp == 0:
                p.grad.div_(dp_shard // efsdp)
            else:
                p.grad.mul_(efsdp / dp_shard)


def ep_layout_findings(layout: MeshLayout) -> list[Finding]:
    """Mesh combinations expert parallelism does not run, each refused with the alternative.

    ``ep`` with ``dp_shard``, ``cp`` and ``tp`` runs when ``ep`` takes whole
    tensor-parallel groups (``ep`` a multiple of ``tp``): each tp rank routes its own
    slice of the sequence, each cp rank its own head-tail part, and the expert replicas
    are the efsdp ranks, which FSDP2 reduces. With ``dp_replicate`` the expert states
    are HSDP over ``(edp_replicate, efsdp)``. With ``pp`` each pipeline's ranks
    borrow their own ep groups (the ``ep`` and ``efsdp`` meshes are per pp rank).
    """
    if layout.ep == 1:
        return []
    out = []
    if layout.tp > 1 and layout.ep % layout.tp:
        out.append(
            Finding(
                "error",
                "mesh",
                "ep",
                f"ep={layout.ep} with tp={layout.tp}: expert parallelism borrows whole "
                "tensor-parallel groups (each tp rank routes its own slice of the sequence); "
                "an ep group that splits a tp group leaves ranks of one tp group holding the "
                "same experts, whose gradients the trainer does not reduce or scale (not "
                "implemented).",
                f"use an ep that is a multiple of tp={layout.tp} and divides dp_shard x cp x "
                f"tp = {layout.dp_shard * layout.cp * layout.tp} (e.g. ep={layout.tp}).",
            )
        )
    return out


def ep_plan_findings(layout: MeshLayout, entries: Sequence[PlanEntry]) -> list[Finding]:
    """An error when the mesh has ``ep`` > 1 but the plan splits no routed experts.

    The ep ranks would then hold every expert and read their batch rows as plain data
    parallelism, silently: an ep size that changes nothing is refused.
    """
    if layout.ep == 1 or any(e.config.dispatch is not None for e in entries):
        return []
    return [
        Finding(
            "error",
            "mesh",
            "ep",
            f"the mesh has ep={layout.ep} but the model's sharding splits no routed experts "
            "(no config with a routed_experts dispatch).",
            "use a mixture-of-experts model (e.g. qwen3-moe-debug, whose 'ep' sharding is "
            "registered) or a plan with expert_parallel(...) entries, or leave ep out of the "
            "mesh.",
        )
    ]
