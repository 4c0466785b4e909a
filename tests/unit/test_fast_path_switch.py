"""The fast-path switch: ``set_fast_path``, ``fast_path(...)`` and ``HYPER_PARALLEL_FAST_PATH``."""

from __future__ import annotations

import pytest

from hyper_parallel.dmodule import fast_path, set_fast_path
from hyper_parallel.dmodule._fast import ENV_VAR, fast_path_enabled


@pytest.fixture(autouse=True)
def _follow_environment():
    set_fast_path(None)
    yield
    set_fast_path(None)


@pytest.mark.parametrize(
    ("value", "enabled"), [("1", True), ("on", True), ("0", False), ("false", False)]
)
def test_environment_variable(monkeypatch, value, enabled):
    monkeypatch.setenv(ENV_VAR, value)
    assert fast_path_enabled() is enabled


def test_default_is_on(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert fast_path_enabled() is True


def test_bad_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "fast")
    with pytest.raises(ValueError, match=rf"{ENV_VAR}='fast'.*1.*0"):
        fast_path_enabled()


def test_switch_overrides_environment_and_context_restores(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "0")
    set_fast_path(True)
    assert fast_path_enabled() is True
    with fast_path(False):
        assert fast_path_enabled() is False
        with fast_path(True):
            assert fast_path_enabled() is True
        assert fast_path_enabled() is False
    assert fast_path_enabled() is True
    set_fast_path(None)
    assert fast_path_enabled() is False


def test_context_restores_after_an_error(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(RuntimeError), fast_path(False):
        raise RuntimeError("inside")
    assert fast_path_enabled() is True


@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_wrong_types_are_rejected(bad):
    with pytest.raises(TypeError, match="set_fast_path"):
        set_fast_path(bad)
    with pytest.raises(TypeError, match="fast_path"), fast_path(bad):
        pass
