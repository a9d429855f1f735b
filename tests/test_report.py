"""Tables and figures of prodigy_core.report, on fabricated results frames (no training)."""

from __future__ import annotations

import itertools
import re
import statistics
import types
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from prodigy_core import report
from prodigy_core.config import RunConfig

LAYOUT = {"rows": "defense", "columns": "attack", "blocks": ["local_momentum"]}
DEFENSES = ["none", "nnm+median", "prodigy"]
ATTACKS = ["none", "alie", "sf"]


def fabricated(seeds=(0, 1, 2), momenta=(0.0, 0.9), value=None) -> pd.DataFrame:
    """One row per run, shaped like results.load(): config columns + final_accuracy + accuracy_curve."""
    rng = np.random.default_rng(1)
    rows = []
    for beta, d, a, s in itertools.product(momenta, DEFENSES, ATTACKS, seeds):
        acc = float(rng.uniform(10, 90)) if value is None else value(beta, d, a, s)
        curve = [[1, 10.0], [2, (10 + acc) / 2], [3, acc]]
        rows.append(dict(local_momentum=beta, defense=d, attack=a, seed=s, n_byzantine=3, final_accuracy=acc,
                         accuracy_curve=curve, stand_in=None))  # fmt: skip
    return pd.DataFrame(rows)


def experiment(name="fab", smoke=False, paper_table=None, layout=LAYOUT, stand_in=None, mini=False):
    return types.SimpleNamespace(name=name, title="Fabricated table", paper_table=paper_table, configs=[],
                                 report=layout, smoke=smoke, stand_in=stand_in, mini=mini)  # fmt: skip


def test_cells_are_mean_and_population_std_over_seeds():
    df = fabricated()
    mean = report.accuracy_table(df, LAYOUT, "mean")
    std = report.accuracy_table(df, LAYOUT, "std")
    for (beta, d, a), runs in df.groupby(["local_momentum", "defense", "attack"]):
        values = runs["final_accuracy"].tolist()
        assert mean.at[d, (beta, a)] == pytest.approx(statistics.fmean(values))
        assert std.at[d, (beta, a)] == pytest.approx(statistics.pstdev(values))
    # rows and columns keep the order of the frame (the grid order), not alphabetical order
    assert list(mean.index) == DEFENSES
    assert list(mean.columns) == [(b, a) for b in (0.0, 0.9) for a in ATTACKS]


def test_one_seed_prints_no_std():
    df = fabricated(seeds=(0,), momenta=(0.0,))
    assert report.accuracy_table(df, LAYOUT, "std").isna().all().all()
    md = report.to_markdown(df, LAYOUT, "t")
    assert "±" not in md.split("\n", 4)[-1]


def test_explicit_order_wins_over_frame_order():
    df = fabricated(seeds=(0,), momenta=(0.0,))
    order = {"defense": ["prodigy", "none", "nnm+median"], "attack": ["sf", "alie", "none"]}
    table = report.accuracy_table(df, LAYOUT, order=order)
    assert list(table.index) == order["defense"]
    assert [c[-1] for c in table.columns] == order["attack"]


def test_worst_case_is_row_minimum_per_block_excluding_no_attack_with_ties():
    # hand-worked: "no attack" is the lowest but never counts; prodigy ties between alie and sf
    acc = {("none", "none"): 5.0, ("none", "alie"): 30.0, ("none", "sf"): 20.0,
           ("nnm+median", "none"): 80.0, ("nnm+median", "alie"): 40.0, ("nnm+median", "sf"): 60.0,
           ("prodigy", "none"): 90.0, ("prodigy", "alie"): 70.0, ("prodigy", "sf"): 70.0}  # fmt: skip
    df = fabricated(seeds=(0,), value=lambda beta, d, a, s: acc[d, a] + (1.0 if beta else 0.0))
    worst = report.accuracy_table(df, LAYOUT, "worst_case")
    expected = {("none", "sf"), ("nnm+median", "alie"), ("prodigy", "alie"), ("prodigy", "sf")}
    for beta in (0.0, 0.9):
        for d, a in itertools.product(DEFENSES, ATTACKS):
            assert worst.at[d, (beta, a)] == ((d, a) in expected), (beta, d, a)
    assert report.worst_case(df, LAYOUT).equals(worst)


def test_markdown_bolds_exactly_the_worst_cells_and_has_one_table_per_block():
    df = fabricated()
    md = report.to_markdown(df, LAYOUT, "My title")
    assert md.startswith("# My title\n")
    assert md.count("\n## ") == 2 and "## β=0\n" in md and "## β=0.9\n" in md
    worst = report.accuracy_table(df, LAYOUT, "worst_case")
    assert md.count("**") // 2 == int(worst.to_numpy().sum()) + 1  # + the legend's **bold**
    mean, std = report.accuracy_table(df, LAYOUT), report.accuracy_table(df, LAYOUT, "std")
    d, c = "prodigy", (0.9, "sf")
    cell = f"{mean.at[d, c]:.2f} ± {std.at[d, c]:.2f}"
    assert (f"**{cell}**" in md) == bool(worst.at[d, c]) and cell in md


def test_latex_rows_have_one_cell_per_column_and_spans_cover_the_blocks():
    df = fabricated().assign(attack=lambda x: x["attack"].replace({"alie": "foe_0.1"}))
    tex = report.to_latex(df, LAYOUT, "Title with 50% and a_b")
    assert r"50\% and a\_b" in tex and r"FOE $\varepsilon$=0.1" in tex
    body = tex.split(r"\midrule")[1].split(r"\bottomrule")[0].strip().splitlines()
    assert len(body) == len(DEFENSES)
    n_cols = 2 * len(ATTACKS)
    assert all(line.count("&") == n_cols for line in body)
    spans = [int(x) for x in re.findall(r"\\multicolumn\{(\d+)\}", tex)]
    assert sum(spans) == n_cols
    worst = report.accuracy_table(df, LAYOUT, "worst_case")
    assert tex.count(r"\textbf{") == int(worst.to_numpy().sum())


