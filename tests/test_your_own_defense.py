"""Your own defense, end to end (issue 26 part 5): notebooks/your_own_defense.ipynb run by papermill at smoke
scale in a temporary folder (a rule written in a cell, beside ProDiGy and NNM + trimmed mean, its heatmap and
worst-case bars), the worst-case bar chart on a hand-built frame, and the smoke profile keeping plug-ins."""

from __future__ import annotations

import json

import nbformat
import numpy as np
import pandas as pd
import papermill
import pytest
import yaml

from prodigy_core import report, reproduce
from prodigy_core.experiments import SMOKE_ATTACKS, experiment_from_spec, resolve_params

NOTEBOOK = reproduce.NOTEBOOKS_DIR / "your_own_defense.ipynb"
LAYOUT = {"rows": "defense", "columns": "attack"}


def hand_built(blocks: bool = False) -> pd.DataFrame:
    """Two defenses x (no attack, ALIE, SF) x seeds 0 and 1; with `blocks`, a second momentum block whose
    accuracies are 10 points lower."""
    accuracy = {  # (defense, attack): (seed 0, seed 1)
        ("prodigy", "none"): (90.0, 92.0),
        ("prodigy", "alie"): (80.0, 70.0),  # mean 75
        ("prodigy", "sf"): (60.0, 64.0),  # mean 62: ProDiGy's worst case
        ("nnm+trimmed_mean", "none"): (20.0, 20.0),  # lower still, but "no attack" is not an attack
        ("nnm+trimmed_mean", "alie"): (40.0, 30.0),  # mean 35: its worst case
        ("nnm+trimmed_mean", "sf"): (55.0, 45.0),  # mean 50
    }
    rows = [
        dict(local_momentum=beta, defense=d, attack=a, seed=s, final_accuracy=acc - 10 * (beta > 0), rounds=5)
        for beta in ((0.0, 0.9) if blocks else (0.0,))
        for (d, a), seeds in accuracy.items()
        for s, acc in enumerate(seeds)
    ]
    return pd.DataFrame(rows)


def bars_of(ax) -> list[float]:
    return [bar.get_width() for bar in ax.patches]


def test_worst_case_bars_are_the_row_minima_over_the_attacks():
    fig = report.worst_case_bars(hand_built(), LAYOUT, "Hand-built")
    (ax,) = fig.axes
    assert bars_of(ax) == pytest.approx([62.0, 35.0])  # mean over seeds, then the lowest over the attacks
    assert [t.get_text() for t in ax.get_yticklabels()] == ["ProDiGy", "NNM+Trimmed mean"]
    assert [t.get_text() for t in ax.texts] == ["62.0 (SF)", "35.0 (ALIE)"]
    assert ax.get_xlim() == (0.0, 100.0)
    # the bars are the table's bold cells
    means, worst = report.accuracy_table(hand_built(), LAYOUT), report.worst_case(hand_built(), LAYOUT)
    assert bars_of(ax) == pytest.approx(means.where(worst).min(axis=1).tolist())
    caption = " ".join(t.get_text() for t in fig.texts)
    assert "after 5 rounds, mean over 2 seeds" in " ".join(caption.split())


def test_worst_case_bars_draw_one_panel_per_block_and_mark_a_diverged_worst_case():
    df = hand_built(blocks=True).assign(diverged=False)
    hit = (df["defense"] == "prodigy") & (df["attack"] == "sf") & (df["local_momentum"] == 0.9)
    df.loc[hit & (df["seed"] == 1), "diverged"] = True
    fig = report.worst_case_bars(df, {**LAYOUT, "blocks": ["local_momentum"]}, "Blocks")
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["β=0", "β=0.9"]
    assert bars_of(panels[0]) == pytest.approx([62.0, 35.0])
    assert bars_of(panels[1]) == pytest.approx([52.0, 25.0])
    assert panels[1].texts[0].get_text() == f"52.0{report.DIVERGED_MARK} (SF)"
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == [f"{report.DIVERGED_MARK} diverged in at least one seed (counted at chance accuracy)"]


def test_a_row_with_no_attacked_cell_run_has_no_bar():
    df = hand_built()
    df = df[~((df["defense"] == "nnm+trimmed_mean") & (df["attack"] != "none"))]
    (ax,) = report.worst_case_bars(df, LAYOUT).axes
    assert bars_of(ax)[0] == pytest.approx(62.0) and np.isnan(bars_of(ax)[1])
    assert [t.get_text() for t in ax.texts] == ["62.0 (SF)"]


RULE = """from prodigy_core.aggregators import Rule


class Closest(Rule):
    display = "Closest to median"

    def __init__(self, f: int):
        self.f = f

    def aggregate(self, G):
        far = (G - G.median(dim=0).values).norm(dim=1)
        return G[far.argsort()[: len(G) - 2 * self.f]].mean(dim=0)
"""


