"""Hugging Face checkpoints in and out, on any mesh: the library below the trainer (its
commands, ``verify-hf``, ``export-hf`` and ``generate``, are :mod:`hyper_parallel.hf_commands`).

- :func:`read_hf_config`: a ``config.json`` as our model config, read by the adapter of
  the registered family that has its architecture (``ModelFamily.hf``), every
  unsupported field refused;
- :func:`load_hf`: fill a model parallelized on any mesh, each rank reading only its
  slices of the safetensors files;
- :func:`save_hf`: write a model (any mesh) as safetensors shards, index and config;
- :func:`family_maps`: the one name/layout mapping per family both use (its adapter's).

Example::

    from hyper_parallel.checkpoint_hf import load_hf, read_hf_config
    from hyper_parallel.train import TrainConfig, build_mesh, build_parallel_model

    cfg = read_hf_config("ckpt/")
    run = TrainConfig(model=cfg.spec, model_overrides=cfg.model_overrides, mesh={"tp": 2})
    model = build_parallel_model(run, build_mesh(run.mesh))
    load_hf(model, "ckpt/")
"""

from __future__ import annotations

from hyper_parallel.checkpoint_hf.config import HFConfig as HFConfig
from hyper_parallel.checkpoint_hf.config import HFConfigError as HFConfigError
from hyper_parallel.checkpoint_hf.config import hf_config_from_model as hf_config_from_model
from hyper_parallel.checkpoint_hf.config import read_hf_config as read_hf_config
from hyper_parallel.checkpoint_hf.io import HFCheckpointError as HFCheckpointError
from hyper_parallel.checkpoint_hf.io import LoadReport as LoadReport
from hyper_parallel.checkpoint_hf.io import checkpoint_files as checkpoint_files
from hyper_parallel.checkpoint_hf.io import load_hf as load_hf
from hyper_parallel.checkpoint_hf.io import save_hf as save_hf
from hyper_parallel.checkpoint_hf.mapping import TensorMap as TensorMap
from hyper_parallel.checkpoint_hf.mapping import family_maps as family_maps
from hyper_parallel.checkpoint_hf.specs import register_specs as register_specs

__all__ = [
    "HFCheckpointError",
    "HFConfig",
    "HFConfigError",
    "LoadReport",
    "TensorMap",
    "checkpoint_files",
    "family_maps",
    "hf_config_from_model",
    "load_hf",
    "read_hf_config",
    "register_specs",
    "save_hf",
]
