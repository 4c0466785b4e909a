"""The model a search plans for: a registered spec with overrides, or a Hugging Face config."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A registered model spec plus config overrides (what ``train.run`` takes).

    Attributes:
        spec_name: Registered name (``llama3-70b``).
        overrides: Keyword overrides of the spec's config (``--model-overrides``).
        label: How reports name it (the spec, or the Hugging Face config's path).
        weights: A Hugging Face checkpoint directory holding this model's weights
            (``--hf-config DIR`` with safetensors in it): the commands start from them
            (``--hf-checkpoint DIR``) instead of random weights.
    """

    spec_name: str
    overrides: tuple[tuple[str, Any], ...] = ()
    label: str = ""
    weights: str | None = None

    @property
    def spec(self) -> Any:
        from hyper_parallel.checkpoint_hf.specs import register_specs
        from hyper_parallel.dmodule.model_spec import get_spec

        register_specs()  # the *-hf specs of a Hugging Face config, also when named
        return get_spec(self.spec_name)

    def config(self, **extra: Any) -> Any:
        """The unsharded model config (``spec.config(**overrides, **extra)``)."""
        return self.spec.config(**{**dict(self.overrides), **extra})

    @property
    def name(self) -> str:
        return self.label or self.spec_name


def model_from_hf_config(path: str | Path) -> ModelSource:
    """A :class:`ModelSource` from a Hugging Face ``config.json`` (or its directory).

    The package's converter
    (:func:`~hyper_parallel.checkpoint_hf.config.read_hf_config`: Llama / Mistral,
    Qwen3 dense, Qwen3-MoE) gives the registered spec (``llama3-hf``, ``qwen3-hf``,
    ``qwen3-moe-hf``) and its overrides — the ``--model`` and ``--model-overrides`` the
    printed commands pass to ``train.run``; nothing is downloaded.

    Raises:
        ValueError: The file cannot be read or is not JSON, or the converter refuses
            it (:class:`~hyper_parallel.checkpoint_hf.config.HFConfigError`: an
            architecture we do not have, or each field we do not implement, named).
    """
    from hyper_parallel.checkpoint_hf.config import read_hf_config
    from hyper_parallel.checkpoint_hf.specs import register_specs

    where = f"--hf-config {str(path)!r}"
    try:
        hf = read_hf_config(path)
    except OSError as e:  # FileNotFoundError included
        raise ValueError(f"{where}: cannot read it ({e.strerror or e}).") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e}).") from None
    register_specs()
    return ModelSource(
        hf.spec,
        tuple(sorted(hf.model_overrides.items())),
        label=str(path),
        weights=hf_weights_dir(path),
    )


def hf_weights_dir(path: str | Path) -> str | None:
    """The directory of a Hugging Face ``config.json`` (or the directory given) when it
    holds weights (``*.safetensors`` or a ``*.safetensors.index.json``), else ``None``."""
    folder = Path(path)
    if not folder.is_dir():
        folder = folder.parent
    if not folder.is_dir():
        return None
    if any(p.name.endswith(".safetensors") or p.name.endswith(".safetensors.index.json")
           for p in folder.iterdir()):  # fmt: skip
        return str(folder)
    return None


def _long_enough(source: ModelSource, seq_len: int) -> tuple[ModelSource, int | None]:
    """``source`` with ``max_seq_len`` raised to ``seq_len`` when its rotary tables are
    shorter (the command then passes it in ``--model-overrides``); and the old limit."""
    limit = source.spec.family.max_seq_len(source.config())
    if limit is None or seq_len <= limit:
        return source, limit
    overrides = dict(source.overrides) | {"max_seq_len": seq_len}
    return dataclasses.replace(source, overrides=tuple(sorted(overrides.items()))), limit


def _num_experts(source: ModelSource, config: Any) -> int:
    """The routed experts of each block (the family's contract); 1 for a dense model."""
    return source.spec.family.num_experts(config) or 1
