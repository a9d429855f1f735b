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

from prodigy_core import lab, reproduce
from prodigy_core.experiments import PARAMS_DIR

RUN_CONTROLS = {"scale", "executor", "jobs"}
# Notebooks that `prodigy-fl reproduce` does not run (no paper item; nbval runs them at smoke scale, and
# tests/test_your_own_defense.py runs it with papermill)
EXAMPLES = {"your_own_defense.ipynb"}
ALL_NOTEBOOKS = sorted({n for n, _ in reproduce.NOTEBOOKS.values()} | EXAMPLES)


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
    } | EXAMPLES


@pytest.mark.parametrize("name", ALL_NOTEBOOKS)
def test_notebook_is_committed_clean(name):
    nb = read(name)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code), f"{name} carries outputs"
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{name} needs exactly one cell tagged 'parameters'"
    assert len({c.id for c in nb.cells}) == len(nb.cells)


REPO = Path(__file__).resolve().parents[1]


def filter_setup() -> str:
    """The extra keys of the documented one-time setup; .gitattributes and the pre-commit hook agree."""
    keys = re.search(
        r'git config filter\.nbstripout\.extrakeys "([^"]+)"', (REPO / ".gitattributes").read_text()
    )
    assert keys, ".gitattributes documents the one-time filter setup"
    hook = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())["repos"][0]["hooks"][0]
    assert hook["id"] == "nbstripout" and f'--extra-keys "{keys[1]}"' in hook["entry"]
    assert keys[1] == lab.NBSTRIPOUT_EXTRA_KEYS  # what `prodigy-fl git-setup` sets
    return keys[1]


def saved_by_jupyterlab(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """What JupyterLab 4 writes after opening a notebook, running every cell and saving it (issue 28 row 1):
    the running kernel's display name, its language_info, outputs, execution counts and widget state."""
    nb = nbformat.from_dict(json.loads(json.dumps(nb)))
    nb.metadata.kernelspec.display_name = "Python 3 (ipykernel)"
    nb.metadata.language_info = {
        "codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
        "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
        "pygments_lexer": "ipython3", "version": "3.11.7"}  # fmt: skip
    nb.metadata.widgets = {"application/vnd.jupyter.widget-state+json": {"state": {}, "version_major": 2}}
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        cell.execution_count = i + 1
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"ran {i}\n")]
    return nb


def git(folder: Path, *args: str) -> str:
    import subprocess

    done = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, check=True)
    return done.stdout


def test_saving_a_notebook_in_jupyterlab_leaves_git_status_clean(tmp_path, git_installed):
    import shutil

    keys = filter_setup()
    repo = tmp_path / "clone"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "t@example.org")
    git(repo, "config", "user.name", "t")
    shutil.copy(REPO / ".gitattributes", repo / ".gitattributes")
    done = lab.setup_git(repo, prefix=str(tmp_path / "env"))  # the documented one-time setup
    assert git(repo, "config", "filter.nbstripout.extrakeys").strip() == keys
    hook = json.loads(lab.config_file(str(tmp_path / "env")).read_text())
    assert hook == {"ContentsManager": {"post_save_hook": lab.HOOK}} and len(done) == 2
    # Two notebooks (the quickstart and the widget explorer): git runs the filter, one Python start, three
    # times per notebook, which is what costs here; every notebook is checked against nbstripout at once in
    # test_every_notebook_is_what_nbstripout_makes_of_its_jupyterlab_save.
    names = ["00_quickstart.ipynb", "explore_attacks.ipynb"]
    for name in names:
        shutil.copy(reproduce.NOTEBOOKS_DIR / name, repo / name)
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "notebooks")
    for name in names:  # the committed files are what the filter makes of them
        assert git(repo, "show", f"HEAD:{name}") == (reproduce.NOTEBOOKS_DIR / name).read_text(), name
        nbformat.write(saved_by_jupyterlab(read(name)), repo / name)
        assert lab.refresh_git_index(str(repo / name)), name  # what JupyterLab runs after its save
    assert git(repo, "status", "--porcelain") == "" and git(repo, "diff", "--cached", "--stat") == ""
    assert "ran 0" in (repo / names[0]).read_text()  # the working copy keeps its outputs
    # a real change stays the user's: listed as modified, nothing staged by the hook
    edited = saved_by_jupyterlab(read(names[0]))
    edited.cells[-1].source += "\n# my change"
    nbformat.write(edited, repo / names[0])
    assert not lab.refresh_git_index(str(repo / names[0]))
    assert git(repo, "status", "--porcelain").split() == ["M", names[0]]
    assert git(repo, "diff", "--cached", "--stat") == ""
    assert not lab.refresh_git_index(str(tmp_path / "not_in_git.ipynb"))  # outside a clone: nothing


