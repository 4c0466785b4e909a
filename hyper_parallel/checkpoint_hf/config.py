"""Hugging Face ``config.json`` to our model config, and back, through each family's adapter.

:func:`read_hf_config` finds the registered family whose Hugging Face adapter
(:class:`~hyper_parallel.contract.HFAdapter`, in the family's own folder) reads the
config's architecture, and turns the ``config.json`` into an :class:`HFConfig`: the
family, the registered spec and the keyword arguments of its factory, which any tool
takes as ``--model NAME --model-overrides JSON`` (the trainer's
``TrainConfig(model=..., model_overrides=...)``). Which architectures are read is the
registry's answer (:func:`hf_architectures`); this module names no family.

Nothing is silently ignored: every field either maps to our config, is checked to
hold a value our model computes identically, or is metadata that changes no number
(token ids, ``dtype``, ``transformers_version``, ...). Anything else, or a value we do
not implement, is one :class:`HFConfigError` listing each field, its value and what
is supported. An adapter reads through a :class:`ConfigReader`, which records every
field it reads and every problem it finds.

:func:`hf_config_from_model` writes the ``config.json`` of one of our configs (for
``export-hf`` of a model that did not come from Hugging Face).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from hyper_parallel.contract import HFAdapter, ModelFamily

__all__ = [
    "ConfigReader",
    "HFConfig",
    "HFConfigError",
    "family_of_model_config",
    "hf_architectures",
    "hf_config_from_model",
    "hf_families",
    "hf_spec_names",
    "load_config_json",
    "load_generation_config",
    "read_hf_config",
    "stop_token_ids",
    "token_ids",
]

# Fields that change no number our model computes (metadata, generation defaults,
# outputs transformers may return).
_METADATA = frozenset(
    {
        "_name_or_path",
        "architectures",
        "model_type",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "initializer_range",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "problem_type",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "tokenizer_class",
        "output_router_logits",
    }
)


class HFConfigError(ValueError):
    """A ``config.json`` our model cannot reproduce; ``problems`` lists each field."""

    def __init__(self, source: str, problems: list[tuple[str, Any, str]]) -> None:
        self.problems = problems
        lines = "\n".join(
            f"  {field}={json.dumps(value)}: {supported}" for field, value, supported in problems
        )
        super().__init__(
            f"{source}: {len(problems)} field(s) our model does not implement:\n{lines}"
        )


@dataclasses.dataclass(frozen=True)
class HFConfig:
    """A Hugging Face config as one of our models.

    Args:
        family: The name of the family whose adapter read it (``ModelFamily.name``).
        spec: Registered spec name whose factory takes ``model_overrides``.
        model_overrides: Keyword arguments of the family's factory (JSON values).
        raw: The ``config.json`` as read.
        generation: The ``generation_config.json`` beside it, when there is one
            (``None``: none, or the config was given as a dict).
    """

    family: str
    spec: str
    model_overrides: dict[str, Any]
    raw: dict[str, Any]
    generation: dict[str, Any] | None = None

    @property
    def tie_word_embeddings(self) -> bool:
        """Whether the checkpoint's output projection is its token embedding."""
        return bool(self.raw.get("tie_word_embeddings", False))

    @property
    def eos_token_ids(self) -> list[int]:
        """``config.json``'s end-of-sequence ids (one or several; empty when unset).

        The model's own end of text: the trainer separates documents with the first.
        Generation stops at :attr:`stop_token_ids`.
        """
        return token_ids(self.raw.get("eos_token_id"))

    @property
    def stop_token_ids(self) -> list[int]:
        """The ids generation stops at, as ``transformers``' ``generate`` takes them
        (:func:`stop_token_ids`)."""
        return stop_token_ids(self.raw, self.generation)

    def model_config(self) -> Any:
        """Our ``Transformer.Config`` (unsharded) for this checkpoint."""
        from hyper_parallel.dmodule.model_spec import get_spec

        return get_spec(self.spec).config(**self.model_overrides)


