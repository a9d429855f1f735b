"""The GPU window's autotune and gate (benchmarks/autotune.py), the paper profile's plan and its group sizing
(benchmarks/gpu_run.py), on the CPU."""

import argparse
import sys
from pathlib import Path

import pytest

from prodigy_core import training
from prodigy_core.experiments import load_experiment
from prodigy_core.seeding import resolve_device

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import autotune  # noqa: E402


@pytest.fixture(scope="module")
def digits():
    config = load_experiment("quickstart_digits", scale="smoke").configs[0]
    config = config.replace(device="cpu", distribution="iid", engine="batched")
    return config, training._load_federation(config.resolved(), resolve_device("cpu"))


def fake_timer(resolved, fed, precision, engine, size):
    """bf16 ten times faster than fp32, whatever this CPU measures: the candidate the gate must judge."""
    return (0.1 if precision == "bf16" else 1.0) * size


@pytest.mark.parametrize("scale", [1.0, 0.0])
def test_the_fastest_candidate_is_chosen_only_if_it_passes_the_gate(digits, scale):
    """Default tolerances: bf16 passes on digits (measured: 1.6-1.9% parameter difference, equal attack
    parameters and zeroed clients) and, ten times faster, is chosen. Tolerances of 0: any rounding difference
    fails it, and the reference is chosen although slower."""
    config, fed = digits
    tolerances = {name: bound * scale for name, bound in autotune.TOLERANCES.items()}
    report = autotune.autotune({"digits": config}, {"digits": fed}, tolerances=tolerances, timer=fake_timer,
                               log=lambda line: None)  # fmt: skip
    tune = report["datasets"]["digits"]
    verdicts = {g["defense"]: g for g in tune["gate"]}
    assert set(verdicts) == set(autotune.GATE_DEFENSES)
    for gate in verdicts.values():
        assert gate["precision"] == "bf16" and gate["measures"]["param_rel"] > 0  # not bitwise fp32
        within = all(gate["measures"][k] <= v for k, v in tolerances.items())
        assert gate["accepted"] is within
    assert tune["chosen"] == {"precision": "bf16" if scale else "fp32", "engine": "batched"}
    assert tune["step_s"] == {1: (0.1 if scale else 1.0), 2: (0.2 if scale else 2.0)}  # the chosen's rates


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
def test_a_group_sized_from_the_rates_fits_the_time_left(gpu_run, seconds_left):
    step_s = {1: 0.010, 4: 0.025, 8: 0.045, 16: 0.090}  # one local step of R stacked runs
    server_s, local_steps, rounds, margin = 0.02, 10, 800, 1.5
    size, estimate = gpu_run.size_group(step_s, server_s, local_steps, rounds, 42, seconds_left, 16, margin)

    def by_hand(r):  # the smallest measured group of at least r bounds a group of r
        upper = min(s for s in step_s if s >= r)
        return margin * rounds * (local_steps * step_s[upper] + r * server_s)

    fitting = [r for r in range(1, 17) if by_hand(r) <= seconds_left]
    if not fitting:  # 1.5 * 800 * (0.1 + 0.02) = 144 s for one run
        assert seconds_left < 144 and size == 0 and estimate == pytest.approx(by_hand(1))
        return
    assert size in fitting and estimate == pytest.approx(by_hand(size)) and estimate <= seconds_left
    assert all(size / by_hand(size) >= r / by_hand(r) for r in fitting)  # the most run-rounds per second


def test_the_group_never_outgrows_the_runs_left_or_the_cap(gpu_run):
    step_s = {1: 0.01, 16: 0.02}
    assert gpu_run.size_group(step_s, 0.0, 1, 10, 3, 10**6, 16)[0] == 3
    assert gpu_run.size_group(step_s, 0.0, 1, 10, 40, 10**6, 5)[0] == 5


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
