"""The results store (atomic records, claims, loading) and the comparison with the paper's numbers."""

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from prodigy_core import results
from prodigy_core.config import SETTINGS_FIELDS, RunConfig, field_names
from prodigy_core.experiments import experiment_from_spec


def record(config: RunConfig, accuracy: float, **extra) -> dict:
    return {"config": config.to_dict(), "final_accuracy": accuracy, "final_loss": 0.5,
            "accuracy_curve": [[1, accuracy]], "environment": {"device": "cpu", "torch": "x"},
            "stand_in": None, **extra}  # fmt: skip


# ------------------------------------------------------------------------------------------- writing


def test_save_record_clears_an_earlier_failure(tmp_path):
    config = RunConfig()
    results.save_failure(tmp_path, config.key(), config.to_dict(), RuntimeError("out of memory"), "e")
    failed = json.loads((tmp_path / f"{config.key()}.failed.json").read_text())
    assert failed["error"] == "RuntimeError: out of memory" and failed["status"] == "failed"
    results.save_record(tmp_path, config.key(), record(config, 42.0), "e")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{config.key()}.json"]
    stored = json.loads((tmp_path / f"{config.key()}.json").read_text())
    assert (stored["key"], stored["experiment"], stored["status"], stored["final_accuracy"]) == (
        config.key(), "e", "done", 42.0,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------- claims


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_claim_is_exclusive_until_released(tmp_path):
    a, b = results.Claims(tmp_path), results.Claims(tmp_path)
    assert a.claim("k1") and not b.claim("k1")
    assert json.loads((tmp_path / "k1.lock").read_text())["pid"] == os.getpid()
    a.release("k1")
    assert b.claim("k1")
    b.release_all()
    assert not list(tmp_path.glob("*.lock"))


def test_a_stale_lock_is_taken_over_a_foreign_or_live_one_is_not(tmp_path):
    claims = results.Claims(tmp_path)
    host = socket.gethostname()
    (tmp_path / "dead.lock").write_text(json.dumps({"pid": dead_pid(), "host": host, "started": 0}))
    (tmp_path / "live.lock").write_text(json.dumps({"pid": os.getppid(), "host": host, "started": 0}))
    (tmp_path / "far.lock").write_text(json.dumps({"pid": dead_pid(), "host": host + "-other", "started": 0}))
    assert claims.claim("dead")
    assert json.loads((tmp_path / "dead.lock").read_text())["pid"] == os.getpid()
    assert not claims.claim("live") and not claims.claim("far")


def test_a_process_killed_while_writing_its_lock_leaves_no_lock(tmp_path):
    # SIGKILL at the moment the lock's content is written: the old O_EXCL-then-write claim left an empty
    # `k.lock` there, which the next claim took for a lock being written and left alone (a resumed grid then
    # left that run undone)
    victim = (
        "import json, os, signal, sys\n"
        "from pathlib import Path\n"
        "from prodigy_core import results\n"
        "json.dump = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n"
        "results.Claims(Path(sys.argv[1])).claim('k')\n"
    )
    proc = subprocess.run([sys.executable, "-c", victim, str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    assert not (tmp_path / "k.lock").exists()
    assert not list(tmp_path.glob("*.lock")) and not list(tmp_path.glob("*.json"))  # a temp file at most
    claims = results.Claims(tmp_path)
    assert claims.claim("k")
    assert json.loads((tmp_path / "k.lock").read_text())["pid"] == os.getpid()


def test_of_many_claims_at_once_exactly_one_wins_and_its_lock_is_whole(tmp_path):
    import threading

    start, won = threading.Barrier(8), []

    def claim(claims: results.Claims) -> None:
        start.wait()
        if claims.claim("k"):
            won.append(claims)

    threads = [threading.Thread(target=claim, args=(results.Claims(tmp_path),)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1
    assert json.loads((tmp_path / "k.lock").read_text()) == won[0]._written["k"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.lock"]  # every temp file removed


def test_a_claim_on_a_file_system_without_hard_links_creates_the_lock_directly(tmp_path, monkeypatch):
    def no_links(src, dst, **kwargs):
        raise PermissionError(1, "Operation not permitted")  # what a FAT or SMB mount says

    monkeypatch.setattr(os, "link", no_links)
    a, b = results.Claims(tmp_path), results.Claims(tmp_path)
    assert a.claim("k") and not b.claim("k")
    assert json.loads((tmp_path / "k.lock").read_text())["pid"] == os.getpid()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.lock"]
    a.release("k")
    assert b.claim("k")


def test_a_finished_run_is_not_claimed(tmp_path):
    config = RunConfig()
    results.save_record(tmp_path, config.key(), record(config, 50.0), "e")
    assert not results.Claims(tmp_path).claim(config.key())
    assert results.Claims(tmp_path, skip_done=False).claim(config.key())


# ------------------------------------------------------------------------------------------- loading


def test_load_gives_config_columns_and_results_one_row_per_run(tmp_path, monkeypatch):
    monkeypatch.setenv("PRODIGY_RESULTS_DIR", str(tmp_path))
    spec = {"experiment": "e", "grid": {"defense": ["prodigy", "nnm+median"], "attack": ["alie", "sf"]}}
    experiment = experiment_from_spec(spec)
    folder = results.experiment_dir("e")
    assert folder == tmp_path / "e"
    for i, config in enumerate(experiment.configs[:3]):
        results.save_record(folder, config.key(), record(config, 10.0 * i), "e")
    stray = RunConfig(rounds=7)  # a record of another grid in the same folder
    results.save_record(folder, stray.key(), record(stray, 99.0), "e")
    results.save_failure(
        folder, experiment.configs[3].key(), experiment.configs[3].to_dict(), ValueError("x"), "e"
    )

    df = results.load(experiment)
    assert list(df["key"]) == [c.key() for c in experiment.configs[:3]]  # grid order, stray left out
    assert list(df["final_accuracy"]) == [0.0, 10.0, 20.0]
    # the settings are folded into the defense and attack labels (as_row)
    assert set(field_names()) - set(SETTINGS_FIELDS) <= set(df.columns)
    assert {"env_device", "stand_in", "status"} <= set(df.columns)
    assert list(df["defense"]) == [c.defense for c in experiment.configs[:3]]
    assert len(results.load("e")) == 4  # by folder name: every record
    assert len(results.load(experiment, include_failed=True)) == 4
    assert results.load("nothing-here").empty


def test_a_corrupt_record_is_named_and_left_out(tmp_path):
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "abc.json").write_text('{"config": ')
    named = r"abc\.json: not a valid result record, left out: not valid JSON"
    with pytest.warns(RuntimeWarning, match=named):
        assert results.load("e", tmp_path).empty


# ------------------------------------------------------------------------------------------- the paper


def test_package_copy_of_the_paper_numbers(paper_reference_csv):
    paper = results.paper_results()
    assert len(paper) == 515
    assert paper.groupby("table").size().to_dict() == {
        "bigtable": 336, "femnist_n20": 84, "femnist_n100": 35, "fraction_byzantine": 36, "n_clients": 24,
    }  # fmt: skip
    copy = Path(results.__file__).parent / "data" / "paper_results.csv"
    assert copy.read_bytes() == paper_reference_csv.read_bytes()


def fabricated(table: str, shift: float, seeds=(0, 1, 2), spread: float = 0.5) -> pd.DataFrame:
    """Our 'results' for every cell of a paper table: paper + shift, seeds spread evenly around it."""
    rows = []
    for _, cell in results.paper_results().query("table == @table").iterrows():
        distribution = cell["distribution"]
        if distribution == "noniid":
            distribution = "natural" if cell["dataset"] == "femnist" else "dirichlet"
        for i, seed in enumerate(seeds):
            offset = (i - (len(seeds) - 1) / 2) * spread
            rows.append({"dataset": cell["dataset"], "distribution": distribution, "dirichlet_alpha": 0.1,
                         "n_clients": cell["n_clients"], "n_byzantine": cell["n_byzantine"],
                         "local_momentum": cell["local_momentum"], "local_steps": cell["local_steps"],
                         "rounds": cell["rounds"], "defense": cell["defense"], "attack": cell["attack"],
                         "seed": seed,
                         "final_accuracy": cell["accuracy_mean"] + shift + offset, "stand_in": None,
                         "status": "done"})  # fmt: skip
    return pd.DataFrame(rows)


def test_compare_with_paper_on_a_shifted_copy():
    out = results.compare_with_paper(fabricated("n_clients", shift=1.0), "n_clients")
    assert len(out) == 24 and (out["n_seeds"] == 3).all()
    assert out["delta"].to_numpy() == pytest.approx([1.0] * 24)
    assert out["ours_std"].to_numpy() == pytest.approx([math.sqrt(0.5**2 * 2 / 3)] * 24)
    assert (out["ours"] - out["paper"]).to_numpy() == pytest.approx(out["delta"].to_numpy())
    assert out["worst_case_match"].tolist() == [True] * 24  # a uniform shift keeps every worst case


def test_compare_with_paper_at_mini_scale_matches_cells_at_any_rounds():
    df = fabricated("bigtable", shift=-2.0, seeds=(0,))
    df["rounds"] = df["rounds"] // 100  # mini: 20 / 10 rounds instead of the paper's 2000 / 1000
    assert results.compare_with_paper(df, "bigtable")["ours"].isna().all()  # the paper's rounds: no match
    out = results.compare_with_paper(df, "bigtable", match_rounds=False)
    assert len(out) == 336 and out["ours"].notna().all()
    assert out["delta"].to_numpy() == pytest.approx([-2.0] * 336)
    assert set(out["rounds"]) == {1000, 2000}  # the rounds column is the paper's


def test_compare_with_paper_bigtable_iid_and_dirichlet_blocks_all_join():
    out = results.compare_with_paper(fabricated("bigtable", shift=-2.0, seeds=(0,)), "bigtable")
    assert len(out) == 336 and out["ours"].notna().all() and out["ours_std"].isna().all()
    assert out["delta"].to_numpy() == pytest.approx([-2.0] * 336)
    assert out["worst_case_match"].tolist() == [True] * 336


def test_compare_with_paper_detects_a_different_worst_case_and_missing_runs():
    df = fabricated("fraction_byzantine", shift=0.0, seeds=(0,))
    paper = results.paper_results().query("table == 'fraction_byzantine'")
    # Table IV has two attacks (alie, sf): in one row, make the attack the paper does NOT bold our worst one
    bold = paper[paper["worst_case_bold"]].iloc[0]
    other = "sf" if bold["attack"] == "alie" else "alie"
    changed = (bold["n_byzantine"], bold["defense"])
    # and leave out one run of another row
    dropped = next(k for k in zip(paper["n_byzantine"], paper["defense"], strict=True) if k != changed)

    def in_row(frame, key):
        return (frame["n_byzantine"] == key[0]) & (frame["defense"] == key[1])

    df.loc[in_row(df, changed) & (df["attack"] == other), "final_accuracy"] = 0.0
    df = df[~(in_row(df, dropped) & (df["attack"] == "sf"))]

    out = results.compare_with_paper(df, "fraction_byzantine")
    assert out.loc[in_row(out, changed), "worst_case_match"].tolist() == [False, False]
    assert out.loc[in_row(out, dropped), "worst_case_match"].isna().all()
    gone = in_row(out, dropped) & (out["attack"] == "sf")
    assert out.loc[gone, "ours"].isna().all() and out.loc[gone, "n_seeds"].tolist() == [0]
    rest = ~in_row(out, changed) & ~in_row(out, dropped)
    assert out.loc[rest, "worst_case_match"].tolist() == [True] * (36 - 4)


def test_compare_with_paper_ignores_stand_in_runs_and_names_bad_tables():
    df = fabricated("n_clients", shift=0.0, seeds=(0,))
    df["stand_in"] = "digits (offline stand-in for cifar10)"
    out = results.compare_with_paper(df, "n_clients")
    assert out["ours"].isna().all() and out["worst_case_match"].isna().all()
    with pytest.raises(ValueError, match="table='table1' is not in paper_results.csv; valid: bigtable"):
        results.compare_with_paper(df, "table1")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_a_killed_claimant_not_yet_reaped_holds_no_lock():
    """A zombie still answers kill(pid, 0): read as alive, its locks kept its runs undone until it was reaped
    or for LOCK_STALE_S. Its /proc state Z says it is gone."""
    import signal
    import subprocess
    import time

    from prodigy_core.results import _pid_alive

    child = subprocess.Popen(["sleep", "30"])
    try:
        assert _pid_alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        for _ in range(100):  # until the kernel has made it a zombie (never reaped: no wait() here)
            if Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
            time.sleep(0.01)
        assert not _pid_alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not _pid_alive(child.pid)
