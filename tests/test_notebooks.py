"""The notebooks' papermill contract and `prodigy-fl reproduce` (the notebooks themselves run under nbval)."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import nbformat
import papermill
import pytest
import yaml

from prodigy_core import reproduce
from prodigy_core.experiments import PARAMS_DIR

RUN_CONTROLS = {"scale", "executor", "jobs"}


def read(name: str) -> nbformat.NotebookNode:
    return nbformat.read(reproduce.NOTEBOOKS_DIR / name, as_version=4)


@pytest.mark.parametrize("name", sorted(reproduce.NOTEBOOKS))
def test_params_file_keys_are_notebook_parameters(name):
    notebook, params_file = reproduce.NOTEBOOKS[name]
    parameters = set(papermill.inspect_notebook(str(reproduce.NOTEBOOKS_DIR / notebook)))
    assert parameters >= RUN_CONTROLS, f"{notebook} lacks the run controls {RUN_CONTROLS - parameters}"
    if params_file is not None:
        keys = set(yaml.safe_load((PARAMS_DIR / params_file).read_text()))
        assert keys <= parameters, f"{params_file} keys {keys - parameters} are not parameters of {notebook}"
        assert "params_file" in parameters


def test_every_params_file_and_notebook_is_mapped():
    mapped_params = {p for _, p in reproduce.NOTEBOOKS.values() if p}
    assert {p.name for p in PARAMS_DIR.glob("*.yaml")} <= mapped_params
    assert {p.name for p in reproduce.NOTEBOOKS_DIR.glob("*.ipynb")} == {
        n for n, _ in reproduce.NOTEBOOKS.values()
    }


@pytest.mark.parametrize("name", sorted(n for n, _ in reproduce.NOTEBOOKS.values()))
def test_notebook_is_committed_clean(name):
    nb = read(name)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code), f"{name} carries outputs"
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{name} needs exactly one cell tagged 'parameters'"
    assert len({c.id for c in nb.cells}) == len(nb.cells)


def write_notebook(path, *sources):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nb.cells[0].metadata["tags"] = ["parameters"]
    nbformat.write(nb, path)


def test_reproduce_names_the_failing_notebook_and_cell_and_goes_on(tmp_path, capsys):
    write_notebook(tmp_path / "broken.ipynb", "scale = 'paper'", "x = 1", "raise KeyError('no such run')")
    write_notebook(tmp_path / "good.ipynb", "scale = 'paper'", "assert scale == 'smoke'")
    notebooks = {"broken": ("broken.ipynb", None), "good": ("good.ipynb", None)}
    build = tmp_path / "build"
    rc = reproduce.reproduce("smoke", notebooks=notebooks, notebooks_dir=tmp_path, build_dir=build)
    err = capsys.readouterr().err
    assert rc != 0
    # the injected-parameters cell runs first, so the third source cell has execution count 4
    assert "notebook broken: cell 4: KeyError: 'no such run'" in err
    assert "notebook good: ok" in err  # the failure did not stop the others; scale="smoke" was injected
    assert json.loads((build / "good.ipynb").read_text())["cells"]  # executed copy written

    rc = reproduce.reproduce(
        "smoke", only=["good"], notebooks=notebooks, notebooks_dir=tmp_path, build_dir=build
    )
    assert rc == 0


def test_reproduce_rejects_unknown_names_and_scales():
    with pytest.raises(ValueError, match="table1_cifar10"):
        reproduce.reproduce(only=["table1_cifar"])
    with pytest.raises(ValueError, match="smoke, mini, paper"):
        reproduce.reproduce(scale="full")


@pytest.mark.parametrize("scale", ["mini", "paper"])
def test_mini_and_paper_scale_inject_the_params_file(scale):
    parameters = reproduce.notebook_parameters("table4_fraction_byzantine.yaml", scale, "ray", 4)
    spec = yaml.safe_load((PARAMS_DIR / "table4_fraction_byzantine.yaml").read_text())
    assert parameters == {**spec, "scale": scale, "executor": "ray", "jobs": 4}
    assert reproduce.notebook_parameters("table4_fraction_byzantine.yaml", "smoke") == {
        "scale": "smoke", "executor": "local", "jobs": 1}  # fmt: skip


def test_reproduce_streams_progress_and_keeps_the_kernel_log_quiet(tmp_path, capfd):
    write_notebook(
        tmp_path / "talk.ipynb",
        "scale = 'paper'",
        "import os, sys\nprint('run 1 of 2 done')\nprint('bar 50%', file=sys.stderr)",
        "assert os.environ['PRODIGY_PROGRESS'] == 'text'  # run_grid draws a text bar, not a widget",
    )
    rc = reproduce.reproduce(
        "smoke", notebooks={"talk": ("talk.ipynb", None)}, notebooks_dir=tmp_path, build_dir=tmp_path / "b"
    )
    out, err = capfd.readouterr()  # file descriptors: the kernel process writes there directly
    assert rc == 0, err
    assert "[1/1] notebook talk (talk.ipynb, smoke scale)" in err
    assert "run 1 of 2 done" in out and "bar 50%" in err  # streamed while the notebook ran
    assert "without encryption" not in err
    assert "PRODIGY_PROGRESS" not in os.environ  # restored after the run


@pytest.mark.parametrize("name", sorted(n for n, (_, p) in reproduce.NOTEBOOKS.items() if p))
def test_papermill_hints_work_from_the_repository_root(name):
    notebook, params_file = reproduce.NOTEBOOKS[name]
    source = "\n".join(c.source for c in read(notebook).cells)
    hints = re.findall(r"papermill (\S+\.ipynb) (\S+\.ipynb)[\s\\#]*-f (\S+\.yaml)", source)
    assert hints, f"{notebook} gives no papermill command"
    root = Path(__file__).resolve().parents[1]
    for notebook_path, output, params_path in hints:
        assert (root / notebook_path).resolve() == (reproduce.NOTEBOOKS_DIR / notebook).resolve()
        assert (root / params_path).resolve() == (PARAMS_DIR / params_file).resolve()
        assert output.startswith("build/")  # the git-ignored folder, made by the hint's `mkdir -p build`
    assert "../params" not in source


def test_tests_and_notebooks_use_a_temporary_results_and_figures_folder():
    # set by the repository's root conftest.py before prodigy_core is imported or a kernel started
    from prodigy_core import report, results

    for name in ("PRODIGY_RESULTS_DIR", "PRODIGY_FIGURES_DIR"):
        folder = Path(os.environ[name])
        assert Path(tempfile.gettempdir()).resolve() in folder.resolve().parents, (name, folder)
    assert results.resolve_results_dir() == Path(os.environ["PRODIGY_RESULTS_DIR"])
    assert report.output_dir(False) == Path(os.environ["PRODIGY_FIGURES_DIR"])