def test_the_smoke_profile_keeps_plugins_beside_its_usual_defenses_and_attacks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_defense.py").write_text(RULE)
    spec = yaml.safe_load(resolve_params("quickstart_digits").read_text())  # 42 runs: shrunk at smoke scale
    spec["grid"]["defense"].append("nnm+my_defense.py:Closest")
    smoke = experiment_from_spec(spec, scale="smoke")
    assert list(dict.fromkeys(c.defense for c in smoke.configs)) == [
        "none", "nnm+trimmed_mean", "prodigy", "nnm+my_defense.py:Closest"]  # fmt: skip
    assert list(dict.fromkeys(c.attack for c in smoke.configs)) == list(SMOKE_ATTACKS)


def test_the_notebook_runs_a_rule_of_your_own_beside_prodigy_and_nnm_trimmed_mean(tmp_path, monkeypatch):
    results, figures, work = tmp_path / "results", tmp_path / "figures", tmp_path / "work"
    monkeypatch.setenv("PRODIGY_RESULTS_DIR", str(results))  # the kernel inherits them
    monkeypatch.setenv("PRODIGY_FIGURES_DIR", str(figures))
    monkeypatch.setenv("PRODIGY_PROGRESS", "text")
    monkeypatch.chdir(tmp_path)
    executed = papermill.execute_notebook(
        str(NOTEBOOK),
        str(tmp_path / "executed.ipynb"),
        parameters={"scale": "smoke", "work_dir": str(work)},
        cwd=str(tmp_path),
        kernel_name=reproduce.KERNEL,
        progress_bar=False,
        extra_arguments=reproduce.KERNEL_ARGUMENTS,
    )
    # the rule's file went to the folder the notebook was given, not beside the notebook
    assert (work / "my_defense.py").is_file() and not (NOTEBOOK.parent / "my_defense.py").exists()
    mine = f"nnm+{(work / 'my_defense.py').resolve()}:Closest"
    records = [json.loads(p.read_text()) for p in (results / "your_own_defense-smoke").glob("*.json")]
    by_defense = {}
    for r in records:
        by_defense.setdefault(r["config"]["defense"], []).append(r)
    assert set(by_defense) == {"prodigy", "nnm+trimmed_mean", mine}
    attacks = {d: sorted(r["config"]["attack"] for r in rs) for d, rs in by_defense.items()}
    assert all(a == sorted(SMOKE_ATTACKS) for a in attacks.values()), attacks  # the full smoke table
    assert all(0 <= r["final_accuracy"] <= 100 for r in records)
    assert all(mine.removeprefix("nnm+") in r["plugins"] for r in by_defense[mine])  # with its file hash
    assert report.display_value("defense", mine) == "NNM+Closest to median"  # the class's `display`
    # the heatmap and the worst-case bar chart: saved, and shown in the notebook
    for name in ("your_own_defense", "your_own_defense_worst_case"):
        assert (figures / "smoke" / f"{name}.png").stat().st_size > 0, name
        assert (figures / "smoke" / f"{name}.pdf").stat().st_size > 0, name
    last = [c for c in nbformat.from_dict(executed).cells if c.cell_type == "code"][-1]
    images = [o for o in last.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2


@pytest.mark.parametrize("notebook, parameters, edit, words", [
    ("your_own_defense.ipynb", {"scale": "smoke"}, ("mean(dim=0)", "mean(dim=1)"),
     "Closest(f=3).aggregate returned shape (4,) on cpu; a rule returns one vector (d,) = (20,) on cpu"),
    ("explore_attacks.ipynb", {"scale": "smoke", "defense": "prodigi"}, None,
     "unknown defense 'prodigi' (did you mean 'prodigy'?)"),
])  # fmt: skip
def test_a_mistake_fails_the_notebook_under_papermill_instead_of_being_printed(
    tmp_path, monkeypatch, notebook, parameters, edit, words
):
    """A notebook audit (helper 50): your_own_defense's rule taking the mean over the wrong axis failed every
    run of it, and the notebook ended with exit 0, its figures quietly without the rule; explore_attacks with
    a misspelt defense printed the error and exited 0 (so did `prodigy-fl reproduce`). Both now fail: the
    rule's contract is checked before the grid (and a failed run stops the notebook), the explorer's error
    is raised at every scale but the interactive one."""
    monkeypatch.setenv("PRODIGY_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("PRODIGY_FIGURES_DIR", str(tmp_path / "figures"))
    nb = nbformat.read(reproduce.NOTEBOOKS_DIR / notebook, as_version=4)
    if edit is not None:  # the rule's cell, as a user might get it wrong
        (cell,) = [c for c in nb.cells if edit[0] in c.source]
        cell.source = cell.source.replace(*edit)
    nbformat.write(nb, tmp_path / notebook)
    with pytest.raises(papermill.PapermillExecutionError) as e:
        papermill.execute_notebook(str(tmp_path / notebook), str(tmp_path / "executed.ipynb"),
                                   parameters={**parameters, "work_dir": str(tmp_path / "work")}
                                   if notebook == "your_own_defense.ipynb" else parameters,
                                   cwd=str(tmp_path), kernel_name=reproduce.KERNEL, progress_bar=False,
                                   extra_arguments=reproduce.KERNEL_ARGUMENTS)  # fmt: skip
    assert words in str(e.value)