def test_missing_column_is_a_clear_error():
    df = fabricated().drop(columns="local_momentum")
    message = r"results frame lacks columns \['local_momentum'\] needed by the layout .*; available: "
    with pytest.raises(ValueError, match=message):
        report.accuracy_table(df, LAYOUT)


def test_write_report_is_byte_identical_when_written_twice(tmp_path):
    df = fabricated(seeds=(0, 1), momenta=(0.0,))
    first = report.write_report(experiment(), df, tmp_path / "a")
    second = report.write_report(experiment(), df, tmp_path / "b")
    names = sorted(p.name for p in first)
    assert names == ["fab.md", "fab.pdf", "fab.png", "fab.tex", "fab_curves.pdf", "fab_curves.png"]
    for p, q in zip(first, second, strict=True):
        assert p.read_bytes() == q.read_bytes(), p.name
    assert b"CreationDate" not in (tmp_path / "a" / "fab.pdf").read_bytes()


HEATMAP_ONLY = {**LAYOUT, "figures": ["heatmap"]}  # keeps the tests below fast


def test_smoke_and_stand_in_outputs_go_to_smoke_folder_and_say_so(tmp_path):
    df = fabricated(seeds=(0,), momenta=(0.0,))
    paths = report.write_report(experiment(smoke=True, layout=HEATMAP_ONLY), df, tmp_path)
    assert {p.parent for p in paths} == {tmp_path / "smoke"}
    headline, subtitle = (tmp_path / "smoke" / "fab.md").read_text().splitlines()[0:3:2]
    # the scale's label leads the headline (issue 28 row 9); the tag's details are the subtitle
    assert (
        headline == "# SMOKE / stand-in — Fabricated table (variant: paper)"
        and report.SMOKE_LABEL in subtitle
    )
    # a run on stand-in data is labelled even when the experiment itself is not smoke
    df_stand_in = df.assign(stand_in="digits (offline stand-in for cifar10)")
    paths = report.write_report(
        experiment("s", paper_table="bigtable", layout=HEATMAP_ONLY), df_stand_in, tmp_path
    )
    assert {p.parent for p in paths} == {tmp_path / "smoke"}
    subtitle = (tmp_path / "smoke" / "s.md").read_text().splitlines()[2]
    assert report.SMOKE_LABEL in subtitle and "digits (offline stand-in" in subtitle
    assert not any("vs_paper" in p.name for p in paths)  # no paper comparison for stand-in numbers


def test_mini_outputs_go_to_mini_folder_say_so_and_compare_without_the_rounds(tmp_path, monkeypatch):
    seen = []

    def compare(df, table, match_rounds=True, **kw):
        seen.append((table, match_rounds))
        return pd.DataFrame({"defense": ["prodigy"], "attack": ["alie"], "ours": [50.0], "paper": [52.0],
                             "delta": [-2.0], "worst_case_match": [pd.NA]})  # fmt: skip

    monkeypatch.setattr("prodigy_core.results.compare_with_paper", compare)
    exp = experiment(paper_table="bigtable", layout=HEATMAP_ONLY, mini=True)
    paths = report.write_report(exp, fabricated(seeds=(0,), momenta=(0.0,)), tmp_path)
    assert {p.parent for p in paths} == {tmp_path / "mini"} and seen == [("bigtable", False)]
    assert report.MINI_LABEL in (tmp_path / "mini" / "fab.md").read_text()
    assert (tmp_path / "mini" / "fab_vs_paper.md").exists()


@pytest.mark.parametrize("scale", ["smoke", "mini"])
def test_the_scale_tag_stays_the_subtitle_after_the_variant(scale):
    from prodigy_core.experiments import load_experiment

    title = report.report_title(load_experiment("table4_fraction_byzantine", scale=scale))
    headline, tag = report.split_title(title)
    assert "variant: paper" in headline and tag.startswith(scale.upper())


def test_paper_comparison_written_at_paper_scale(tmp_path, monkeypatch):
    comparison = pd.DataFrame({"dataset": ["cifar10"] * 4, "n_byzantine": [2, 2, 4, 4],
                               "defense": ["prodigy"] * 4, "attack": ["alie", "sf"] * 2,
                               "ours": [50.0, 60.0, 40.0, np.nan], "paper": [52.0, 58.0, 41.0, 55.0],
                               "delta": [-2.0, 2.0, -1.0, np.nan],
                               "worst_case_match": [True, True, pd.NA, pd.NA]})  # fmt: skip
    seen = []
    fake = lambda df, t, **kw: seen.append(t) or comparison  # noqa: E731
    monkeypatch.setattr("prodigy_core.results.compare_with_paper", fake)
    exp = experiment(paper_table="fraction_byzantine", layout=HEATMAP_ONLY)
    paths = report.write_report(exp, fabricated(seeds=(0,), momenta=(0.0,)), tmp_path)
    assert seen == ["fraction_byzantine"]
    text = (tmp_path / "fab_vs_paper.md").read_text()
    assert tmp_path / "fab_vs_paper.md" in paths
    assert "Cells run: 3 of 4." in text
    assert "Mean |ours - paper|: 1.67 points." in text  # (2 + 2 + 1) / 3
    assert "agrees with the paper's on 1 of 1 rows" in text
    assert "| dataset" not in text and "| n_byzantine" in text  # constant setting columns left out


