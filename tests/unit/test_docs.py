"""The documentation: ``mkdocs build --strict`` passes, the run-option page lists every
option, and the README stays a short user's path that links into ``docs/``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hyper_parallel.train.arguments import option_fields, option_flag

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs extra (pip install -e '.[docs]')")
    pytest.importorskip("mkdocstrings", reason="the docs extra (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    # --strict: a broken link, a missing page or a docstring mkdocstrings cannot
    # render fails the build (and so this test).
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", "mkdocs.yml", "-d", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def test_the_site_builds_strict_with_every_page(site):
    nav = re.findall(r"^\s+- [^:]+: (\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.M)
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").glob("*.md"))
    assert sorted(nav) == pages  # every page is in the navigation, and nothing else
    for page in nav:
        name = page.removesuffix(".md")
        html = site / ("index.html" if name == "index" else f"{name}/index.html")
        assert html.is_file(), page


def test_the_training_page_lists_every_run_option(site):
    html = (site / "training" / "index.html").read_text()
    assert "<!-- run-options -->" not in html  # the marker was replaced by the table
    for dest in option_fields():
        assert f"<code>{option_flag(dest)}" in html, option_flag(dest)
        assert f"<code>{dest}</code>" in html, dest


def test_the_api_reference_renders_the_public_entry_points(site):
    html = (site / "api" / "index.html").read_text()
    for name in (
        "hyper_parallel.dmodule.ShardingConfig",
        "hyper_parallel.dmodule.resolve_placements",
        "hyper_parallel.dmodule.parallelize_module",
        "hyper_parallel.train.TrainConfig",
        "hyper_parallel.train.train",
        "hyper_parallel.checkpoint_hf.load_hf",
        "hyper_parallel.checkpoint_hf.read_hf_config",
        "hyper_parallel.analysis.validate.validate",
        "hyper_parallel.analysis.dry_run.dry_run",
        "hyper_parallel.analysis.check_equivalence",
    ):
        assert f'id="{name}"' in html, name


def test_the_readme_is_a_short_users_path_into_docs():
    words = len(README.split())
    assert words <= 3100, f"README has {words} words; move detail into docs/"
    headings = re.findall(r"^## (.+)$", README, re.M)
    order = [
        "Install",
        "First run",
        "Fine-tune a Hugging Face checkpoint",
        "Choose a layout",
        "Several machines",
        "The sharding API",
    ]
    assert [h for h in headings if h in order] == order
    assert "make test" in README
    for link in re.findall(r"\]\((docs/[^)#]+)", README):
        assert (ROOT / link).is_file(), link


def test_the_install_extras_named_in_the_docs_exist():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for text in (README, (ROOT / "docs" / "getting-started.md").read_text()):
        for name in re.findall(r"^\| `(\w+)` \|", text, re.M):
            assert name in extras, name
    assert {"hf", "docs", "test"} <= set(extras)
    assert any(d.startswith("transformers") for d in extras["hf"])
    assert any(d.startswith("mkdocstrings") for d in extras["docs"])
