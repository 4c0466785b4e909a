"""The Hugging Face adapter protocol: what a family ships so that ``checkpoint_hf``
reads and writes its checkpoints without naming it (:class:`HFAdapter`).

A family's adapter lives in its own folder (``models/<family>/hf.py``) and sits in
the ``hf`` slot of its :class:`~hyper_parallel.contract.ModelFamily`; the library
asks it for the architectures it reads, the config conversion both ways and the
tensor names with their reversible transforms.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["HFAdapter"]


@runtime_checkable
class HFAdapter(Protocol):
    """One family's Hugging Face edge.

    Attributes:
        architectures: ``config.json`` ``architectures[0]`` values it reads
            (``("LlamaForCausalLM", "MistralForCausalLM")``).
        model_types: ``model_type`` -> architecture, for configs that name no
            architecture (built in code, not yet saved).
        spec: The registered spec whose factory takes the converted config's keyword
            arguments (``"llama3-hf"``).
    """

    architectures: tuple[str, ...]
    model_types: dict[str, str]
    spec: str

    def read_config(self, reader: Any) -> dict[str, Any]:
        """The spec factory's keyword arguments of a ``config.json``.

        ``reader`` holds the raw dict and collects the fields read and the problems
        found (``checkpoint_hf.config.ConfigReader``); nothing is silently ignored.
        """
        ...

    def owns(self, config: Any) -> bool:
        """Whether ``config`` (one of our model configs) is a model of this family."""
        ...

    def write_config(self, config: Any) -> dict[str, Any]:
        """The ``config.json`` of our (unsharded) ``config``."""
        ...

    def tensor_maps(self, config: Any, *, tie_word_embeddings: bool = False) -> list[Any]:
        """Every parameter of a model built from ``config`` with the Hugging Face
        tensor(s) it is made of (``checkpoint_hf.mapping.TensorMap``)."""
        ...
