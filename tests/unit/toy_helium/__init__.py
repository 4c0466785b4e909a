"""A toy family in one folder: a Helium-shaped decoder (``HeliumForCausalLM``) built
from the shared decoder's layers, and its Hugging Face adapter.

Helium is Llama-shaped but rotates adjacent pairs of a rotary head, as ours does, so
its adapter permutes no q/k rows (``rotate_half = False``): the one way it differs.
Registering it is one line (``register_hf_spec(FAMILY, helium_hf_config)``); nothing
outside this folder names it.
"""

from __future__ import annotations

from tests.unit.toy_helium.hf import HF, helium_hf_config
from tests.unit.toy_helium.model import Transformer, helium_config, num_params

__all__ = ["FAMILY", "HF", "Transformer", "helium_config", "helium_hf_config"]

from hyper_parallel.models.common.family import dense_family

FAMILY = dense_family(
    "toy_helium",
    (None, None, None),
    num_params,
    why_no_ep="a dense toy",
    hf=HF,
)
"""The toy family's contract: the shared decoder's answers and its adapter."""
