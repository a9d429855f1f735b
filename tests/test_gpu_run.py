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
    summary = (out / "summary.txt").read_text()
    assert "cross-device check vs the CPU reference, digits: agrees to rounding" in summary
    with tarfile.open(out / "results.tar.gz") as tar:
        record = json.load(
            tar.extractfile(next(m for m in tar.getmembers() if m.name.startswith("results/")))
        )
    assert record["environment"]["device"] == "cpu"
    assert list(record["phase_seconds"]) == ["local", "craft", "aggregate", "eval", "rest"]  # issue 41 item 1
    assert record["phase_seconds"]["local"] > 0 and record["phase_seconds"]["eval"] > 0
    assert "used " in (out / "summary.txt").read_text()
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
    # 80 s: the readings before the first group (the early tarballs' summaries read it too) cost 5 s each
    code, out, work = simulate(gpu_run, tmp_path, data, "--deadline", "80", "--group-size", "1")
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
    assert f"copy ../shared/data/cifar10-jpeg and femnist-leaf-24 into {tmp_path / 'nowhere'}" in err
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
    code, first, work1 = simulate(gpu_run, tmp_path / "1", data, "--deadline", "80", "--group-size", "1")
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


def test_a_cell_made_at_another_precision_is_not_made_again(gpu_run, tmp_path, data):
    """The third window of 2026-11-27 chose bf16 and remade three cells the second had made in fp32 (155 s of
    its 736): precision is in the key. A cell with a record at any precision counts as made: a command whose
    (reused) autotune chooses bf16 trains none of the cells an fp32 command finished, and counts them done
    (and the other way round, when this CPU's autotune chose bf16)."""
    code, first, work1 = simulate(gpu_run, tmp_path / "1", data, "--no-profile")
    assert code == 0 and finished_keys(work1)
    with tarfile.open(first / "results.tar.gz") as tar:
        report = json.load(tar.extractfile("autotune.json"))
    chosen = report["datasets"]["digits"]["chosen"]  # fp32 or bf16, as this CPU's timings and gate found
    chosen["precision"] = {"fp32": "bf16", "bf16": "fp32"}[chosen["precision"]]  # the other one
    given = tmp_path / "autotune.json"
    given.write_text(json.dumps(report))
    resume = ["--resume", str(first / "results.tar.gz"), "--autotune", str(given), "--no-profile"]
    code, out, work = simulate(gpu_run, tmp_path / "2", data, *resume)
    assert code == 0
    log = (work / "log.txt").read_text()
    assert "autotune digits: reused from" in log
    assert not [line for line in log.splitlines() if line.strip().startswith("done ")]  # nothing trained
    assert finished_keys(work) == finished_keys(work1)
    assert all(r[4] == "done" and r[0] == r[1] for r in summary_rows(out).values())


# ------------------------------------------------------------------------ issue 41: estimates, autotune reuse
TRUE_STEP_S = {1: 0.5, 2: 0.75}  # one local step of a group of R runs, as the fake machine takes it
TRUE_SERVER_S = {("prodigy", "alie"): 1.0, ("prodigy", "sf"): 0.5, ("nnm+trimmed_mean", "alie"): 2.5,
                 ("nnm+trimmed_mean", "sf"): 0.5, ("none", "alie"): 0.25, ("none", "sf"): 0.0}  # fmt: skip
GATE_KINDS = {("prodigy", "alie"), ("nnm+trimmed_mean", "alie")}  # the autotune's gate measures these


def trained_share(batch) -> float:
    """The share of a group's client rows that train: the Byzantine clients of FOE, and of ALIE under the
    paper's text (the authors' ALIE may send their honest update), take no step."""

    def idle(c) -> bool:
        return c.attack in ("foe_0.1", "foe_100") or (c.attack == "alie" and c.variant == "paper")

    return sum(1 - idle(c) * c.n_byzantine / c.n_clients for c in batch) / len(batch)


def true_seconds(batch, idle_saves: bool = True) -> float:
    """A group's seconds on the fake machine: idle clients save their share of a step (a CPU), or nothing
    (`idle_saves` False: the H200 of 2026-11-27, a FEMNIST run alone)."""
    share = trained_share(batch) if idle_saves else 1.0
    local = max(c.rounds for c in batch) * batch[0].local_steps * TRUE_STEP_S[len(batch)] * share
    return local + sum(c.rounds * TRUE_SERVER_S[c.defense, c.attack] for c in batch)


