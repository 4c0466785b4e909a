"""Configurable base class: objects built from nested, typed config dataclasses."""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import enum
import functools
import sys
from collections.abc import Iterator
from typing import Any, ClassVar, TypeVar

import torch

__all__ = ["Configurable"]

_C = TypeVar("_C", bound="Configurable.Config")

# A key inside a config tree: a dataclass field name, a list/tuple index or a dict key.
_Key = Any

# The configs inside the copy an enclosing ``build`` made and has not yet handed to a
# nested build, by id (the objects are held, so no id is reused meanwhile). A nested
# build takes its config from there instead of copying it again: a model's build copies
# its config tree once, not once per level (an 80-layer model built ~4x faster).
_PRIVATE: contextvars.ContextVar[dict[int, Any] | None] = contextvars.ContextVar(
    "hyper_parallel_private_configs", default=None
)


class Configurable:
    """Base class for objects constructed from a nested ``Config`` dataclass.

    A subclass declares its ``Config`` in its class body, subclassing the
    parent's ``Config`` and decorated with ``@dataclass(kw_only=True, slots=True)``.
    The config is then bound to its owner, so ``config.build()`` constructs it.

    Example:
        >>> from dataclasses import dataclass
        >>> class Scale(Configurable):
        ...     @dataclass(kw_only=True, slots=True)
        ...     class Config(Configurable.Config):
        ...         factor: float = 2.0
        ...     def __init__(self, config, *, offset=0.0):
        ...         self.config, self.offset = config, offset
        >>> Scale.Config(factor=3.0).build(offset=1.0).config.factor
        3.0
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        """Base of every config: a plain value describing how to build its owner."""

        # Set on each subclass by ``Configurable.__init_subclass__``; never a field.
        _owner: ClassVar[type[Configurable] | None] = None

        def build(self, **runtime_kwargs: Any) -> Configurable:
            """Construct the owner from a deep copy of this config.

            Args:
                **runtime_kwargs: Arguments that are not part of the config
                    (a device, a process group), passed through to the owner.

            Returns:
                A new instance of the ``Configurable`` that declares this config.

            Raises:
                TypeError: If this config class is not declared inside a
                    ``Configurable`` subclass.
                ValueError: If a runtime argument is also a config field.

            Example:
                >>> from dataclasses import dataclass
                >>> class Box(Configurable):
                ...     @dataclass(kw_only=True, slots=True)
                ...     class Config(Configurable.Config):
                ...         size: int = 1
                ...     def __init__(self, config):
                ...         self.config = config
                >>> Box.Config(size=2).build().config
                Box.Config(size=2)
            """
            owner = _owner_of(type(self))
            overlap = sorted(set(runtime_kwargs) & {f.name for f in dataclasses.fields(self)})
            if overlap:
                raise ValueError(
                    f"{type(self).__qualname__}.build(): runtime arguments must not be config "
                    f"fields, but received {overlap}; set them with "
                    f"config.replace({', '.join(f'{name}=...' for name in overlap)}).build() instead."
                )
            private = _PRIVATE.get()
            if private is not None and private.get(id(self)) is self:
                # Part of the enclosing build's own copy, handed out once: no copy needed.
                del private[id(self)]
                return owner._from_config(self, **runtime_kwargs)
            config = copy.deepcopy(self)
            token = _PRIVATE.set({id(c): c for c in _nested_configs(config)})
            try:
                return owner._from_config(config, **runtime_kwargs)
            finally:
                _PRIVATE.reset(token)

        def replace(self: _C, **changes: Any) -> _C:
            """Return a copy of this config with some fields changed.

            Args:
                **changes: New values, keyed by field name.

            Returns:
                A new config of the same class; this one is left unchanged.

            Raises:
                TypeError: If a name in ``changes`` is not a field of this config.

            Example:
                >>> from dataclasses import dataclass
                >>> class Box(Configurable):
                ...     @dataclass(kw_only=True, slots=True)
                ...     class Config(Configurable.Config):
                ...         size: int = 1
                >>> Box.Config().replace(size=5)
                Box.Config(size=5)
            """
            names = [f.name for f in dataclasses.fields(self) if f.init]
            unknown = sorted(set(changes) - set(names))
            if unknown:
                raise TypeError(
                    f"{type(self).__qualname__}.replace(): {unknown} are not fields of this "
                    f"config (has: {', '.join(names) or 'no fields'}); pass only those names."
                )
            return dataclasses.replace(self, **changes)

        def to_dict(self) -> dict[str, Any]:
            """Return the fields as a nested, JSON-serialisable dict.

            Nested configs and dataclasses become dicts, objects with a
            ``to_dict()`` method their ``to_dict()``, tuples lists, enums their
            value, functions and classes a dotted name, dtypes ``"torch.float32"``;
            anything else not JSON-native becomes its ``repr``.

            Returns:
                A dict from field name to a JSON-friendly value.

            Example:
                >>> from collections.abc import Callable
                >>> from dataclasses import dataclass
                >>> class Act(Configurable):
                ...     @dataclass(kw_only=True, slots=True)
                ...     class Config(Configurable.Config):
                ...         fn: Callable[..., torch.Tensor] = torch.nn.functional.silu
                ...         dtype: torch.dtype = torch.bfloat16
                >>> Act.Config().to_dict()
                {'fn': 'torch.nn.functional.silu', 'dtype': 'torch.bfloat16'}
            """
            return {f.name: _to_jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}

        def traverse(self, config_cls: type[_C]) -> Iterator[tuple[str, _C, Any, _Key]]:
            """Yield every instance of ``config_cls`` in this config tree, root included.

            The walk goes through dataclass fields, list and tuple elements and
            dict values, depth first, yielding a node before its children. After
            a node is yielded, the walk descends into whatever is then at its
            place, so a caller may swap the node in place: ``setattr(parent, key,
            new)`` when ``parent`` is a dataclass, ``parent[key] = new`` when it is
            a list or dict. Tuples are immutable; replace their owner instead.

            Args:
                config_cls: The config class to look for (subclasses match too).

            Yields:
                ``(path, config, parent, key)``: the dotted path from the root
                (``"layers.3.attention"``; ``""`` for the root), the config, its
                container (``None`` for the root) and its key in that container.

            Example:
                >>> from dataclasses import dataclass, field
                >>> class Leaf(Configurable):
                ...     @dataclass(kw_only=True, slots=True)
                ...     class Config(Configurable.Config):
                ...         size: int = 1
                >>> class Tree(Configurable):
                ...     @dataclass(kw_only=True, slots=True)
                ...     class Config(Configurable.Config):
                ...         leaves: list[Leaf.Config] = field(default_factory=list)
                >>> tree = Tree.Config(leaves=[Leaf.Config(), Leaf.Config()])
                >>> [path for path, *_ in tree.traverse(Leaf.Config)]
                ['leaves.0', 'leaves.1']
            """
            yield from _walk(self, config_cls, "", None, None)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Check and bind the ``Config`` declared in the subclass body, if any."""
        super().__init_subclass__(**kwargs)
        config_cls = cls.__dict__.get("Config")
        if config_cls is None:
            return
        parent = next(
            base.__dict__["Config"] for base in cls.__mro__[1:] if "Config" in base.__dict__
        )
        name = f"{cls.__qualname__}.Config"
        if not (isinstance(config_cls, type) and issubclass(config_cls, parent)):
            raise TypeError(
                f"{name} must subclass {parent.__qualname__}, but received {config_cls!r}; "
                f"declare it as `class Config({parent.__qualname__}): ...`."
            )
        if (
            "__dataclass_fields__" not in config_cls.__dict__
            or "__slots__" not in config_cls.__dict__
        ):
            raise TypeError(
                f"{name} must be a slotted dataclass, but it is not decorated with "
                f"@dataclass(kw_only=True, slots=True); add that decorator."
            )
        positional = [f.name for f in dataclasses.fields(config_cls) if not f.kw_only]
        if positional:
            raise TypeError(
                f"{name} fields must be keyword-only, but {positional} are positional; "
                f"decorate it with @dataclass(kw_only=True, slots=True)."
            )
        bound = config_cls.__dict__.get("_owner")
        if bound is not None and bound is not cls:
            raise TypeError(
                f"{name} is {bound.__qualname__}.Config, which already belongs to "
                f"{bound.__qualname__}; a config builds exactly one class, so declare a "
                f"subclass: `class Config({bound.__qualname__}.Config): ...`."
            )
        # Slotted dataclasses only restrict instance attributes, so a class attribute is fine.
        config_cls._owner = cls

    @classmethod
    def _from_config(cls, config: Configurable.Config, **runtime_kwargs: Any) -> Configurable:
        """Construct ``cls`` from an already-copied config; subclasses may extend this."""
        return cls(config, **runtime_kwargs)


