"""Where outputs go (the project folder, env vars), `prodigy-fl init`, and a wheel installed outside the
repository that runs the smoke quickstart from an unrelated folder without writing into its install folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prodigy_core import paths, results
from prodigy_core.cli import main
from prodigy_core.experiments import load_experiment, resolve_params

REPO = Path(__file__).resolve().parents[1]
ENV_VARS = (paths.ENV_RESULTS, paths.ENV_FIGURES, paths.ENV_DATA)


@pytest.fixture
def no_env(monkeypatch):
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def test_project_folder_is_the_nearest_ancestor_with_params_else_the_cwd(tmp_path, monkeypatch, no_env):
    (tmp_path / "proj" / "params").mkdir(parents=True)
    deep = tmp_path / "proj" / "notebooks" / "sub"
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)
    assert paths.project_dir() == tmp_path / "proj"
    assert results.resolve_results_dir() == tmp_path / "proj" / "results"
    assert paths.figures_dir() == tmp_path / "proj" / "outputs"
    assert paths.data_dir() == tmp_path / "proj" / "data"
    monkeypatch.chdir(tmp_path)  # no params/ here or above: the working directory itself
    assert paths.project_dir() == tmp_path and paths.results_dir() == tmp_path / "results"


def test_env_vars_and_the_argument_win(tmp_path, monkeypatch, no_env):
    monkeypatch.chdir(tmp_path)
    for name, folder in zip(ENV_VARS, ("r", "f", "d"), strict=True):
        monkeypatch.setenv(name, str(tmp_path / folder))
    assert (paths.results_dir(), paths.figures_dir(), paths.data_dir()) == (
        tmp_path / "r", tmp_path / "f", tmp_path / "d",
    )  # fmt: skip
    assert results.resolve_results_dir(tmp_path / "x") == tmp_path / "x"


def test_a_notebooks_scale_comes_from_the_environment_and_a_wrong_one_names_the_variable(monkeypatch):
    """A misspelt PRODIGY_SCALE failed later, in load_experiment, without naming the variable (helper 50)."""
    monkeypatch.delenv("PRODIGY_SCALE", raising=False)
    assert paths.notebook_scale() == "interactive"
    for scale in ("smoke", "mini", "paper"):
        monkeypatch.setenv("PRODIGY_SCALE", scale)
        assert paths.notebook_scale() == scale
    monkeypatch.setenv("PRODIGY_SCALE", "smok")
    valid = r"valid: interactive, smoke, mini, paper \(unset it for interactive\)$"
    with pytest.raises(ValueError, match=rf"^env PRODIGY_SCALE='smok' is unknown; {valid}"):
        paths.notebook_scale()


def test_a_working_directory_inside_an_installed_package_is_refused(tmp_path, monkeypatch, no_env):
    monkeypatch.chdir(paths.PACKAGE_DIR)  # in a clone: the repository is the project folder
    assert paths.results_dir() == REPO / "results"
    site = tmp_path / "site-packages"  # an installation: no params/ beside the package
    (site / "prodigy_core" / "_bundled").mkdir(parents=True)
    monkeypatch.setattr(paths, "PACKAGE_DIR", site / "prodigy_core")
    monkeypatch.setattr(paths, "SOURCE_ROOT", site)
    for cwd in (site, site / "prodigy_core", site / "prodigy_core" / "_bundled"):
        monkeypatch.chdir(cwd)
        with pytest.raises(ValueError, match="inside the installed package .*: cd to a project folder"):
            paths.results_dir()


def test_init_lays_out_a_project_and_keeps_edited_files(tmp_path, monkeypatch, capsys, no_env):
    project = tmp_path / "proj"
    assert main(["init", str(project)]) == 0
    for folder, pattern in (("notebooks", "*.ipynb"), ("params", "*.yaml")):
        shipped = sorted(p.name for p in (REPO / folder).glob(pattern))
        assert shipped and sorted(p.name for p in (project / folder).iterdir()) == shipped
        for name in shipped:
            assert (project / folder / name).read_bytes() == (REPO / folder / name).read_bytes()
    for empty in ("results", "outputs", "data"):
        assert (project / empty).is_dir() and not any((project / empty).iterdir())

    # the project's edited params file wins over the package's, looked up from any subfolder
    edited = project / "params" / "quickstart_digits.yaml"
    edited.write_text(edited.read_text().replace('title: "Quickstart', 'title: "My quickstart'))
    assert main(["init", str(project)]) == 0
    assert "kept as they were" in capsys.readouterr().out
    assert "My quickstart" in edited.read_text()  # a second init overwrote nothing
    monkeypatch.chdir(project / "notebooks")
    assert resolve_params("quickstart_digits") == edited
    assert load_experiment("quickstart_digits").title.startswith("My quickstart")


def test_grid_dry_run_at_paper_scale_counts_every_seed(tmp_path, monkeypatch, capsys, no_env):
    monkeypatch.chdir(tmp_path)
    assert main(["grid", "table4_fraction_byzantine", "--dry-run"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    # Table IV: f in {2, 4, 6} x 6 defenses x {ALIE, SF} x 3 seeds, counted by hand from the paper
    assert last.startswith("108 runs (0 stored, 108 to run)") and str(tmp_path / "results") in last
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_wheel_installed_elsewhere_runs_the_smoke_quickstart_without_writing_into_it(tmp_path):
    """Build a wheel from a copy of the sources, install it into a bare folder, run the smoke quickstart from
    an unrelated working directory: outputs land there, and the install location is left byte-for-byte."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("prodigy_core", "params", "notebooks"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "_bundled"))
    dist, site, work = tmp_path / "dist", tmp_path / "site", tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS and k != "PYTHONPATH"}
    # the build backend directly (what `pip wheel --no-build-isolation` calls), this environment's setuptools
    build = "from setuptools import build_meta as b; import sys; b.build_wheel(sys.argv[1])"
    subprocess.run([sys.executable, "-c", build, str(dist)], cwd=source, env=env, check=True,
                   capture_output=True)  # fmt: skip
    (wheel,) = dist.glob("*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                    str(wheel)], env=env, check=True, capture_output=True)  # fmt: skip
    assert (site / "prodigy_core" / "_bundled" / "params" / "quickstart_digits.yaml").is_file()
    assert (site / "prodigy_core" / "_bundled" / "notebooks" / "00_quickstart.ipynb").is_file()

    def listing() -> dict[str, tuple[int, int]]:
        return {str(p.relative_to(site)): (p.stat().st_size, p.stat().st_mtime_ns) for p in site.rglob("*")}

    before = listing()
    env.update(PYTHONPATH=str(site), PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    which = subprocess.run([sys.executable, "-c", "import prodigy_core; print(prodigy_core.__file__)"],
                           cwd=work, env=env, check=True, capture_output=True, text=True)  # fmt: skip
    assert which.stdout.strip() == str(site / "prodigy_core" / "__init__.py")  # the installed copy
    done = subprocess.run([sys.executable, "-m", "prodigy_core.cli", "quickstart", "--smoke"], cwd=work,
                          env=env, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert listing() == before  # nothing written, changed or removed under the install location
    assert len(list((work / "results" / "quickstart_digits-smoke").glob("*.json"))) == 6
    assert (work / "outputs" / "smoke" / "quickstart_digits.md").is_file()
