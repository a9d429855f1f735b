"""Hostile inputs, round 4 (issue 42): reports that averaged across precisions, the GPU driver's import and
resume of bad tarballs, the scripts' and notebooks' arguments. One regression test per finding, each against
an independent expectation (hand-made frames and tarballs, the file system after the fault)."""

import importlib
import io
import json
import sys
import tarfile
import types
from pathlib import Path

import pandas as pd
import pytest

from prodigy_core import report, results
from prodigy_core.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = {"rows": "defense", "columns": "attack", "figures": ["heatmap"]}


def runs(**columns) -> pd.DataFrame:
    """A results frame of one cell (prodigy / alie), one row per value of the given columns' lists."""
    n = len(next(iter(columns.values())))
    base = {"defense": ["prodigy"] * n, "attack": ["alie"] * n, "seed": [0] * n, "rounds": [3] * n}
    return pd.DataFrame({**base, **columns})


def experiment(name="fab", paper_table=None):
    return types.SimpleNamespace(name=name, title="Fabricated table", paper_table=paper_table, configs=[],
                                 report=LAYOUT, smoke=False, stand_in=None, mini=False)  # fmt: skip


# ------------------------------------------------------ 4, 5: a cell is a mean over seeds only


def test_42_4_a_report_never_averages_across_precisions(tmp_path):
    df = runs(precision=["fp32", "bf16"], final_accuracy=[90.0, 10.0])  # one seed at each precision
    with pytest.raises(ValueError, match="differ in precision") as e:
        report.to_markdown(df, LAYOUT, "t")
    assert "\n" not in str(e.value)
    paths = report.write_report(experiment(), df, tmp_path)
    fp32, bf16 = (tmp_path / "fab.md").read_text(), (tmp_path / "fab_bf16.md").read_text()
    assert report.markdown_cells(fp32)["ProDiGy", "ALIE"] == "**90.00**"  # its own seed, not 50.00 ± 40.00
    assert report.markdown_cells(bf16)["ProDiGy", "ALIE"] == "**10.00**"
    assert "one seed" in fp32 and "one seed" in bf16
    assert {p.name for p in paths} >= {"fab.md", "fab.tex", "fab_bf16.md", "fab_bf16.tex"}


def test_42_4_b_a_field_varying_outside_the_layout_is_refused_in_one_line_naming_it(tmp_path):
    df = runs(lr=[0.1, 0.5], seed=[0, 0], final_accuracy=[90.0, 10.0])
    table, files = (
        lambda: report.to_markdown(df, LAYOUT, "t"),
        lambda: report.write_report(experiment(), df, tmp_path),
    )
    for make in (table, files):
        with pytest.raises(ValueError, match=r"differ in lr \(0\.1, 0\.5\)") as e:
            make()
        assert "\n" not in str(e.value) and "report.blocks" in str(e.value)
    # the seeds alone differ, or the field differs between blocks: a table as before
    assert "45.00 ± 5.00" in report.to_markdown(runs(seed=[0, 1], final_accuracy=[40.0, 50.0]), LAYOUT, "t")
    blocks = {**LAYOUT, "blocks": ["lr"]}
    assert "## lr=0.5" in report.to_markdown(df, blocks, "t")


def test_42_4_c_the_comparison_with_the_paper_never_averages_across_precisions():
    paper = results.paper_results()
    cell = paper[paper["table"] == "femnist_n20"].iloc[0]
    setting = {c: [cell[c]] * 2 for c in results.PAPER_SETTING if c != "algorithm"}
    setting["distribution"] = ["natural"] * 2
    cell_of = {"defense": [cell["defense"]] * 2, "attack": [cell["attack"]] * 2, "seed": [0, 0]}
    df = pd.DataFrame({**setting, **cell_of, "precision": ["fp32", "bf16"], "final_accuracy": [90.0, 10.0]})
    with pytest.raises(ValueError, match="differ in precision"):
        results.compare_with_paper(df, "femnist_n20")
    ours = results.compare_with_paper(df[df["precision"] == "bf16"], "femnist_n20")
    assert ours["ours"].dropna().tolist() == [10.0]


def test_42_5_a_bf16_report_says_so_in_its_title_and_file_names(tmp_path):
    df = runs(precision=["bf16"], final_accuracy=[10.0])
    paths = report.write_report(experiment(), df, tmp_path)
    assert sorted(p.name for p in paths) == ["fab_bf16.md", "fab_bf16.pdf", "fab_bf16.png", "fab_bf16.tex"]
    title = "# Fabricated table (variant: paper; precision: bf16)\n"
    assert (tmp_path / "fab_bf16.md").read_text().startswith(title)
    assert "precision: bf16" in (tmp_path / "fab_bf16.tex").read_text()
    fp32 = report.write_report(experiment(), runs(final_accuracy=[90.0]), tmp_path)  # no precision column
    assert (tmp_path / "fab.md").read_text().startswith("# Fabricated table (variant: paper)\n")
    assert "fab.md" in {p.name for p in fp32} and (tmp_path / "fab_bf16.md").exists()  # never overwritten