def _nested_configs(config: Configurable.Config) -> Iterator[Configurable.Config]:
    """Every config inside ``config`` (not itself), through fields, lists, tuples and dicts."""
    stack: list[Any] = [getattr(config, f.name) for f in dataclasses.fields(config)]
    while stack:
        value = stack.pop()
        if isinstance(value, Configurable.Config):
            yield value
            stack.extend(getattr(value, f.name) for f in dataclasses.fields(value))
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())


def _owner_of(config_cls: type[Configurable.Config]) -> type[Configurable]:
    """Return the class that declared ``config_cls`` (not one it inherited from)."""
    owner = config_cls.__dict__.get("_owner")
    if owner is None:
        raise TypeError(
            f"{config_cls.__qualname__} cannot be built: it is not declared as `Config` in the "
            f"body of a Configurable subclass; declare it there or build that class's Config."
        )
    return owner


def _qualified_name(obj: Any) -> str:
    """Return a dotted import name for a function or class, e.g. ``torch.relu``."""
    module = getattr(obj, "__module__", None)
    name = getattr(obj, "__name__", None)
    if module and name and getattr(sys.modules.get(module), name, None) is obj:
        return f"{module}.{name}"  # Prefer the public alias (torch.relu) to the qualname.
    qualname = getattr(obj, "__qualname__", name)
    return f"{module}.{qualname}" if module else str(qualname)


