"""Under ``CI=true`` a skipped or xfail-marked test fails the run: either hides what it covers.

Every skip in this suite is a missing test dependency (``pytest.importorskip``,
``skipif`` on ``find_spec``). Locally such a test skips with its reason; in CI the
dependency is part of the ``test`` extra, so its absence is a broken environment and
must not leave the run green. An ``xfail`` (``pytest.mark.xfail`` or ``pytest.xfail``)
passes a run whatever the test does — failing as expected, or passing unexpectedly
without ``strict`` — so under ``CI=true`` it fails the run too: a known failure is
fixed or refused by the code with a test of the refusal, not marked. Registered by ``tests/conftest.py``; usable on its own
as ``pytest -p tests.ci_skips``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

__all__ = ["in_ci", "pytest_make_collect_report", "pytest_runtest_makereport"]

_TRUE = frozenset({"1", "true", "yes", "on"})


def in_ci() -> bool:
    """Whether the ``CI`` environment variable says this run is continuous integration."""
    return os.environ.get("CI", "").strip().lower() in _TRUE


def _fail_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    where = f"{longrepr[0]}:{longrepr[1]}: " if isinstance(longrepr, tuple) else ""
    report.outcome = "failed"
    report.longrepr = (
        f"{where}skipped under CI=true ({reason}); in CI a skip hides the tests it covers. "
        "Install the test dependencies (pip install -e '.[test]'), or run without CI=true."
    )


def _fail_xfail(report: pytest.TestReport) -> None:
    reason = getattr(report, "wasxfail", None)
    if reason is None:
        return
    happened = "failed as expected" if report.skipped else "passed unexpectedly"
    report.outcome = "failed"
    del report.wasxfail  # else pytest still counts it as xfailed / xpassed
    report.longrepr = (
        f"{report.nodeid}: marked xfail ({reason or 'no reason given'}) and {happened}; "
        "under CI=true an xfail fails the run, since it passes whatever the test does. "
        "Fix the failure, or make the code refuse the case and test the refusal."
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[Any]:
    report = yield
    if in_ci():
        _fail_xfail(report)
        _fail_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[Any]:
    report = yield
    if in_ci():
        _fail_skip(report)
    return report
