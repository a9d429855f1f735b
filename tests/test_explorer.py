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
    pytest.importorskip("prodigy_core.aggregators")
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


def test_explore_without_attack_has_no_search():
    pytest.importorskip("prodigy_core.aggregators")
    ex = explorer.explore(n_clients=6, n_byzantine=2, rounds=1, attack="none", defense="nnm+median")
    assert ex.search == [] and ex.chosen is None and ex.damage >= 0


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
    pytest.importorskip("ipywidgets")
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