def _to_jsonable(value: Any) -> Any:
    """Convert one config value to a JSON-friendly value (see ``Config.to_dict``)."""
    if isinstance(value, enum.Enum):
        return _to_jsonable(value.value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, torch.dtype | torch.device):
        return str(value)
    if isinstance(value, functools.partial):
        args = [_qualified_name(value.func)]
        args += [repr(a) for a in value.args] + [f"{k}={v!r}" for k, v in value.keywords.items()]
        return f"functools.partial({', '.join(args)})"
    if isinstance(value, type) or (callable(value) and hasattr(value, "__qualname__")):
        return _qualified_name(value)
    if callable(getattr(value, "to_dict", None)):
        return _to_jsonable(value.to_dict())
    if dataclasses.is_dataclass(value):
        return {f.name: _to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {
            k if isinstance(k, str) else str(_to_jsonable(k)): _to_jsonable(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_to_jsonable(v) for v in value]
    return repr(value)


def _children(node: Any) -> list[tuple[_Key, Any]]:
    """Return a snapshot of ``(key, child)`` pairs of a dataclass, list, tuple or dict."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node)]
    if isinstance(node, list | tuple):
        return list(enumerate(node))
    if isinstance(node, dict):
        return list(node.items())
    return []


def _get(parent: Any, key: _Key) -> Any:
    """Read ``key`` from ``parent`` the way ``_children`` enumerated it."""
    return getattr(parent, key) if dataclasses.is_dataclass(parent) else parent[key]


def _walk(
    node: Any, config_cls: type[_C], path: str, parent: Any, key: _Key
) -> Iterator[tuple[str, _C, Any, _Key]]:
    """Pre-order walk behind ``Config.traverse``; re-reads a node after yielding it."""
    if isinstance(node, config_cls):
        yield path, node, parent, key
        if parent is not None:
            node = _get(parent, key)  # The caller may have swapped it in place.
    for child_key, child in _children(node):
        child_path = f"{path}.{child_key}" if path else str(child_key)
        yield from _walk(child, config_cls, child_path, node, child_key)
