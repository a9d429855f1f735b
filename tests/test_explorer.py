"""The attack explorer (prodigy_core.explorer): a short run seen at its last round, its summary and widget."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from prodigy_core import explorer
from prodigy_core.config import RunConfig


@pytest.fixture(scope="module")
def alie_round():
    return explorer.explore(n_clients=6, n_byzantine=2, rounds=1, attack="alie", defense="prodigy")


def test_explore_reports_the_last_round_consistently(alie_round):
    ex = alie_round
    n, f = 6, 2
    assert ex.round == 1 and ex.byzantine == [0, 1]
    D = ex.distances
    assert D.shape == (n, n) and torch.allclose(D, D.T) and bool((D.diagonal() == 0).all())
    s = ex.scores
    assert torch.allclose(s.composite, s.proximity * s.dissimilarity)
    assert ex.kept == [k for k in range(n) if s.weight[k] > 0] and len(ex.kept) <= n - f
    # the damage we recompute through the defense equals the best one of the attack's own search
    params, damages = zip(*ex.search, strict=True)
    assert ex.chosen == params[int(np.argmax(damages))]
    assert ex.damage == pytest.approx(max(damages), rel=1e-4)
    figures = explorer.exploration_figures(ex)
    assert set(figures) == {"distances", "scores", "damage"}


def test_written_views_go_where_the_scale_says(alie_round, tmp_path):
    """As `report.output_dir`: the folder itself, its smoke/ and its mini/ subfolder; only the named views."""
    for smoke, mini, folder in [(False, False, tmp_path), (True, False, tmp_path / "smoke"),
                                (False, True, tmp_path / "mini")]:  # fmt: skip
        paths = explorer.write_exploration(alie_round, "x", smoke=smoke, mini=mini, out_dir=tmp_path,
                                           views=["scores"])  # fmt: skip
        assert sorted(p.name for p in paths) == ["x_scores.pdf", "x_scores.png"]
        assert {p.parent for p in paths} == {folder} and all(p.is_file() for p in paths)


def test_explore_without_attack_has_no_search():
    from prodigy_core import training

    ex = explorer.explore(n_clients=6, n_byzantine=2, rounds=1, attack="none", defense="nnm+median")
    assert ex.search == [] and ex.chosen is None
    # the damage by brute force, from the same run's server input (a CPU run repeats itself to the bit)
    seen = {}
    training.run(
        ex.config, progress=False, on_round=lambda r, u, m, *_: seen.update(u=u.double(), m=m.double())
    )
    u, f = seen["u"], 2
    torch.testing.assert_close(
        ex.distances.double(), ((u[:, None] - u[None]) ** 2).sum(-1), rtol=1e-5, atol=1e-6
    )
    mixed = []
    for k in range(len(u)):  # NNM: each update averaged with its N - f nearest, itself included
        nearest = sorted(range(len(u)), key=lambda j: (float(((u[k] - u[j]) ** 2).sum()), j))[: len(u) - f]
        mixed.append(u[nearest].mean(dim=0))
    median = torch.stack(mixed).sort(dim=0).values[2:4].mean(dim=0)  # N = 6: the two middle values
    damage = torch.linalg.vector_norm(median - seen["m"][f:].mean(dim=0)).item()
    assert ex.damage == pytest.approx(damage, rel=1e-4)


def test_exploration_summary_names_the_defense_that_ran():
    ex = explorer.Exploration(config=RunConfig(defense="nnm+median", attack="alie"), round=3,
                              byzantine=[0, 1, 2], distances=torch.zeros(3, 3), scores=object(), kept=[3, 4],
                              search=[], chosen=1.5, damage=0.25, accuracy=50.0)  # fmt: skip
    line = explorer.exploration_summary(ex)
    assert line.startswith("NNM+Median vs ALIE, round 3") and "damage under NNM+Median" in line
    assert "ProDiGy would keep [3, 4]" in line and "kept by ProDiGy" not in line
    prodigy = explorer.exploration_summary(dataclasses.replace(ex, config=RunConfig(attack="alie")))
    assert prodigy.startswith("ProDiGy vs ALIE") and "kept by ProDiGy [3, 4]" in prodigy


def test_explorer_widget_has_readable_labels_and_trains_with_round_progress():
    # ipywidgets is in the dev extra: CI runs the widget tests (issue 28 row 12), they never skip
    box = explorer.explorer(n_clients=6, n_byzantine=2, rounds=1, attack="alie", defense="prodigy")
    controls = box.children[0].children
    labels = [c.description for c in controls]
    assert labels == list(explorer.EXPLORER_LABELS.values()) and not any("_" in label for label in labels)
    button, bar = box.children[1].children
    assert button.description == "Train and show"
    seen = []
    bar.observe(lambda change: seen.append(change["new"]), names="description")
    ex = box.train()
    assert ex is not None and ex.round == 1 and ex.config.data_dir is None
    assert seen[-1] == "round 1 / 1" and not button.disabled


# ------------------------------------------------------------------ what the explorer offers (issue 28 row 5)


def widget(**setting):
    return explorer.explorer(**{"n_clients": 6, "n_byzantine": 2, "rounds": 1, **setting})


def offered(control):
    return [value for _, value in control.options]


def test_explorer_leads_with_its_controls_in_the_notebook():
    import nbformat

    from prodigy_core import reproduce

    nb = nbformat.read(reproduce.NOTEBOOKS_DIR / "explore_attacks.ipynb", as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    first = next(i for i, src in enumerate(code) if "explorer(**setting)" in src or "explore(" in src)
    assert "box = explorer(**setting)" in code[first] and "display(box)" in code[first], "controls first"
    trained = [src for src in code if "explore(" in src]  # the first setting is trained once
    assert len(trained) == 1 and "box.keep(first)" in trained[0]


def test_labels_fit_their_controls():
    box = widget()
    c = box.controls
    grid = box.children[0]
    assert grid.layout.grid_template_columns == f"repeat(2, {explorer.COLUMN_EM}em)"
    room = explorer.COLUMN_EM - explorer.DESCRIPTION_EM - 2.5  # em left for the text beside the arrow
    for field, control in c.items():
        assert control.layout.width == "100%", field  # fills its column (ipywidgets' default is 300px)
        assert control.style.description_width == f"{explorer.DESCRIPTION_EM}em"
        texts = [label for label, _ in getattr(control, "options", [])]
        texts.append(getattr(control, "placeholder", ""))
        assert all(0.55 * len(text) <= room for text in texts), (field, texts)  # ~0.55 em a character
    assert offered(c["dataset"]) == ["digits", "femnist", "cifar10"]
    assert c["dataset"].options[0][0] == "digits (offline)"


def test_f_stays_below_half_of_n_as_n_moves():
    c = widget(n_clients=10, n_byzantine=4).controls
    assert c["n_byzantine"].max == 4
    c["n_clients"].value = 6
    assert c["n_byzantine"].max == 2 and c["n_byzantine"].value == 2  # clipped, never f >= N/2
    c["n_clients"].value = 21
    assert c["n_byzantine"].max == 10
    for n in range(4, 51):
        c["n_clients"].value = n
        assert 2 * c["n_byzantine"].max < n


def test_one_name_per_rule_and_only_runnable_options():
    c = widget().controls
    defenses = offered(c["defense"])
    labels = [label for label, _ in c["defense"].options]
    assert "none" in defenses and "average" not in defenses and len(labels) == len(set(labels))
    assert not any(d.endswith("average") for d in defenses)
    # every offered option runs with the current N and f; every one left out does not
    menus = (("defense", explorer.EXPLORER_DEFENSES), ("attack", explorer.ATTACKS.ready()))
    for field, everything in menus:
        setting = {k: ctl.value for k, ctl in c.items() if k not in ("defense_params", "attack_params")}
        for option in everything:
            fixed = {"attack": "none"} if field == "defense" else {"defense": "none"}
            try:
                RunConfig(**{**setting, **fixed, field: option})
                runs = True
            except Exception:
                runs = False
            assert runs == (option in offered(c[field])), (field, option)
    c["n_byzantine"].value = 0  # no Byzantine client: no attack to choose
    assert offered(c["attack"]) == ["none"] and c["attack"].value == "none"
    c["dataset"].value = "femnist"
    assert offered(c["distribution"]) == ["natural"] and c["dirichlet_alpha"].disabled
    assert c["download"].disabled and not c["data_dir"].disabled
    c["dataset"].value = "digits"
    assert c["data_dir"].disabled


def test_errors_are_in_the_widget_words(capsys, monkeypatch, tmp_path):
    from prodigy_core import data

    words = explorer.in_widget_words("n_byzantine=5 with n_clients=10: need 0 <= f < N/2")
    assert words == "Byzantine f=5 with clients N=10: need 0 <= f < N/2"
    # CIFAR-10 missing (issue 28 row 10): the documented command with a placeholder, the checkbox's label
    monkeypatch.setattr(data, "CIFAR10_JPEG_ARCHIVE", tmp_path / "nowhere" / "cifar10-jpeg.tar.gz")
    box = widget(dataset="cifar10", distribution="iid", data_dir=str(tmp_path / "empty"))
    assert box.train() is None
    message = capsys.readouterr().out
    assert "cannot run this setting: CIFAR-10 not found in " in message
    assert "prodigy-fl data cifar10 --from PATH/cifar10-jpeg.tar.gz" in message
    assert 'tick "download CIFAR-10 if missing"' in message
    assert "download=True" not in message and "shared/data" not in message and "data_dir" not in message


# ------------------------------------------------------------------ the damage view (issue 28 row 6)


def test_damages_tied_within_rounding_are_a_sentence_not_a_noisy_plot():
    from prodigy_core import report

    tie = [(0.1, 3.0890e-07), (1.0, 3.0891e-07), (10.0, 3.0890e-07)]
    assert report.flat_damage(tie, scale=0.8).startswith("damage about 0 for every candidate")
    fig = report.damage_plot(tie, "foe_0.1", defense="prodigy", scale=0.8)
    ax = fig.axes[0]
    assert not ax.axison and not ax.get_lines()  # no axes, no line, no "chosen" star
    assert any("about 0 for every candidate" in t.get_text() for t in ax.texts)
    same = [(0.5, 4.2), (1.0, 4.2), (2.0, 4.2 * (1 + 1e-7))]
    assert "equal within rounding" in report.flat_damage(same)
    assert report.flat_damage([(0.1, 1.0), (0.2, 3.0)]) is None and report.flat_damage([]) is None
    sf = report.damage_plot([], "sf")
    assert not sf.axes[0].axison and "SF has no parameter search" in sf.axes[0].texts[0].get_text()


def test_exploration_without_a_search_or_with_a_tie_says_so():
    base = dict(config=RunConfig(attack="sf"), round=3, byzantine=[0, 1, 2], distances=torch.ones(4, 4),
                scores=None, kept=[], search=[], chosen=None, damage=0.5, accuracy=50.0)  # fmt: skip
    ex = explorer.Exploration(**base)
    assert "damage" not in explorer.exploration_figures(ex)  # no empty axes for SF
    assert "SF has no parameter search" in explorer.exploration_summary(ex)
    tie = explorer.Exploration(**{**base, "config": RunConfig(attack="foe_100"), "chosen": 10.0,
                                  "search": [(1.0, 3e-7), (10.0, 3e-7)], "scale": 1.0})  # fmt: skip
    line = explorer.exploration_summary(tie)
    assert "damage about 0 for every candidate" in line and "chosen ε" not in line


def test_the_test_command_installs_what_the_explorer_tests_need():
    # issue 28 row 12: the test command of README and .ci/run must not skip the widget tests
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    pyproject = (root / "pyproject.toml").read_text()  # (tomllib is Python >= 3.11)
    extras = {m[1]: re.findall(r'"([^"]+)"', m[2]) for m in re.finditer(r"(?m)^(\w+) = \[(.*)\]$", pyproject)}
    command = 'pip install -e ".[dev,ray,flower]" && pytest'
    assert command in (root / "README.md").read_text() and command in (root / ".ci" / "run").read_text()
    widgets = [r for r in extras["lab"] if r.startswith("ipywidgets")]
    assert widgets and set(widgets) <= set(extras["dev"])
    assert not any(re.match(r"jupyterlab\b", r) for r in extras["dev"])  # CI stays light


# ------------------------------------------------------------------ a newcomer's first hour (issue 37)


def test_the_chosen_attack_and_defense_come_back_after_f_passes_through_zero():
    c = widget(n_byzantine=2, attack="sf", defense="nnm+cclip").controls
    c["n_byzantine"].value = 0  # no Byzantine client: no attack is offered
    assert c["attack"].value == "none"
    c["n_byzantine"].value = 1
    assert (c["attack"].value, c["defense"].value) == ("sf", "nnm+cclip")  # what the user had chosen
    c["attack"].value = "alie"  # a new choice is remembered in its turn
    c["n_byzantine"].value = 0
    c["n_byzantine"].value = 2
    assert c["attack"].value == "alie"


def test_titles_and_summary_name_the_settings(monkeypatch):
    seen = {}
    for tau in (5, 50):
        box = widget(attack="sf", defense="nnm+cclip", defense_params={"tau": tau})
        ex = box.train()
        figures = explorer.exploration_figures(ex)
        seen[tau] = (explorer.exploration_summary(ex), figures["distances"]._suptitle.get_text())
    for tau, (summary, title) in seen.items():  # tau's default is a float: 5 runs as 5.0, and says so
        assert summary.startswith(f"NNM+CClip (tau={float(tau)}) vs SF"), summary
        assert f"NNM+CClip (tau={float(tau)})" in title.replace("\n", " "), title


def test_the_same_setting_is_trained_once_and_shown_again(monkeypatch):
    calls = []
    real = explorer.explore
    monkeypatch.setattr(explorer, "explore", lambda **kw: calls.append(kw) or real(**kw))
    box = widget(attack="sf")
    first = box.train()
    assert box.train() is first and len(calls) == 1  # pressed again unchanged: shown, not retrained
    box.controls["seed"].value = 1
    assert box.train() is not first and len(calls) == 2


def test_a_setting_that_is_not_a_number_is_one_worded_line(capsys):
    box = widget(defense="nnm+cclip")
    box.controls["defense_params"].value = "tau=abc"
    assert box.train() is None
    message = capsys.readouterr().out
    assert "tau='abc' must be a number, like its default tau=10" in message
    assert "not supported between" not in message