def fake_window(gpu_run, monkeypatch, tune_step_s, idle_saves: bool = True):
    """A window on a fake machine: a clock that only the fake training moves, a group taking `true_seconds`,
    and an autotune that reports `tune_step_s` and the gate's kinds at their true server cost. Returns the
    groups trained: [(configs, seconds)]."""
    from benchmarks import autotune
    from prodigy_core import results as store
    from prodigy_core.training import RunResult

    now, trained = [0.0], []
    monkeypatch.setattr(gpu_run.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(gpu_run, "cross_device_check", lambda driver, dataset: None)
    monkeypatch.setattr(gpu_run.Driver, "probe", lambda self, dataset, config: None)
    gate = {f"{d}/{a}": TRUE_SERVER_S[d, a] for d, a in GATE_KINDS}
    tune = {"chosen": {"precision": "fp32", "engine": "batched"}, "timings": [], "gate": [],
            "step_s": tune_step_s, "server_s": gate}  # fmt: skip
    monkeypatch.setattr(autotune, "autotune", lambda *a, **k: {"datasets": {"digits": tune}})

    def train_group(self, exp, batch, folder):
        records = []
        for c in batch:
            server = c.rounds * TRUE_SERVER_S[c.defense, c.attack]
            server_all = sum(b.rounds * TRUE_SERVER_S[b.defense, b.attack] for b in batch)
            local = (true_seconds(batch, idle_saves) - server_all) / len(batch)
            phases = {"local": local, "craft": server / 2, "aggregate": server / 2, "eval": 0.0, "rest": 0.0}
            result = RunResult(config=c.to_dict(), final_accuracy=50.0, final_loss=1.0,
                               rounds_completed=c.rounds, phase_seconds=phases)  # fmt: skip
            store.save_record(folder, c.key(), result.to_dict(), exp.results_name)
            records.append(store.stored_record(folder, c.key()))
        now[0] += true_seconds(batch, idle_saves)
        trained.append((batch, true_seconds(batch, idle_saves)))
        return records

    monkeypatch.setattr(gpu_run.Driver, "train_group", train_group)
    return trained


def test_the_schedule_fills_the_window_from_measured_costs_issue_41_item_2(
    gpu_run, tmp_path, data, monkeypatch
):
    """A fake clock and fake costs. The autotune's local step is half the true one and most kinds' server side
    is unknown at first: after the first group the estimates are the measured costs (x GROUP_MARGIN; at least
    that for a trained share no group had, whose idle clients are credited nothing), no group
    overruns the deadline, a step the deadline stops leaves its time to later steps' runs that fit, and the
    window ends with less time unused than its cheapest remaining run needs, as summary.txt says."""
    trained = fake_window(gpu_run, monkeypatch, {1: 0.25, 2: 0.375})
    deadline = 35  # 6 of the 8 runs fit
    code, out, work = simulate(gpu_run, tmp_path, data, "--deadline", str(deadline), "--no-profile")
    assert code == 0
    used = sum(seconds for _, seconds in trained)
    assert trained and used <= deadline
    lines = [x for x in (work / "log.txt").read_text().splitlines() if x.strip().startswith("group of")]
    estimates = [float(x.split("estimated ")[1].split(" s")[0]) for x in lines]
    assert len(estimates) == len(trained)
    known, shares, checked = set(GATE_KINDS), set(), 0
    for i, ((batch, seconds), estimate) in enumerate(zip(trained, estimates, strict=True)):
        share = round(gpu_run.trained_share(batch), 3)
        if i > 0 and {(c.defense, c.attack) for c in batch} <= known:
            if share in shares:  # measured, corrected (the next test makes this case on purpose)
                assert estimate == pytest.approx(gpu_run.GROUP_MARGIN * seconds, rel=0.01)
            else:  # a share not measured: idle clients credited nothing, never under
                assert estimate >= gpu_run.GROUP_MARGIN * seconds * 0.99
            checked += 1
        known |= {(c.defense, c.attack) for c in batch}
        shares.add(share)
    assert checked >= 1  # some group after the first was checked, not skipped by the condition
    rows = summary_rows(out)
    order = [s.name for s in gpu_run.plan("paper", simulate=True)]
    stopped = [n for n in order if rows[n][4].startswith("stopped by the deadline")]
    assert stopped and any(int(rows[n][1]) > 0 for n in order[order.index(stopped[0]) + 1 :])  # filled later
    line = next(x for x in (out / "summary.txt").read_text().splitlines() if x.startswith("used "))
    unused = float(line.split("unused ")[1].split(" s")[0])
    cheapest = float(line.split("left: ~")[1].split(" s")[0])
    assert unused == pytest.approx(deadline - used, abs=1) and unused < cheapest
    done, driver = finished_keys(work), gpu_run.Driver(gpu_run_args(gpu_run, data), work)
    left = [c for s in gpu_run.plan("paper", simulate=True) for c in driver.experiment(s).configs
            if c.key() not in done]  # fmt: skip
    assert left and deadline - used < min(true_seconds([c]) for c in left)  # no run that fitted was left out


def test_the_local_estimate_learns_what_idle_clients_save_on_this_device(
    gpu_run, tmp_path, data, monkeypatch
):
    """On the H200 a FEMNIST run alone took as long with 14 of 20 clients training as with 20, while the
    estimate scaled its step by the share (and one learned factor for all shares swung by the last group's).
    On a fake machine where idle clients save nothing, a group whose trained share and kinds a finished group
    already measured is estimated at its true seconds (x GROUP_MARGIN), whatever group came just before."""
    from benchmarks.gpu_run import trained_share as shares

    trained = fake_window(gpu_run, monkeypatch, {1: 0.25, 2: 0.375}, idle_saves=False)
    code, out, work = simulate(gpu_run, tmp_path, data, "--deadline", "1000", "--no-profile")
    assert code == 0
    lines = [x for x in (work / "log.txt").read_text().splitlines() if x.strip().startswith("group of")]
    estimates = [float(x.split("estimated ")[1].split(" s")[0]) for x in lines]
    known, seen, checked = set(GATE_KINDS), set(), 0
    for (batch, seconds), estimate in zip(trained, estimates, strict=True):
        share = round(shares(batch), 3)
        if share in seen and {(c.defense, c.attack) for c in batch} <= known:
            assert estimate == pytest.approx(gpu_run.GROUP_MARGIN * seconds, rel=0.01)
            checked += 1
        known |= {(c.defense, c.attack) for c in batch}
        seen.add(share)
    assert checked >= 1 and len({round(shares(b), 3) for b, _ in trained}) >= 2  # shares alternate


def test_an_earlier_autotune_is_reused_on_the_same_gpu_and_software_issue_41_item_3(
    gpu_run, tmp_path, data, monkeypatch
):
    """--autotune FILE, and the --resume tarball's autotune.json, are reused when the GPU, torch, CUDA, cuDNN
    and tuned code match: the autotune is not run again and the window runs at the reused choice. Another
    torch in the file: refused with the reason, and the autotune runs here (at most 45 s)."""
    from benchmarks import autotune

    code, first, _ = simulate(gpu_run, tmp_path / "1", data, "--deadline", "1", "--no-profile")
    with tarfile.open(first / "results.tar.gz") as tar:
        report = json.load(tar.extractfile("autotune.json"))
    assert report["fingerprint"]["code"] and report["datasets"]["digits"]["floor"]
    calls = []
    real = autotune.autotune
    monkeypatch.setattr(autotune, "autotune", lambda *a, **k: calls.append(1) or real(*a, **k))
    given = tmp_path / "autotune.json"
    given.write_text(json.dumps(report))
    for extra in (["--autotune", str(given)], ["--resume", str(first / "results.tar.gz")]):
        # the exit code is not this test's: with --deadline 1, 1 when no run fits the second left
        _, out, work = simulate(gpu_run, tmp_path / extra[0].strip("-"), data, "--deadline", "1", *extra)
        assert not calls
        assert "autotune digits: reused from" in (work / "log.txt").read_text()
        assert json.loads((work / "autotune.json").read_text())["datasets"] == report["datasets"]
    report["fingerprint"]["torch"] = "0.0.1"
    given.write_text(json.dumps(report))
    _, out, work = simulate(gpu_run, tmp_path / "3", data, "--deadline", "1", "--autotune", str(given))
    assert calls == [1]
    assert f"autotune digits: {given} not reused: another torch '0.0.1'" in (work / "log.txt").read_text()
    assert autotune.BUDGET_S <= 45


def test_import_keeps_the_autotune_and_the_profile_issue_41_finding_6(gpu_run, tmp_path, data):
    """The window's autotune.json and profile.txt (torch.profiler's top ops) come home in the tarball and the
    import writes them beside PROVENANCE.md; every record carries its phases into PROVENANCE.md."""
    code, out, work = simulate(gpu_run, tmp_path, data)
    assert code == 0
    profile = (work / "profile.txt").read_text()
    assert "top 25 CPU ops" in profile and "aten::" in profile
    gpu_run.import_results(out / "results.tar.gz", tmp_path / "results", tmp_path / "figures")
    figures = tmp_path / "figures" / "gpu"
    assert json.loads((figures / "autotune.json").read_text())["datasets"]["digits"]["chosen"]
    assert (figures / "profile.txt").read_text() == profile
    provenance = (figures / "PROVENANCE.md").read_text()
    assert "| phases (s) |" in provenance
    assert all(
        line.count("/") >= 4 for line in provenance.splitlines() if "| quickstart_digits-smoke |" in line
    )


def test_the_drivers_phases_are_the_records(gpu_run):
    # gpu_run keeps torch out of its import (the import subcommand reads records only), so it names the
    # record's phases itself: they must be training's, in training's order.
    from prodigy_core import training

    assert gpu_run.PHASES == training.PHASES


def test_a_dataset_is_made_ready_when_its_first_step_comes_up_and_only_with_time_left(
    gpu_run, tmp_path, data, monkeypatch
):
    """`Driver.prepare`: the CIFAR-10 decode (not in --simulate), the cross-device check, the probe and the
    autotune of a dataset, in that order, once; a dataset after the first only with PREPARE_MIN_S left (it
    says so in the log and does nothing), the first step's whatever the deadline."""
    import argparse

    now, calls = [0.0], []
    monkeypatch.setattr(gpu_run.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(gpu_run, "cross_device_check", lambda driver, d: calls.append(("check", d)))
    monkeypatch.setattr(gpu_run.Driver, "probe", lambda self, dataset, c: calls.append(("probe", dataset)))
    monkeypatch.setattr(gpu_run.Driver, "autotune", lambda self, dataset, c: calls.append(("tune", dataset)))
    args = argparse.Namespace(simulate=False, profile="paper", out=tmp_path, group_size=1, deadline=100.0,
                              data=tmp_path / "data")  # fmt: skip
    decoded = []
    monkeypatch.setattr("prodigy_core.data.decode_cifar10_jpeg", lambda *a, **k: decoded.append(a[0]))
    driver = gpu_run.Driver(args, tmp_path)
    now[0] = 50.0  # 50 s left, under PREPARE_MIN_S (60)
    assert gpu_run.PREPARE_MIN_S > 50
    assert not driver.prepare("cifar10", None)
    assert calls == [] and decoded == [] and "cifar10: not prepared (50 s left" in driver.log_path.read_text()
    assert driver.prepare("femnist", None, first=True)  # the first step's dataset: always
    assert calls == [("check", "femnist"), ("probe", "femnist"), ("tune", "femnist")] and decoded == []
    now[0] = 30.0  # 70 s left
    assert driver.prepare("cifar10", None) and decoded == [tmp_path / "data" / gpu_run.CIFAR10_ARCHIVE]
    assert calls[3:] == [("check", "cifar10"), ("probe", "cifar10"), ("tune", "cifar10")]
    assert driver.prepare("cifar10", None) and len(calls) == 6  # once


def test_the_time_no_run_can_use_times_what_the_autotune_left_out(gpu_run, tmp_path, data, monkeypatch):
    """Every run done with time to spare (a fake machine): the candidate the autotune's budget left out is
    timed on this CPU after the runs, and the server side of every kind the plan runs is measured, so that
    autotune.json in the tarball (which a --resume command reuses) holds the row, marked after_runs, and a
    server side for every kind."""
    from benchmarks import autotune

    fake_window(gpu_run, monkeypatch, {1: 0.5, 2: 0.75})
    timings = [{"precision": "fp32", "engine": "batched", "size": 1, "step_s": 0.5, "wall_s": 1.0,
                "images_per_s": 1.0},
               {"precision": "bf16", "engine": "batched", "size": 1,
                "error": autotune.NOT_TIMED}]  # fmt: skip
    tune = {"chosen": {"precision": "fp32", "engine": "batched"}, "gate": [], "step_s": {1: 0.5, 2: 0.75},
            "server_s": {}, "gflop_per_image": 0.0003, "timings": timings}  # fmt: skip
    monkeypatch.setattr(autotune, "autotune", lambda *a, **k: {"datasets": {"digits": tune}})
    code, out, work = simulate(gpu_run, tmp_path, data, "--deadline", "1000", "--no-profile")
    assert code == 0 and all(r[4] == "done" for r in summary_rows(out).values())
    assert "after the runs, digits: images/s bf16/batched x1 " in (work / "log.txt").read_text()
    with tarfile.open(out / "results.tar.gz") as tar:
        rows = json.load(tar.extractfile("autotune.json"))["datasets"]["digits"]["timings"]
    assert rows[1]["after_runs"] and rows[1]["images_per_s"] > 0 and "error" not in rows[1]
    with tarfile.open(out / "results.tar.gz") as tar:
        server = json.load(tar.extractfile("autotune.json"))["datasets"]["digits"]["server_s"]
    kinds = {f"{d}/{a}" for d in ("prodigy", "nnm+trimmed_mean", "none") for a in ("alie", "sf")}
    assert set(server) == kinds and all(v > 0 for v in server.values())  # the simulated plan's six kinds
    log = (work / "log.txt").read_text()
    assert "after the runs, digits: the server side of 6 more kinds measured" in log


@pytest.mark.parametrize("in_first_group", [False, True])
def test_the_profile_adds_the_costliest_server_side_when_the_first_group_lacks_it(
    gpu_run, tmp_path, in_first_group
):
    """`Driver.profile`: the first step's first group, then the step's run whose server side is estimated
    costliest (`server_estimate`), alone, in a section of its own, when its kind is not in that group: the
    third H200 window's profile covered no attack's search, a third of such a run. Its kind in the first
    group: one section."""
    import argparse

    args = argparse.Namespace(simulate=False, profile="paper", out=tmp_path, group_size=1, deadline=10**5)
    driver = gpu_run.Driver(args, tmp_path)
    driver.start = gpu_run.time.monotonic()
    driver.tune = {"femnist": {"step_s": {1: 0.01}, "chosen": {"precision": "bf16", "engine": "batched"}}}
    driver.eval_s["femnist"] = 0.0
    configs = driver.experiment(gpu_run.plan("paper", simulate=False)[0]).configs
    driver.server_s = {("femnist", c.defense, c.attack): 0.01 for c in configs}
    first, _ = driver.choose_group(configs)
    head = [(c.defense, c.attack) for c in first]
    costliest = head[0] if in_first_group else ("nnm+trimmed_mean", "alie")
    assert (costliest in head) == in_first_group
    driver.server_s[("femnist", *costliest)] = 0.05
    profiled = []

    def fake(name, batch, cuda):
        profiled.append([(c.defense, c.attack) for c in batch])
        return f"section {len(profiled)}\n"

    driver.profiled = fake
    driver.profile()
    assert profiled == ([head] if in_first_group else [head, [costliest]])
    assert (driver.work / "profile.txt").read_text() == "".join(
        f"section {i + 1}\n" for i in range(len(profiled))
    )
    if not in_first_group:  # the second section failing (out of memory, say) keeps the first
        profiled.clear()

        def second_fails(name, batch, cuda):
            if profiled:
                raise RuntimeError("CUDA out of memory")
            return fake(name, batch, cuda)

        driver.profiled = second_fails
        driver.profile()
        assert (driver.work / "profile.txt").read_text() == "section 1\n"
        log = driver.log_path.read_text()
        assert "profile: nnm+trimmed_mean/alie failed (RuntimeError: CUDA out of memory)" in log


def test_the_profiler_starts_before_the_autotune_captures_any_graph(gpu_run, tmp_path, data, monkeypatch):
    """Profiling the replay of a CUDA graph captured before the profiler's first use has raised illegal
    memory accesses (pytorch#75504): with its profiling step on, the driver starts the profiler
    (`init_profiler_for_cuda_graphs`) before the autotune, whose captured engines make graphs; with
    --no-profile it never does."""
    from benchmarks import autotune

    calls = []
    tune = autotune.autotune
    monkeypatch.setattr(gpu_run, "init_profiler_for_cuda_graphs", lambda: calls.append("profiler"))
    monkeypatch.setattr(autotune, "autotune", lambda *a, **k: calls.append("autotune") or tune(*a, **k))
    code, _, _ = simulate(gpu_run, tmp_path / "a", data, "--deadline", "60")
    assert code == 0 and calls[:2] == ["profiler", "autotune"] and calls.count("profiler") == 1
    calls.clear()
    code, _, _ = simulate(gpu_run, tmp_path / "b", data, "--deadline", "60", "--no-profile")
    assert code == 0 and "profiler" not in calls and "autotune" in calls