def test_distance_heatmap_marks_byzantine_clients():
    D = np.arange(16, dtype=float).reshape(4, 4)
    fig = report.distance_heatmap((D + D.T) * (1 - np.eye(4)), byzantine_ids=[0, 2])
    labels = fig.axes[0].get_yticklabels()
    marked = [lab.get_text() for lab in labels if lab.get_color() == report.BYZANTINE_COLOUR]
    assert marked == ["0 (B)", "2 (B)"]


def test_score_bars_colour_byzantine_and_hatch_zero_weight():
    scores = {"proximity": [1.0, 2.0, 3.0, 4.0], "dissimilarity": [1.0, 1.0, 1.0, 1.0],
              "composite": [1.0, 2.0, 3.0, 4.0], "weight": [0.0, 2.0, 3.0, 0.0]}  # fmt: skip
    fig = report.score_bars(scores, byzantine_ids=[0, 1])
    bars = fig.axes[0].patches
    assert [b.get_height() for b in bars] == scores["proximity"]
    red = matplotlib_colour(report.BYZANTINE_COLOUR)
    assert [tuple(b.get_facecolor()) == red for b in bars] == [True, True, False, False]
    assert [bool(b.get_hatch()) for b in bars] == [True, False, False, True]


def test_damage_plot_marks_the_most_damaging_candidate():
    fig = report.damage_plot([(0.1, 1.0), (0.2, 3.0), (0.3, 2.0)], "alie")
    star = [line for line in fig.axes[0].get_lines() if line.get_marker() == "*"][0]
    assert list(star.get_xdata()) == [0.2] and list(star.get_ydata()) == [3.0]


def matplotlib_colour(c):
    import matplotlib.colors

    return matplotlib.colors.to_rgba(c)


# ------------------------------------------------------------------ honest figures and tables (issue 19)


def diverged_frame() -> pd.DataFrame:
    """Two seeds; no defense under SF diverges in seed 1 at round 2 (chance accuracy 10, empty curve)."""
    df = fabricated(seeds=(0, 1), momenta=(0.0,)).assign(diverged=False, diverged_at=None)
    hit = (df["defense"] == "none") & (df["attack"] == "sf") & (df["seed"] == 1)
    df.loc[hit, ["diverged", "diverged_at", "final_accuracy"]] = [True, 2, 10.0]
    df.loc[hit, "accuracy_curve"] = pd.Series([[]] * int(hit.sum()), index=df.index[hit])
    return df


def test_diverged_cells_carry_a_dagger_and_a_footnote_in_markdown_and_latex():
    df = diverged_frame()
    md = report.to_markdown(df, LAYOUT, "t")
    row = next(line for line in md.splitlines() if line.startswith("| No defense"))
    assert row.split(" | ")[-1].rstrip(" |*").endswith(report.DIVERGED_MARK)  # the SF cell
    assert md.count(report.DIVERGED_MARK) == 2  # the cell and its footnote
    assert md.splitlines()[-1].startswith(f"{report.DIVERGED_MARK} The model diverged")
    tex = report.to_latex(df, LAYOUT, "t")
    assert tex.count(r"$^\dagger$") == 2 and "diverged" in tex  # the cell and the caption
    # without any diverged run: no dagger, no footnote
    clean = report.to_markdown(fabricated(seeds=(0, 1), momenta=(0.0,)), LAYOUT, "t")
    assert report.DIVERGED_MARK not in clean and "diverged" not in clean


def test_caption_says_mean_and_std_only_over_more_than_one_seed():
    assert report.seeds_phrase([1, 1, 1]) == "one seed"
    assert report.seeds_phrase([3, 3]) == "mean ± std over 3 seeds"
    assert report.seeds_phrase([2, 3]) == "mean ± std over 2-3 seeds"
    one = report.to_markdown(fabricated(seeds=(0,), momenta=(0.0,)), LAYOUT, "t")
    assert "Final test accuracy (%), one seed;" in one and "std" not in one
    tex = report.to_latex(fabricated(seeds=(0, 1, 2), momenta=(0.0,)), LAYOUT, "t")
    assert r"mean $\pm$ std over 3 seeds" in tex


def test_bold_latex_cells_set_their_math_in_bold_too():
    tex = report.to_latex(fabricated(), LAYOUT, "t")
    bold = re.findall(r"\\textbf\{([^}]*)\}", tex)
    assert bold and all(cell.startswith(r"\boldmath ") for cell in bold)


def test_titles_keep_their_smoke_tag_as_a_subtitle():
    assert report.split_title("Table I [SMOKE: 3 rounds; digits]") == ("Table I", "SMOKE: 3 rounds; digits")
    assert report.split_title("Table I") == ("Table I", None)
    assert report.join_title(*report.split_title("A [b]")) == "A [b]"
    fig = report.heatmap(fabricated(seeds=(0,), momenta=(0.0,)), LAYOUT, "Short [SMOKE: 3 rounds]")
    texts = [t.get_text() for t in fig.texts]
    assert fig._suptitle.get_text().strip() == "SMOKE — Short" and "SMOKE: 3 rounds" in texts


def test_heatmap_hatches_diverged_cells_and_smoke_scale_follows_the_data():
    df = diverged_frame()
    fig = report.heatmap(df, {"rows": "defense", "columns": "attack"}, limits=None)
    ax = fig.axes[0]
    hatched = [p for p in ax.patches if p.get_hatch()]
    assert len(hatched) == 1 and hatched[0].get_xy() == (2 - 0.5, 0 - 0.5)  # no defense (row 0), SF (col 2)
    assert any(t.get_text().endswith(report.DIVERGED_MARK) for t in ax.texts)
    means = report.accuracy_table(df, {"rows": "defense", "columns": "attack"}).to_numpy(dtype=float)
    image = ax.get_images()[0]
    assert image.norm.vmin == pytest.approx(means.min()) and image.norm.vmax == pytest.approx(means.max())
    full = report.heatmap(df, {"rows": "defense", "columns": "attack"}).axes[0].get_images()[0].norm
    assert (full.vmin, full.vmax) == (0, 100)


