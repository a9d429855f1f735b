"""Hostile inputs, round 4 (issue 42): reports that averaged across precisions, the GPU driver's import and
resume of bad tarballs, the scripts' and notebooks' arguments. One regression test per finding, each against
an independent expectation (hand-made frames and tarballs, the file system after the fault)."""

import argparse
import gzip
import io
import json
import tarfile
import time
import types
from pathlib import Path

import pandas as pd
import pytest

from prodigy_core import report, results
from prodigy_core.config import ConfigError, RunConfig
from prodigy_core.experiments import load_experiment

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


def test_42_5_b_a_bf16_comparison_with_the_paper_says_so_in_its_title_and_file_name(tmp_path, monkeypatch):
    comparison = pd.DataFrame({"defense": ["prodigy"], "attack": ["alie"], "ours": [10.0], "paper": [52.0],
                               "delta": [-42.0], "worst_case_match": [pd.NA]})  # fmt: skip
    monkeypatch.setattr("prodigy_core.results.compare_with_paper", lambda df, t, **kw: comparison)
    df = runs(precision=["fp32", "bf16"], final_accuracy=[90.0, 10.0])
    names = {p.name for p in report.write_report(experiment(paper_table="femnist_n20"), df, tmp_path)}
    assert {"fab_vs_paper.md", "fab_bf16_vs_paper.md"} <= names
    assert (
        "(variant: paper; precision: bf16)" in (tmp_path / "fab_bf16_vs_paper.md").read_text().splitlines()[0]
    )
    assert "precision" not in (tmp_path / "fab_vs_paper.md").read_text().splitlines()[0]


# ---------------------------------------- 8-10, 15-21, 26, 27, 35: the GPU driver's import and resume

FOLDER = "results/quickstart_digits-smoke"


def quick(
    precision: str = "fp32", n: int = 2, accuracy: float = 50.0, start: int = 0
) -> list[tuple[str, dict]]:
    """(member name, record) of `n` runs of the smoke quickstart at `precision`, as the driver stores them."""
    exp = load_experiment("quickstart_digits", scale="smoke", fields={"precision": precision})
    out = []
    for i, c in enumerate(exp.configs[start : start + n]):
        record = {"key": c.key(), "experiment": exp.name, "status": "done", "config": c.resolved().to_dict(),
                  "final_accuracy": accuracy + i, "accuracy_curve": [[1, accuracy + i]], "round_times": [0.5],
                  "environment": {"device": "cpu", "precision": precision}}  # fmt: skip
        out.append((f"{FOLDER}/{c.key()}.json", record))
    return out


def write_tar(path: Path, members: list[tuple[str, str | bytes | dict]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, content in members:
            data = json.dumps(content).encode() if isinstance(content, dict) else content
            data = data.encode() if isinstance(data, str) else data
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def provenance_rows(figures: Path) -> list[list[str]]:
    text = (figures / "gpu" / "PROVENANCE.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| quickstart")]
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in rows]


@pytest.fixture
def roots(tmp_path):
    return tmp_path / "results", tmp_path / "figures"


def test_42_8_import_reports_the_bf16_records_of_a_folder_holding_both_precisions(gpu_run, tmp_path, roots):
    members = quick("fp32", accuracy=70.0) + quick("bf16", accuracy=20.0)
    gpu_run.import_results(write_tar(tmp_path / "r.tar.gz", members), *roots)
    assert len(list((roots[0] / "gpu").rglob("*.json"))) == 4
    smoke = roots[1] / "gpu" / "smoke"
    fp32 = report.markdown_cells((smoke / "quickstart_digits.md").read_text())
    bf16 = report.markdown_cells((smoke / "quickstart_digits_bf16.md").read_text())
    assert sorted(v.strip("*") for v in fp32.values() if v != "–") == ["70.00", "71.00"]
    assert sorted(v.strip("*") for v in bf16.values() if v != "–") == ["20.00", "21.00"]


def resume_without_training(gpu_run, monkeypatch, tmp_path, tarball: Path) -> Path:
    """`gpu_run.py --simulate --resume tarball` up to its first tarball (no probe, no autotune, no run)."""

    def drive(driver, args, work):
        driver.refresh_out()
        return 0

    monkeypatch.setattr(gpu_run, "drive", drive)
    out = tmp_path / "out"
    argv = ["--simulate", "--data", str(tmp_path / "none"), "--out", str(out), "--work", str(tmp_path / "w"),
            "--resume", str(tarball)]  # fmt: skip
    assert gpu_run.main(argv) == 0
    return out / "results.tar.gz"