def test_every_notebook_is_what_nbstripout_makes_of_its_jupyterlab_save(tmp_path):
    """nbstripout with the documented extra keys (git's filter), run once on every notebook as JupyterLab
    saves it, gives back the committed file byte for byte."""
    import subprocess
    import sys

    keys = filter_setup()
    paths = [tmp_path / name for name in ALL_NOTEBOOKS]
    for name, path in zip(ALL_NOTEBOOKS, paths, strict=True):
        nbformat.write(saved_by_jupyterlab(read(name)), path)
    subprocess.run([sys.executable, "-m", "nbstripout", "--extra-keys", keys, *map(str, paths)], check=True)
    for name, path in zip(ALL_NOTEBOOKS, paths, strict=True):
        assert path.read_text() == (reproduce.NOTEBOOKS_DIR / name).read_text(), name


def test_the_hook_waits_for_another_git_command_to_release_the_index(tmp_path, git_installed):
    import threading

    repo = tmp_path / "clone"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "t@example.org")
    git(repo, "config", "user.name", "t")
    nbformat.write(nbformat.v4.new_notebook(), repo / "a.ipynb")
    git(repo, "add", "a.ipynb")
    git(repo, "commit", "-q", "-m", "a")
    lock = repo / ".git" / "index.lock"
    lock.write_text("")  # a `git status` running elsewhere holds the index...
    threading.Timer(0.3, lock.unlink).start()  # ...for 0.3 s
    assert lab.refresh_git_index(str(repo / "a.ipynb"))  # waited for it instead of giving up
    assert git(repo, "status", "--porcelain") == ""


def test_the_post_save_hook_returns_before_git_runs_and_refreshes_in_the_background(monkeypatch):
    import threading

    started, release, calls = threading.Event(), threading.Event(), []

    def slow_git(path: str) -> bool:  # git and the nbstripout filter, stuck behind a loaded machine
        started.set()
        release.wait(60)
        calls.append(path)
        return True

    monkeypatch.setattr(lab, "refresh_git_index", slow_git)
    for path in ("a.ipynb", "a.ipynb", "notes.txt"):
        lab.after_save(path)  # what the server calls inside each save request
    assert started.wait(60) and calls == []  # every save returned while git was still running
    release.set()
    lab.wait_for_refreshes()
    assert set(calls) == {"a.ipynb"} and len(calls) <= 2  # a notebook, never the text file


def test_git_setup_replaces_the_former_synchronous_hook(tmp_path):
    config = lab.config_file(str(tmp_path))
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps({"ContentsManager": {"post_save_hook": lab.FORMER_HOOKS[0]}}))
    lab.install_hook(str(tmp_path))
    assert json.loads(config.read_text()) == {"ContentsManager": {"post_save_hook": lab.HOOK}}


def test_jupyter_server_reads_the_hook_where_git_setup_writes_it(tmp_path, monkeypatch):
    from jupyter_server import serverapp  # in the dev extra: this runs in CI, never skips

    config = lab.config_file(str(tmp_path))
    config.parent.mkdir(parents=True)
    config.write_text('{"ServerApp": {"port_retries": 3}}')
    assert lab.install_hook(str(tmp_path)) == config
    assert json.loads(config.read_text())["ServerApp"] == {"port_retries": 3}  # the file's other settings
    monkeypatch.setenv("JUPYTER_CONFIG_PATH", str(config.parent))  # as <prefix>/etc/jupyter is for a venv
    app = serverapp.ServerApp()
    app.load_config_file()
    assert app.config.ContentsManager.post_save_hook == lab.HOOK
    manager = serverapp.AsyncLargeFileManager(config=app.config)
    assert manager.post_save_hook is lab.after_save
    config.write_text('{"ContentsManager": {"post_save_hook": "my.hook"}}')
    with pytest.raises(ValueError, match="already sets ContentsManager.post_save_hook='my.hook'"):
        lab.install_hook(str(tmp_path))


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
        "scale": "smoke", "executor": "local", "jobs": None}  # fmt: skip


def test_reproduce_runs_each_grid_as_the_quickstart_does_unless_told(monkeypatch, tmp_path):
    """`prodigy-fl reproduce` passes --jobs (default None: the notebook's own choice) and takes a notebook by
    its file as well as by its name; every notebook that runs a grid turns None into 1 at smoke scale and
    "auto" otherwise, as `prodigy-fl quickstart` runs (one single-threaded process per CPU core)."""
    from prodigy_core.cli import main

    calls = []
    monkeypatch.setattr(
        papermill, "execute_notebook", lambda src, out, **kw: calls.append((src, kw["parameters"]))
    )
    monkeypatch.chdir(tmp_path)  # a folder without notebooks/: the package's, build/ made here
    args = ["reproduce", "--scale", "mini", "--only", "notebooks/00_quickstart.ipynb", "table1_cifar10"]
    assert main(args) == 0 and main([*args, "--jobs", "2"]) == 0
    assert [(Path(src).name, p["jobs"]) for src, p in calls] == [
        ("00_quickstart.ipynb", None), ("table1_cifar10.ipynb", None),
        ("00_quickstart.ipynb", 2), ("table1_cifar10.ipynb", 2)]  # fmt: skip
    for name in ALL_NOTEBOOKS:
        cells = [c.source for c in read(name).cells if c.cell_type == "code"]
        runs = [i for i, c in enumerate(cells) if "run_grid(exp" in c]
        for i in runs:
            resolve = 'workers = jobs or (1 if exp.smoke else "auto")'
            before = "\n".join(cells[: i + 1]).split("run_grid(exp")[0]
            assert resolve in before, f"{name}: jobs=None reaches run_grid"
            assert "jobs=workers" in cells[i], f"{name}: run_grid is not given the resolved jobs"


