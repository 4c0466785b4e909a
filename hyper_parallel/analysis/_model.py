"""What the analyses look at: a model config, a built model, or a model plus a plan.

A :class:`Target` builds the model on the meta device (for the static checks) or
with fake tensors (for traced runs), at full depth or with fewer identical layers,
and lists the plan's entries the way ``parallelize`` would.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hyper_parallel._torch_private import FakeTensorMode, is_fake, pytree
from hyper_parallel.config import Configurable
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dmodule.entries import parallelize_entries
from hyper_parallel.dmodule.findings import Finding, PlanEntry
from hyper_parallel.dmodule.module import Module
from hyper_parallel.dmodule.plan import match_plan
from hyper_parallel.dmodule.plan_file import load_plan
from hyper_parallel.dmodule.sharding import ShardingConfig

__all__ = [
    "Target",
    "check_sizes",
    "cp_inputs",
    "default_inputs",
    "default_loss",
    "resolve_target",
]

Plan = Mapping[str, ShardingConfig]
# Layers are traced at these two depths and extrapolated linearly (see Target.trace_depths).
TRACE_DEPTHS = (1, 2)


@dataclasses.dataclass
class Target:
    """A model to analyse and the plan that shards it.

    Attributes:
        name: Class name of the model, for reports.
        config: The model's ``Config`` (built on demand), or ``None``.
        model: The built model, or ``None``.
        plan: Module path pattern → config, or ``None`` when the model's own
            ``sharding_config``s are the plan.
        layers_field: The config field holding the list of identical layer configs
            (``"layers"``), when the model can be traced with fewer layers.
        num_layers: Length of that list.
    """

    name: str
    config: Any = None
    model: nn.Module | None = None
    plan: Plan | None = None
    layers_field: str | None = None
    num_layers: int | None = None

    # ------------------------------------------------------------------ the run plan

    def run_plan(
        self, layout: Any, meta: nn.Module, entries: Sequence[PlanEntry], **switches: Any
    ) -> Any:
        """This target's :class:`~hyper_parallel.distributed.run_plan.RunPlan` on ``layout``.

        The one constructor the analyses (``validate``, the dry run) build a run plan
        with: the same decisions and findings as the trainer's
        (:meth:`~hyper_parallel.distributed.run_plan.RunPlan.for_model`).

        Args:
            layout: The mesh.
            meta: A meta build of the target (the dry run's may have fewer identical
                layers): what the checks read.
            entries: The plan's entries on ``meta`` (:meth:`entries`).
            switches: As :meth:`~hyper_parallel.distributed.run_plan.RunPlan.for_model`
                (``pipeline_layout`` too).
        """
        from hyper_parallel.distributed.run_plan import RunPlan

        subject = self.config if self.config is not None else meta
        return RunPlan.for_subject(
            subject, layout, name=self.name, entries=entries, model=meta, **switches
        )

    # ------------------------------------------------------------------ building

    def _config_at(self, num_layers: int | None) -> Any:
        if num_layers is None or self.layers_field is None:
            return self.config
        layers = getattr(self.config, self.layers_field)
        return self.config.replace(**{self.layers_field: list(layers[:num_layers])})

    def build_meta(self, num_layers: int | None = None) -> nn.Module:
        """The model on the meta device (a built model is returned as it is)."""
        if self.model is not None:
            return self.model
        with torch.device("meta"):
            return self._config_at(num_layers).build()

    def build_fake(
        self, mode: FakeTensorMode, num_layers: int | None = None, dtype: torch.dtype | None = None
    ) -> nn.Module:
        """A copy of the model whose parameters and buffers are fake CPU tensors.

        Fake tensors have shapes, dtypes and a device but no storage; FSDP2 accepts
        them (it refuses meta parameters) and DTensor runs on them unchanged.

        Args:
            mode: The fake tensor mode the run uses.
            num_layers: Build only the first ``num_layers`` layers (configs only).
            dtype: Floating-point parameters and buffers are created in this dtype.
        """
        if self.model is None:
            model = self.build_meta(num_layers)
            _replace_states(model, _fake_factory(mode, dtype))
            return model
        # A copy that shares no storage: the memo hands deepcopy a fake tensor for
        # every parameter and buffer, so real weights are never copied.
        fakes = _fake_states(self.model, _fake_factory(mode, dtype))
        memo: dict[int, Any] = {id(old): new for old, new in fakes}
        return copy.deepcopy(self.model, memo)

    # ------------------------------------------------------------------ plan

    def entries(self, model: nn.Module) -> tuple[list[PlanEntry], list[Finding]]:
        """The (path, module, config) entries ``parallelize`` would apply, and plan problems."""
        if self.plan is not None:
            return match_plan(model, self.plan)
        entries = [
            PlanEntry(path, m, m.sharding_config)
            for path, m in model.named_modules()
            if isinstance(m, Module) and m.sharding_config is not None
        ]
        return entries, []

    def parallelize(
        self, model: nn.Module, mesh: DeviceMesh, entries: Sequence[PlanEntry] | None = None
    ) -> None:
        """Apply the plan (or the given subset of its entries) to ``model`` on ``mesh``."""
        if entries is None:
            entries, findings = self.entries(model)
        else:
            findings = []
        parallelize_entries(model, mesh, entries, findings)

    def depth_note(self, traced: Sequence[int]) -> str:
        return (
            f"{self.layers_field}: traced with {' and '.join(map(str, traced))} of "
            f"{self.num_layers} layers and extrapolated linearly (exact: every layer has the "
            "same shapes and sharding config; the run at each depth is otherwise identical)."
        )


def check_sizes(who: str, **sizes: int | None) -> None:
    """Refuse a size that is not a positive integer (``None``: not given), naming it.

    The analysis' Python entry points take what the CLI's ``--batch``/``--seq`` refuse:
    ``seq_len=0`` passed ``validate`` and failed deep in ``dry_run``'s trace (a view of
    0 elements).

    Raises:
        ValueError: ``who: name=value: ...`` with the fix.
    """
    for name, value in sizes.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{who}: {name}={value!r}: give a positive integer.")


def resolve_target(model_or_config: Any, plan: Plan | str | Path | None = None) -> Target:
    """Classify what the caller passed: a ``Config``, a built model, or a model + plan.

    Raises:
        TypeError: For anything else, or a plan that is neither a mapping nor a path.
    """
    if isinstance(plan, (str, Path)):
        plan = load_plan(plan)
    if plan is not None and not isinstance(plan, Mapping):
        raise TypeError(
            f"plan must be a dict of module path -> ShardingConfig or a plan file path, "
            f"got {type(plan).__name__}."
        )
    if isinstance(model_or_config, nn.Module):
        return Target(name=type(model_or_config).__name__, model=model_or_config, plan=plan)
    if isinstance(model_or_config, Configurable.Config) and hasattr(model_or_config, "build"):
        field, num_layers = _identical_layers(model_or_config)
        owner = type(model_or_config).__qualname__.removesuffix(".Config")
        return Target(
            name=owner,
            config=model_or_config,
            plan=plan,
            layers_field=field,
            num_layers=num_layers,
        )
    raise TypeError(
        f"expected a model Config (with build()) or an nn.Module, got "
        f"{type(model_or_config).__name__}; build Hugging Face models with "
        "hyper_parallel.hf.build_hf_model(family, device='meta') and pass a plan."
    )


def _identical_layers(config: Any) -> tuple[str | None, int | None]:
    """The one list field of module configs whose entries differ only in initializers."""
    candidates = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if (
            isinstance(value, list)
            and len(value) > max(TRACE_DEPTHS)
            and all(isinstance(c, Module.Config) for c in value)
        ):
            candidates.append((f.name, value))
    if len(candidates) != 1:
        return None, None
    name, layers = candidates[0]
    first = _structure(layers[0])
    if any(type(c) is not type(layers[0]) or _structure(c) != first for c in layers[1:]):
        return None, None
    return name, len(layers)


def _structure(config: Any) -> Any:
    """A config's fields without initializers (which may differ per layer)."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k != "param_init"}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(config.to_dict())


