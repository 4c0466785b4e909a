"""Plan files: a mapping *module path → ShardingConfig* stored as YAML or JSON.

A plan file is data only. YAML is read with ``yaml.safe_load``'s loader (no Python tags,
no object construction), JSON with :mod:`json`; nothing in a plan file can run code. A
key given twice in one mapping (a module path, a state) is refused: both readers would
keep the last silently (:mod:`hyper_parallel.config.data_files`)::

    # plan.yaml
    layers.*.attention.wq:
      state_shardings: {weight: {tp: Shard(0)}}
      out_dst_shardings: {tp: Shard(-1)}
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import yaml

from hyper_parallel.config.data_files import DuplicateKeyError, load_json, load_yaml
from hyper_parallel.dmodule.sharding import ShardingConfig

__all__ = ["dump_plan", "load_plan", "plan_from_dict", "plan_to_dict"]

_YAML_SUFFIXES = (".yaml", ".yml")
_JSON_SUFFIXES = (".json",)


def _format_of(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in _YAML_SUFFIXES:
        return "yaml"
    if suffix in _JSON_SUFFIXES:
        return "json"
    raise ValueError(
        f"plan file {str(path)!r}: unknown suffix {suffix!r}; use .yaml, .yml or .json."
    )


def plan_to_dict(plan: Mapping[str, ShardingConfig]) -> dict[str, dict]:
    """Plan → plain dict (module path → config dict without the ``repr`` key).

    Args:
        plan: Module path pattern → ShardingConfig.

    Returns:
        Module path → the config's non-default fields, placements as text.

    Raises:
        TypeError: If a value is not a ShardingConfig.

    Example::

        from hyper_parallel.dmodule.plan_file import plan_to_dict
        from hyper_parallel.dmodule.presets import rowwise

        data = plan_to_dict({"down": rowwise()})
        assert data["down"]["out_dst_shardings"] == {"tp": "Replicate()"}
    """
    out: dict[str, dict] = {}
    for path, config in plan.items():
        if not isinstance(config, ShardingConfig):
            raise TypeError(
                f"plan[{path!r}]: expected a ShardingConfig, got {type(config).__name__}."
            )
        data = config.to_dict()
        data.pop("repr")
        if data.get("local_map") is not None:
            data["local_map"].pop("repr")
        # Defaults are left out so a file says only what the plan sets.
        defaults = ShardingConfig().to_dict()
        out[path] = {k: v for k, v in data.items() if v != defaults[k]}
    return out


def plan_from_dict(data: object, source: str = "plan") -> dict[str, ShardingConfig]:
    """Plain dict (module path → config dict) → plan; errors name the entry.

    Args:
        data: What a plan file holds, e.g. ``{"up": {"state_shardings": ...}}``.
        source: Where ``data`` came from, for error messages.

    Returns:
        Module path pattern → :class:`ShardingConfig`.

    Raises:
        ValueError: For a non-mapping ``data``, a non-string path or an invalid entry.
        TypeError: For an entry field of the wrong shape.

    Example::

        from hyper_parallel.core.dtensor.placement_types import Shard
        from hyper_parallel.dmodule.plan_file import plan_from_dict

        plan = plan_from_dict({"up": {"state_shardings": {"weight": {"tp": "S(0)"}}}})
        assert plan["up"].state_shardings == {"weight": {"tp": Shard(0)}}
    """
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ValueError(
            f"{source}: expected a mapping of module path -> sharding config, "
            f"got {type(data).__name__}."
        )
    plan: dict[str, ShardingConfig] = {}
    for path, entry in data.items():
        if not isinstance(path, str):
            raise ValueError(f"{source}: module path {path!r} must be a string.")
        try:
            plan[path] = ShardingConfig.from_dict(entry if entry is not None else {})
        except (TypeError, ValueError) as e:
            raise type(e)(f"{source}: entry {path!r}: {e}") from None
    return plan


def load_plan(path: str | Path) -> dict[str, ShardingConfig]:
    """Read a plan file (``.yaml``/``.yml`` or ``.json``).

    Args:
        path: The file.

    Returns:
        Module path (``*`` matches one path segment) → :class:`ShardingConfig`.

    Raises:
        ValueError: For an unknown suffix, unsafe YAML (``!!python/...`` tags), a
            syntax error, a key given twice, or an invalid entry; the message names file
            and entry.

    Example::

        plan = load_plan("examples/plans/hf_llama_tp.yaml")
    """
    path = Path(path)
    fmt = _format_of(path)
    text = path.read_text()
    try:
        data = load_yaml(text) if fmt == "yaml" else load_json(text)
    except DuplicateKeyError as e:  # two entries for one module: the first was dropped
        raise ValueError(f"plan file {str(path)!r}: {e}") from None
    except yaml.constructor.ConstructorError as e:
        raise ValueError(
            f"plan file {str(path)!r}: tag not allowed ({e.problem}); plan files hold plain "
            "data only — write placements as text such as 'Shard(0)'."
        ) from None
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise ValueError(f"plan file {str(path)!r}: cannot parse: {e}") from None
    return plan_from_dict(data, source=f"plan file {str(path)!r}")


def dump_plan(plan: Mapping[str, ShardingConfig], path: str | Path) -> None:
    """Write a plan to ``.yaml``/``.yml`` or ``.json`` (format chosen by suffix).

    Args:
        plan: Module path pattern → ShardingConfig.
        path: The file to write; its suffix picks the format.

    Raises:
        ValueError: For an unknown suffix.
        TypeError: If a value is not a ShardingConfig.

    Example::

        import os
        import tempfile
        from hyper_parallel.dmodule.plan_file import dump_plan, load_plan
        from hyper_parallel.dmodule.presets import colwise

        path = os.path.join(tempfile.mkdtemp(), "plan.yaml")
        dump_plan({"layers.*.up": colwise()}, path)
        assert load_plan(path) == {"layers.*.up": colwise()}
    """
    path = Path(path)
    fmt = _format_of(path)
    data = plan_to_dict(plan)
    if fmt == "yaml":
        text = yaml.safe_dump(data, sort_keys=False, default_flow_style=None)
    else:
        text = json.dumps(data, indent=2) + "\n"
    path.write_text(text)