def test_curves_end_a_diverged_run_at_its_round_and_draw_single_points_as_points():
    df = diverged_frame()
    layout = {"rows": "defense", "columns": "attack"}
    fig = report.accuracy_curves(df, layout)
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible() and ax.get_title()}
    ends = [line for line in panels["SF"].get_lines() if line.get_marker() == "X"]
    assert len(ends) == 1 and list(ends[0].get_xdata()) == [2] and list(ends[0].get_ydata()) == [10.0]
    assert fig.get_figwidth() == report.PAPER_WIDTH
    one = fabricated(seeds=(0,), momenta=(0.0,)).assign(
        accuracy_curve=lambda x: [[[3, a]] for a in x["final_accuracy"]]
    )
    lines = [line for ax in report.accuracy_curves(one, layout).axes for line in ax.get_lines()]
    assert lines and all(line.get_linestyle() == "None" and len(line.get_xdata()) == 1 for line in lines)


def test_distance_heatmap_uses_a_log_colour_scale():
    import matplotlib.colors

    D = np.array([[0.0, 1.0, 1e6], [1.0, 0.0, 1e6], [1e6, 1e6, 0.0]])
    norm = report.distance_heatmap(D, [2]).axes[0].get_images()[0].norm
    assert isinstance(norm, matplotlib.colors.LogNorm) and (norm.vmin, norm.vmax) == (1.0, 1e6)


def test_score_bars_mark_clients_whose_score_is_zero():
    scores = {"proximity": [0.0, 0.0, 3.0, 4.0], "dissimilarity": [1.0, 1.0, 1.0, 1.0],
              "composite": [0.0, 0.0, 3.0, 4.0], "weight": [0.0, 0.0, 3.0, 4.0]}  # fmt: skip
    fig = report.score_bars(scores, byzantine_ids=[0, 1])
    for ax, name in zip(fig.axes, report.SCORE_PANELS, strict=False):
        marked = [tuple(xy) for c in ax.collections for xy in c.get_offsets()]
        expected = [(float(i), 0.0) for i, v in enumerate(scores[name]) if v == 0]
        assert marked == expected, name


def test_damage_plot_has_no_offset_notation_and_formats_the_chosen_parameter():
    search = [(0.123456, 4.29401), (0.2, 4.29405), (0.3, 4.29403)]  # a flat curve: offset notation would show
    fig = report.damage_plot(search, "alie", defense="nnm+median")
    fig.canvas.draw()
    ax = fig.axes[0]
    assert (
        ax.yaxis.get_major_formatter().get_offset() == ""
        and ax.xaxis.get_major_formatter().get_offset() == ""
    )
    assert ax.get_legend().get_texts()[0].get_text() == "chosen: z = 0.2"
    assert "NNM+Median" in ax.get_title()
    assert report.format_parameter((1.23456, 0.5)) == "(1.23, 0.5)"


@pytest.mark.parametrize("seeds", [1, 3])
def test_committed_quickstart_table_was_made_by_the_current_params_and_code(seeds):
    # The cheap half of the check that committed outputs are what the committed code produces; the full
    # half (retrain everything, compare every cell) is scripts/check_committed_quickstart.py.
    from prodigy_core.cli import quickstart_name
    from prodigy_core.experiments import load_experiment

    name = quickstart_name(seeds)
    committed = Path(report.__file__).resolve().parents[1] / "figures" / f"{name}.md"
    # Both the runs hash (of every resolved config field) and the code hash (prodigy_core/) must match:
    # a change to the code is committed with the regenerated quickstart (README, "Working on the project").
    written = report.read_provenance(committed.read_text(encoding="utf-8"))
    overrides = {"seeds": list(range(seeds))} if seeds > 1 else None
    current = report.provenance(load_experiment("quickstart_digits", overrides=overrides))
    assert written == current, (
        f"figures/{name}.* were made by other params or code ({written}; now {current}): "
        "run `python scripts/regenerate.py` and commit figures/"
    )


def test_a_one_seed_table_is_compared_cell_by_cell_with_the_reference_mean_and_std():
    reference = "\n".join([
        "| Defense | No attack | ALIE | SF |", "|:---|---:|---:|---:|",
        "| No defense | 96.75 ± 1.39 | 83.10 ± 7.80 | **10.00 ± 0.00†** |",
        "| ProDiGy | 84.77 ± 3.30 | **69.73 ± 15.33** | 78.37 ± 4.61 |",
    ])  # fmt: skip
    one_seed = "\n".join([
        "| Defense | No attack | ALIE | SF |", "|:---|---:|---:|---:|",
        "| No defense | 96.38 | 99.00 | **10.00†** |",  # |99 - 83.1| = 15.9 > 2 x 7.8 = 15.6: outside
        "| ProDiGy | 91.37 | **54.04** | 87.59 |",  # 6.60 = 2 x 3.30 and 9.22 = 2 x 4.61 away: within
    ])  # fmt: skip
    text, within, compared = report.compare_with_reference(one_seed, reference)
    assert (within, compared) == (5, 6)  # all but ALIE on No defense
    lines = text.splitlines()
    outside = "**99.00 (83.10 ± 7.80)**"
    assert lines[2] == f"| No defense | 96.38 (96.75 ± 1.39) | {outside} | 10.00 (10.00 ± 0.00) |"
    assert lines[3] == "| ProDiGy | 91.37 (84.77 ± 3.30) | 54.04 (69.73 ± 15.33) | 87.59 (78.37 ± 4.61) |"
    assert lines[-1].startswith("5 of 6 accuracy cells lie within 2 std") and "seed" in lines[-1]
    assert report.compare_with_reference("| a | b |\n|---|---|\n| x | 1 |", reference)[1:] == (0, 0)
    assert report.parse_cell("–") is None and report.parse_cell("**59.24 ± 7.85**") == (59.24, 7.85)


