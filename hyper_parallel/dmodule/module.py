"""The module runtime: ``Module`` = ``torch.nn.Module`` + :class:`Configurable`.

A ``Module`` is built from its ``Config``; the config may carry a
:class:`ShardingConfig` and parameter initializers. ``parallelize(mesh)`` applies
every sharding config in the tree, ``init_states()`` initializes parameters and
buffers in place, on DTensor shards too.

Example::

    import torch
    from torch import nn
    from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
    from hyper_parallel.dmodule import Module, ShardingConfig

    Linear = Module.from_nn_module(nn.Linear)
    colwise = Linear.Config(
        in_features=16,
        out_features=32,
        sharding_config=ShardingConfig(
            state_shardings={"weight": {"tp": Shard(0)}, "bias": {"tp": Shard(0)}},
            in_dst_shardings={"input": {"tp": Replicate()}},
        ),
    ).build()
    # colwise.parallelize(mesh)  # mesh: a DeviceMesh with an axis named "tp"
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from hyper_parallel.config import Configurable
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor import DTensor, distribute_tensor
from hyper_parallel.dmodule._boundary import parallelize_entries
from hyper_parallel.dmodule._checks import BOUNDARY_ATTR, Finding, PlanEntry
from hyper_parallel.dmodule.sharding import ShardingConfig

__all__ = ["Module", "ModuleDict", "ModuleList", "Sequential"]

ParamInit = Callable[[torch.Tensor], Any]


class Module(nn.Module, Configurable):
    """``torch.nn.Module`` built from a ``Config``, with declarative sharding.

    A subclass declares ``@dataclass(kw_only=True, slots=True) class Config(Module.Config)``
    and ``__init__(self, config)``; ``Config.build()`` constructs it and attaches the
    config's ``param_init`` and ``sharding_config``.

    Example::

        import dataclasses
        import torch
        from torch import nn
        from hyper_parallel.dmodule import Module

        class Scale(Module):
            @dataclasses.dataclass(kw_only=True, slots=True)
            class Config(Module.Config):
                size: int = 4

            def __init__(self, config: "Scale.Config") -> None:
                super().__init__()
                self.weight = nn.Parameter(torch.empty(config.size))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x * self.weight

        scale = Scale.Config(param_init={"weight": nn.init.ones_}).build()
        scale.init_states()
        assert torch.equal(scale(torch.ones(4)), torch.ones(4))
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        """Fields every module config has.

        Args:
            param_init: Parameter name → in-place initializer (``fn(tensor)``), used by
                :meth:`Module.init_states`.
            sharding_config: How this module's states and activations are placed.
        """

        param_init: dict[str, ParamInit] | None = None
        sharding_config: ShardingConfig | None = None

    _hp_param_init: ClassVar[dict[str, ParamInit] | None] = None
    _hp_sharding_config: ClassVar[ShardingConfig | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        if "Config" not in cls.__dict__:
            if _init_owner(cls) is not None:
                # An nn class mixed in (``class E(nn.Embedding, Module)``): a Config with
                # one field per constructor argument.
                cls.Config = _config_from_signature(cls)
            else:
                # No fields of its own: an empty subclass of the parent's Config, so that
                # ``Sub.Config().build()`` builds ``Sub``, not the parent.
                cls.Config = _empty_config(cls)
        super().__init_subclass__(**kwargs)

    @classmethod
    def _from_config(cls, config: Module.Config, **runtime_kwargs: Any) -> Module:
        owner = _init_owner(cls)
        if owner is not None:  # nn class constructor: fields are its keyword arguments
            kwargs = {
                f.name: getattr(config, f.name)
                for f in dataclasses.fields(config)
                if f.name not in ("param_init", "sharding_config")
            }
            module = cls(**kwargs, **runtime_kwargs)
        else:
            module = cls(config, **runtime_kwargs)
        _check_param_init(module, config.param_init)
        sharding = config.sharding_config
        if sharding is not None and not isinstance(sharding, ShardingConfig):
            raise TypeError(
                f"{type(config).__qualname__}.sharding_config: expected a ShardingConfig or "
                f"None, got {type(sharding).__name__}: {sharding!r}; write "
                "ShardingConfig(state_shardings=...), or ShardingConfig.from_dict(d) for a "
                "dict in plan-file form."
            )
        module._hp_param_init = config.param_init
        module._hp_sharding_config = config.sharding_config
        if type(module).compute_buffers is not Module.compute_buffers:
            # Buffers the module computes (rotary tables) are never in a state dict: built
            # on a real device they are computed now, and again after a load_state_dict
            # (they were torch.empty until init_states: NaN logits after a load alone).
            _compute_real_buffers(module)
            module.register_load_state_dict_post_hook(_recompute_after_load)
        return module

    @property
    def sharding_config(self) -> ShardingConfig | None:
        """The :class:`ShardingConfig` this module was built with (read-only)."""
        return self._hp_sharding_config

    @property
    def param_init(self) -> dict[str, ParamInit] | None:
        """Parameter initializers this module was built with (read-only)."""
        return self._hp_param_init

    @classmethod
    def from_nn_module(cls, nn_cls: type[nn.Module]) -> type[Module]:
        """A ``Module`` subclass of a ``torch.nn`` class (cached: same class every call).

        Its ``Config`` has one field per constructor argument, e.g.
        ``Module.from_nn_module(nn.Linear).Config(in_features=4, out_features=8)``.
        """
        return _from_nn_module(nn_cls)

    # ------------------------------------------------------------------ parallelize

    def parallelize(self, mesh: DeviceMesh) -> Module:
        """Apply every ``sharding_config`` in this module's tree on ``mesh``.

        States named in ``state_shardings`` become DTensors; ``forward`` of each
        configured module adapts its inputs and outputs. The whole tree is checked
        first: on any problem a :class:`ValueError` lists all of them, each with its
        module path, and nothing is changed.

        Args:
            mesh: A DeviceMesh with ``mesh_dim_names``.

        Returns:
            ``self``, parallelized in place.
        """
        entries = [
            PlanEntry(path, m, m.sharding_config)
            for path, m in self.named_modules()
            if isinstance(m, Module) and m.sharding_config is not None
        ]
        extra = []
        if getattr(self, "_hp_parallelized", False) and not any(
            getattr(e.module, BOUNDARY_ATTR, None) is not None for e in entries
        ):
            extra.append(
                Finding(
                    "error",
                    "",
                    "",
                    f"{type(self).__name__} is already parallelized.",
                    "parallelize a model once; build a fresh model to apply another plan.",
                )
            )
        parallelize_entries(self, mesh, entries, extra)
        self._hp_parallelized = True
        return self

    # ------------------------------------------------------------------ init

    def init_states(self, *, buffer_device: torch.device | str | None = None) -> None:
        """Initialize parameters and buffers in place, children first.

        Own parameters use ``param_init[name]``; any without one are reset by the
        class's ``reset_parameters()``; buffers are recomputed by
        :meth:`compute_buffers`. Works on DTensor states and after ``to_empty()`` of a
        model built on the meta device, so each rank initializes only its shards.

        Args:
            buffer_device: Where recomputed buffers go; defaults to where they are
                (or, for meta buffers, to the device of the module's parameters).

        Raises:
            ValueError: A parameter has no initializer and the class no
                ``reset_parameters`` (a plain ``nn.Module`` in the tree included,
                checked before anything is initialized); the message names module
                path and parameter.
        """
        _check_plain_initializers(self)
        self._init_states("", buffer_device)

    def _init_states(self, path: str, buffer_device: torch.device | str | None) -> None:
        for child_path, child in _module_children(self, path):
            child._init_states(child_path, buffer_device)
        self._init_self_params(path)
        self._init_self_buffers(buffer_device)

    def _init_self_params(self, path: str) -> None:
        params = {n: p for n, p in self._parameters.items() if p is not None}
        if not params:
            return
        inits = self.param_init or {}
        missing = [n for n in params if n not in inits]
        reset = getattr(self, "reset_parameters", None)
        if missing and reset is None:
            raise ValueError(
                f"{path or '<root>'}: {type(self).__name__} has no initializer for "
                f"parameter(s) {missing} and no reset_parameters(); add them to "
                "Config.param_init (e.g. {'weight': nn.init.zeros_})."
            )
        with torch.no_grad(), _full_parameters(self):
            if missing:
                reset()
            for name, init in inits.items():
                if name in params:
                    init(self._parameters[name])

    def compute_buffers(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Full (unsharded) values of this module's own buffers; override to define them.

        Returns:
            Buffer name → value. Buffers not returned are left as they are.
        """
        return {}

    def _init_self_buffers(self, buffer_device: torch.device | str | None) -> None:
        own = {n: b for n, b in self._buffers.items() if b is not None}
        if not own:
            return
        device = torch.device(buffer_device) if buffer_device is not None else None
        if device is None:
            device = _state_device(self)
        for name, value in self.compute_buffers(device).items():
            old = own.get(name)
            if isinstance(old, DTensor):
                value = value.to(dtype=old.dtype)
                # Every rank computes the same full value: no communication needed.
                value = distribute_tensor(
                    value, old.device_mesh, old.placements, src_data_rank=None
                )
            elif old is not None:
                value = value.to(dtype=old.dtype)
            self._buffers[name] = value


def _check_param_init(module: nn.Module, param_init: dict[str, ParamInit] | None) -> None:
    """Refuse initializers for parameters the module does not have.

    ``init_states`` would skip them (``reset_parameters`` covers the real ones), so a
    misspelled key would leave a parameter with its default init and no error.
    """
    if not param_init:
        return
    # A parameter registered as None (``bias=False``) is a known name: its initializer
    # simply has nothing to do.
    unknown = sorted(name for name in param_init if name not in module._parameters)
    if unknown:
        has = ", ".join(module._parameters) or "none"
        near = [m for n in unknown for m in difflib.get_close_matches(n, module._parameters, n=1)]
        hint = f"did you mean {near}? " if near else ""
        raise ValueError(
            f"{type(module).__name__}.Config.param_init names {unknown}, which are not "
            f"parameters of {type(module).__name__} (has: {has}); {hint}key param_init by "
            "the module's own parameter names (a child's parameters go in the child's config)."
        )


def _check_plain_initializers(root: Module) -> None:
    """Refuse plain ``nn.Module``s in the tree whose parameters nothing would initialize.

    A plain module is initialized only by its own ``reset_parameters``; without one,
    ``init_states`` would pass over its parameters and leave whatever ``to_empty``
    allocated (a model built on the meta device would silently differ from one device).
    """
    missing = []
    for path, module in root.named_modules():
        if isinstance(module, Module) or getattr(module, "reset_parameters", None) is not None:
            continue
        names = [n for n, p in module._parameters.items() if p is not None]
        if names:
            missing.append(f"{path or '<root>'} ({type(module).__name__}: {', '.join(names)})")
    if missing:
        raise ValueError(
            f"init_states: {'; '.join(missing)}: plain nn.Module(s) with parameters and no "
            "reset_parameters(), so nothing would initialize them (after to_empty() they "
            "hold uninitialized memory); give the class a reset_parameters() that sets them, "
            "or make it a Module and name initializers in its Config.param_init."
        )


def _compute_real_buffers(module: Module) -> None:
    """``module``'s computed buffers, where they live on a real device (a meta build keeps
    them for ``init_states(buffer_device=...)`` after ``to_empty``)."""
    own = [b for b in module._buffers.values() if b is not None]
    local = [b.to_local() if isinstance(b, DTensor) else b for b in own]
    if own and all(b.device.type != "meta" for b in local):
        with torch.no_grad():
            module._init_self_buffers(None)


def _recompute_after_load(module: nn.Module, incompatible_keys: Any) -> None:
    _compute_real_buffers(module)  # type: ignore[arg-type]


def _state_device(module: nn.Module) -> torch.device:
    for t in [*module._buffers.values(), *module.parameters()]:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.device.type != "meta":
            return local.device
    return torch.device("cpu")


def _module_children(module: nn.Module, path: str) -> Iterator[tuple[str, Module]]:
    """Child ``Module``s, looking through plain ``nn.Module`` wrappers.

    Plain modules on the way are reset with their own ``reset_parameters`` if they
    have parameters, so a plain ``nn.Linear`` inside a ``Module`` is initialized too.
    """
    for name, child in module.named_children():
        child_path = f"{path}.{name}" if path else name
        if isinstance(child, Module):
            yield child_path, child
        else:
            yield from _module_children(child, child_path)
            reset = getattr(child, "reset_parameters", None)
            if reset is not None and any(p is not None for p in child._parameters.values()):
                with torch.no_grad(), _full_parameters(child):
                    reset()


@contextlib.contextmanager
def _full_parameters(module: nn.Module) -> Iterator[None]:
    """Let initializers see full-size plain parameters; copy each back after.

    Every rank draws the same full values in the same order as a single process
    would, so a model initialized sharded equals the one initialized on one device,
    at any mesh. (DTensor's own random ops do not guarantee this on every device.)
    The full tensor exists only while one module is initialized. Parameters stored in
    a low-precision float (``--dtype bf16-true``) are drawn in float32 too and rounded
    when copied back, so they start from the float32 model's values, rounded.
    """
    staged = {
        n: p
        for n, p in module._parameters.items()
        if p is not None and (isinstance(p, DTensor) or p.dtype in _LOW_PRECISION)
    }
    if not staged:
        yield
        return
    fulls = {}
    for name, p in staged.items():
        local = p.to_local() if isinstance(p, DTensor) else p
        fulls[name] = nn.Parameter(
            torch.empty(
                p.shape,
                dtype=torch.float32 if p.dtype in _LOW_PRECISION else p.dtype,
                device=local.device,
            ),
            requires_grad=p.requires_grad,
        )
        module._parameters[name] = fulls[name]
    try:
        yield
    finally:
        for name, p in staged.items():
            module._parameters[name] = p
    with torch.no_grad():
        for name, p in staged.items():
            full = fulls[name].detach()
            if not isinstance(p, DTensor):
                p.copy_(full)
                continue
            shard = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(shard.to_local())


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _init_owner(cls: type) -> type[nn.Module] | None:
    """The torch ``nn`` class whose constructor ``cls`` uses, if not a Module's own."""
    for klass in cls.__mro__:
        if "__init__" in klass.__dict__:
            if issubclass(klass, Module) or klass is nn.Module:
                return None
            return klass if issubclass(klass, nn.Module) else None
    return None


def _config_from_signature(cls: type) -> type:
    owner = _init_owner(cls)
    assert owner is not None
    fields: list[tuple[str, Any, Any]] = []
    for p in inspect.signature(owner.__init__).parameters.values():
        if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in ("device", "dtype"):  # runtime arguments, passed to build()
            continue
        default = dataclasses.MISSING if p.default is inspect.Parameter.empty else _field(p.default)
        fields.append((p.name, Any, default))
    parent = next(b.__dict__["Config"] for b in cls.__mro__[1:] if "Config" in b.__dict__)
    config = dataclasses.make_dataclass(
        "Config",
        [(n, t, d) if d is not dataclasses.MISSING else (n, t) for n, t, d in fields],
        bases=(parent,),
        kw_only=True,
        slots=True,
    )
    config.__qualname__ = f"{cls.__qualname__}.Config"
    config.__module__ = cls.__module__
    return config


def _empty_config(cls: type) -> type:
    parent = next(b.__dict__["Config"] for b in cls.__mro__[1:] if "Config" in b.__dict__)
    config = dataclasses.make_dataclass("Config", [], bases=(parent,), kw_only=True, slots=True)
    config.__qualname__ = f"{cls.__qualname__}.Config"
    config.__module__ = cls.__module__
    return config


def _field(default: Any) -> Any:
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d))
    return default


@functools.cache
def _from_nn_module(nn_cls: type[nn.Module]) -> type[Module]:
    if not (isinstance(nn_cls, type) and issubclass(nn_cls, nn.Module)):
        raise TypeError(f"from_nn_module: expected an nn.Module subclass, got {nn_cls!r}.")
    if issubclass(nn_cls, Module):
        return nn_cls
    return type(nn_cls.__name__, (nn_cls, Module), {"__module__": __name__})


ModuleList = _from_nn_module(nn.ModuleList)
ModuleDict = _from_nn_module(nn.ModuleDict)
Sequential = _from_nn_module(nn.Sequential)
