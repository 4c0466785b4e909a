"""``hyper_parallel.train.run`` with one rank that dies once, for the restart test.

Run under ``torchrun --max-restarts 1``. Rank ``HP_CRASH_RANK`` ends its process with
``os._exit(1)`` right after step ``HP_CRASH_STEP`` — but only while the file
``HP_CRASH_MARKER`` does not exist, which it creates first, so the restarted
attempt trains through.
"""

from __future__ import annotations

import os
import sys

from hyper_parallel.train.run import main


def _crash_once(step: int, loss: float) -> None:
    marker = os.environ["HP_CRASH_MARKER"]
    if (
        step == int(os.environ["HP_CRASH_STEP"])
        and os.environ.get("RANK") == os.environ["HP_CRASH_RANK"]
        and not os.path.exists(marker)
    ):
        with open(marker, "w") as f:
            f.write(f"rank {os.environ['RANK']} exited after step {step}\n")
        os._exit(1)  # no cleanup, no exception: as if the process were killed


if __name__ == "__main__":
    sys.exit(main(step_callback=_crash_once))
