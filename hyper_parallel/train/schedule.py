"""Learning-rate schedules: linear warm-up, then cosine, linear, constant or WSD.

Every schedule warms up linearly from ``lr / warmup_steps`` to ``lr`` over
``warmup_steps`` steps, then

- ``cosine``: half a cosine from ``lr`` down to ``min_lr`` at ``total_steps``;
- ``linear``: a straight line from ``lr`` down to ``min_lr`` at ``total_steps``;
- ``constant``: ``lr`` to the end;
- ``wsd`` (warmup-stable-decay, Hägele et al. 2024, "Scaling Laws and Compute-Optimal
  Training Beyond Fixed Training Durations"): ``lr`` until the last
  :data:`WSD_DECAY_FRACTION` of ``total_steps``, then linearly down to ``min_lr``.

Past ``total_steps`` (a resumed run given more steps than the schedule it started
with) the rate stays at its final value (``min_lr``; ``lr`` for ``constant``), also
where the warm-up fills the schedule: a warm-up longer than the schedule stops at its
end. ``total_steps`` is the schedule's length,
which a resumed run keeps (:mod:`hyper_parallel.train.report` says so).

Example::

    >>> round(lr_at(0, lr=1e-3, warmup_steps=2, total_steps=10, min_lr=1e-4), 6)
    0.0005
"""

from __future__ import annotations

import math

__all__ = ["LR_SCHEDULES", "WSD_DECAY_FRACTION", "check_schedule", "lr_at"]

LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
"""The names ``--lr-schedule`` takes."""

WSD_DECAY_FRACTION = 0.2
"""The share of the steps over which ``wsd`` decays (the paper's 20 % cool-down)."""


def check_schedule(schedule: str, lr: float, min_lr: float, warmup_steps: int) -> None:
    """Raise a ``ValueError`` naming the option for a schedule that cannot run."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(
            f"--lr-schedule {schedule!r} is not a schedule; choose one of {', '.join(LR_SCHEDULES)}."
        )
    if not 0 <= min_lr <= lr:
        raise ValueError(f"--min-lr {min_lr} must be between 0 and --lr {lr}.")
    if warmup_steps < 0:
        raise ValueError(f"--warmup-steps {warmup_steps} must be >= 0.")


def lr_at(
    step: int,
    *,
    lr: float,
    warmup_steps: int,
    total_steps: int,
    min_lr: float,
    schedule: str = "cosine",
) -> float:
    """Learning rate of optimizer step ``step`` (0-based) under ``schedule``.

    Past the schedule's end (``step >= total_steps``) the rate is the schedule's final
    one, ``lr`` for ``constant`` and ``min_lr`` for the others, also where the warm-up
    is longer than the schedule: the warm-up ends with the schedule (it went on to the
    peak first, then dropped to ``min_lr``).
    """
    if step >= total_steps:
        # Before the warm-up's test: a warm-up that outlasts the schedule stops with it.
        # (The formulas below give min_lr too, but not when the warm-up fills the
        # schedule: their decay would start at the peak.)
        return lr if schedule == "constant" else min_lr
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    if schedule == "wsd":
        decay = max(1, round(WSD_DECAY_FRACTION * total_steps))
        start = max(warmup_steps, total_steps - decay)
        if step < start:
            return lr
        progress = min(1.0, (step - start) / max(1, total_steps - start))
        return lr - (lr - min_lr) * progress
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return lr - (lr - min_lr) * progress
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
