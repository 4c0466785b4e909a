"""This rank's device and its process group, as ``torchrun`` launches it.

Every command that runs on ranks (training, the demo, ``verify-hf``) joins the group
here: the backend follows the device (NCCL on CUDA, gloo on CPU), and under a
restarting ``torchrun`` the rendezvous keys are scoped to the attempt.

Example::

    from hyper_parallel.distributed.process_group import init_process_group

    world_size = init_process_group()  # 1 when not launched by torchrun
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

__all__ = ["attempt_store", "default_device", "init_process_group", "one_rank_group"]


def default_device() -> torch.device:
    """This rank's device: its CUDA device under ``LOCAL_RANK`` when there is one, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def attempt_store() -> dist.Store | None:
    """torchrun's shared rendezvous store, with keys scoped to this restart attempt.

    torchrun (torch 2.13) lets workers share its agent's TCP store and keeps that
    store across restarts, while ``env://`` initialization adds no per-attempt
    prefix: after a restart, ranks read the previous attempt's gloo addresses and
    fail with "connectFullMesh ... Connection refused". Prefixing the keys with
    ``TORCHELASTIC_RESTART_COUNT`` (the same on every worker of an attempt) keeps
    attempts apart. ``None`` when workers do not use the agent's store.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=default_pg_timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"hyper_parallel/attempt_{attempt}", store)


def init_process_group() -> int:
    """Join torchrun's process group when launched by it; returns the world size.

    The backend follows the device: NCCL on CUDA, gloo on CPU.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not dist.is_initialized():
        device = default_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        store = attempt_store()
        if store is None:
            dist.init_process_group(backend=backend)
        else:
            rank = int(os.environ["RANK"])
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size)
    return world_size


@contextlib.contextmanager
def one_rank_group(device: torch.device | str = "cpu") -> Iterator[None]:
    """A process group of this process alone (world size 1), for the block's duration.

    For a one-device run that wraps its model with FSDP2 (which needs a process group)
    in a process that has none, as the demo's one-process reference does: an in-memory
    store, the device's backend (NCCL on CUDA, gloo on CPU), destroyed on exit.

    Raises:
        RuntimeError: This process is in a process group already.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "one_rank_group: this process is in a process group already (world size "
            f"{dist.get_world_size()}); a group of one rank is for a process that has none."
        )
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