def test_42_9_resume_keeps_the_earlier_commands_log_env_summary_and_autotune(gpu_run, tmp_path, monkeypatch):
    earlier = [("log.txt", "trained run A\n"), ("env.txt", "gpu: H100\n"), ("summary.txt", "step | 1 done\n"),
               ("autotune.json", '{"chosen": "bf16"}'), *quick("fp32", n=1)]  # fmt: skip
    first = resume_without_training(
        gpu_run, monkeypatch, tmp_path / "1", write_tar(tmp_path / "a.tar.gz", earlier)
    )
    with tarfile.open(first) as tar:
        kept = tar.extractfile(gpu_run.EARLIER_LOG).read().decode()
        assert sum(m.name.startswith("results/") for m in tar.getmembers()) == 1
    for text in (
        "trained run A",
        "gpu: H100",
        "step | 1 done",
        '{"chosen": "bf16"}',
        str(tmp_path / "a.tar.gz"),
    ):
        assert text in kept
    second = resume_without_training(gpu_run, monkeypatch, tmp_path / "2", first)  # a resume of a resume
    with tarfile.open(second) as tar:
        chained = tar.extractfile(gpu_run.EARLIER_LOG).read().decode()
    assert chained.startswith(kept.rstrip("\n")) and chained.count("===== an earlier command") == 2
    assert "resumed from" in chained.split("===== an earlier command")[2]  # the first resume's own log


def test_41_a_resumed_command_that_makes_no_profile_carries_the_earlier_one(gpu_run, tmp_path, monkeypatch):
    """The second command of the 2026-11-27 window (--resume, --no-profile) brought home a tarball without the
    first command's profile.txt: the resumed tarball's profile now travels on until a command profiles
    anew."""
    earlier = [("log.txt", "trained run A\n"), ("profile.txt", "top 25 CUDA kernels: conv\n"),
               *quick("fp32", n=1)]  # fmt: skip
    out = resume_without_training(
        gpu_run, monkeypatch, tmp_path / "1", write_tar(tmp_path / "a.tar.gz", earlier)
    )
    with tarfile.open(out) as tar:
        assert tar.extractfile("profile.txt").read().decode() == "top 25 CUDA kernels: conv\n"


def test_42_10_a_duplicated_member_is_imported_once_with_a_warning(gpu_run, tmp_path, roots, capsys):
    ((name, record),) = quick("fp32", n=1, accuracy=40.0)
    tarball = write_tar(tmp_path / "r.tar.gz", [(name, record), (name, {**record, "final_accuracy": 99.0})])
    gpu_run.import_results(tarball, *roots)
    err = capsys.readouterr().err
    assert f"skipped {name!r}: a second member of this name" in err
    stored = json.loads((roots[0] / "gpu" / Path(name).relative_to("results")).read_text())
    assert stored["final_accuracy"] == 40.0
    assert len(provenance_rows(roots[1])) == 1


@pytest.mark.parametrize("kind", ["missing", "not a tar", "empty", "results root is a file"])
def test_42_15_import_of_a_bad_file_or_into_a_file_is_one_line(gpu_run, tmp_path, roots, capsys, kind):
    tarball = tmp_path / "r.tar.gz"
    if kind == "not a tar":
        tarball.write_text("hello")
    elif kind == "empty":
        tarball.write_bytes(b"")
    elif kind == "results root is a file":
        write_tar(tarball, quick(n=1))
        roots[0].write_text("a file")
    argv = ["import", str(tarball), "--results-root", str(roots[0]), "--figures-root", str(roots[1])]
    assert gpu_run.main(argv) == gpu_run.EXIT_PREFLIGHT
    err = capsys.readouterr().err.strip()
    assert err.startswith("gpu_run import: error: ") and "\n" not in err, err
    assert not (roots[1] / "gpu").exists()


def test_42_16_a_stale_record_with_a_partial_config_is_listed(gpu_run, tmp_path, roots):
    config = {"dataset": "digits", "n_clients": 6, "n_byzantine": 1, "defense": "average", "attack": "none"}
    stale = {"key": "0123456789abcdef", "status": "done", "config": config, "final_accuracy": 50.0}
    gpu_run.import_results(
        write_tar(tmp_path / "r.tar.gz", [(f"{FOLDER}/0123456789abcdef.json", stale)]), *roots
    )
    (row,) = provenance_rows(roots[1])
    assert row[:4] == ["quickstart_digits-smoke", "paper", "average", "none"] and row[-1] == "no"


