"""The GPU window's time, on fake clocks and fake costs (benchmarks/gpu_run.py, throughput.py): the deadline
counts from the process's start, the estimates credit no idle client they have not measured, what runs after
the runs and before them (profile, a later dataset's preparation) fits the time it is given, and nothing is
captured under the profiler."""

import argparse
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from test_gpu_run import fake_window, summary_rows, tarball_keys  # noqa: E402

from benchmarks import autotune  # noqa: E402


def driver_for(gpu_run, tmp_path, deadline=10.0**5, simulate=False, **extra):
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    args = argparse.Namespace(simulate=simulate, profile="paper", out=out, group_size=16, deadline=deadline,
                              data=tmp_path / "data", autotune=None, resume=None, **extra)  # fmt: skip
    return gpu_run.Driver(args, work)


def tarball_member(out: Path, name: str) -> str | None:
    if not (out / "results.tar.gz").exists():
        return None
    with tarfile.open(out / "results.tar.gz") as tar:
        return tar.extractfile(name).read().decode() if name in tar.getnames() else None


# ------------------------------------------------------------------------------------------------ W1
def test_the_deadline_counts_from_the_process_start(gpu_run, tmp_path, monkeypatch):
    """The third H200 window's first command ran 14 s (import torch, the preflight) before the driver's clock
    started: its 35 s of slack before `timeout` were 21. Started 20 s before the driver (a fake clock that
    only the fake training moves), a 35 s deadline leaves 15 s of groups; counted from the driver, 35."""
    trained = fake_window(gpu_run, monkeypatch, {1: 0.5, 2: 0.75})

    def argv(name: str) -> list[str]:
        return ["--simulate", "--data", str(tmp_path / "none"), "--out", str(tmp_path / name), "--work",
                str(tmp_path / f"{name}-work"), "--deadline", "35", "--no-profile"]  # fmt: skip

    assert gpu_run.main(argv("out"), started=-20.0) == 0
    used = sum(seconds for _, seconds in trained)
    assert trained and used <= 35 - 20
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert float(summary.split("elapsed: ")[1].split(" s")[0]) >= 20 + used
    trained.clear()
    assert gpu_run.main(argv("out2")) == 0
    assert sum(seconds for _, seconds in trained) > 35 - 20  # the driver's own clock: the 20 s not counted