@pytest.mark.parametrize("name", ALL_NOTEBOOKS)
def test_no_cell_overwrites_a_parameter(name):
    """A later cell never assigns a name of the parameters cell: run again after `scale` changes, it must see
    the parameter as given (None: the scale's choice), not the value a previous run turned it into."""
    import ast

    cells = [c for c in read(name).cells if c.cell_type == "code"]
    first = next(i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", []))

    def assigned(source: str) -> set[str]:
        code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
        names = set()
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        return names

    parameters = assigned(cells[first].source)
    assert "scale" in parameters
    for i, cell in enumerate(cells[first + 1 :], first + 1):
        if "%%writefile" in cell.source:
            continue  # a file's text, not code of this kernel
        assert not assigned(cell.source) & parameters, f"{name}, code cell {i}"


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


# The paper items' notebooks are one template: the same cells, each naming its own params file; only the
# first Markdown cell (title and description) is their own.
PAPER_ITEMS = sorted(n for n in reproduce.NOTEBOOKS if n.startswith(("table", "figure")))
TEMPLATE = "table1_cifar10"


@pytest.mark.parametrize("name", [n for n in PAPER_ITEMS if n != TEMPLATE])
def test_paper_item_notebooks_are_one_template(name):
    template, notebook = read(reproduce.NOTEBOOKS[TEMPLATE][0]), read(reproduce.NOTEBOOKS[name][0])
    assert len(notebook.cells) == len(template.cells), name
    assert notebook.cells[0].cell_type == "markdown" and notebook.cells[0].source.startswith("# ")
    for i, (ours, theirs) in enumerate(zip(notebook.cells[1:], template.cells[1:], strict=True), start=1):
        expected = theirs.source.replace(TEMPLATE, name)
        assert (ours.cell_type, ours.source, ours.metadata.get("tags")) == (
            theirs.cell_type, expected, theirs.metadata.get("tags")
        ), f"notebooks/{name}.ipynb cell {i} drifted from notebooks/{TEMPLATE}.ipynb"  # fmt: skip


# Notebooks a reader opens in JupyterLab to see something real (issue 37): their own default scale.
INTERACTIVE_NOTEBOOKS = ["00_quickstart.ipynb", "your_own_defense.ipynb", "explore_attacks.ipynb"]


@pytest.mark.parametrize("name", INTERACTIVE_NOTEBOOKS)
def test_opened_in_lab_a_notebook_runs_at_the_interactive_scale_and_under_ci_at_smoke(name, monkeypatch):
    from prodigy_core import paths

    assert os.environ["PRODIGY_SCALE"] == "smoke"  # the root conftest.py: nbval's kernels inherit it
    nb = read(name)
    source = next(c.source for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    scales = {}
    for env in (None, "smoke"):
        if env is None:
            monkeypatch.delenv("PRODIGY_SCALE")  # JupyterLab started by a reader
        else:
            monkeypatch.setenv("PRODIGY_SCALE", env)
        namespace: dict = {}
        exec(source, namespace)  # the parameters cell as the kernel runs it
        scales[env] = namespace["scale"]
    assert scales == {None: paths.INTERACTIVE, "smoke": "smoke"}
    first = nb.cells[0]
    assert first.cell_type == "markdown" and "**Scale and time.**" in first.source
    assert "*interactive* scale" in first.source and "PRODIGY_SCALE=smoke" in first.source
    assert re.search(r"\d+ (s|seconds|minutes?)\b|a minute", first.source), "the first cell says the time"


@pytest.mark.parametrize("scale", ["interactive", "smoke", "paper"])
def test_the_quickstarts_few_interactive_cells_never_overwrite_its_full_report(scale, monkeypatch):
    """00_quickstart at the interactive scale trains 4 cells of the 42-run grid: its report goes to
    <figures>/interactive/, not over `prodigy-fl quickstart`'s outputs/quickstart_digits.* (which a
    paper-scale run of the notebook writes, as the CLI does)."""
    from prodigy_core import experiments, paths, report

    written = []
    monkeypatch.setattr(experiments, "run_grid", lambda exp, **kw: exp)
    monkeypatch.setattr(report, "write_report", lambda exp, df, out_dir=None: written.append((exp, out_dir)))
    cells = [c.source for c in read("00_quickstart.ipynb").cells if c.cell_type == "code"]
    namespace: dict = {}
    exec(cells[0], namespace)  # the parameters cell
    namespace["scale"] = scale
    exec(cells[1], namespace)  # load, select, run, report
    ((exp, out_dir),) = written
    if scale == "interactive":
        assert out_dir == paths.figures_dir() / "interactive" and len(exp.configs) == 4
    else:  # smoke: the shrunk grid, whose report goes to smoke/; paper: the whole grid, the CLI's files
        assert out_dir is None and exp.smoke == (scale == "smoke")
        assert scale == "smoke" or len(exp.configs) == 42
