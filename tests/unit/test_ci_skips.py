"""A missing test dependency skips locally (with its reason) and fails the run under CI=true;
an xfail passes locally and fails the run under CI=true; ``.ci/run`` sets CI=true itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ci_skips import in_ci

ROOT = Path(__file__).resolve().parents[2]
_PYTEST = (
    *(sys.executable, "-m", "pytest", "-q", "-rA"),
    *("-p", "tests.ci_skips", "-p", "no:cacheprovider"),
)

IN_TEST = """
import pytest

def test_needs_it():
    pytest.importorskip("hp_no_such_dependency")
"""

AT_MODULE_LEVEL = """
import pytest

pytest.importorskip("hp_no_such_dependency", reason="needs hp_no_such_dependency")

def test_covered():
    assert True
"""


XFAILS = """
import pytest

@pytest.mark.xfail(reason="known wrong")
def test_marked_and_failing():
    assert 1 == 2

@pytest.mark.xfail(reason="known wrong")
def test_marked_and_passing():
    assert True

def test_xfail_called():
    pytest.xfail("called inside")
"""


def _pytest(directory: Path, ci: str | None) -> subprocess.CompletedProcess[str]:
    (directory / "test_other.py").write_text("def test_plain():\n    assert True\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(ROOT)
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # faster start; the plugin is named with -p
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [*_PYTEST, "--rootdir", str(directory), str(directory)],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("source", [IN_TEST, AT_MODULE_LEVEL], ids=["in_test", "module_level"])
def test_missing_dependency_skips_locally_with_its_reason(tmp_path, source):
    (tmp_path / "test_dep.py").write_text(source)
    result = _pytest(tmp_path, ci=None)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed, 1 skipped" in result.stdout
    assert "hp_no_such_dependency" in result.stdout  # the reason names what is missing


@pytest.mark.parametrize("source", [IN_TEST, AT_MODULE_LEVEL], ids=["in_test", "module_level"])
def test_missing_dependency_fails_the_run_in_ci(tmp_path, source):
    (tmp_path / "test_dep.py").write_text(source)
    result = _pytest(tmp_path, ci="true")
    assert result.returncode != 0, result.stdout
    assert "skipped under CI=true" in result.stdout
    assert "hp_no_such_dependency" in result.stdout
    assert "pip install -e '.[test]'" in result.stdout
    assert "skipped" not in result.stdout.splitlines()[-1]


@pytest.mark.parametrize(
    ("value", "expected"),
    [("true", True), ("1", True), ("TRUE", True), ("false", False), ("", False), (None, False)],
)
def test_what_counts_as_ci(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert in_ci() is expected


def test_xfail_passes_locally(tmp_path):
    (tmp_path / "test_x.py").write_text(XFAILS)
    result = _pytest(tmp_path, ci=None)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed, 2 xfailed, 1 xpassed" in result.stdout


def test_every_xfail_fails_the_run_in_ci(tmp_path):
    (tmp_path / "test_x.py").write_text(XFAILS)
    result = _pytest(tmp_path, ci="true")
    assert result.returncode != 0, result.stdout
    last = result.stdout.splitlines()[-1]
    assert "3 failed, 1 passed" in last, result.stdout
    assert "xfail" not in last and "xpass" not in last
    for name in ("test_marked_and_failing", "test_marked_and_passing", "test_xfail_called"):
        assert f"FAILED test_x.py::{name}" in result.stdout, name
    assert "under CI=true an xfail fails the run" in result.stdout
    assert "failed as expected" in result.stdout and "passed unexpectedly" in result.stdout


def test_the_ci_script_sets_ci_itself():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    code = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert "export CI=true" in code
    assert code.index("export CI=true") < code.index("make test")