def load_config_json(
    source: str | os.PathLike[str] | dict[str, Any],
) -> tuple[dict[str, Any], str]:
    """``(the config.json as a dict, where it was read)`` of a path, its directory or a dict.

    Raises:
        FileNotFoundError: No ``config.json`` there.
    """
    if isinstance(source, dict):
        return dict(source), "config"
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"read_hf_config: no {path}; a Hugging Face checkpoint directory holds config.json "
            "next to its safetensors files."
        )
    with open(path, encoding="utf-8") as f:
        return json.load(f), path


def token_ids(value: Any) -> list[int]:
    """A token-id field (``eos_token_id``: one id, a list, or null) as a list."""
    if value is None:
        return []
    return [int(e) for e in (value if isinstance(value, list) else [value])]


def load_generation_config(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``folder/generation_config.json`` as a dict, ``None`` when there is none."""
    path = os.path.join(os.fspath(folder), "generation_config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def stop_token_ids(config: dict[str, Any] | None, generation: dict[str, Any] | None) -> list[int]:
    """The end-of-sequence ids ``transformers``' ``generate`` stops at.

    ``transformers`` loads ``generation_config.json`` when the checkpoint has one and
    takes its ``eos_token_id`` (a list of several ids, or none at all, as written),
    whatever ``config.json`` says; only without that file does it build the generation
    config from ``config.json`` (``GenerationConfig.from_model_config``). Llama-3-Instruct
    stops at ``[128001, 128009]`` from its ``generation_config.json`` while its
    ``config.json`` says 128001.

    Args:
        config: ``config.json`` (``None``: a model not from Hugging Face).
        generation: ``generation_config.json``, ``None`` when there is none.
    """
    if generation is not None:
        return token_ids(generation.get("eos_token_id"))
    return token_ids((config or {}).get("eos_token_id"))


SUPPORTED_ROPE = (
    "rope_type 'default' or 'llama3' (factor, low_freq_factor, high_freq_factor, "
    "original_max_position_embeddings)"
)
"""The rotary encodings :meth:`ConfigReader.rope` reads."""


class ConfigReader:
    """A ``config.json`` being read by a family's adapter: the raw fields, the fields
    read so far and the problems found (each ``(field, value, what is supported)``).

    Args:
        raw: The ``config.json`` as read.
    """

    def __init__(self, raw: dict[str, Any]) -> None:
        self.raw = raw
        self.used: set[str] = set()
        self.problems: list[tuple[str, Any, str]] = []

    def get(self, field: str, default: Any = None) -> Any:
        """The value of ``field`` (``default`` when absent), marked as read."""
        self.used.add(field)
        return self.raw.get(field, default)

    def problem(self, field: str, value: Any, supported: str) -> None:
        """Record that ``field=value`` is not what we implement (``supported`` is)."""
        self.problems.append((field, value, supported))

    def expect(self, field: str, allowed: tuple[Any, ...], supported: str) -> None:
        """``field``, when present, must be one of ``allowed``."""
        self.used.add(field)
        if field in self.raw and self.raw[field] not in allowed:
            self.problem(field, self.raw[field], supported)

    def required(self, *fields: str) -> list[Any]:
        """The values of ``fields``; each absent (or null) one is a problem."""
        values = []
        for field in fields:
            self.used.add(field)
            if field not in self.raw or self.raw[field] is None:
                self.problem(field, None, "required")
            values.append(self.raw.get(field))
        return values

    def rope(self) -> tuple[float, dict[str, Any] | None]:
        """``(rope_theta, llama3 frequency scaling or None)`` from ``rope_parameters`` or
        the older ``rope_scaling`` / ``rope_theta``."""
        return _rope(self.raw, self.problems, self.used)


def _rope(raw: dict[str, Any], problems: list, used: set[str]) -> tuple[float, dict | None]:
    """``(rope_theta, llama3 scaling or None)`` from ``rope_parameters`` or the older fields."""
    used.update({"rope_parameters", "rope_scaling", "rope_theta"})
    params = raw.get("rope_parameters")
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
        if "rope_theta" in raw:
            params.setdefault("rope_theta", raw["rope_theta"])
    params = dict(params)
    theta = float(params.pop("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        if params:
            problems.append(("rope_parameters", params, SUPPORTED_ROPE))
        return theta, None
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in params]
        extra = sorted(set(params) - set(keys))
        if missing or extra:
            problems.append(("rope_parameters", {"rope_type": rope_type, **params}, SUPPORTED_ROPE))
            return theta, None
        scaling = {k: params[k] for k in keys}
        scaling["original_max_position_embeddings"] = int(
            scaling["original_max_position_embeddings"]
        )
        return theta, scaling
    problems.append(("rope_parameters.rope_type", rope_type, SUPPORTED_ROPE))
    return theta, None


def hf_families() -> list[ModelFamily]:
    """The registered families that ship a Hugging Face adapter (``ModelFamily.hf``),
    each once, in registry order."""
    from hyper_parallel.dmodule.model_spec import get_spec, list_specs

    out: list[ModelFamily] = []
    for name in list_specs():
        family = get_spec(name).family
        if family.hf is not None and all(family.hf is not f.hf for f in out):
            out.append(family)
    return out


def hf_architectures() -> dict[str, ModelFamily]:
    """``architectures[0]`` of a ``config.json`` -> the family whose adapter reads it."""
    return {arch: f for f in hf_families() for arch in f.hf.architectures}


def hf_spec_names() -> set[str]:
    """The registered specs that take a converted ``config.json`` (``HFAdapter.spec``)."""
    return {f.hf.spec for f in hf_families()}


def _adapter(family: ModelFamily) -> HFAdapter:
    assert family.hf is not None  # hf_families() holds only families with an adapter
    return family.hf


def read_hf_config(source: str | os.PathLike[str] | dict[str, Any]) -> HFConfig:
    """Our model config of a Hugging Face ``config.json`` (a path, its directory, or a dict).

    Raises:
        FileNotFoundError: No ``config.json`` there.
        HFConfigError: An architecture no registered family reads, or fields its
            adapter does not implement (each listed with its value and what is
            supported).

    Example::

        cfg = read_hf_config("path/to/checkpoint")
        model = cfg.model_config().build()
    """
    raw, where = load_config_json(source)
    generation = (
        None if isinstance(source, dict) else load_generation_config(os.path.dirname(where))
    )
    archs = raw.get("architectures") or []
    families = hf_architectures()
    # Configs built in code (not yet saved) name only their model_type.
    by_type = {t: a for f in hf_families() for t, a in _adapter(f).model_types.items()}
    arch = archs[0] if archs else by_type.get(raw.get("model_type", ""))
    family = families.get(arch or "")
    if family is None:
        raise HFConfigError(where, [("architectures", archs, f"one of {sorted(families)}")])
    adapter = _adapter(family)
    reader = ConfigReader(raw)
    reader.used.update({"architectures", "model_type"})
    overrides = adapter.read_config(reader)
    for field in sorted(set(raw) - reader.used - _METADATA):
        reader.problem(field, raw[field], f"not a field of {arch} that we implement")
    if reader.problems:
        raise HFConfigError(where, reader.problems)
    return HFConfig(
        family=family.name,
        spec=adapter.spec,
        model_overrides=overrides,
        raw=raw,
        generation=generation,
    )


def _family_of_config(config: Any) -> ModelFamily:
    for family in hf_families():
        if _adapter(family).owns(config):
            return family
    raise ValueError(
        f"no Hugging Face mapping for {type(config).__qualname__}; families with one: "
        f"{', '.join(f.name for f in hf_families())}."
    )


def family_of_model_config(config: Any) -> str:
    """The name of the family whose Hugging Face adapter owns one of our configs.

    Raises:
        ValueError: A config no registered family's adapter owns.
    """
    return _family_of_config(config).name


def hf_config_from_model(config: Any, **extra: Any) -> dict[str, Any]:
    """The ``config.json`` of our (unsharded) model config, written by its family's adapter.

    Args:
        config: One of our model configs whose family ships a Hugging Face adapter.
        **extra: Fields to add or replace (``eos_token_id``, ``tie_word_embeddings``).

    Returns:
        A dict ``transformers`` reads with ``AutoConfig``; :func:`read_hf_config` maps
        it back to the same model.
    """
    raw = _adapter(_family_of_config(config)).write_config(config)
    raw.update(extra)
    return raw