def test_42_17_a_record_without_data_source_is_reported(gpu_run, tmp_path, roots, capsys):
    ((name, record),) = quick(n=1, accuracy=30.0)
    config = {k: v for k, v in record["config"].items() if k != "data_source"}
    gpu_run.import_results(write_tar(tmp_path / "r.tar.gz", [(name, {**record, "config": config})]), *roots)
    table = (roots[1] / "gpu" / "smoke" / "quickstart_digits.md").read_text()
    assert "30.00" in table


# a file of the current folder (the repository root's README.md) is no params file either
@pytest.mark.parametrize(
    "folder", ["results/nosuch-mini", "results/quickstart_digits-huge", "results/README.md"]
)
def test_42_18_an_unknown_folder_or_scale_is_skipped_before_anything_is_written(
    gpu_run, tmp_path, roots, capsys, folder
):
    ((name, record),) = quick(n=1)
    bad = name.replace(FOLDER, folder)
    tarball = write_tar(tmp_path / "r.tar.gz", [(bad, record), (name, record)])
    assert gpu_run.main(["import", str(tarball), "--results-root", str(roots[0]), "--figures-root",
                         str(roots[1])]) == 0  # fmt: skip
    assert f"skipped {bad!r}: results folder {Path(folder).name!r}" in capsys.readouterr().err
    assert not (roots[0] / "gpu" / Path(folder).name).exists()
    assert (roots[1] / "gpu" / "smoke" / "quickstart_digits.md").exists()  # the good folder still reported


@pytest.mark.parametrize("field, value", [("environment", ["odd"]), ("environment", "x|y\nz"),
                                          ("round_times", 5), ("round_times", {"a": 1})])  # fmt: skip
def test_42_19_odd_environment_or_round_times_fields_still_give_a_provenance(
    gpu_run, tmp_path, roots, field, value
):
    ((name, record),) = quick(n=1)
    record[field] = value
    assert results.check_record(record, Path(name)) is None  # the store accepts it
    gpu_run.import_results(write_tar(tmp_path / "r.tar.gz", [(name, record)]), *roots)
    (row,) = provenance_rows(roots[1])
    assert len(row) == 15 and row[7] == ("n/a" if field == "round_times" else "0.5")  # 15: with the phases


def truncated(tmp_path: Path) -> Path:
    whole = write_tar(tmp_path / "whole.tar.gz", [*quick(n=4), ("log.txt", "x" * 50_000)])
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    return cut


def test_42_20_a_truncated_resume_tarball_stops_in_the_preflight(gpu_run, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--simulate", "--data", str(tmp_path / "none"), "--out", str(out), "--work", str(tmp_path / "w"),
            "--resume", str(truncated(tmp_path))]  # fmt: skip
    assert gpu_run.main(argv) == gpu_run.EXIT_PREFLIGHT
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("gpu_run: error: --resume ") and "truncated" in err[-1]
    assert not out.exists()


def test_42_20_b_a_truncated_tarball_imports_nothing(gpu_run, tmp_path, roots, capsys):
    argv = [
        "import",
        str(truncated(tmp_path)),
        "--results-root",
        str(roots[0]),
        "--figures-root",
        str(roots[1]),
    ]
    assert gpu_run.main(argv) == gpu_run.EXIT_PREFLIGHT
    assert not roots[0].exists() and not roots[1].exists()


def test_42_21_a_tarball_that_expands_past_the_cap_is_refused_before_it_is_read(
    gpu_run, tmp_path, roots, capsys
):
    info = tarfile.TarInfo("log.txt")  # a header declaring 10 GB, its content never sent
    info.size = 10 * 2**30
    bomb = tmp_path / "bomb.tar.gz"
    with gzip.open(bomb, "wb") as fh:
        fh.write(info.tobuf(format=tarfile.GNU_FORMAT) + b"\0" * 10_000)
    argv = ["import", str(bomb), "--results-root", str(roots[0]), "--figures-root", str(roots[1])]
    tic = time.monotonic()
    assert gpu_run.main(argv) == gpu_run.EXIT_PREFLIGHT
    assert time.monotonic() - tic < 10
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"expands past {gpu_run.MAX_TOTAL_BYTES:,} bytes" in err
    # many members each under the member cap: their sum counts (the cap made small to keep the test small)
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(gpu_run, "MAX_TOTAL_BYTES", 20_000)
    try:
        many = write_tar(
            tmp_path / "many.tar.gz", [*quick(n=1), *[(f"log{i}.txt", "x" * 4000) for i in range(8)]]
        )
        assert gpu_run.main(["import", str(many), *argv[2:]]) == gpu_run.EXIT_PREFLIGHT
    finally:
        monkeypatch.undo()
    assert "expands past 20,000 bytes" in capsys.readouterr().err
    assert not roots[0].exists() and not (roots[1] / "gpu").exists()


