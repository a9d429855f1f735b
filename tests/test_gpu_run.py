"""benchmarks/gpu_run.py rehearsed on the CPU (--simulate): what comes home fits the device tool's limits and
holds exactly the finished runs; the deadline, missing data and a failing step behave as the issue asks."""

import json
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FILES, MAX_DEPTH, MAX_BYTES = 8, 2, 16 * 2**20  # the device tool's limits on $OUT


@pytest.fixture
def data(tmp_path):
    """A --data folder that does not exist: the simulation trains on the embedded digits and needs neither
    real data set (issue 35, finding 19)."""
    return tmp_path / "no-data-here"


def simulate(gpu_run, tmp_path, data, *extra):
    out, work = tmp_path / "out", tmp_path / "work"
    code = gpu_run.main(["--simulate", "--data", str(data), "--out", str(out), "--work", str(work), *extra])
    return code, out, work


def tarball_keys(out: Path) -> set[str]:
    with tarfile.open(out / "results.tar.gz") as tar:
        names = [m.name for m in tar.getmembers() if m.isfile()]
    assert not [n for n in names if n.endswith((".pt", ".lock"))]  # no checkpoints, no locks
    return {
        Path(n).name.removesuffix(".json") for n in names if n.startswith("results/") and ".failed" not in n
    }


def finished_keys(work: Path) -> set[str]:
    return {p.stem for p in (work / "results").rglob("*.json") if ".failed" not in p.name}


def summary_rows(out: Path) -> dict[str, list[str]]:
    lines = (out / "summary.txt").read_text().splitlines()
    head = lines.index("step | planned | done | failed | seconds | status")
    rows = [line.split(" | ") for line in lines[head + 1 :] if " | " in line]
    return {r[0]: r[1:] for r in rows}


@pytest.mark.parametrize("profile", ["paper", "mini"])
def test_simulated_run_brings_home_every_finished_run_within_the_limits(gpu_run, tmp_path, data, profile):
    code, out, work = simulate(gpu_run, tmp_path, data, "--profile", profile)
    assert code == 0
    files = [p for p in out.rglob("*") if p.is_file()]
    assert sorted(p.name for p in files) == ["env.txt", "results.tar.gz", "summary.txt"]
    assert len(files) <= MAX_FILES
    assert all(len(p.relative_to(out).parts) - 1 <= MAX_DEPTH and p.stat().st_size < MAX_BYTES for p in files)
    rows = summary_rows(out)
    assert set(rows) == {s.name for s in gpu_run.plan(profile, simulate=True)}
    assert all(r[4] == "done" and r[0] == r[1] for r in rows.values())  # planned == done
    done = sum(int(r[1]) for r in rows.values())
    assert tarball_keys(out) == finished_keys(work) and len(finished_keys(work)) == done
    env = (out / "env.txt").read_text()
    assert "tf32_matmul: False" in env and "deterministic: True" in env
    assert "cross-device check vs the CPU reference: agrees to rounding" in (out / "summary.txt").read_text()
    with tarfile.open(out / "results.tar.gz") as tar:
        record = json.load(
            tar.extractfile(next(m for m in tar.getmembers() if m.name.startswith("results/")))
        )
    assert record["environment"]["device"] == "cpu"
    with tarfile.open(out / "results.tar.gz") as tar:  # the autotune and its gate came home
        tune = json.load(tar.extractfile("autotune.json"))["datasets"]["digits"]
    tried = {(t["precision"], t["engine"]) for t in tune["timings"]}
    assert tried == {("fp32", "batched"), ("bf16", "batched")}  # tf32 exists only on CUDA
    assert {(g["precision"], g["defense"]) for g in tune["gate"]} == {
        ("bf16", "prodigy"),
        ("bf16", "nnm+trimmed_mean"),
    }
    assert record["config"].get("precision", "fp32") == tune["chosen"]["precision"]