# ---------------------------------------------------------------------- fake states

StateFactory = Callable[[torch.Tensor, bool], torch.Tensor]


def _fake_factory(mode: FakeTensorMode, dtype: torch.dtype | None) -> StateFactory:
    def make(t: torch.Tensor, is_param: bool) -> torch.Tensor:
        # Floating-point parameters and buffers alike, as ``model.to(dtype)`` casts them.
        new_dtype = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
        with mode:
            fake = torch.empty(t.shape, dtype=new_dtype, device="cpu")
            if is_param:
                return nn.Parameter(fake, requires_grad=t.requires_grad)
        return fake

    return make


def _fake_states(model: nn.Module, make: StateFactory) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(old, new) for every distinct parameter and buffer; tied states get one new tensor."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for m in model.modules():
        for store, is_param in ((m._parameters, True), (m._buffers, False)):
            for t in store.values():
                if t is not None and id(t) not in seen:
                    seen[id(t)] = (t, make(t, is_param))
    return list(seen.values())


@contextlib.contextmanager
def fake_trace() -> Iterator[None]:
    """What the analysis' traces on fake tensors run under.

    - Hugging Face mixtures of experts run on fp32 fake tensors: ``transformers`` runs
      experts with torch's grouped GEMM where its kernel runs (on CPU too), but that
      operator's meta kernel, which fake tensors run, takes bf16 only (``plan``/``validate``
      of an fp32 Qwen3-MoE or Mixtral failed: "Expected inputs of BF16 type"). A fake
      operand other than bf16 takes transformers' own fallback (a custom operator with a
      fake kernel: the same shapes, the same tensors saved for backward). Real tensors,
      and runs without ``transformers`` imported, are untouched.
    - A kernel that fails on fake tensors is reported once, by the caller (a finding or
      a note): torch's fake-tensor logger printed its traceback to stderr besides.
    """
    moe = sys.modules.get("transformers.integrations.moe")
    original = getattr(moe, "_can_use_grouped_mm", None)

    def can_use(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> bool:
        if is_fake(weight) and weight.dtype != torch.bfloat16:
            return False
        return bool(original(input, weight, offs))

    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    if original is not None:
        moe._can_use_grouped_mm = can_use
    try:
        yield
    finally:
        fake_log.setLevel(level)
        if original is not None:
            moe._can_use_grouped_mm = original


def _replace_states(model: nn.Module, make: StateFactory) -> None:
    new = {id(old): fake for old, fake in _fake_states(model, make)}
    for m in model.modules():
        for store in (m._parameters, m._buffers):
            for name, t in store.items():
                if t is not None:
                    store[name] = new[id(t)]  # type: ignore[assignment]


# ---------------------------------------------------------------------- inputs and loss


def default_inputs(
    model: nn.Module, batch_size: int, seq_len: int, mode: FakeTensorMode
) -> tuple[torch.Tensor, ...]:
    """Fake inputs for the model's first layer: token ids for an embedding, else features.

    Raises:
        ValueError: When the first layer with parameters is neither an
            ``nn.Embedding`` nor an ``nn.Linear``; pass ``inputs=`` instead.
    """
    for path, m in model.named_modules():
        if isinstance(m, nn.Embedding):
            with mode:
                return (torch.zeros(batch_size, seq_len, dtype=torch.long),)
        if isinstance(m, nn.Linear):
            with mode:
                shape = (batch_size, seq_len, m.in_features)
                return (torch.zeros(shape, dtype=m.weight.dtype),)
        if any(p is not None for p in m._parameters.values()):
            raise ValueError(
                f"cannot infer the model's inputs: its first layer with parameters "
                f"({path or '<root>'}, {type(m).__name__}) is neither an nn.Embedding (token ids) "
                "nor an nn.Linear (features); pass inputs=(tensor, ...) explicitly."
            )
    raise ValueError("cannot infer the model's inputs: it has no parameters; pass inputs=.")


def cp_inputs(
    model: nn.Module, batch_size: int, seq_len: int, cp_size: int, mode: FakeTensorMode
) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """Rank 0's fake inputs under context parallelism: its ``seq_len / cp`` tokens and
    their global positions (head-tail), as the trainer feeds them.

    Raises:
        ValueError: ``seq_len`` not divisible by ``2 * cp_size`` (from the split).
    """
    from hyper_parallel.distributed import context_parallel

    positions = context_parallel.positions(seq_len, 0, cp_size)
    args = default_inputs(model, batch_size, positions.numel(), mode)
    return args, {"positions": mode.from_tensor(positions)}


def default_loss(output: Any, *inputs: Any) -> torch.Tensor:
    """Sum of every floating-point output that requires grad (``logits.sum()``)."""
    leaves = [
        t
        for t in pytree.tree_leaves(output)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
    ]
    if not leaves:
        raise ValueError(
            "the model's output has no floating-point tensor that requires grad, so there is "
            "no backward pass to trace; pass loss_fn=."
        )
    total = leaves[0].sum()
    for t in leaves[1:]:
        total = total + t.sum()
    return total