BAD_ARGUMENTS = [("--group-size", "0"), ("--group-size", "-2"), ("--group-size", "x"), ("--deadline", "0"),
                 ("--deadline", "nan"), ("--deadline", "-5")]  # fmt: skip


@pytest.mark.parametrize("flag, value", BAD_ARGUMENTS)
def test_42_26_a_group_size_or_deadline_that_trains_nothing_is_a_usage_error(
    gpu_run, tmp_path, capsys, flag, value
):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        gpu_run.main(["--simulate", "--data", str(tmp_path), "--out", str(out), flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {value!r}" in err and "usage:" in err
    assert not out.exists()


def test_42_27_when_no_run_fits_the_deadline_the_command_fails_and_names_the_steps(gpu_run, tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    args = argparse.Namespace(simulate=True, profile="paper", out=out, group_size=1, deadline=1.0)
    driver = gpu_run.Driver(args, work)
    steps = [s.name for s in gpu_run.plan("paper", simulate=True)]
    driver.rows = [{"step": s, "planned": 3, "done": 0, "failed": 0, "seconds": 0.0, "status": "too slow"}
                   for s in steps]  # fmt: skip
    driver.write_summary(final=True)
    assert driver.failed()
    assert f"never started: {', '.join(steps)}" in (out / "summary.txt").read_text()
    driver.rows[0].update(status="done", done=3, seconds=5.0)  # one step trained: the others are reported
    assert not driver.failed()


def test_42_35_provenance_takes_the_precision_from_the_key_not_the_environment(gpu_run, tmp_path, roots):
    ((name, record),) = quick("bf16", n=1)
    record["environment"]["precision"] = "fp32"  # what a record's environment may claim
    gpu_run.import_results(write_tar(tmp_path / "r.tar.gz", [(name, record)]), *roots)
    (row,) = provenance_rows(roots[1])
    assert row[11] == "bf16"


# ---------------------------------------------------------------- 30, 31: the notebooks' parameters


def test_42_30_the_explorer_notebook_refuses_an_unknown_scale():
    from prodigy_core.explorer import notebook_rounds

    with pytest.raises(ValueError, match=r"scale='huge' is unknown; valid: smoke, interactive, mini, paper"):
        notebook_rounds("huge")
    assert [notebook_rounds(s) for s in ("smoke", "interactive", "mini", "paper")] == [3, 30, 20, 20]
    assert notebook_rounds("smoke", 7) == 7
    nb = json.loads((ROOT / "notebooks" / "explore_attacks.ipynb").read_text())
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    assert any("rounds = notebook_rounds(scale, rounds)" in src for src in code)  # the notebook asks it


def test_42_31_a_single_row_value_selects_like_a_list_and_an_empty_list_is_named():
    from prodigy_core.experiments import select

    exp = load_experiment("quickstart_digits", scale="paper")
    one = select(exp, {"defense": "prodigy", "attack": ["none", "sf"]})  # interactive_rows="prodigy"
    assert [c.key() for c in one.configs] == [
        c.key() for c in select(exp, {"defense": ["prodigy"], "attack": ["none", "sf"]}).configs
    ]
    assert len(one.configs) == 2
    with pytest.raises(
        ConfigError, match=r"--only attack: no value given \(an empty list\); give one or more of: "
    ):
        select(exp, {"defense": ["prodigy"], "attack": []})  # interactive_columns=[]


def test_a_misspelt_field_or_a_params_name_given_for_an_experiment_is_named():
    """`select(e, {"defence": ...})` met `'RunConfig' object has no attribute 'defence'`, and
    `run_grid("quickstart_digits")` an AttributeError on str."""
    from prodigy_core.experiments import run_grid, select

    exp = load_experiment("quickstart_digits", scale="paper")
    with pytest.raises(ConfigError, match=r"^--only defence: not a run field \(did you mean 'defense'\?\)$"):
        select(exp, {"defence": ["prodigy"]})
    takes = r"takes an Experiment, e.g. load_experiment"
    with pytest.raises(TypeError, match=rf"^run_grid {takes}\('quickstart_digits'\); got str$"):
        run_grid("quickstart_digits")
    with pytest.raises(TypeError, match=rf"^select {takes}\(...\); got RunConfig$"):
        select(exp.configs[0], {"defense": ["prodigy"]})


# ---------------------------------------------------------------- 32-34: the scripts' arguments


@pytest.fixture
def script(scripts):
    return lambda name: scripts(f"scripts/{name}.py")


@pytest.fixture
def no_training(monkeypatch):
    def run_grid(*args, **kwargs):
        raise AssertionError("trained before checking its arguments")

    monkeypatch.setattr("prodigy_core.experiments.run_grid", run_grid)


BAD_COUNTS = [
    ("precision_check", ["--seeds", "0"], "--seeds"),
    ("precision_check", ["--jobs", "abc"], "--jobs"),
    ("alie_z_sensitivity", ["--rounds", "0"], "--rounds"),
    ("alie_z_sensitivity", ["--seeds", "0"], "--seeds"),
    ("no_attack_f0", ["--rounds", "x"], "--rounds"),
    ("no_attack_f0", ["--seeds", "0"], "--seeds"),
]


@pytest.mark.parametrize("name, argv, flag", BAD_COUNTS)
def test_42_32_a_bad_count_is_a_usage_line(name, argv, flag, capsys, no_training, script):
    with pytest.raises(SystemExit) as e:
        script(name).main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and f"argument {flag}: " in err and "Traceback" not in err


def test_42_33_one_seed_is_refused_and_a_cell_without_a_standard_error_is_not_marked(
    capsys, no_training, script
):
    module = script("precision_check")
    with pytest.raises(SystemExit):
        module.main(["--seeds", "1"])
    assert "at least 2 seeds" in capsys.readouterr().err
    frame = pd.DataFrame({"defense": ["prodigy"] * 2, "attack": ["none", "alie"], "seed": [0, 0],
                          "final_accuracy": [80.0, 60.0]})  # fmt: skip
    cells, rows = module.compare(frame, frame)  # one seed, equal at both precisions
    text = module.markdown(cells, rows, seeds=1)
    assert "nan" not in text and "| prodigy | alie | 60.00 | 60.00 | +0.00 | n/a | n/a |" in text


@pytest.mark.parametrize("name", ["precision_check", "alie_z_sensitivity", "no_attack_f0"])
def test_42_34_an_unwritable_out_is_refused_before_training(name, tmp_path, capsys, no_training, script):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = blocker / ("figures" if name == "precision_check" else "table.md")  # under a file: unwritable
    with pytest.raises(SystemExit) as e:
        script(name).main(["--seeds", "2", "--out", str(out)])
    assert e.value.code == 2 and f"--out {out}: cannot write there" in capsys.readouterr().err
    if name != "precision_check":  # a folder where the table file goes
        with pytest.raises(SystemExit):
            script(name).main(["--out", str(tmp_path)])
        assert "a folder; give the file to write" in capsys.readouterr().err


def test_42_4_d_a_record_without_the_precision_field_is_fp32_and_is_not_averaged_with_bf16():
    df = runs(precision=[None, "bf16"], final_accuracy=[90.0, 10.0])
    with pytest.raises(ValueError, match="differ in precision"):
        report.to_markdown(df, LAYOUT, "t")
    assert results.precisions_in(df) == ["fp32", "bf16"]


def test_42_4_e_a_result_field_named_as_a_config_field_is_not_a_setting():
    # A record's `attack_params` is the parameter the attack chose each round; its config's is the attack's
    # setting. Three seeds' line searches choose differently: the cell is still one setting. A setting
    # that differs (FOE's eps) is still refused.
    def record(seed, chosen, eps=0.1):
        config = RunConfig(attack="foe", attack_params={"eps": eps}, seed=seed, data_source="digits")
        return {"key": config.key(), "config": config.to_dict(), "final_accuracy": 50.0,
                "attack_params": chosen}  # fmt: skip

    frame = pd.DataFrame([results._flatten(record(s, [0.1, 0.08 * s])) for s in range(3)])
    assert frame["attack_params"].map(repr).nunique() == 3  # the per-round choices, as the report reads them
    results.check_one_setting_per_cell(frame, ["defense", "attack"], "fix")  # one setting: nothing raised
    mixed = pd.DataFrame([results._flatten(record(s, [0.1], eps=[0.1, 0.2][s % 2])) for s in range(3)])
    with pytest.raises(ValueError, match="differ in attack"):
        results.check_one_setting_per_cell(mixed, ["defense"], "fix")
