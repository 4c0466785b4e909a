"""A small trainer for the reference models: TP (+SP) x FSDP2 / HSDP, DCP checkpoints, the demo.

Public API::

    from hyper_parallel.train import TrainConfig, train

    result = train(TrainConfig(model="llama3-debug", steps=10))

Under ``torchrun`` the same run is ``python -m hyper_parallel.train.run --mesh dp=2,tp=2``
(any axes: ``--mesh dp_replicate=2,dp_shard=2``; see :mod:`hyper_parallel.train.run`);
``hyper_parallel.train.demo`` compares a run on any mesh with one process.
"""

from __future__ import annotations

from hyper_parallel.train.checkpoint import NoIntactCheckpointError as NoIntactCheckpointError
from hyper_parallel.train.checkpoint import checkpoint_path as checkpoint_path
from hyper_parallel.train.checkpoint import latest_checkpoint as latest_checkpoint
from hyper_parallel.train.checkpoint import load_checkpoint as load_checkpoint
from hyper_parallel.train.checkpoint import save_checkpoint as save_checkpoint
from hyper_parallel.train.data import DEFAULT_TEXT as DEFAULT_TEXT
from hyper_parallel.train.data import VOCAB_SIZE as VOCAB_SIZE
from hyper_parallel.train.data import TextBatches as TextBatches
from hyper_parallel.train.data import available_texts as available_texts
from hyper_parallel.train.data import load_tokens as load_tokens
from hyper_parallel.train.trainer import MODEL_AXES as MODEL_AXES
from hyper_parallel.train.trainer import TRAINER_AXES as TRAINER_AXES
from hyper_parallel.train.trainer import TrainConfig as TrainConfig
from hyper_parallel.train.trainer import Trainer as Trainer
from hyper_parallel.train.trainer import TrainResult as TrainResult
from hyper_parallel.train.trainer import build_mesh as build_mesh
from hyper_parallel.train.trainer import build_parallel_model as build_parallel_model
from hyper_parallel.train.trainer import check_config as check_config
from hyper_parallel.train.trainer import clip_grad_norm_ as clip_grad_norm_
from hyper_parallel.train.trainer import default_device as default_device
from hyper_parallel.train.trainer import model_config as model_config
from hyper_parallel.train.trainer import train as train

__all__ = [
    "DEFAULT_TEXT",
    "MODEL_AXES",
    "TRAINER_AXES",
    "VOCAB_SIZE",
    "NoIntactCheckpointError",
    "TextBatches",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "available_texts",
    "build_mesh",
    "build_parallel_model",
    "check_config",
    "checkpoint_path",
    "clip_grad_norm_",
    "default_device",
    "latest_checkpoint",
    "load_checkpoint",
    "load_tokens",
    "model_config",
    "save_checkpoint",
    "train",
]
