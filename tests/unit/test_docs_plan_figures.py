"""The docs' dry-run figures (activation GBs of ``plan``) are what ``plan`` prints today.

The figures are quoted in ``docs/choosing-a-layout.md``. Each is recomputed by the CLI
itself, in this process, on the fake process group, and compared with the page's text
rounded as it prints (``human_bytes``: GB, one
decimal). One ``plan`` run records every checkpointing mode's activations (the CLI's
report keeps ``activations_by_ac``), so two traces cover the four figures.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest

import hyper_parallel.analysis as analysis
from hyper_parallel.cli import main

PAGE = (Path(__file__).resolve().parents[2] / "docs" / "choosing-a-layout.md").read_text()
# The page wraps lines; compare with single spaces.
FLAT = " ".join(PAGE.split())


def _plan(*argv: str) -> tuple[dict[str, Any], Any]:
    """``hyper-parallel plan ... --format json``: its JSON and the DryRunReport behind it."""
    reports = []
    real = analysis.dry_run

    def recording(*args: Any, **kwargs: Any) -> Any:
        reports.append(real(*args, **kwargs))
        return reports[-1]

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setattr(analysis, "dry_run", recording)
        code = main(["plan", *argv, "--format", "json"])
    assert code == 0, out.getvalue()[-2000:]
    assert len(reports) == 1
    return json.loads(out.getvalue()), reports[0]


def _gb(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.1f}"


@pytest.fixture(scope="module")
def tp8() -> tuple[dict[str, Any], Any]:
    return _plan("--model", "llama3-8b", "--mesh", "tp=8", "--seq", "8192")


def test_docs_activations_per_checkpointing_mode_are_what_plan_prints(tp8):
    printed, report = tp8
    by_ac = report.activations_by_ac
    # The JSON's figure (what `--ac none` prints) is the report's own for that mode.
    assert printed["ac"] == "none"
    assert printed["per_rank_bytes"]["activations"] == by_ac["none"]
    found = re.search(
        r"llama3-8b at tp=8, seq 8192, batch 1: ([\d.]+) GB with `--ac none`, "
        r"([\d.]+) GB with `--ac full`, ([\d.]+) GB with `--ac selective`, "
        r"([\d.]+) GB with `--ac op`",
        FLAT,
    )
    assert found, "the docs' --ac sentence changed; update this test with it"
    modes = ("none", "full", "selective", "op")
    assert found.groups() == tuple(_gb(by_ac[m]) for m in modes)


def test_docs_cp_activations_are_what_plan_prints(tp8):
    cp2, _ = _plan("--model", "llama3-8b", "--mesh", "tp=8,cp=2", "--seq", "8192")
    found = re.search(
        r"`plan --model llama3-8b --mesh tp=8,cp=2 --seq 8192`: ([\d.]+) GB vs ([\d.]+) GB "
        r"at `--mesh tp=8`",
        FLAT,
    )
    assert found, "the docs' cp sentence changed; update this test with it"
    cp1_bytes = tp8[0]["per_rank_bytes"]["activations"]
    cp2_bytes = cp2["per_rank_bytes"]["activations"]
    assert found.groups() == (_gb(cp2_bytes), _gb(cp1_bytes))
    assert cp2_bytes < 0.6 * cp1_bytes  # "about half", as the docs say