def test_the_scripts_take_their_clock_before_torch_is_imported():
    """PROCESS_START (the scripts pass it to `main`) is read before any heavy import: gpu_run.py imports only
    the standard library at its top, throughput.py reads it before `import torch`."""
    code = (
        "import sys; sys.path.insert(0, 'benchmarks'); import gpu_run; assert 'torch' not in sys.modules; "
        "src = open('benchmarks/throughput.py').read(); "
        "assert src.index('PROCESS_START = time.perf_counter()') < src.index('import torch')"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    for script in ("gpu_run.py", "throughput.py"):
        assert "sys.exit(main(started=PROCESS_START))" in (ROOT / "benchmarks" / script).read_text()


# ------------------------------------------------------------------------------------------------ W2
@pytest.fixture
def femnist_driver(gpu_run, tmp_path):
    """The audit's case (/tmp/audit/gpu/share.py): the H200's autotune step of a FEMNIST run alone (T=800,
    E=10), runs ProDiGy + SF (every client trains) and ProDiGy + ALIE (6 of 20 idle)."""
    driver = driver_for(gpu_run, tmp_path, deadline=520.0)
    driver.tune["femnist"] = {"chosen": {"precision": "bf16", "engine": "batched"}, "step_s": {1: 0.00635}}
    by = {(c.defense, c.attack): c for c in driver.experiment(gpu_run.plan("paper", False)[0]).configs}
    return driver, by["prodigy", "sf"], by["prodigy", "alie"]


def test_an_unmeasured_trained_share_credits_no_idle_client(gpu_run, femnist_driver):
    """The H200 took 0.0652 s a round of local steps for a FEMNIST run alone with every client training, and
    as long with 14 of 20 (idle clients save nothing there). With a ProDiGy + SF run measured so, ProDiGy +
    ALIE's local steps are 800 x 0.0652 = 52.2 s, not 36.5 (x 0.7: the factor of SF's share applied to
    ALIE's, its estimate 45 s against 62 s taken in the third window); before any run, 800 x 10 x 0.00635
    (the autotune's step, every client training), not x 0.7."""
    driver, sf, alie = femnist_driver
    assert driver.local_estimate([alie]) == pytest.approx(800 * 10 * 0.00635)
    phases = {"local": 0.0652 * 800, "craft": 0.0, "aggregate": 1.9, "eval": 0.4, "rest": 1.2}
    driver.learn([sf], [{"phase_seconds": phases, "rounds_completed": 800}])
    assert driver.local_estimate([sf]) == pytest.approx(52.16)
    assert driver.local_estimate([alie]) == pytest.approx(52.16)


def test_a_share_above_every_measured_one_keeps_the_largest_factor(gpu_run, femnist_driver):
    """Only ALIE's share (0.7) measured, at 0.0652 s a round: its factor, 52.16 / (800 x 10 x 0.00635 x 0.7) =
    1.467, taken at share 1 for SF (74.5 s predicted, at least the 52.16 s a device that saves nothing takes,
    and a CPU's 0.0652 / 0.7 x 800 = 74.5 s, which saves the idle clients' share); ALIE itself as measured."""
    driver, sf, alie = femnist_driver
    phases = {"local": 0.0652 * 800, "craft": 0.0, "aggregate": 1.9, "eval": 0.4, "rest": 1.2}
    driver.learn([alie], [{"phase_seconds": phases, "rounds_completed": 800}])
    assert driver.local_estimate([alie]) == pytest.approx(52.16)
    assert driver.local_estimate([sf]) == pytest.approx(52.16 / 0.7)


def test_a_group_starts_only_when_its_estimate_times_its_datasets_overrun_fits(gpu_run, femnist_driver):
    """Helper 48: a group whose estimate alone fits starts, and the third window's groups took up to 1.24 x
    their estimate; one the outer `timeout` kills brings nothing home. Before any group of the data set its
    estimate x UNMEASURED_OVERRUN must fit; after one, x what its learned estimates leave unexplained of its
    seconds (a ProDiGy + SF group with 55.66 s in its phases that took 70 s: 14.34 s of start-up no phase
    holds), so the same group then needs GROUP_MARGIN x 70 s; one that took less than its phases leaves 1."""
    driver, sf, _ = femnist_driver
    before = driver.estimate([sf])
    assert driver.needed([sf]) == pytest.approx(before * gpu_run.UNMEASURED_OVERRUN)
    assert not driver.fits([sf], before * 1.2) and driver.fits([sf], before * 1.25)
    phases = {"local": 0.0652 * 800, "craft": 0.0, "aggregate": 1.9, "eval": 0.4, "rest": 1.2}
    driver.learn([sf], [{"phase_seconds": phases, "rounds_completed": 800}], seconds=70.0)
    assert driver.estimate([sf]) == pytest.approx(gpu_run.GROUP_MARGIN * 55.66)  # the phases, x the margin
    assert driver.needed([sf]) == pytest.approx(gpu_run.GROUP_MARGIN * 70.0)
    assert driver.cheapest([sf]) == float("inf")  # its data set not made ready here: not estimated
    driver.learn([sf], [{"phase_seconds": phases, "rounds_completed": 800}], seconds=50.0)
    assert driver.needed([sf]) == pytest.approx(gpu_run.GROUP_MARGIN * 55.66)


# ------------------------------------------------------------------------------------------------ W3
def test_after_the_runs_the_server_side_comes_home_first_and_compiled_last_with_its_margin(
    gpu_run, tmp_path, monkeypatch
):
    """After the runs: the server side of the kinds not measured, in the tarball's autotune.json before any
    timing starts; then the rows the autotune left out; compiled last, only with its need (the longest wall,
    2 s), COMPILE_S (40) and COMPILE_MARGIN_S (20) left. A fake clock: the server side takes 5 s, a row
    1 s."""
    from prodigy_core import training

    now = [0.0]
    monkeypatch.setattr(gpu_run.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(training, "run_federation", lambda *a, **k: None)
    driver = driver_for(gpu_run, tmp_path, deadline=1000.0, simulate=True)
    driver.ready = {"digits": driver.experiment(gpu_run.plan("paper", True)[0]).configs[0]}
    not_timed = {"size": 1, "error": autotune.NOT_TIMED}
    rows = [{"precision": "fp32", "engine": "batched", "size": 1, "step_s": 0.1, "wall_s": 2.0,
             "images_per_s": 1.0},
            {"precision": "fp32", "engine": "compiled", **not_timed},
            {"precision": "bf16", "engine": "batched", **not_timed}]  # fmt: skip
    driver.tune = {"digits": {"timings": rows, "server_s": {}, "gflop_per_image": 0.0}}
    events = []

    def home() -> int:  # the kinds whose server side the tarball's autotune.json holds now
        text = tarball_member(driver.out, "autotune.json")
        return len(json.loads(text)["datasets"]["digits"]["server_s"]) if text else 0

    def server_costs(config, fed, kinds, left):
        events.append(("server side", home()))
        now[0] += 5.0
        return {"/".join(k): 0.1 for k in kinds}

    def time_row(timer, resolved, fed, precision, engine, size):
        events.append((f"{precision}/{engine}", home()))
        now[0] += 1.0
        return {"precision": precision, "engine": engine, "size": size, "step_s": 0.1, "wall_s": 1.0,
                "images_per_s": 1.0}  # fmt: skip

    monkeypatch.setattr(autotune, "server_costs", server_costs)
    monkeypatch.setattr(autotune, "time_row", time_row)
    now[0] = 1000.0 - (5 + 1 + 2 + 40 + 20 / 2)  # compiled's need then, with half its margin
    driver.time_left_out()
    assert events == [("server side", 0), ("bf16/batched", 6)]  # the simulated plan's 6 kinds, home first
    assert rows[1]["error"] == autotune.NOT_TIMED
    now[0] = 1000.0 - (2 + 40 + 20)  # the whole margin
    driver.time_left_out()
    assert events[2:] == [("fp32/compiled", 6)] and rows[1]["after_runs"]


def test_the_final_summary_is_in_the_tarball_before_the_timings_after_the_runs(
    gpu_run, tmp_path, monkeypatch
):
    """A command killed while it times what the autotune left out brings home the final summary (seconds used
    and unused, the cheapest run left) in the tarball, which the import takes into PROVENANCE.md."""
    fake_window(gpu_run, monkeypatch, {1: 0.5, 2: 0.75})
    seen = []
    caught = lambda self: seen.append(tarball_member(self.out, "summary.txt"))  # noqa: E731
    monkeypatch.setattr(gpu_run.Driver, "time_left_out", caught)
    out = tmp_path / "out"
    gpu_run.main(["--simulate", "--data", str(tmp_path / "none"), "--out", str(out), "--work",
                  str(tmp_path / "work"), "--deadline", "1000", "--no-profile"])  # fmt: skip
    assert seen and "\nused " in seen[0] and "never started: none" in seen[0]
    assert all(r[4] == "done" for r in summary_rows(out).values())


# ------------------------------------------------------------------------------------------- W4, S1
def test_the_profile_runs_at_most_four_runs_not_made_yet(gpu_run, tmp_path):
    """A group of 16 is the fastest per run here, and the first two runs of the step are made: the profiling
    step's group is the step's 3rd to 6th runs (a group of 16 would cost the first command 30-50 s)."""
    from prodigy_core import results as store
    from prodigy_core.training import RunResult

    driver = driver_for(gpu_run, tmp_path)
    driver.tune = {"femnist": {"step_s": {1: 0.01, 4: 0.025, 16: 0.04},
                               "chosen": {"precision": "fp32", "engine": "batched"}}}  # fmt: skip
    driver.eval_s["femnist"] = 0.0
    exp = driver.experiment(gpu_run.plan("paper", simulate=False)[0])
    driver.server_s = {("femnist", c.defense, c.attack): 0.0 for c in exp.configs}
    folder = store.experiment_dir(exp.results_name, driver.results)
    for c in exp.configs[:2]:
        result = RunResult(config=c.to_dict(), final_accuracy=50.0, final_loss=1.0, rounds_completed=c.rounds)
        store.save_record(folder, c.key(), result.to_dict(), exp.results_name)
    profiled = []
    driver.profiled = lambda name, batch, cuda: profiled.append([c.key() for c in batch]) or "section\n"
    driver.profile()
    assert profiled == [[c.key() for c in exp.configs[2:6]]]


def test_a_captured_engine_is_profiled_uncaptured(gpu_run, monkeypatch):
    """`Driver.profiled` never captures a CUDA graph under torch.profiler: each captured engine runs as its
    uncaptured twin, an uncaptured one as it is."""
    from prodigy_core import groups, training
    from prodigy_core.experiments import load_experiment

    ran = []
    monkeypatch.setattr(groups, "run_group", lambda batch, **k: ran.append([c.engine for c in batch]))
    monkeypatch.setattr(training, "run", lambda c, **k: ran.append([c.engine]))
    configs = load_experiment("quickstart_digits", scale="smoke").configs[:2]
    twins = {"bmm_wgrad_graphs": "bmm_wgrad", "channels_last_graphs": "channels_last",
             "cuda_graphs": "batched", "channels_last": "channels_last"}  # fmt: skip
    for engine, twin in twins.items():
        ran.clear()
        group = [c.replace(engine=engine, device="cpu") for c in configs]
        text = gpu_run.Driver.profiled("step", group, cuda=False)
        gpu_run.Driver.profiled("step", group[:1], cuda=False)
        assert ran == [[twin, twin], [twin]] and f"/{twin}\n" in text


def test_throughputs_profile_of_a_captured_engine_is_its_twins(monkeypatch):
    """throughput.py --profile: a captured engine is not run under the profiler (its uncaptured twin's profile
    stands for its kernels); the others are."""
    from benchmarks import throughput

    ran = []
    monkeypatch.setattr(
        throughput, "time_step", lambda config, fed, p, engine, size, steps: ran.append(engine)
    )
    fastest = {"channels_last_graphs": (2.0, "fp32", 1), "channels_last": (1.0, "fp32", 1)}
    text = throughput.profile_engines(
        argparse.Namespace(dataset="digits"), None, fastest, False, lambda e: True
    )
    assert ran == ["channels_last"]
    assert "channels_last_graphs, fp32, a group of 1 (2 images/s): not profiled, captured" in text


# ------------------------------------------------------------------------------------------------ W5
def earlier_report(gpu_run, tmp_path, reusable: bool) -> Path:
    """An autotune.json of this machine that timed CIFAR-10 at 0.012 s a step alone and 0.04 s in a group of
    4 (0.01 s a run); valid for reuse here, or (`reusable` False) of other tuned code."""
    from prodigy_core.seeding import resolve_device

    fingerprint = autotune.fingerprint(resolve_device("cpu"))
    if not reusable:
        fingerprint["code"] = "another"
    rows = [{"precision": "fp32", "engine": "batched", "size": 1, "step_s": 0.012, "wall_s": 1.0},
            {"precision": "fp32", "engine": "batched", "size": 4, "step_s": 0.04, "wall_s": 1.0}]  # fmt: skip
    tune = {"timings": rows, "chosen": {"precision": "fp32", "engine": "batched"}, "step_s": {"1": 0.012},
            "server_s": {}}  # fmt: skip
    path = tmp_path / "autotune.json"
    path.write_text(json.dumps({"fingerprint": fingerprint, "datasets": {"cifar10": tune}}))
    return path


@pytest.mark.parametrize(
    ("left", "probe_s", "reusable", "ready"),
    [
        (100.0, 0.0, False, False),  # under 60 + 70: nothing done
        (140.0, 30.0, False, False),  # 110 s after the probe: under the autotune's 45 + 70
        (140.0, 20.0, False, True),  # 120 s: enough
        (140.0, 30.0, True, True),  # 110 s, the autotune reused (0 s): enough
    ],
)
def test_a_later_dataset_is_prepared_only_with_time_for_a_run_of_it(
    gpu_run, tmp_path, monkeypatch, left, probe_s, reusable, ready
):
    """Table I's pair (CIFAR-10, T=1000, E=10, ALIE: 3 of 10 clients idle) after an earlier autotune on this
    GPU timed 0.01 s a step per run: its cheapest run needs at least 1000 x 10 x 0.01 x 0.7 = 70 s. CIFAR-10
    is made ready only with PREPARE_MIN_S (60) + 70 s left, and the autotune starts only when what the
    decode, check and probe left still covers its budget (45 s; 0 when reused) + 70 s."""
    now, calls = [0.0], []
    monkeypatch.setattr(gpu_run.time, "monotonic", lambda: now[0])
    monkeypatch.setattr("prodigy_core.data.decode_cifar10_jpeg", lambda *a, **k: calls.append("decode"))
    monkeypatch.setattr(gpu_run, "cross_device_check", lambda driver, d: calls.append("check"))

    def probe(self, dataset, config):
        calls.append("probe")
        now[0] += probe_s

    monkeypatch.setattr(gpu_run.Driver, "probe", probe)
    monkeypatch.setattr(gpu_run.Driver, "autotune", lambda self, dataset, c: calls.append("autotune"))
    driver = driver_for(gpu_run, tmp_path, deadline=1000.0)
    driver.args.autotune = earlier_report(gpu_run, tmp_path, reusable)
    runs = driver.experiment(gpu_run.plan("paper", simulate=False)[2]).configs  # table1-paper-pair
    assert {(c.dataset, c.rounds, c.local_steps, c.attack, c.n_byzantine, c.n_clients) for c in runs} == {
        ("cifar10", 1000, 10, "alie", 3, 10)
    }
    now[0] = 1000.0 - left
    assert driver.prepare("cifar10", runs[0], runs=runs) == ready
    log = driver.log_path.read_text() if driver.log_path.exists() else ""
    if left < 130:
        assert (
            calls == []
            and "not prepared (100 s left, under the 60 s it needs + ~70 s for its cheapest" in log
        )
    elif not ready:
        assert calls == ["decode", "check", "probe"]
        assert (
            "not prepared (110 s left after 30 s of decoding, check and probe, under the autotune's 45 s"
            in log
        )
    else:
        assert calls == ["decode", "check", "probe", "autotune"] and "cifar10" in driver.ready


def test_engines_leaves_out_an_earlier_autotune_choosing_an_engine_it_excludes(gpu_run, tmp_path):
    """--engines, the way round an engine that broke a command: an earlier autotune that chose an engine it
    leaves out is not reused (its runs would use it); one that chose the reference (batched) or a named one
    is; a name that is no engine is a usage line."""
    from prodigy_core.config import RunConfig

    config = RunConfig(dataset="cifar10", device="cpu")
    cases = [(("channels_last",), "batched", True), (("channels_last",), "bmm_conv", False),
             (("bmm_conv", "channels_last"), "bmm_conv", True)]  # fmt: skip
    for engines, chosen, reused in cases:
        driver = driver_for(gpu_run, tmp_path, engines=engines)
        driver.args.autotune = earlier_report(gpu_run, tmp_path, reusable=True)
        report = json.loads(driver.args.autotune.read_text())
        report["datasets"]["cifar10"]["chosen"]["engine"] = chosen
        driver.args.autotune.write_text(json.dumps(report))
        why = driver.reusable("cifar10", config)[2]
        assert (why is None) == reused, why
        if not reused:
            assert why == f"its choice, engine {chosen}, is not among --engines {','.join(engines)}"
    assert gpu_run.engines_arg(" channels_last, bmm_conv,channels_last") == ("channels_last", "bmm_conv")
    for bad in ("batched,warp", ","):
        with pytest.raises(argparse.ArgumentTypeError, match=rf"'{bad}': engines among batched, "):
            gpu_run.engines_arg(bad)


def test_out_holds_the_resumed_records_before_anything_can_hang_and_a_failed_side_step_is_noted(
    gpu_run, tmp_path, monkeypatch
):
    """Helper 48: $OUT got its first tarball only after the check, probe, autotune and profile (60-90 s in);
    a hang there left env.txt alone. It is written first now, the resumed records in it. The profiler's start
    and the timings left out after the runs failing (a CUDA error, say) are noted in summary.txt, and the
    command goes on and ends as it would have."""
    fake_window(gpu_run, monkeypatch, {1: 0.5, 2: 0.75})
    first = tmp_path / "first"
    argv = ["--simulate", "--data", str(tmp_path / "none"), "--deadline", "35", "--no-profile"]
    assert gpu_run.main([*argv, "--out", str(first), "--work", str(tmp_path / "w1")]) == 0
    records = tarball_keys(first)
    assert records

    class Hang(Exception):
        pass

    def prepare(self, *args, **kwargs):
        raise Hang  # what a hang looks like to what came home before it

    monkeypatch.setattr(gpu_run.Driver, "prepare", prepare)
    second = tmp_path / "second"
    with pytest.raises(Hang):
        gpu_run.main([*argv, "--out", str(second), "--work", str(tmp_path / "w2"), "--resume",
                      str(first / "results.tar.gz")])  # fmt: skip
    assert tarball_keys(second) == records
    monkeypatch.undo()

    fake_window(gpu_run, monkeypatch, {1: 0.5, 2: 0.75})
    monkeypatch.setattr(gpu_run, "init_profiler_for_cuda_graphs", lambda: 1 / 0)
    monkeypatch.setattr(gpu_run.Driver, "profile", lambda self: None)
    monkeypatch.setattr(gpu_run.Driver, "time_left_out", lambda self: [][0])
    third = tmp_path / "third"
    argv = ["--simulate", "--data", str(tmp_path / "none"), "--deadline", "35"]
    assert gpu_run.main([*argv, "--out", str(third), "--work", str(tmp_path / "w3")]) == 0
    summary = (third / "summary.txt").read_text()
    assert "the profiler's start failed (ZeroDivisionError: division by zero)" in summary
    assert "the timings left out failed (IndexError: list index out of range)" in summary


# ------------------------------------------------------------------------------------------ W7, W1
def run_throughput(monkeypatch, *argv, started=None):
    from benchmarks import throughput

    timed = []

    def time_step(config, fed, precision, engine, size, steps):
        timed.append((engine, precision, size))
        return 0.01

    monkeypatch.setattr(throughput, "time_step", time_step)
    args = ["--datasets", "digits", "--engines", "batched", "compiled", "--precisions", "fp32", "bf16",
            "--sizes", "1", "2", "--steps", "1", "--peak-size", "64", *argv]  # fmt: skip
    assert (throughput.main(args) if started is None else throughput.main(args, started=started)) == 0
    return timed


def test_throughput_times_a_compiled_row_after_the_first_datasets_and_the_others_last(monkeypatch, tmp_path):
    """Issue 44's missing number: one compiled row (the first dataset, precision and size) after the first
    dataset's other engines and before the other datasets', where a long compilation costs later rows of
    --budget instead of the outer timeout's kill, yet cannot take the first dataset's rows with it; the other
    compiled rows after every other engine. throughput.md is written before any timing and after every row
    (helper 48: a compilation killed by the timeout left $OUT empty)."""
    from benchmarks import throughput

    monkeypatch.setitem(throughput.SETTINGS, "digits12", {**throughput.SETTINGS["digits"], "n_clients": 12})
    monkeypatch.setattr(throughput, "flops_per_image", lambda dataset, shape: 1e6)
    out, written = tmp_path / "out", []
    timed = []

    def time_step(config, fed, precision, engine, size, steps):
        rows = (out / "throughput.md").read_text().count("\n| digits")  # what came home before this row
        written.append(rows)
        timed.append((config.n_clients, engine, precision, size))
        return 0.01

    monkeypatch.setattr(throughput, "time_step", time_step)
    args = ["--datasets", "digits", "digits12", "--engines", "batched", "compiled", "--precisions", "fp32",
            "bf16", "--sizes", "1", "2", "--steps", "1", "--peak-size", "64", "--out", str(out)]  # fmt: skip
    assert throughput.main(args) == 0
    every = [(p, z) for p in ("fp32", "bf16") for z in (1, 2)]
    assert timed == [*[(10, "batched", p, z) for p, z in every], (10, "compiled", "fp32", 1),
                     *[(12, "batched", p, z) for p, z in every],
                     *[(10, "compiled", p, z) for p, z in every[1:]],
                     *[(12, "compiled", p, z) for p, z in every]]  # fmt: skip
    assert written == list(range(len(timed)))  # the title first, then each row as it was timed
    assert (out / "throughput.md").read_text().count("\n| digits") == len(timed)


def test_a_refused_compiled_head_row_is_not_tried_again(monkeypatch, capsys):
    """The compiled head row refused (no compiler, say): its precision's other sizes are not tried after
    every other engine (that cost a second failed call, with its compilation attempt, in a GPU window);
    the other precision still is."""
    from benchmarks import throughput

    timed = []

    def time_step(config, fed, precision, engine, size, steps):
        timed.append((engine, precision, size))
        if engine == "compiled" and precision == "fp32":
            raise RuntimeError("no C compiler")
        return 0.01

    monkeypatch.setattr(throughput, "time_step", time_step)
    args = ["--datasets", "digits", "--engines", "batched", "compiled", "--precisions", "fp32", "bf16",
            "--sizes", "1", "2", "--steps", "1", "--peak-size", "64"]  # fmt: skip
    assert throughput.main(args) == 0
    batched = [("batched", p, z) for p in ("fp32", "bf16") for z in (1, 2)]
    assert timed == [*batched, ("compiled", "fp32", 1), ("compiled", "bf16", 1), ("compiled", "bf16", 2)]
    assert capsys.readouterr().out.count("refused: RuntimeError: no C compiler") == 1


def test_throughputs_budget_counts_from_the_process_start(monkeypatch, capsys):
    """throughput.py started 1,000 s ago (its `import torch` included), --budget 500: nothing starts."""
    timed = run_throughput(monkeypatch, "--budget", "500", started=time.perf_counter() - 1000)
    assert timed == [] and capsys.readouterr().out.count("not timed: the --budget was spent") == 8


def test_a_group_out_of_memory_goes_again_in_groups_of_half_its_size(gpu_run, tmp_path, monkeypatch):
    """Helper 48: a group whose size the autotune's step timing allowed but whose aggregation, evaluation or
    captured graphs' memory did not failed every member, and those runs were not tried again in the command.
    Here every pair runs out of memory: its runs go again, first, alone, and none is counted failed."""
    import torch

    from prodigy_core import results as store

    fake_window(gpu_run, monkeypatch, {1: 0.5, 2: 0.75})
    fits_alone = gpu_run.Driver.train_group
    sizes = []

    def train_group(self, exp, batch, folder):
        sizes.append(len(batch))
        if len(batch) == 1:
            return fits_alone(self, exp, batch, folder)
        for c in batch:
            error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            store.save_failure(folder, c.key(), c.to_dict(), error, exp.results_name)
        return [None] * len(batch)

    monkeypatch.setattr(gpu_run.Driver, "train_group", train_group)
    out = tmp_path / "out"
    argv = ["--simulate", "--data", str(tmp_path / "none"), "--out", str(out), "--work", str(tmp_path / "w"),
            "--deadline", "1000", "--no-profile"]  # fmt: skip
    assert gpu_run.main(argv) == 0
    rows = summary_rows(out)
    assert all(r[4] == "done" and r[0] == r[1] and r[2] == "0" for r in rows.values()), rows
    assert sizes[0] == 2 and set(sizes[1:]) == {1}  # the pair once, then every run alone (cap 1 for digits)
    log = (tmp_path / "w" / "log.txt").read_text()
    assert "out of memory in a group of 2: its 2 runs again, in groups of at most 1" in log


def test_a_command_killed_in_the_gate_has_its_timings_in_out_and_they_are_never_reused(
    gpu_run, tmp_path, monkeypatch
):
    """The autotune's timings (the variant table of issue 44) reach $OUT's tarball before its gate starts,
    marked as partial: a command killed in the gate (a hung capture, the command's `timeout`) still brings
    them home. A later command given that tarball tunes again, saying why (a partial entry has no choice)."""
    from test_gpu_run import simulate

    data = tmp_path / "no-data-here"  # the simulation trains on the embedded digits

    class Killed(BaseException):  # as a kill: nothing in the driver contains it
        pass

    seen = {}

    def killed_in_the_gate(*args, **kwargs):
        seen["autotune.json"] = tarball_member(tmp_path / "1" / "out", "autotune.json")
        raise Killed

    monkeypatch.setattr(autotune, "trajectory", killed_in_the_gate)
    with pytest.raises(Killed):
        simulate(gpu_run, tmp_path / "1", data, "--deadline", "1", "--no-profile")
    entry = json.loads(seen["autotune.json"])["datasets"]["digits"]
    assert entry["partial"] == autotune.PARTIAL and "chosen" not in entry
    timed = [r for r in entry["timings"] if "step_s" in r]
    assert timed and {(r["precision"], r["engine"]) for r in timed} >= {autotune.REFERENCE}

    monkeypatch.undo()
    tarball = tmp_path / "1" / "out" / "results.tar.gz"
    _, _, work = simulate(gpu_run, tmp_path / "2", data, "--deadline", "1", "--no-profile", "--resume",
                          str(tarball))  # fmt: skip
    log = (work / "log.txt").read_text()
    assert (
        f"autotune digits: {tarball}:autotune.json not reused: its digits entry holds {autotune.PARTIAL}"
        in log
    )
    final = json.loads((work / "autotune.json").read_text())["datasets"]["digits"]
    assert "partial" not in final and final["chosen"]


def test_a_broken_cuda_context_goes_on_in_a_fresh_process_without_what_broke_it(
    gpu_run, tmp_path, monkeypatch
):
    """A sticky CUDA error (BrokenDevice) fails every later kernel of the process: the rest of the command
    runs in a fresh process with --engines less the engine that broke (every captured one when a captured
    one did: they share one capture path), a group's runs that broke it left out, --no-profile when the
    profiler did, --resume from $OUT's tarball, --deadline what is left, a new --work, no --autotune, the
    restart counted and its reason passed on; not restarted (exit 1, the log says why) after MAX_RESTARTS or
    when what broke it cannot be left out (batched in the autotune, the probe); after the runs, not
    restarted and the exit code as if nothing broke."""
    from test_gpu_run import fake_window

    calls = []
    monkeypatch.setattr(gpu_run.subprocess, "call", lambda cmd, env: calls.append((cmd, env)) or 0)
    for name in (gpu_run.RESTARTS_ENV, gpu_run.SKIP_RUNS_ENV, gpu_run.REASON_ENV):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "out"
    given = tmp_path / "given-autotune.json"
    given.write_text("{}")

    def argv(work, engines="batched,bmm_conv,channels_last"):
        return ["--simulate", "--data", str(tmp_path / "none"), "--out", str(out), "--work",
                str(tmp_path / work), "--deadline=400", "--no-profile", "--autotune", str(given),
                "--engines", engines]  # fmt: skip

    def broken(precision, engine, runs=()):
        def autotune_that_breaks(*args, **kwargs):
            raise autotune.BrokenDevice(
                precision, engine, "RuntimeError: CUDA error: illegal memory access", runs
            )

        monkeypatch.setattr(autotune, "autotune", autotune_that_breaks)

    broken("bf16", "bmm_conv")
    assert gpu_run.main(argv("w1")) == 0  # the fresh process's exit code
    ((cmd, env),) = calls
    assert cmd[1].endswith("gpu_run.py") and "--work" not in cmd and "--deadline=400" not in cmd
    assert "--autotune" not in cmd  # the resumed tarball's autotune.json holds this command's
    tail = cmd[cmd.index("--engines"):]  # fmt: skip
    assert tail[:4] == ["--engines", "batched,channels_last", "--resume", str(out / "results.tar.gz")]
    assert tail[4] == "--deadline" and 300 < float(tail[5]) <= 400 and env[gpu_run.RESTARTS_ENV] == "1"
    assert "--simulate" in cmd and "--no-profile" in cmd
    assert env[gpu_run.REASON_ENV].startswith("the CUDA context stopped working after bf16/bmm_conv failed")
    assert "the CUDA context stopped working after bf16/bmm_conv failed" in tarball_member(out, "log.txt")

    calls.clear()  # a captured engine: every captured one left out
    broken("fp32", "channels_last_graphs")
    gpu_run.main(argv("w2", "batched,cuda_graphs,channels_last_graphs,channels_last"))
    assert calls[0][0][calls[0][0].index("--engines") + 1] == "batched,channels_last"

    refused = [(gpu_run.MAX_RESTARTS, "bmm_conv", "already restarted 2 times"),
               (0, "batched", "batched broke it, and every run needs it"),
               (0, "the probe", "the probe broke it, and every run needs it")]  # fmt: skip
    for restarts, engine, why in refused:
        calls.clear()
        monkeypatch.setenv(gpu_run.RESTARTS_ENV, str(restarts))
        broken("fp32", engine)
        assert gpu_run.main(argv(f"w-{restarts}-{engine}")) == gpu_run.EXIT_FAILED
        assert not calls and f"!! not restarted: {why}" in tarball_member(out, "log.txt")
    monkeypatch.delenv(gpu_run.RESTARTS_ENV)

    # the profiler broke it: restarted with --no-profile (this command profiles)
    calls.clear()
    broken("fp32", "profiler")
    gpu_run.main([a for a in argv("w-profiler") if a != "--no-profile"])
    assert "--no-profile" in calls[0][0] and calls[0][0][calls[0][0].index("--engines") + 1] == (
        "batched,bmm_conv,channels_last"
    )

    # a group whose runs failed on a device that no longer works: the runs' engine and the runs left out,
    # after their failures are logged and in $OUT
    fake_window(gpu_run, monkeypatch, {1: 0.5, 2: 0.75})
    tune = autotune.autotune()["datasets"]["digits"]  # fake_window's, with the runs on channels_last
    tune["chosen"] = {"precision": "fp32", "engine": "channels_last"}
    monkeypatch.setattr(autotune, "autotune", lambda *a, **k: {"datasets": {"digits": tune}})
    trained = []

    def train_group(self, exp, batch, folder):
        trained.extend(batch)
        return [None] * len(batch)

    monkeypatch.setattr(gpu_run.Driver, "train_group", train_group)
    monkeypatch.setattr(gpu_run, "failure_error", lambda folder, config: "RuntimeError: CUDA error")
    monkeypatch.setattr(autotune, "device_works", lambda device: False)
    calls.clear()
    assert gpu_run.main(argv("w-runs")) == 0
    ((cmd, env),) = calls
    assert cmd[cmd.index("--engines") + 1] == "batched,bmm_conv"  # the runs' engine left out
    assert env[gpu_run.SKIP_RUNS_ENV].split(",") == [c.key() for c in trained] and trained
    log = tarball_member(out, "log.txt")
    assert log.index("   FAILED ") < log.index("!! the CUDA context stopped working")

    # the fresh process: those runs are not started again, and its summary says why
    monkeypatch.setattr(autotune, "device_works", lambda device: True)
    monkeypatch.setenv(gpu_run.SKIP_RUNS_ENV, env[gpu_run.SKIP_RUNS_ENV])
    monkeypatch.setenv(gpu_run.REASON_ENV, env[gpu_run.REASON_ENV])
    skipped, trained[:] = set(env[gpu_run.SKIP_RUNS_ENV].split(",")), []
    gpu_run.main(argv("w-child"))
    assert trained and not skipped & {c.key() for c in trained}
    assert (
        "restarted in a fresh process after: the CUDA context stopped working"
        in (out / "summary.txt").read_text()
    )


def test_a_device_broken_after_the_runs_restarts_nothing_and_keeps_the_exit_code(
    gpu_run, tmp_path, monkeypatch
):
    """Helper 60: a break in the timings after the runs made the exit code 1 though every run was done."""
    from test_gpu_run import fake_window

    fake_window(gpu_run, monkeypatch, {1: 0.5, 2: 0.75})
    for name in (gpu_run.RESTARTS_ENV, gpu_run.SKIP_RUNS_ENV, gpu_run.REASON_ENV):
        monkeypatch.delenv(name, raising=False)

    def breaks(self):
        raise autotune.BrokenDevice("fp32", "compiled", "CUDA error")

    monkeypatch.setattr(gpu_run.Driver, "time_left_out", breaks)
    monkeypatch.setattr(gpu_run.subprocess, "call", lambda *a, **k: pytest.fail("restarted after the runs"))
    out = tmp_path / "out"
    argv = ["--simulate", "--data", str(tmp_path / "none"), "--out", str(out), "--work", str(tmp_path / "w"),
            "--deadline", "1000", "--no-profile"]  # fmt: skip
    assert gpu_run.main(argv) == 0
    assert "!! not restarted: the runs are over" in tarball_member(out, "log.txt")
