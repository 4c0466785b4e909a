"""The model specs that take a converted ``config.json`` (``HFAdapter.spec``, e.g.
``<family>-hf``): each family registers its own next to its presets, with the family's
:class:`~hyper_parallel.contract.ModelFamily` (sharding, loss, pipeline, its Hugging
Face adapter), so a checkpoint's model runs wherever a preset does:
``TrainConfig(model=cfg.spec, model_overrides=cfg.model_overrides)``, ``plan``,
``validate``, the dry run. Sizes a config does not give are the family's debug
preset's; given no sizes at all, each refuses (name the config.json).
"""

from __future__ import annotations

from hyper_parallel.dmodule.model_spec import list_specs

__all__ = ["register_specs"]


def register_specs() -> None:
    """Load the registry, the ``*-hf`` specs of every family with an adapter included
    (each family registers its own; later calls do nothing)."""
    list_specs()
