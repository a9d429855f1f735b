"""The GPU window's autotune and gate (benchmarks/autotune.py), the paper profile's plan and its group sizing
(benchmarks/gpu_run.py), on the CPU."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prodigy_core import training
from prodigy_core.experiments import load_experiment
from prodigy_core.seeding import resolve_device

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from test_gpu_run import trained_share  # noqa: E402

from benchmarks import autotune  # noqa: E402


@pytest.fixture(scope="module")
def digits():
    config = load_experiment("quickstart_digits", scale="smoke").configs[0]
    config = config.replace(device="cpu", distribution="iid", engine="batched")
    return config, training.run_federation(config.resolved(), resolve_device("cpu"))


def fake_timer(resolved, fed, precision, engine, size):
    """bf16 ten times faster than fp32, whatever this CPU measures: the candidate the gate must judge."""
    return (0.1 if precision == "bf16" else 1.0) * size


@pytest.mark.parametrize("scale", [1.0, 0.0])
def test_the_fastest_candidate_is_chosen_only_if_it_passes_the_gate(digits, scale, monkeypatch):
    """Default tolerances: bf16 passes on digits (measured: 1.6-1.9% parameter difference, equal attack
    parameters and zeroed clients) and, ten times faster, is chosen. Tolerances of 0 and no noise floor: any
    rounding difference fails it, and the reference is chosen although slower."""
    config, fed = digits
    if not scale:
        monkeypatch.setattr(autotune, "FLOOR_FACTOR", 0.0)
    tolerances = {name: bound * scale for name, bound in autotune.TOLERANCES.items()}
    report = autotune.autotune({"digits": config}, {"digits": fed}, tolerances=tolerances, timer=fake_timer,
                               log=lambda line: None)  # fmt: skip
    tune = report["datasets"]["digits"]
    verdicts = {g["defense"]: g for g in tune["gate"]}
    assert set(verdicts) == set(autotune.GATE_DEFENSES)
    for gate in verdicts.values():
        assert gate["precision"] == "bf16" and gate["measures"]["param_rel"] > 0  # not bitwise fp32
        floor = tune["floor"][gate["defense"]]  # max(tolerance, FLOOR_FACTOR x floor), by hand
        by_hand = {k: max(v, autotune.FLOOR_FACTOR * floor.get(k, 0.0)) for k, v in tolerances.items()}
        assert gate["bounds"] == by_hand
        within = all(gate["measures"][k] <= v for k, v in gate["bounds"].items())
        assert gate["accepted"] is within
    assert tune["chosen"] == {"precision": "bf16" if scale else "fp32", "engine": "batched"}
    assert tune["step_s"] == ({1: 0.1, 2: 0.2} if scale else {1: 1.0, 2: 2.0})  # the chosen's rates
    # every precision groups (hostile round 5): bf16 is timed at both sizes and gated in a group of 2, its
    # probe size, which no other size beats (the fake rates are equal)
    assert {row["size"] for row in tune["timings"] if row["precision"] == "bf16"} == {1, 2}
    assert {gate["size"] for gate in verdicts.values()} == {2}


def test_a_bound_is_the_larger_of_the_tolerance_and_twice_the_floor():
    assert autotune.FLOOR_FACTOR == 2  # issue 41 item 4: "twice the same measure between the two references"
    got = autotune.bounds({"a": 0.1, "b": 0.1, "c": 0.3}, {"a": 0.02, "b": 0.2})  # c: no floor measured
    assert got == {"a": 0.1, "b": 0.4, "c": 0.3}


@pytest.mark.parametrize(("times_floor", "accepted"), [(1.5, True), (3.0, False)])
def test_the_gate_bounds_a_candidate_by_twice_its_noise_floor_issue_41_item_4(
    digits, monkeypatch, times_floor, accepted
):
    """The fp32 reference runs twice, the second on the streams of another seed (batches, dropout masks):
    their distance is the floor that autotune.json records. With tolerances of 0 a candidate is judged by the
    floor alone: one that differs from the reference by 1.5x the floor's parameter distance is accepted, one
    at 3x is refused (its other measures equal the reference's)."""
    config, fed = digits
    real, seen = autotune.trajectory, {}

    def candidate_off_by(config, fed, precision, engine, rounds, other_stream=False, size=1):
        if precision == "fp32":
            found = real(config, fed, precision, engine, rounds, other_stream)
            seen[config.defense, other_stream] = found
            return found
        ref, twin = seen[config.defense, False], seen[config.defense, True]
        direction = torch.randn(ref["theta"].shape, generator=torch.Generator().manual_seed(0))
        offset = times_floor * float((twin["theta"] - ref["theta"]).norm()) * direction / direction.norm()
        return {**ref, "theta": ref["theta"] + offset}

    monkeypatch.setattr(autotune, "trajectory", candidate_off_by)
    tolerances = dict.fromkeys(autotune.TOLERANCES, 0.0)
    report = autotune.autotune({"digits": config}, {"digits": fed}, tolerances=tolerances, timer=fake_timer,
                               log=lambda line: None)  # fmt: skip
    tune = report["datasets"]["digits"]
    for gate in tune["gate"]:
        ref, twin = seen[gate["defense"], False], seen[gate["defense"], True]
        floor = tune["floor"][gate["defense"]]
        assert floor == autotune.compare(ref, twin) and floor["param_rel"] > 0  # another stream moves it
        assert gate["bounds"]["param_rel"] == pytest.approx(2 * floor["param_rel"])
        assert gate["measures"]["param_rel"] == pytest.approx(times_floor * floor["param_rel"])
        assert gate["accepted"] is accepted
    assert tune["chosen"]["precision"] == ("bf16" if accepted else "fp32")


def test_gate_measures_are_zero_for_the_reference_against_itself(digits):
    config, fed = digits
    base = config.replace(defense="prodigy", attack="alie", rounds=2, eval_every=2)
    first = autotune.trajectory(base, fed, "fp32", "batched", 2)
    again = autotune.trajectory(base, fed, "fp32", "batched", 2)
    assert autotune.compare(first, again) == {
        "param_rel": 0.0, "client_loss_rel": 0.0, "attack_param_rel": 0.0, "zeroed_diff": 0,
        "accuracy_points": 0.0,
    }  # fmt: skip
    assert first["zeroed"] and len(first["attack_params"]) == 2


def test_shared_federations_loads_each_split_once(monkeypatch):
    """Inside `training.shared_federations` (the GPU driver's whole window) runs of one split share one loaded
    federation; outside it every run loads its own, as before."""
    loads = []
    read = training._read_federation
    monkeypatch.setattr(training, "_read_federation", lambda *a: loads.append(a[0].dataset) or read(*a))
    config = load_experiment("quickstart_digits", scale="smoke").configs[0].replace(rounds=1, device="cpu")
    with training.shared_federations():
        training.run(config, progress=False)
        training.run(config.replace(defense="none"), progress=False)  # same split: no second load
        training.run(config.replace(seed=1), progress=False)  # its own split (data_seed = seed)
    assert loads == ["digits", "digits"]
    training.run(config, progress=False)
    assert len(loads) == 3


def test_paper_profile_plan(gpu_run, tmp_path):
    """Issue 33's order: Table II beta 0.9 `paper` T=800 seed 0 (3 rows x 6 attacks, then the other 4
    defenses), Table I's central pair T=1000, Table II beta 0.9 `authors`, the rest of Table I's non-IID
    FedAVG beta 0.9 block."""
    steps = gpu_run.plan("paper", simulate=False)
    assert [s.name for s in steps] == ["table2-paper-rows", "table2-paper-rest", "table1-paper-pair",
                                       "table2-authors", "table1-paper-block"]  # fmt: skip
    args = argparse.Namespace(simulate=False, profile="paper", out=tmp_path, group_size=16, deadline=1.0)
    driver = gpu_run.Driver(args, tmp_path)
    expected = {  # runs, dataset, T, variant, defenses
        "table2-paper-rows": (18, "femnist", 800, "paper", {"prodigy", "nnm+trimmed_mean", "none"}),
        "table2-paper-rest": (24, "femnist", 800, "paper", {"nnm+median", "nnm+geomed", "nnm+krum",
                                                           "nnm+cclip"}),
        "table1-paper-pair": (2, "cifar10", 1000, "paper", {"prodigy", "nnm+trimmed_mean"}),
        "table2-authors": (42, "femnist", 800, "authors", None),
        "table1-paper-block": (42, "cifar10", 1000, "paper", None),
    }  # fmt: skip
    for step in steps:
        configs = driver.experiment(step).configs
        runs, dataset, rounds, variant, defenses = expected[step.name]
        assert len(configs) == runs
        assert {(c.dataset, c.rounds, c.variant, c.local_momentum, c.seed) for c in configs} == {
            (dataset, rounds, variant, 0.9, 0)
        }
        assert all(c.checkpoint_every == c.rounds for c in configs)  # no checkpoints: none comes home
        if defenses:
            assert {c.defense for c in configs} == defenses
        if dataset == "cifar10":
            assert {(c.distribution, c.local_steps) for c in configs} == {("dirichlet", 10)}
    pair = {(c.defense, c.attack) for c in driver.experiment(steps[2]).configs}
    assert pair == {("prodigy", "alie"), ("nnm+trimmed_mean", "alie")}
    assert pair < {(c.defense, c.attack) for c in driver.experiment(steps[4]).configs}


@pytest.mark.parametrize("seconds_left", [30.0, 100.0, 1000.0, 10**5])
def test_a_group_sized_from_the_measured_costs_fits_the_time_left(gpu_run, tmp_path, seconds_left):
    """`Driver.choose_group`: of the first runs' compatible ones in order, the size with the most run-rounds
    per second whose estimate (GROUP_MARGIN x (rounds x E x step_s[R'] + each run's rounds x server side))
    x 1.25 fits (no group finished yet: idle Byzantine clients credited nothing, `Driver.local_factor_for`,
    and the data set's overrun not measured, `gpu_run.UNMEASURED_OVERRUN`); when
    none does, the most wanted runs that fit (here: the unattacked ones, cheaper by their server side); none
    at all: an empty group."""
    args = argparse.Namespace(
        simulate=False, profile="paper", out=tmp_path, group_size=16, deadline=seconds_left
    )
    driver = gpu_run.Driver(args, tmp_path)
    driver.start = gpu_run.time.monotonic()
    step_s = {1: 0.010, 4: 0.025, 8: 0.045, 16: 0.090}  # one local step of R stacked runs
    driver.tune = {"femnist": {"step_s": step_s, "chosen": {"precision": "fp32", "engine": "batched"}}}
    driver.eval_s["femnist"] = 0.0
    configs = driver.experiment(gpu_run.plan("paper", simulate=False)[0]).configs  # 800 rounds, E = 10
    driver.server_s = {("femnist", c.defense, c.attack): 0.0 if c.attack == "none" else 0.1 for c in configs}
    todo = sorted(configs, key=lambda c: c.attack == "none")  # the attacked runs first

    def by_hand(batch):
        upper = min(s for s in step_s if s >= len(batch))
        server = sum(0.0 if c.attack == "none" else 0.1 for c in batch)
        return gpu_run.GROUP_MARGIN * 800 * (10 * step_s[upper] + server)

    batch, estimate = driver.choose_group(todo)
    left = seconds_left - driver.elapsed()
    fitting = [todo[:r] for r in range(1, 17) if 1.25 * by_hand(todo[:r]) <= left]
    if fitting:
        assert batch in fitting and estimate == pytest.approx(by_hand(batch))
        assert all(len(batch) / by_hand(batch) >= len(b) / by_hand(b) - 1e-12 for b in fitting)
    elif 1.25 * by_hand([todo[-1]]) <= left:  # 1.25 x 1.1 x 800 x 0.1 = 110 s: an unattacked run alone
        assert batch and all(c.attack == "none" for c in batch) and estimate <= left
    else:
        assert batch == [] and estimate == pytest.approx(by_hand(todo[:1]))


@pytest.mark.parametrize("pair_timed", [True, False])
def test_the_windows_end_packs_a_pair_where_a_group_of_4_no_longer_fits(gpu_run, tmp_path, pair_timed):
    """The 2026-11-27 window ran its last 240 s as single runs (86-125 s each at fp32) because a group of 4
    (212 s measured, more estimated) no longer fitted and no size between 1 and 4 was timed. The autotune now
    times groups of 2 (`CANDIDATES`); with 200 s left and the window's fp32 step times, the driver starts a
    pair (1.1 x 8,000 steps x 0.019 s = 167 s: no group finished yet, so idle Byzantine clients are credited
    nothing; FEMNIST groups ran before: its overrun measured, here 1) instead of one run (94 s)."""
    assert 2 in autotune.CANDIDATES["cuda"]["size"]
    args = argparse.Namespace(simulate=False, profile="paper", out=tmp_path, group_size=16, deadline=200.0)
    driver = gpu_run.Driver(args, tmp_path)
    driver.start = gpu_run.time.monotonic()
    step_s = {1: 0.0107, 2: 0.019, 4: 0.0333, 8: 0.130} if pair_timed else {1: 0.0107, 4: 0.0333, 8: 0.130}
    driver.tune = {"femnist": {"step_s": step_s, "chosen": {"precision": "fp32", "engine": "batched"}}}
    driver.eval_s["femnist"] = 0.0
    configs = driver.experiment(gpu_run.plan("paper", simulate=False)[0]).configs
    driver.server_s = {("femnist", c.defense, c.attack): 0.0 for c in configs}
    driver.overrun["femnist"] = 1.0
    batch, estimate = driver.choose_group(configs)
    assert len(batch) == (2 if pair_timed else 1)
    assert estimate == pytest.approx(gpu_run.GROUP_MARGIN * 800 * 10 * step_s[len(batch)])


def test_the_group_never_outgrows_the_runs_left_or_the_cap(gpu_run, tmp_path):
    args = argparse.Namespace(simulate=False, profile="paper", out=tmp_path, group_size=5, deadline=10**6)
    driver = gpu_run.Driver(args, tmp_path)
    driver.tune = {"femnist": {"step_s": {1: 0.01, 16: 0.02}, "chosen": {"engine": "batched"}}}
    configs = driver.experiment(gpu_run.plan("paper", simulate=False)[0]).configs
    assert len(driver.choose_group(configs[:3])[0]) == 3
    assert len(driver.choose_group(configs)[0]) == 5


def test_a_run_too_slow_for_the_whole_deadline_is_not_started_and_says_so(gpu_run, tmp_path, monkeypatch):
    """A measured rate at which one run needs more than the whole --deadline: no group starts, one clear
    line per step says so, and the window goes on to the next step; with no run started, exit 1 (issue 42,
    finding 27: not 0, as if the window had done its work)."""
    real = autotune.autotune

    def slow(*args, **kwargs):
        report = real(*args, **kwargs)
        report["datasets"]["digits"]["step_s"] = {1: 100.0, 2: 200.0}  # 4 rounds x E=2: 1,200 s a run
        return report

    monkeypatch.setattr(autotune, "autotune", slow)
    data = tmp_path / "data"
    (data / "cifar10-jpeg").mkdir(parents=True)
    (data / "cifar10-jpeg" / "cifar10-jpeg.tar.gz").write_bytes(b"")
    (data / "femnist-leaf-24").mkdir()
    work = tmp_path / "work"
    code = gpu_run.main(["--simulate", "--data", str(data), "--out", str(tmp_path / "out"), "--work",
                         str(work), "--deadline", "300"])  # fmt: skip
    assert code == gpu_run.EXIT_FAILED
    log = (work / "log.txt").read_text()
    lines = [line for line in log.splitlines() if "too slow: one run of" in line]
    assert len(lines) == len(gpu_run.plan("paper", simulate=True))
    assert "more than the whole --deadline 300 s: not started" in lines[0]
    assert not list((work / "results").rglob("*.json"))  # nothing trained


def test_estimates_learn_from_a_group_whose_run_diverged_early(gpu_run, tmp_path):
    """`Driver.learn`: a run that diverged at round 6 of 800 ran 6 rounds of local steps; the local factor
    (measured / the autotune's prediction) is taken over those 6 rounds, and its kind's server side per round
    over its own rounds."""
    args = argparse.Namespace(simulate=False, profile="paper", out=tmp_path, group_size=16, deadline=500.0)
    driver = gpu_run.Driver(args, tmp_path)
    driver.tune = {"femnist": {"step_s": {1: 0.01}, "chosen": {"engine": "batched"}}}
    config = driver.experiment(gpu_run.plan("paper", simulate=False)[0]).configs[0]  # E = 10, T = 800
    phases = {"local": 2 * 6 * 10 * 0.01, "craft": 0.6, "aggregate": 0.3, "eval": 0.06, "rest": 0.3}
    driver.learn([config], [{"phase_seconds": phases, "rounds_completed": 6}])
    assert driver.share_factor["femnist", round(trained_share([config]), 3)] == pytest.approx(2.0)
    assert driver.server_s["femnist", config.defense, config.attack] == pytest.approx(1.2 / 6)
    assert driver.eval_s["femnist"] == pytest.approx(0.01)
    expected = gpu_run.GROUP_MARGIN * 800 * (2 * 10 * 0.01 + 0.2 + 0.01)
    assert driver.estimate([config]) == pytest.approx(expected)


@pytest.mark.parametrize(("per_trajectory", "gated"), [(0.6, []), (0.4, ["prodigy"])])
def test_the_gate_stops_gating_candidates_once_the_budget_is_spent(
    digits, monkeypatch, per_trajectory, gated
):
    """The autotune's bound: once its budget (1 s) is spent, no further candidate trajectory starts; a
    candidate left out is not accepted, and the reference (fp32) is chosen although slower. Each trajectory
    takes `per_trajectory` seconds of autotune's fake clock: at 0.6 s the first defense's two references
    spend 1.2 s and no candidate is gated; at 0.4 s they spend 0.8 s, the first defense gates its candidate
    (bf16, the only other one on a CPU), which ends at 1.2 s, and the second defense gates none."""
    config, fed = digits
    clock = FakeClock(0.0)
    monkeypatch.setattr(autotune, "time", clock)
    monkeypatch.setattr(autotune, "add_rates", lambda *args: None)  # its peak needs a real clock
    real, started = autotune.trajectory, []

    def slow_trajectory(config, fed, precision, *args, **kwargs):
        started.append((config.defense, precision))
        clock.now += per_trajectory
        return real(config, fed, precision, *args, **kwargs)

    monkeypatch.setattr(autotune, "trajectory", slow_trajectory)
    report = autotune.autotune({"digits": config}, {"digits": fed}, budget_s=1.0, timer=fake_timer,
                               log=lambda line: None)  # fmt: skip
    tune = report["datasets"]["digits"]
    # each defense's two references, then its candidate only where the budget still lasted
    assert started == [
        (d, p) for d in autotune.GATE_DEFENSES for p in ("fp32", "fp32", "bf16")[: 3 if d in gated else 2]
    ]
    assert [g["defense"] for g in tune["gate"]] == list(autotune.GATE_DEFENSES)
    spent = {"error": "not gated: the autotune's budget was spent"}
    for g in tune["gate"]:
        assert g["precision"] == "bf16"
        if g["defense"] not in gated:
            assert not g["accepted"] and g["measures"] == spent
        else:
            assert "error" not in g["measures"]
    assert tune["chosen"]["precision"] == "fp32" and set(tune["floor"]) == set(autotune.GATE_DEFENSES)


class FakeClock:
    """autotune's clock: each timing costs `per_timing` seconds, nothing else advances it."""

    def __init__(self, per_timing: float) -> None:
        self.now, self.per_timing = 0.0, per_timing

    def perf_counter(self) -> float:
        return self.now


def grouped_rates(precision, engine, size):
    """images/s by candidate and group size: fp32 rises to 4 runs and falls beyond (what both 2026-11-27
    windows measured), bf16 1.5x fp32's; bmm_conv is the fastest engine."""
    by_size = {1: 100.0, 2: 150.0, 4: 200.0, 8: 120.0, 16: 110.0}[size]
    return (
        by_size
        * {"batched": 1.0, "channels_last": 0.8, "bmm_conv": 2.0}[engine]
        * (1.5 if precision == "bf16" else 1.0)
    )


@pytest.fixture
def grouped_space(monkeypatch):
    space = {"precision": ("fp32", "bf16"), "engine": ("batched", "channels_last", "bmm_conv"),
             "size": (1, 2, 4, 8, 16)}  # fmt: skip
    monkeypatch.setitem(autotune.CANDIDATES, "cpu", space)
    return space


def test_every_candidate_is_timed_once_before_any_group_size_is_explored(digits, grouped_space, monkeypatch):
    """The 2026-11-27 window timed precision by precision: fp32's four sizes took the timing share, and no
    engine variant, nor CIFAR-10's tf32 and bf16, was ever timed. Breadth first: every (precision, engine)
    at its probe size (4; every precision groups since hostile round 5), then the reference's other sizes and
    each other candidate's by rate, the smaller ones all, the larger ones until the rate falls."""
    config, fed = digits
    clock, calls = FakeClock(0.01), []
    monkeypatch.setattr(autotune, "time", clock)
    monkeypatch.setattr(autotune, "add_rates", lambda *args: None)  # its peak needs a real clock

    def timer(resolved, fed, precision, engine, size):
        calls.append((precision, engine, size))
        clock.now += clock.per_timing
        return size * resolved.n_clients * resolved.batch_size / grouped_rates(precision, engine, size)

    report = autotune.autotune({"digits": config}, {"digits": fed}, timer=timer, log=lambda line: None)
    probes = [(p, e, 4) for e in grouped_space["engine"] for p in ("fp32", "bf16")]
    assert calls[: len(probes)] == probes
    explored = calls[len(probes) :]
    # the reference, then the others by rate: 600, 400, 300, 240 and 160 images/s at their probe size
    by_rate = [("fp32", "batched"), ("bf16", "bmm_conv"), ("fp32", "bmm_conv"), ("bf16", "batched"),
               ("bf16", "channels_last"), ("fp32", "channels_last")]  # fmt: skip
    assert explored == [(p, e, z) for p, e in by_rate for z in (1, 2, 8)]
    tune = report["datasets"]["digits"]
    assert tune["chosen"]["engine"] == "bmm_conv"  # accepted: bmm_conv is batched's computation
    assert tune["step_s"] == {z: pytest.approx(z * 10 * 64 / grouped_rates(tune["chosen"]["precision"],
                              "bmm_conv", z)) for z in (1, 2, 4, 8)}  # fmt: skip
    assert {gate["size"] for gate in tune["gate"]} == {4}  # each gated at its fastest size


@pytest.mark.parametrize("engines", [("channels_last",), ("bmm_conv", "channels_last")])
def test_engines_times_only_the_named_engines_and_the_reference(digits, grouped_space, monkeypatch, engines):
    """gpu_run.py --engines (helper 48: a captured variant's CUDA error ended a command, and the next tuned
    again and died the same way): the engines left out are neither timed nor gated nor chosen; batched, the
    reference, always is."""
    config, fed = digits
    monkeypatch.setattr(autotune, "time", FakeClock(0.01))
    monkeypatch.setattr(autotune, "add_rates", lambda *args: None)  # its peak needs a real clock
    calls = []

    def timer(resolved, fed, precision, engine, size):
        calls.append(engine)
        return size * resolved.n_clients * resolved.batch_size / grouped_rates(precision, engine, size)

    report = autotune.autotune({"digits": config}, {"digits": fed}, timer=timer, log=lambda line: None,
                               engines=engines)  # fmt: skip
    tune = report["datasets"]["digits"]
    assert set(calls) == {"batched", *engines}
    assert {row["engine"] for row in tune["timings"]} == {"batched", *engines}
    assert {gate["engine"] for gate in tune["gate"]} <= {"batched", *engines}
    # bmm_conv, the fastest, when named; else bf16 batched (300 images/s at 4) over channels_last's 240
    assert tune["chosen"]["engine"] == ("bmm_conv" if "bmm_conv" in engines else "batched")


def test_a_failing_gate_reference_server_side_or_rate_keeps_the_timings_and_chooses_the_reference(
    digits, grouped_space, monkeypatch
):
    """Helper 48: one exception anywhere in the gate's references, the server side or the rates lost every
    timing row (the driver then ran fp32/batched at the probe's rates, the measurements gone). Each now fails
    alone: the timings kept, nothing gated accepted (the reference chosen), the error in the gate and log."""
    config, fed = digits
    monkeypatch.setattr(autotune, "time", FakeClock(0.01))

    def fails(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    for name in ("trajectory", "server_costs", "add_rates"):
        monkeypatch.setattr(autotune, name, fails)
    lines: list[str] = []
    report = autotune.autotune({"digits": config}, {"digits": fed}, timer=lambda r, f, p, e, z: 0.01 * z,
                               log=lines.append, server_kinds={"digits": [("none", "sf")]})  # fmt: skip
    tune = report["datasets"]["digits"]
    assert {(row["precision"], row["engine"]) for row in tune["timings"] if "step_s" in row} == {
        (p, e) for p in grouped_space["precision"] for e in grouped_space["engine"]
    }
    assert tune["chosen"] == {"precision": "fp32", "engine": "batched"} and tune["server_s"] == {}
    assert tune["gate"] and all(not g["accepted"] and g["measures"]["error"].startswith(
        "the fp32 reference failed: RuntimeError: CUDA error") for g in tune["gate"])  # fmt: skip
    assert sum("server side not measured (RuntimeError" in x for x in lines) == 1
    assert sum("TFLOP/s and peak share not added (RuntimeError" in x for x in lines) == 1


def test_a_candidate_the_timing_budget_leaves_out_is_listed_as_not_timed(digits, grouped_space, monkeypatch):
    """A budget with room for three timings: the first three candidates at their probe size, the other three
    listed with the reason, no size explored; the reference's probe is timed whatever the budget."""
    config, fed = digits
    budget_s = 1.0
    clock = FakeClock(budget_s * autotune.TIMING_SHARE / 2.5)  # room after two timings, not after three
    monkeypatch.setattr(autotune, "time", clock)
    monkeypatch.setattr(autotune, "add_rates", lambda *args: None)  # its peak needs a real clock
    monkeypatch.setattr(autotune, "trajectory", lambda *a, **k: pytest.fail("no gate in this test"))

    def timer(resolved, fed, precision, engine, size):
        clock.now += clock.per_timing
        return 1.0

    monkeypatch.setattr(autotune, "GATE_DEFENSES", ())
    lines: list[str] = []
    report = autotune.autotune({"digits": config}, {"digits": fed}, budget_s=budget_s, timer=timer,
                               log=lines.append)  # fmt: skip
    rows = report["datasets"]["digits"]["timings"]
    assert [(r["precision"], r["engine"], r["size"], "step_s" in r) for r in rows] == [
        ("fp32", "batched", 4, True), ("bf16", "batched", 4, True), ("fp32", "channels_last", 4, True),
        ("bf16", "channels_last", 4, False), ("fp32", "bmm_conv", 4, False), ("bf16", "bmm_conv", 4, False),
    ]  # fmt: skip
    assert all(r["error"] == "not timed: the timing budget was spent" for r in rows[3:])
    assert "not timed or failed: bf16/channels_last, fp32/bmm_conv, bf16/bmm_conv;" in "\n".join(lines)


def test_the_candidates_the_budget_left_out_are_timed_after_the_runs_in_the_time_left(digits):
    """Issue 44's table of every variant: after the window's runs, each "not timed" row is timed while the
    time left holds the longest wall measured, compiled apart (`compiled=True`, which the driver calls last)
    and only with COMPILE_S + COMPILE_MARGIN_S more; a row timed replaces its placeholder, marked after_runs,
    with its TFLOP/s and share of the peak; the rest stay "not timed"."""
    config, fed = digits
    placeholder = {"error": autotune.NOT_TIMED}
    tune = {"gflop_per_image": 0.5, "timings": [
        {"precision": "fp32", "engine": "batched", "size": 4, "step_s": 1.0, "wall_s": 3.0,
         "images_per_s": 100.0},
        {"precision": "fp32", "engine": "compiled", "size": 4, **placeholder},
        {"precision": "fp32", "engine": "bmm_conv", "size": 4, **placeholder},
        {"precision": "bf16", "engine": "bmm_conv", "size": 1, **placeholder},
    ]}  # fmt: skip
    timed, left = [], [5.0]

    def timer(resolved, fed, precision, engine, size):
        timed.append((precision, engine, size))
        left[0] -= 1.0  # each timing takes a second of the time left
        return 0.5

    rows = autotune.time_left_out(tune, config, fed, peak=10.0, seconds_left=lambda: left[0], timer=timer)
    # 5 s left: bmm_conv fp32 (needs 3), then 4 s: bmm_conv bf16; compiled is not among these
    assert timed == [("fp32", "bmm_conv", 4), ("bf16", "bmm_conv", 1)] and len(rows) == 2
    by_key = {(r["precision"], r["engine"]): r for r in tune["timings"]}
    images = 4 * config.resolved().n_clients * config.resolved().batch_size / 0.5
    row = by_key["fp32", "bmm_conv"]
    assert row["after_runs"] and row["images_per_s"] == pytest.approx(images)
    assert row["tflops"] == pytest.approx(images * 0.5 / 1e3) and row["peak_share"] == pytest.approx(
        row["tflops"] / 10.0
    )
    assert by_key["fp32", "compiled"]["error"] == autotune.NOT_TIMED
    left[0] = 3.0 + autotune.COMPILE_S  # its compilation, not the margin: not timed
    assert not autotune.time_left_out(tune, config, fed, None, lambda: left[0], timer, compiled=True)
    left[0] = 3.0 + autotune.COMPILE_S + autotune.COMPILE_MARGIN_S  # enough for compiled now
    autotune.time_left_out(
        tune, config, fed, peak=None, seconds_left=lambda: left[0], timer=timer, compiled=True
    )
    assert timed[-1] == ("fp32", "compiled", 4) and by_key["fp32", "batched"] is tune["timings"][0]
    assert "peak_share" not in tune["timings"][1] and tune["timings"][1]["after_runs"]


def test_the_server_side_of_each_kind_of_the_window_is_measured_while_the_budget_lasts(digits, monkeypatch):
    """Issue 41 item 2: each (defense, attack) of the window's runs gets its own server side per round, from
    runs of that kind fed one local round's pseudo-gradients, in order while the budget lasts; the gate's
    kinds keep the gate's measure. The real `timed_server_round` times `training.server_round` (replaced: it
    records its call and advances autotune's fake clock by 10 k + r seconds in kind k's round r), and each
    kind's cost is the mean of its rounds after the first (the start-up); a kind that diverges (here the
    second, at round 2) stops there, its cost what it measured so far."""
    config, fed = digits
    assert autotune.SERVER_ROUNDS == 3  # the hand-worked costs below: rounds 2 and 3 kept, round 1 dropped
    kinds = [("nnm+trimmed_mean", "sf"), ("none", "foe_100"), ("none", "lf"), ("prodigy", "sf")]
    left = iter([1.0, 1.0, 1.0, 1.0, 0.0])  # room for three kinds (the first call is the start's)
    clock = FakeClock(0.0)
    monkeypatch.setattr(autotune, "time", clock)
    calls: list[tuple[str, str, int, float]] = []
    fed_grads: list[torch.Tensor] = []

    def server_round(st, r, gamma, grads, buffers):
        kind = (st.resolved.defense, st.resolved.attack)
        calls.append((*kind, r, gamma))
        fed_grads.append(grads)
        clock.now += 10.0 * (kinds.index(kind) + 1) + r  # this round's seconds
        return not (kind == ("none", "foe_100") and r == 2)  # diverged at its round 2

    monkeypatch.setattr(training, "server_round", server_round)
    costs = autotune.server_costs(config, fed, kinds, lambda: next(left))
    lr = 0.05  # the smoke quickstart's rate, not decayed before round 4 (after 2/3 of its 3 rounds)
    assert calls == [
        ("nnm+trimmed_mean", "sf", 1, lr), ("nnm+trimmed_mean", "sf", 2, lr),
        ("nnm+trimmed_mean", "sf", 3, lr),
        ("none", "foe_100", 1, lr), ("none", "foe_100", 2, lr),  # diverged: no round 3
        ("none", "lf", 1, lr), ("none", "lf", 2, lr), ("none", "lf", 3, lr),
    ]  # fmt: skip
    # kind 1: rounds of 11, 12, 13 s -> (12 + 13) / 2; kind 2: 21, 22 s -> 22; kind 3: 31, 32, 33 s -> 32.5
    assert costs == {"nnm+trimmed_mean/sf": 12.5, "none/foe_100": 22.0, "none/lf": 32.5}
    # every round is fed the same pseudo-gradients, each its own copy (a round's attack writes into its rows)
    assert all(torch.equal(g, fed_grads[0]) and g is not fed_grads[0] for g in fed_grads[1:])
    monkeypatch.undo()
    assert autotune.server_costs(config, fed, kinds, lambda: 0.0) == {}  # no budget: nothing started
    # the whole autotune on a clock that never moves (its budget never spent, however loaded this machine)
    monkeypatch.setattr(autotune, "time", FakeClock(0.0))
    monkeypatch.setattr(autotune, "add_rates", lambda *args: None)  # its peak needs a real clock
    report = autotune.autotune({"digits": config}, {"digits": fed}, timer=fake_timer, log=lambda line: None,
                               server_kinds={"digits": [("prodigy", "alie"), ("none", "sf")]})  # fmt: skip
    server = report["datasets"]["digits"]["server_s"]
    assert set(server) == {"prodigy/alie", "nnm+trimmed_mean/alie", "none/sf"}  # the gate's two, then ours


def test_the_gate_runs_a_candidate_in_a_group_of_its_fastest_size_at_most_the_probe(
    digits, grouped_space, monkeypatch
):
    """Hostile round 5: bf16 groups, so the gate judges a candidate as a group's member (its kernels round
    as a group's): at the size where it was fastest, here 2 (its rate falls beyond), and where it is fastest
    in a group of 16, at the probe size 4, which bounds the gate's cost (a gate out of budget would fall back
    to the reference). The reference's trajectories run alone."""
    config, fed = digits
    peak = {"bf16": 2, "fp32": 1}  # each precision's fastest size; bf16 the faster
    monkeypatch.setattr(autotune, "add_rates", lambda *args: None)

    def timer(resolved, fed, precision, engine, size):
        rate = (3.0 if precision == "bf16" else 2.0) * (size if size <= peak[precision] else 1.0)
        return size / rate

    sizes = []
    real = autotune.trajectory

    def trajectory(config, fed, precision, engine, rounds, other_stream=False, size=1):
        sizes.append((precision, engine, size))
        return real(config, fed, precision, engine, 1, other_stream, size)

    monkeypatch.setattr(autotune, "trajectory", trajectory)
    grouped_space["engine"] = ("batched", "bmm_conv")
    report = autotune.autotune({"digits": config}, {"digits": fed}, timer=timer, log=lambda line: None)
    gate = {(g["precision"], g["engine"]): g["size"] for g in report["datasets"]["digits"]["gate"]}
    assert gate == {("bf16", "batched"): 2, ("bf16", "bmm_conv"): 2}  # the two fastest, each at 2
    assert {s for p, e, s in sizes if (p, e) == ("fp32", "batched")} == {1}  # the references, alone

    peak.update(bf16=16)
    sizes.clear()
    report = autotune.autotune({"digits": config}, {"digits": fed}, timer=timer, log=lambda line: None)
    assert {g["size"] for g in report["datasets"]["digits"]["gate"]} == {autotune.PROBE_SIZE}


def test_the_gate_also_judges_the_fastest_fp32_variant_when_the_two_fastest_are_tensor_core_ones(
    digits, grouped_space, monkeypatch
):
    """GPU driver audit W6: only the two fastest candidates were gated; on CIFAR-10 both were tf32/bf16 and
    refused, so the window ran fp32/batched while an fp32 engine variant 2x faster went ungated. Here bf16
    (the two fastest) is refused by construction and fp32/bmm_conv, gated as a third, is chosen."""
    config, fed = digits
    monkeypatch.setattr(autotune, "add_rates", lambda *args: None)

    def timer(resolved, fed, precision, engine, size):  # bf16 3x fp32: its two engines the two fastest
        rate = grouped_rates("fp32", engine, size) * (3.0 if precision == "bf16" else 1.0)
        return size * resolved.n_clients * resolved.batch_size / rate

    real_trajectory, real_compare = autotune.trajectory, autotune.compare

    def trajectory(config, fed, precision, *args, **kwargs):
        return {**real_trajectory(config, fed, precision, *args, **kwargs), "precision": precision}

    def compare(ref, cand):  # a bf16 trajectory far from the reference, an fp32 one as measured
        measures = real_compare(ref, cand)
        return {k: 1e9 for k in measures} if cand.get("precision") == "bf16" else measures

    monkeypatch.setattr(autotune, "trajectory", trajectory)
    monkeypatch.setattr(autotune, "compare", compare)
    tune = autotune.autotune({"digits": config}, {"digits": fed}, timer=timer, log=lambda line: None)
    tune = tune["datasets"]["digits"]
    gated = list(dict.fromkeys((g["precision"], g["engine"]) for g in tune["gate"]))
    # by rate: bf16/bmm_conv 6, bf16/batched 3, bf16/channels_last 2.4, fp32/bmm_conv 2, fp32/batched 1
    assert gated == [("bf16", "bmm_conv"), ("bf16", "batched"), ("fp32", "bmm_conv")]
    assert [g["accepted"] for g in tune["gate"] if g["precision"] == "bf16"] == [False] * 4
    assert tune["chosen"] == {"precision": "fp32", "engine": "bmm_conv"}


def test_a_candidate_that_breaks_the_device_stops_the_autotune_and_one_that_fails_alone_does_not(
    digits, grouped_space, monkeypatch
):
    """A captured engine's sticky CUDA error fails every later kernel of the process: the candidate's
    failure is then `BrokenDevice`, which no candidate's containment swallows, naming the candidate; while the
    device still works after a failure (no compiler, no bf16 kernels) the failure is that candidate's row
    alone and the autotune chooses among the others."""
    config, fed = digits
    works = [True]

    def timer(resolved, fed, precision, engine, size):
        if engine == "bmm_conv":
            works[0] = not broken
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return 0.01 * size

    monkeypatch.setattr(autotune, "device_works", lambda device: works[0])
    broken = False
    report = autotune.autotune({"digits": config}, {"digits": fed}, timer=timer, log=lambda line: None)
    rows = [r for r in report["datasets"]["digits"]["timings"] if r["engine"] == "bmm_conv"]
    assert rows and all(r["error"].startswith("RuntimeError: CUDA error") for r in rows)
    assert report["datasets"]["digits"]["chosen"]["engine"] != "bmm_conv"
    broken = True
    with pytest.raises(autotune.BrokenDevice) as caught:
        autotune.autotune({"digits": config}, {"digits": fed}, timer=timer, log=lambda line: None)
    assert (caught.value.precision, caught.value.engine) == ("fp32", "bmm_conv")
    assert "illegal memory access" in caught.value.error and not isinstance(caught.value, Exception)


def test_the_tuned_code_is_every_module_the_training_step_imports_but_bookkeeping():
    """An earlier autotune is reused while the hash of `TUNED_CODE` is equal, so every module the training
    step imports must be in it (local_training, config, evaluation and names were not: a change to the
    stacked loop reused the old timings and gate verdicts), except the bookkeeping named here, which moves
    neither a timing nor a number."""
    bookkeeping = {"__init__", "paths", "progress", "registry", "results", "safe_io"}
    code = ("import sys, prodigy_core.training, prodigy_core.groups, prodigy_core.local_training; "
            "print(' '.join(m for m in sys.modules if m.startswith('prodigy_core')))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    imported = {m.removeprefix("prodigy_core").lstrip(".") or "__init__" for m in out.stdout.split()}
    tuned = {Path(p).stem for p in autotune.TUNED_CODE if p.startswith("prodigy_core/")}
    assert tuned == imported - bookkeeping