def test_a_short_deadline_stops_between_groups_and_keeps_what_finished(gpu_run, tmp_path, data, monkeypatch):
    clock = iter(range(0, 10**6, 5))  # every reading of the clock is 5 s later: a slow, deterministic machine
    monkeypatch.setattr(gpu_run.time, "monotonic", lambda: next(clock))
    code, out, work = simulate(gpu_run, tmp_path, data, "--deadline", "60", "--group-size", "1")
    assert code == 0  # stopping at the deadline is not a failure
    rows = summary_rows(out)
    done = sum(int(r[1]) for r in rows.values())
    planned = sum(len(gpu_run.Driver(gpu_run_args(gpu_run, data), work).experiment(s).configs)
                  for s in gpu_run.plan("paper", simulate=True))  # fmt: skip
    assert 0 < done < planned
    assert any(r[4].startswith("stopped by the deadline") for r in rows.values())
    assert "never started:" in (out / "summary.txt").read_text()
    assert tarball_keys(out) == finished_keys(work) and len(finished_keys(work)) == done


def gpu_run_args(gpu_run, data):
    import argparse

    return argparse.Namespace(
        simulate=True, profile="paper", out=Path("."), group_size=1, deadline=1.0, data=data
    )


def test_missing_data_exits_2_before_any_training(gpu_run, tmp_path, capsys):
    out, work = tmp_path / "out", tmp_path / "work"  # a real window (no --simulate): data first
    code = gpu_run.main(["--data", str(tmp_path / "nowhere"), "--out", str(out), "--work", str(work)])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "data missing" in err and "cifar10-jpeg.tar.gz" in err
    assert not work.exists() and not (out / "results.tar.gz").exists()


def test_a_failing_step_gives_a_non_zero_exit_and_the_others_still_run(gpu_run, tmp_path, data):
    code, out, work = simulate(gpu_run, tmp_path, data, "--fail-step", "rows-authors")
    assert code == 1
    rows = summary_rows(out)
    assert rows["rows-authors"][4].startswith("failed") and rows["rest-paper"][4] == "done"
    assert tarball_keys(out) == finished_keys(work)


def test_import_writes_the_records_apart_and_a_provenance(gpu_run, tmp_path, data):
    code, out, work = simulate(gpu_run, tmp_path, data)
    assert code == 0
    written = gpu_run.import_results(out / "results.tar.gz", tmp_path / "results", tmp_path / "figures")
    assert (tmp_path / "results" / "gpu").is_dir() and not (
        tmp_path / "results" / "quickstart_digits-smoke"
    ).exists()
    imported = {p.stem for p in (tmp_path / "results" / "gpu").rglob("*.json")}
    assert imported == finished_keys(work)
    provenance = (tmp_path / "figures" / "gpu" / "PROVENANCE.md").read_text()
    assert provenance.count("| quickstart_digits-smoke |") == len(imported)
    assert "tf32_matmul: False" in provenance and written[-1].name == "PROVENANCE.md"


def test_resume_skips_the_runs_an_earlier_command_finished(gpu_run, tmp_path, data, monkeypatch):
    clock = iter(range(0, 10**6, 5))
    monkeypatch.setattr(gpu_run.time, "monotonic", lambda: next(clock))
    code, first, work1 = simulate(gpu_run, tmp_path / "1", data, "--deadline", "60", "--group-size", "1")
    monkeypatch.undo()
    before = finished_keys(work1)
    assert code == 0 and before
    code, out, work = simulate(gpu_run, tmp_path / "2", data, "--resume", str(first / "results.tar.gz"))
    assert code == 0
    rows = summary_rows(out)
    assert all(r[4] == "done" and r[0] == r[1] for r in rows.values())  # every run done in the end
    log = (work / "log.txt").read_text()
    assert f"resumed from {first / 'results.tar.gz'}: {len(before)} records" in log
    trained = {line for line in log.splitlines() if line.strip().startswith("done ")}
    assert len(trained) == len(finished_keys(work)) - len(before)  # only the runs not finished before
    assert tarball_keys(out) == finished_keys(work) >= before