DETECTION_SECTION = """## ProDiGy detection

Detection precision: ...

| defense | attack | seed | detection precision | detection recall | no-attack rate |
|---|---|---|---|---|---|
{rows}
"""


def quickstart_like(cells: list[str], detection_rows: list[str]) -> str:
    """An accuracy table (No defense / ProDiGy x No attack / SF) and, under it, a detection section."""
    table = ["| Defense | No attack | SF |", "|:---|---:|---:|", f"| No defense | {cells[0]} | {cells[1]} |",
             f"| ProDiGy | {cells[2]} | {cells[3]} |"]  # fmt: skip
    return "\n".join([*table, "", DETECTION_SECTION.format(rows="\n".join(detection_rows))])


def test_the_comparison_with_the_reference_counts_accuracy_cells_only_not_the_detection_rows():
    # Issue 43: the detection table's "prodigy" row was read as a table row beside the defenses, its seed
    # compared as a cell ("seed 0.00 (2.00 ± 0.00)"): the quickstart counted 42 of 46 cells.
    reference = quickstart_like(["96.75 ± 1.39", "10.00 ± 0.00", "84.77 ± 3.30", "78.37 ± 4.61"],
                                ["| prodigy | sf | 0 | 0.77 | 0.77 | 0.06 |",
                                 "| prodigy | sf | 1 | 0.53 | 0.53 | 0.33 |",
                                 "| prodigy | sf | 2 | 0.95 | 0.95 | 0.83 |"])  # fmt: skip
    one_seed = quickstart_like(
        ["96.38", "10.00", "91.37", "87.59"], ["| prodigy | sf | 0 | 0.50 | 0.50 | 0.06 |"]
    )
    text, within, compared = report.compare_with_reference(one_seed, reference)
    assert (within, compared) == (4, 4) and "seed" not in text.splitlines()[0]
    assert "prodigy" not in text and "4 of 4 accuracy cells" in text
    # Detection in its own table: seed 0 beside the mean ± population std of seeds 0-2 of the same run.
    text, within, compared = report.compare_detection_with_reference(one_seed, reference)
    mean, std = np.mean([0.77, 0.53, 0.95]), np.std([0.77, 0.53, 0.95])  # 0.75 ± 0.172: 0.50 is within
    rate_mean, rate_std = np.mean([0.06, 0.33, 0.83]), np.std([0.06, 0.33, 0.83])
    lines = text.splitlines()
    assert lines[0] == "| defense | attack | seed | detection precision | detection recall | no-attack rate |"
    cell = f"0.50 ({mean:.2f} ± {std:.2f})"
    assert lines[2] == f"| prodigy | sf | 0 | {cell} | {cell} | 0.06 ({rate_mean:.2f} ± {rate_std:.2f}) |"
    assert (within, compared) == (3, 3) and lines[-1].startswith("3 of 3 detection values lie within")
    far = quickstart_like(["1", "2", "3", "4"], ["| prodigy | sf | 0 | 0.30 | 0.90 | 0.06 |"])
    assert report.compare_detection_with_reference(far, reference)[1:] == (2, 3)  # 0.30 < 0.75 - 2 x 0.17
    assert "**0.30 (0.75 ± 0.17)**" in report.compare_detection_with_reference(far, reference)[0]
    assert report.compare_detection_with_reference(one_seed, one_seed.split("## ")[0])[1:] == (0, 0)


def test_the_committed_quickstart_tables_compare_42_accuracy_cells_and_detection_apart():
    from prodigy_core.cli import reference_comparison

    figures = Path(report.__file__).resolve().parents[1] / "figures"
    one_seed = (figures / "quickstart_digits.md").read_text(encoding="utf-8")
    reference = (figures / "quickstart_digits_3seeds.md").read_text(encoding="utf-8")
    assert report.compare_with_reference(one_seed, reference)[2] == 42  # 7 defenses x 6 attacks
    assert report.compare_detection_with_reference(one_seed, reference)[2] == 15  # 5 attacks x 3 values
    printed = reference_comparison(one_seed)
    assert "of 42 accuracy cells" in printed and "of 15 detection values" in printed


