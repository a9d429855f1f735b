"""Where progress goes (prodigy_core.progress): quiet text bars without ipywidgets, per-run lines on stdout in
a notebook and on stderr in a terminal (issue 28 rows 3, 4 and 11)."""

from __future__ import annotations

import nbformat
import pytest

from prodigy_core import progress, reproduce
from prodigy_core.experiments import experiment_from_spec, run_grid

TINY = {"experiment": "tiny", "base": {"dataset": "digits", "n_clients": 5, "n_byzantine": 2, "rounds": 1,
                                       "local_steps": 1, "device": "cpu"},
        "grid": {"defense": ["prodigy", "none"]}}  # fmt: skip


def test_a_notebook_without_ipywidgets_shows_no_warning_and_prints_run_lines_on_stdout(tmp_path, capfd):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    nb.cells = [
        nbformat.v4.new_code_cell("scale = 'paper'"),
        # a plain install: no `lab` extra, so ipywidgets cannot be imported
        nbformat.v4.new_code_cell("import sys\nsys.modules['ipywidgets'] = None"),
        nbformat.v4.new_code_cell(
            "from prodigy_core.experiments import experiment_from_spec, run_grid\n"
            f"run_grid(experiment_from_spec({TINY!r}, scale='paper'))"
        ),
    ]
    nb.cells[0].metadata["tags"] = ["parameters"]
    nbformat.write(nb, tmp_path / "grid.ipynb")
    rc = reproduce.reproduce(
        "smoke", notebooks={"grid": ("grid.ipynb", None)}, notebooks_dir=tmp_path, build_dir=tmp_path / "b"
    )
    out, err = capfd.readouterr()
    assert rc == 0, err
    assert "IProgress" not in err and "ipywidgets" not in err  # tqdm's warning is not shown
    # the per-run lines and the summary are stdout in a notebook (stderr is drawn as an error box)
    assert out.count("done   defense=") == 2 and "done   defense=" not in err
    assert "tiny: 2 runs trained, 0 already stored, 0 failed" in out


def test_in_a_terminal_run_lines_go_to_stderr_with_correct_grammar(tmp_path, capsys):
    experiment = experiment_from_spec({**TINY, "grid": {"defense": ["prodigy"]}}, scale="paper")
    run_grid(experiment, results_dir=tmp_path)
    out, err = capsys.readouterr()
    assert out == "" and "done   " in err and "tiny: 1 run trained, 0 already stored, 0 failed" in err
    run_grid(experiment, results_dir=tmp_path)
    assert "tiny: 0 runs trained, 1 already stored, 0 failed" in capsys.readouterr().err


def test_bar_class_is_the_widget_bar_only_in_a_kernel_with_ipywidgets(monkeypatch):
    from tqdm.std import tqdm as text_bar

    assert not progress.in_notebook() and progress.bar_class() is text_bar
    monkeypatch.setattr(progress, "in_notebook", lambda: True)
    monkeypatch.setattr(progress, "widgets_available", lambda: False)
    assert progress.bar_class() is text_bar
    monkeypatch.setattr(progress, "widgets_available", lambda: True)
    from tqdm.notebook import tqdm as widget_bar

    assert progress.bar_class() is widget_bar and progress.bar_class(text=True) is text_bar


def test_init_hints_at_the_lab_extra_and_quickstart_help_gives_the_readme_time(tmp_path, capsys):
    import re
    from pathlib import Path

    from prodigy_core.cli import main

    assert main(["init", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert "pip install 'prodigy-fl[lab]' && jupyter lab notebooks/" in out
    assert "(or: jupyter lab" not in out
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    seconds = int(re.search(r"Wall time of `prodigy-fl quickstart`.*?\*\*([\d,]+) s\*\*", readme, re.S)[1])
    with pytest.raises(SystemExit):
        main(["quickstart", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"about {round(seconds / 60)} minutes" in help_text and "a few minutes" not in help_text


def test_readme_speaks_to_users_not_of_the_projects_history():
    # issue 28 row 13: hardware named as hardware, no issue numbers or development-setup paths
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    prose = re.sub(r"`[^`]*`", "", readme)  # code names (a test's name) may keep theirs
    for phrase in (r"\bissue \d+", r"\blent\b", r"this project's", r"\.\./shared/data", r"fidelity round"):
        assert not re.search(phrase, prose, flags=re.I), phrase
    assert "2-core AMD EPYC" in readme
