"""Two ``torchrun`` agents on this host as two nodes train as one device does.

Each agent is one node (``--nnodes 2 --node-rank 0/1 --nproc-per-node 1``) meeting the
other at a c10d rendezvous on a free port: the same per-node command ``suggest`` and
``launch`` print, with ``$MASTER_ADDR:$MASTER_PORT`` filled in. The run
(``python -m hyper_parallel.train.run``, FSDP2 over dp_shard=2, one rank per node) is
held against one process with the same seed and data: the first step's full gradients,
every loss, and the final parameters (read back from the last checkpoint).

Tolerances, from the arithmetic: the two runs differ only in the order of fp32
additions (each rank sums its half of the batch, then the halves are reduced and
averaged), each a rounding of at most 2**-24 relative; over a few thousand terms that
stays below 1e-5 relative, so gradients are held to the suite's fp32 bounds
(``tests._compare``: 1e-5 absolute with a 1e-3 relative norm, which a gradient 2x off,
a missing reduction, fails). The loss is a mean of O(1) values: 1e-5 absolute. AdamW
normalises each update to at most ``lr`` per element, so after ``STEPS`` steps a
parameter differs by far less than ``STEPS x lr``; held to the same fp32 bounds.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from hyper_parallel.train import TrainConfig, Trainer, latest_checkpoint
from tests._compare import FP32_RTOL, check, diffs, worst_abs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 4
OPTIONS = [
    "--steps", str(STEPS),
    "--batch-size", "4",
    "--seq-len", "32",
    "--checkpoint-every", str(STEPS),
    "--log-every", "0",
    "--no-progress",
]  # fmt: skip
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "CUDA_VISIBLE_DEVICES": "",  # gloo CPU ranks, like the rest of the suite
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _outputs(folder) -> list[str]:
    return [
        "--checkpoint-dir", str(folder / "ckpt"),
        "--metrics-out", str(folder / "metrics.json"),
        "--grads-out", str(folder / "grads.pt"),
    ]  # fmt: skip


def _final_parameters(checkpoint_dir) -> dict[str, torch.Tensor]:
    """The parameters of the last checkpoint, loaded into one process."""
    path = latest_checkpoint(checkpoint_dir, distributed=False)
    assert path is not None and path.endswith(f"step_{STEPS:06d}"), path
    trainer = Trainer(TrainConfig(steps=STEPS, progress=False), device="cpu")
    trainer.load(path)
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_two_torchrun_nodes_on_one_host_train_as_one_device(tmp_path):
    nodes_dir, one_dir = tmp_path / "two_nodes", tmp_path / "one_device"
    nodes_dir.mkdir()
    one_dir.mkdir()
    endpoint = f"127.0.0.1:{_free_port()}"
    agents = []
    for node_rank in (0, 1):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2",
            "--node-rank", str(node_rank),
            "--nproc-per-node", "1",
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint,
            "--rdzv-id", "two-nodes-test",
            "--monitor-interval", "0.5",
            "-m", "hyper_parallel.train.run",
            "--mesh", "dp=2",
            *OPTIONS,
            *_outputs(nodes_dir),  # one command for both nodes, as launch prints it
        ]  # fmt: skip
        agents.append(
            subprocess.Popen(
                cmd,
                env=ENV,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = []
    for agent in agents:
        try:
            out, _ = agent.communicate(timeout=240)
        finally:
            if agent.poll() is None:
                agent.kill()
        logs.append(out)
    assert [a.returncode for a in agents] == [0, 0], "\n".join(log[-4000:] for log in logs)
    run = nodes_dir
    two = json.loads((run / "metrics.json").read_text())
    assert two["config"]["mesh"] == {"dp_shard": 2}
    # The same run on one process, no launcher.
    single = subprocess.run(
        [sys.executable, "-m", "hyper_parallel.train.run", *OPTIONS, *_outputs(one_dir)],
        env={k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE")},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert single.returncode == 0, single.stderr[-4000:]
    one = json.loads((one_dir / "metrics.json").read_text())
    assert two["steps"] == one["steps"] == list(range(1, STEPS + 1))
    losses = [abs(a - b) for a, b in zip(two["losses"], one["losses"], strict=True)]
    assert worst_abs(losses) < 1e-5, (two["losses"], one["losses"])
    grads_two, grads_one = torch.load(run / "grads.pt"), torch.load(one_dir / "grads.pt")
    assert grads_two.keys() == grads_one.keys() and len(grads_one) > 10
    check(diffs(grads_two, grads_one), atol=1e-5, rtol=FP32_RTOL)
    # The checkpoint directory is shared (one host); both nodes' shards are in it.
    final_two = _final_parameters(run / "ckpt")
    final_one = _final_parameters(one_dir / "ckpt")
    check(diffs(final_two, final_one), atol=1e-5, rtol=FP32_RTOL)