def test_no_column_of_a_report_called_precision_or_recall_alone_means_detection(tmp_path):
    # "precision" alone is a run's numeric precision (fp32, tf32, bf16); detection says so.
    exp = experiment(layout={"rows": "defense", "columns": "attack", "figures": ["heatmap"]})
    df = detection_frame_fixture()
    text = (report.write_report(exp, df[df["dirichlet_alpha"] == 0.1], tmp_path)[0]).read_text()
    detection = report.split_detection(text)[1]
    header = next(line for line in detection.splitlines() if line.startswith("|"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert "detection precision" in columns and "detection recall" in columns
    assert "precision" not in columns and "recall" not in columns
    assert detection.count("Precision:") == 0 and "Detection precision: share" in detection


def test_worst_case_of_a_grid_with_a_missing_cell_warns_nothing():
    import warnings

    df = fabricated(seeds=(0,), momenta=(0.0,))
    df = df[~((df.defense == "prodigy") & (df.attack == "sf"))]  # one cell never ran
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pandas' FutureWarning on downcasting in fillna included
        worst = report.worst_case(df, LAYOUT)
    assert not worst.at["prodigy", (0.0, "sf")] and worst.to_numpy().dtype == bool
    assert worst.loc["prodigy"].sum() == 1  # the lower of its two remaining attacked cells


def test_provenance_names_the_runs_and_the_code(tmp_path):
    df = fabricated(seeds=(0,), momenta=(0.0,))
    exp = experiment(layout=HEATMAP_ONLY)
    exp.configs = [RunConfig(seed=0), RunConfig(seed=1)]
    md = next(p for p in report.write_report(exp, df, tmp_path) if p.suffix == ".md").read_text()
    assert report.read_provenance(md) == report.provenance(exp)
    other = report.provenance(types.SimpleNamespace(configs=[RunConfig(seed=0)]))
    assert other != report.provenance(exp) and other.endswith(f"code {report.code_hash()}")


def test_a_table_names_the_machine_its_runs_trained_on(tmp_path):
    # Issue 45: a table says which CPU kernels, torch and threads made its digits, read back as written.
    # The engine and the group size (out of the key: rounding only) are named too; a run trained alone
    # records no group size, and counts as a group of 1.
    df = fabricated(seeds=(0,), momenta=(0.0,)).assign(env_device="cpu", env_torch="2.14.1", env_threads=1,
                                                       env_engine="sequential")  # fmt: skip
    df["env_cpu_capability"] = ["AVX2"] * (len(df) - 1) + ["AVX512"]  # one run elsewhere: both named
    df["env_group_size"] = [4.0] * (len(df) - 1) + [None]  # stored as floats beside a missing one
    report.write_report(experiment(layout=HEATMAP_ONLY), df, tmp_path)
    md = tmp_path / "fab.md"
    expected = {"device": "cpu", "cpu_capability": "AVX2/AVX512", "torch": "2.14.1", "threads": "1",
                "engine": "sequential", "group_size": "1/4"}  # fmt: skip
    assert report.read_machine(md.read_text()) == expected
    assert "% trained on: device=cpu, cpu_capability=AVX2/AVX512" in (tmp_path / "fab.tex").read_text()
    unknown = report.machine(df.drop(columns=["env_torch", "env_group_size"]))
    assert unknown["torch"] == "unknown" and unknown["group_size"] == "1"
    assert report.read_machine("| a |") is None


def test_titles_name_the_data_source_and_sources_never_mix(tmp_path):
    df = fabricated(seeds=(0,), momenta=(0.0,)).assign(data_source="cifar10-jpeg")
    paths = report.write_report(experiment(layout=HEATMAP_ONLY), df, tmp_path)
    header = (tmp_path / "fab.md").read_text().splitlines()[0]
    assert header == "# Fabricated table (variant: paper; data: CIFAR-10 (JPEG copy))"
    assert tmp_path / "fab.md" in paths
    mixed = pd.concat([df, df.assign(data_source="cifar10-binary")])
    with pytest.raises(ValueError, match="mix data sources cifar10-binary, cifar10-jpeg"):
        report.write_report(experiment(layout=HEATMAP_ONLY), mixed, tmp_path)
    from prodigy_core.results import compare_with_paper

    with pytest.raises(ValueError, match="mix data sources"):
        compare_with_paper(mixed.assign(dataset="cifar10"), "bigtable")


COMMITTED = Path(report.__file__).resolve().parents[1] / "figures"


@pytest.fixture(scope="module")
def quickstart_sample(tmp_path_factory):
    # The regenerating half of the committed-outputs check, on a sample CI can afford: two cells of the
    # quickstart's ProDiGy row (ALIE, whose line search is the most code, and label flip, the data-side
    # attack) trained anew as `prodigy-fl quickstart` trains them (jobs="auto": one thread per run, so the
    # numbers do not depend on the machine's core count). The whole table is checked by
    # `python scripts/check_committed_quickstart.py` (126 runs: about half an hour to an hour on 2 cores).
    import dataclasses

    from prodigy_core.experiments import load_experiment, run_grid

    experiment = load_experiment("quickstart_digits")
    row = [c for c in experiment.configs if c.defense == "prodigy" and c.attack in ("alie", "lf")]
    sample = dataclasses.replace(experiment, configs=row)
    df = run_grid(sample, jobs="auto", results_dir=tmp_path_factory.mktemp("sample"), progress=False)
    assert len(df) == len(row) == 2
    text = (COMMITTED / "quickstart_digits.md").read_text(encoding="utf-8")
    return df, text, report.read_machine(text), report.machine(df)


def sample_cells(df, table: str) -> list[tuple[tuple[str, str], float, str]]:
    """(cell, this run's accuracy, the committed cell's text) for each run of the sample."""
    cells = report.markdown_cells(table)
    found = []
    for row in df.itertuples():
        cell = (report.display_value("defense", row.defense), report.display_value("attack", row.attack))
        found.append((cell, row.final_accuracy, cells[cell]))
    return found


@pytest.mark.slow
def test_committed_quickstart_cells_are_what_the_code_trains_now_digit_for_digit(quickstart_sample):
    # Digit for digit only where the committed table's machine (its "trained on" line: CPU kernels, torch,
    # threads per run) is this one's: another CPU type's kernels round differently, and a last-bit
    # difference can move a cell by a seed's spread (report.SEED_NOTE). Elsewhere the next test checks.
    df, text, made_on, here = quickstart_sample
    if made_on != here:
        pytest.skip(
            f"digit-for-digit check not made: figures/quickstart_digits.md was trained on "
            f"{report.machine_line(made_on) if made_on else 'an unnamed machine'}, this one is "
            f"{report.machine_line(here)}; checked within {report.WITHIN_STD} std of the 3-seed table instead"
        )
    for cell, accuracy, committed in sample_cells(df, text):
        assert f"{accuracy:.2f}" == re.sub(r"[*†]", "", committed), cell


@pytest.mark.slow
def test_committed_quickstart_cells_are_within_2_std_of_3_seeds_on_another_machine(quickstart_sample):
    df, text, made_on, here = quickstart_sample
    if made_on == here:
        same = report.machine_line(here)
        pytest.skip(f"2-std check not made: the committed table was trained here ({same}); digits checked")
    three_seeds = (COMMITTED / "quickstart_digits_3seeds.md").read_text(encoding="utf-8")
    for cell, accuracy, committed in sample_cells(df, three_seeds):
        mean, std = report.parse_cell(committed)
        assert abs(accuracy - mean) <= report.WITHIN_STD * std + 0.005, (cell, accuracy, committed)


def test_mini_provenance_lists_every_mini_record_with_its_machine_and_time(tmp_path, scripts):
    import torch

    from prodigy_core.experiments import experiment_from_spec, run_grid

    module = scripts("scripts/mini_provenance.py")
    experiment = experiment_from_spec({
        "experiment": "tiny", "base": {"dataset": "digits", "n_clients": 5, "n_byzantine": 2, "rounds": 9,
                                       "local_steps": 1, "device": "cpu"},
        "grid": {"defense": ["prodigy", "none"]}, "mini": {"rounds": 2}}, scale="mini")  # fmt: skip
    df = run_grid(experiment, results_dir=tmp_path, progress=False)
    rows = module.rows(tmp_path)
    assert len(rows) == len(df) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        match = df[df["defense"] == cells[1]].iloc[0]
        assert cells[0] == "tiny-mini" and cells[5] == "2"  # the mini rounds, from its own folder
        assert cells[7] == f"{match['final_accuracy']:.2f}"
        assert cells[9].startswith("cpu, ") and cells[9].endswith("thread(s)")
        assert cells[10] == torch.__version__


# ------------------------------------------------------------------ figures that say what they are (issue 28)


def texts_of(fig):
    return " ".join(t.get_text() for t in fig.texts) + " " + fig._suptitle.get_text()


def test_table_figures_say_rounds_seeds_and_what_bold_means():
    # row 7: a table figure names its rounds and seeds and explains the bold cells
    df = fabricated(seeds=(0,), momenta=(0.0,)).assign(rounds=70)
    heat = " ".join(texts_of(report.heatmap(df, LAYOUT, "Quickstart")).split())
    assert "Final test accuracy (%) after 70 rounds, one seed" in heat
    assert "bold: the worst case over the attacks per defense" in heat
    curves = " ".join(texts_of(report.accuracy_curves(df, LAYOUT, "Quickstart")).split())
    assert "Test accuracy (%) over 70 rounds, one seed" in curves and "bold" not in curves
    # rounds that differ between blocks (a cell's runs differ in the seed only: issue 42, finding 4)
    three = fabricated(seeds=(0, 1, 2)).assign(rounds=lambda x: 20 + 20 * (x["local_momentum"] > 0))
    assert "after 20-40 rounds, mean over 3 seeds" in " ".join(
        texts_of(report.heatmap(three, LAYOUT, "t")).split()
    )
    # one seed: no "in at least one seed" anywhere
    one = diverged_frame()[lambda x: x["seed"] == 1]
    md, tex = report.to_markdown(one, LAYOUT, "t"), report.to_latex(one, LAYOUT, "t")
    legend = [t.get_text() for t in report.heatmap(one, LAYOUT, "t").legends[0].get_texts()]
    assert "at least one seed" not in md + tex + " ".join(legend) and "diverged" in md and legend
    assert "in at least one seed" in report.to_markdown(diverged_frame(), LAYOUT, "t")


def test_partial_grids_say_how_many_cells_ran_and_femnist_names_its_writers(tmp_path):
    # row 8: "9 of 84 cells", writers in words, the provenance's count is the grid's
    df = fabricated(seeds=(0,), momenta=(0.0,))
    exp = experiment(layout={**LAYOUT, "figures": ["heatmap"]})
    exp.configs = [RunConfig(defense=d, attack=a, local_momentum=b, seed=0)
                   for b in (0.0, 0.9) for d in DEFENSES for a in ATTACKS]  # fmt: skip
    femnist = df.assign(data_source="femnist-leaf-a5c029fd3f00", n_clients=20)
    paths = report.write_report(exp, femnist, tmp_path)
    md = (tmp_path / "fab.md").read_text()
    assert "9 of 18 cells run" in md and "(18 in the grid)" in md
    assert md.startswith(
        "# Fabricated table (variant: paper; data: FEMNIST, 20 LEAF writers (writer set a5c0"
    )
    heat = " ".join(texts_of(report.heatmap(df, LAYOUT, "t", coverage="9 of 18 cells run")).split())
    assert "one seed; 9 of 18 cells run; bold" in heat and tmp_path / "fab.png" in paths
    assert report.grid_coverage(exp, pd.concat([df, df.assign(local_momentum=0.9)]), LAYOUT) is None


def test_paper_comparison_never_prints_zero_of_zero():
    frame = pd.DataFrame({"local_momentum": [0.9, 0.9], "defense": ["prodigy"] * 2, "attack": ["alie", "sf"],
                          "ours": [50.0, np.nan], "paper": [52.0, 55.0], "delta": [-2.0, np.nan],
                          "worst_case_match": [pd.NA, pd.NA]})  # fmt: skip
    both = report.paper_comparison_markdown({"paper": frame, "authors": frame.assign(ours=np.nan)}, "T")
    one = report.paper_comparison_markdown(frame.assign(variant="paper"), "T")
    for text in (both, one):
        assert "0 of 0" not in text and "not enough cells" in text
    assert "no cells run" in both
    # no no-attack column here: no note about the paper's no-attack cells; with one of ours run, in both
    # layouts; with none of ours run there (e.g. runs at another f, which match no paper cell), none
    assert report.NO_ATTACK_NOTE not in both + one
    unrun = pd.concat([frame, frame.assign(attack="none", ours=np.nan)], ignore_index=True)
    assert report.NO_ATTACK_NOTE not in report.paper_comparison_markdown(unrun.assign(variant="paper"), "T")
    quiet = pd.concat([frame, frame.assign(attack="none")], ignore_index=True)
    for text in (report.paper_comparison_markdown({"paper": quiet, "authors": quiet}, "T"),
                 report.paper_comparison_markdown(quiet.assign(variant="paper"), "T")):  # fmt: skip
        assert text.count(report.NO_ATTACK_NOTE) == 1
        assert text.index(report.NO_ATTACK_NOTE) < text.index("\n| ")  # above the table


def test_stand_in_is_in_the_title_and_accuracy_colours_are_0_to_100_or_flagged_local(tmp_path):
    # row 9
    df = fabricated(seeds=(0,), momenta=(0.0,)).assign(stand_in="digits (offline stand-in for cifar10)")
    report.write_report(experiment("s", layout=HEATMAP_ONLY), df, tmp_path)
    assert (tmp_path / "smoke" / "s.md").read_text().startswith("# SMOKE / stand-in — Fabricated table")
    title = report.report_title(experiment("s"), df)
    fig = report.heatmap(df, LAYOUT, title)
    assert fig._suptitle.get_text().startswith("SMOKE / stand-in — Fabricated table")
    norm = fig.axes[0].get_images()[0].norm
    assert (norm.vmin, norm.vmax) == (0, 100)  # what write_report draws at every scale
    local = report.heatmap(df, LAYOUT, title, limits=None)
    colourbar = local.axes[-1].get_ylabel()
    assert "LOCAL scale" in colourbar and "not 0-100" in colourbar


def detection_frame_fixture() -> pd.DataFrame:
    """ProDiGy runs of two seeds and two alphas: an attacked run's no-attack twin differs in the attack;
    seed 1 at alpha 0.5 has none, and its none run at alpha 0.1 zeroed nobody (precision NaN)."""
    nan = np.nan
    rows = [  # alpha, defense, attack, seed, precision, recall
        (0.1, "prodigy", "none", 0, 0.575, 0.4),
        (0.1, "prodigy", "sf", 0, 0.76, 0.9),
        (0.1, "prodigy", "alie", 0, 1.0, 1.0),
        (0.1, "prodigy", "none", 1, nan, 0.0),
        (0.1, "prodigy", "sf", 1, 0.5, 0.5),
        (0.5, "prodigy", "sf", 1, 0.25, 0.1),
        (0.5, "prodigy", "none", 0, 0.125, 0.1),  # another split: not seed 0's twin at alpha 0.1
        (0.1, "nnm+median", "sf", 0, nan, nan),  # no detection without ProDiGy
    ]
    return pd.DataFrame([dict(distribution="dirichlet", dirichlet_alpha=a, defense=d, attack=k, seed=s,
                              n_byzantine=3, detection_precision=p, detection_recall=r, final_accuracy=50.0,
                              engine="batched" if s else "sequential")  # engine: not part of the split
                         for a, d, k, s, p, r in rows])  # fmt: skip


def test_detection_precision_sits_beside_the_no_attack_rate_of_the_same_split_and_seed():
    frame = report.detection_frame(detection_frame_fixture())
    assert list(frame.columns) == ["dirichlet_alpha", "defense", "attack", "seed", "detection precision",
                                   "detection recall", "no-attack rate"]  # fmt: skip
    columns = ["dirichlet_alpha", "attack", "seed", "detection precision", "no-attack rate"]
    got = {(a, k, s): (p, rate) for a, k, s, p, rate in frame[columns].itertuples(index=False)}
    assert set(got) == {(0.1, "sf", 0), (0.1, "alie", 0), (0.1, "sf", 1), (0.5, "sf", 1)}
    assert got[(0.1, "sf", 0)] == (0.76, 0.575) and got[(0.1, "alie", 0)] == (1.0, 0.575)
    assert np.isnan(got[(0.1, "sf", 1)][1]) and np.isnan(got[(0.5, "sf", 1)][1])  # zeroed nobody; not stored
    text = report.detection_markdown(detection_frame_fixture())
    assert "| 0.10 | prodigy | sf | 0 | 0.76 | 0.90 | 0.57 |" in text  # 0.575 printed with 2 digits
    assert "| 0.50 | prodigy | sf | 1 | 0.25 | 0.10 | n/a |" in text
    assert report.detection_markdown(fabricated()) == ""  # no precision in the frame: no section


def test_report_and_vs_paper_quote_the_no_attack_rate(tmp_path, monkeypatch):
    comparison = pd.DataFrame({"defense": ["prodigy"], "attack": ["sf"], "ours": [50.0], "paper": [52.0],
                               "delta": [-2.0], "worst_case_match": [pd.NA]})  # fmt: skip
    monkeypatch.setattr("prodigy_core.results.compare_with_paper", lambda df, t, **kw: comparison)
    exp = experiment(
        paper_table="table1", layout={"rows": "defense", "columns": "attack", "figures": ["heatmap"]}
    )
    df = detection_frame_fixture()
    report.write_report(exp, df[df["dirichlet_alpha"] == 0.1], tmp_path)
    for name in ("fab.md", "fab_vs_paper.md"):
        text = (tmp_path / name).read_text()
        assert "no-attack rate" in text and "| prodigy | sf | 0 | 0.76 | 0.90 | 0.57 |" in text, name
