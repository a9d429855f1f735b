"""Params files, grid expansion, run keys, the smoke profile and the grid executor (with a fake training run
where the behaviour under test is the store, the real one where it is the executor)."""

import csv
import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from prodigy_core import experiments, results
from prodigy_core.config import ConfigError, RunConfig, field_names
from prodigy_core.experiments import (
    PARAMS_DIR,
    SMOKE_MAX_RUNS,
    SMOKE_ROUNDS,
    experiment_from_spec,
    load_experiment,
    mini_profile,
    run_grid,
    smoke_profile,
)

PAPER_CSV = Path(__file__).resolve().parents[1] / "prodigy_core" / "data" / "paper_results.csv"
PAPER_FILES = {
    "table1_cifar10": "bigtable",
    "table2_femnist_n20": "femnist_n20",
    "table3_femnist_n100": "femnist_n100",
    "table4_fraction_byzantine": "fraction_byzantine",
    "table5_n_clients": "n_clients",
}
ALL_FILES = [*PAPER_FILES, "figure1_pairwise_distances", "quickstart_digits"]
PAPER_DEFENSES = ["none", "nnm+median", "nnm+trimmed_mean", "nnm+geomed", "nnm+krum", "nnm+cclip", "prodigy"]
PAPER_ATTACKS = ["none", "alie", "foe_0.1", "foe_100", "lf", "sf"]


def paper_rows(table: str) -> list[dict]:
    with open(PAPER_CSV) as fh:
        return [r for r in csv.DictReader(fh) if r["table"] == table]


def paper_cell(row: dict) -> tuple:
    """A paper cell in RunConfig terms: 'noniid' is Dirichlet(alpha) for CIFAR-10, per-writer for FEMNIST."""
    distribution = row["distribution"]
    if distribution == "noniid":
        distribution = "natural" if row["dataset"] == "femnist" else "dirichlet"
    alpha = float(row["dirichlet_alpha"]) if distribution == "dirichlet" else None
    assert {"fedsgd": 1, "fedavg": 10}[row["algorithm"]] == int(row["local_steps"])
    return (row["dataset"], distribution, alpha, int(row["n_clients"]), int(row["n_byzantine"]),
            float(row["local_momentum"]), int(row["local_steps"]), int(row["rounds"]), row["defense"],
            row["attack"])  # fmt: skip


def config_cell(c: RunConfig) -> tuple:
    alpha = c.dirichlet_alpha if c.distribution == "dirichlet" else None
    return (c.dataset, c.distribution, alpha, c.n_clients, c.n_byzantine, c.local_momentum, c.local_steps,
            c.rounds, c.defense, c.attack)  # fmt: skip


def write_yaml(tmp_path: Path, text: str, name: str = "exp.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------------- params files


@pytest.mark.parametrize("name, table", PAPER_FILES.items())
def test_paper_params_file_has_exactly_the_paper_cells(name, table):
    experiment = load_experiment(name)
    assert experiment.paper_table == table
    cells = [paper_cell(r) for r in paper_rows(table)]
    assert len(set(cells)) == len(cells)
    by_cell: dict[tuple, list[int]] = {}
    for c in experiment.configs:
        by_cell.setdefault(config_cell(c), []).append(c.seed)
    assert set(by_cell) == set(cells)  # every paper cell is run, and nothing else
    seeds = {tuple(sorted(s)) for s in by_cell.values()}
    assert seeds == {(0,)} if table == "bigtable" else seeds == {(0, 1, 2)}


def test_paper_scale_is_about_870_runs():
    counts = {name: len(load_experiment(name).configs) for name in PAPER_FILES}
    expected = {name: len(paper_rows(t)) * (1 if t == "bigtable" else 3) for name, t in PAPER_FILES.items()}
    assert counts == expected
    assert sum(counts.values()) == 336 + 3 * (84 + 35 + 36 + 24)


def test_figure1_and_quickstart_settings():
    (fig,) = load_experiment("figure1_pairwise_distances").configs
    assert (fig.dataset, fig.distribution, fig.dirichlet_alpha, fig.n_clients, fig.n_byzantine) == (
        "cifar10", "dirichlet", 0.1, 10, 3,
    )  # fmt: skip
    assert (fig.defense, fig.attack, fig.local_steps, fig.record_distances_at) == (
        "prodigy",
        "sf",
        10,
        (100,),
    )
    assert fig.rounds >= 100
    quick = load_experiment("quickstart_digits")
    assert {(c.dataset, c.distribution, c.n_clients, c.n_byzantine) for c in quick.configs} == {
        ("digits", "dirichlet", 10, 3)
    }
    assert sorted((c.defense, c.attack) for c in quick.configs) == sorted(
        (d, a) for d in PAPER_DEFENSES for a in PAPER_ATTACKS
    )


def test_quickstart_is_table1_noniid_fedavg_momentum_with_rounds_past_convergence():
    quick = load_experiment("quickstart_digits")
    settings = {(c.local_steps, c.local_momentum, c.lr_decay_at) for c in quick.configs}
    assert settings == {(10, 0.9, None)}  # FedAVG E=10, beta=0.9, the paper's lr drop at 2/3 of the rounds
    # the committed convergence curve: the first round from which 3 consecutive evaluations are within 1 point
    # of the final accuracy must come before the learning-rate drop (2/3 of the rounds)
    with open(PAPER_CSV.parents[2] / "figures" / "quickstart_convergence.csv") as fh:
        curve = [(int(r["round"]), float(r["test_accuracy_percent"])) for r in csv.DictReader(fh)]
    final = curve[-1][1]
    converged = next(
        curve[i][0] for i in range(len(curve) - 2) if all(abs(a - final) <= 1 for _, a in curve[i : i + 3])
    )
    (rounds,) = {c.rounds for c in quick.configs}
    assert converged <= quick.configs[0].resolved().lr_decay_at < rounds


@pytest.mark.parametrize("name", ALL_FILES)
def test_every_params_file_has_a_valid_report_layout(name):
    experiment = load_experiment(name)
    assert experiment.name == name and experiment.title
    layout = experiment.report
    for key in ("rows", "columns"):
        if key in layout:
            assert layout[key] in field_names()
    # the layout's fields together with the seed identify every run of a table
    if "rows" in layout:
        fields = [layout["rows"], layout["columns"], *layout.get("blocks", []), "seed"]
        assert len({tuple(getattr(c, f) for f in fields) for c in experiment.configs}) == len(
            experiment.configs
        )


def test_load_by_name_or_path_is_the_same():
    by_name = load_experiment("quickstart_digits")
    by_path = load_experiment(PARAMS_DIR / "quickstart_digits.yaml")
    assert [c.key() for c in by_name.configs] == [c.key() for c in by_path.configs]
    with pytest.raises(FileNotFoundError, match="quickstart_digits"):
        load_experiment("quickstart_digit")


# ------------------------------------------------------------------------------------------- grid and keys


def test_grid_is_the_cartesian_product_times_seeds(tmp_path):
    path = write_yaml(tmp_path, """
experiment: g
base: {rounds: 5}
grid: {defense: [prodigy, nnm+median], attack: [alie, sf, lf]}
seeds: [0, 7]
""")  # fmt: skip
    experiment = load_experiment(path)
    got = [(c.defense, c.attack, c.seed) for c in experiment.configs]
    expected = [(d, a, s) for d in ("prodigy", "nnm+median") for a in ("alie", "sf", "lf") for s in (0, 7)]
    assert sorted(got) == sorted(expected) and len(got) == 12
    assert all(c.rounds == 5 for c in experiment.configs)


def test_list_of_grids_is_the_union_without_duplicates(tmp_path):
    path = write_yaml(tmp_path, """
experiment: u
grid:
  - {n_clients: [10], n_byzantine: [2, 3], attack: [alie]}
  - {n_clients: [10, 20], n_byzantine: [3], attack: [alie]}
""")  # fmt: skip
    got = sorted((c.n_clients, c.n_byzantine) for c in load_experiment(path).configs)
    assert got == [(10, 2), (10, 3), (20, 3)]  # (10, 3) is in both products, run once


def test_same_config_same_key_and_any_result_field_changes_it():
    base = RunConfig(dataset="digits", distribution="dirichlet", defense="prodigy", attack="alie")
    assert base.key() == RunConfig.from_dict(base.to_dict()).key()
    changed = {
        "dataset": "cifar10", "distribution": "iid", "dirichlet_alpha": 0.5, "n_clients": 12,
        "n_byzantine": 2, "local_momentum": 0.9, "local_steps": 10, "rounds": 99, "defense": "nnm+krum",
        "attack": "sf", "lr": 0.1,
        "lr_decay_at": 7, "lr_decay_factor": 0.5, "weight_decay": 0.1, "batch_size": 32, "eval_every": 5,
        "seed": 1, "data_seed": 1, "record_distances_at": [3], "variant": "authors",
        "femnist_min_writer_samples": 5,  # only matters for femnist: checked below
        "data_source": "cifar10-jpeg",  # a source of cifar10 only: checked below
        "defense_params": {"tau": 5}, "attack_params": {"eps": 1},  # settings of CClip and FOE: below
        "precision": "bf16",
    }  # fmt: skip
    non_result = set(RunConfig.NON_RESULT_FIELDS)
    assert set(changed) | non_result == set(field_names())
    for name, value in changed.items():
        if name == "femnist_min_writer_samples":
            femnist = base.replace(dataset="femnist", distribution="natural")
            assert femnist.replace(femnist_min_writer_samples=value).key() != femnist.key()
        elif name in ("defense_params", "attack_params"):
            owner = base.replace(defense="cclip", attack="foe_100")
            assert owner.replace(**{name: value}).key() != owner.key(), name
        elif name == "data_source":
            binary = base.replace(dataset="cifar10", data_source="cifar10-binary")
            assert binary.replace(data_source=value).key() != binary.key()
        else:
            other = base.replace(**{name: value})
            assert other.key() != base.key(), name
    for name, value in {"checkpoint_every": 7, "device": "cpu", "engine": "sequential", "data_dir": "/x",
                        "download": True}.items():  # fmt: skip
        assert base.replace(**{name: value}).key() == base.key(), name


def test_keys_in_the_grid_are_distinct_per_run():
    experiment = load_experiment("table1_cifar10")
    assert len({c.key() for c in experiment.configs}) == len(experiment.configs)


def test_a_mapping_override_merges_into_the_files_so_the_rest_of_the_setting_stays():
    """A notebook's `-y "base: {rounds: 50}"` replaced Table II's whole base: its 252 runs were built on
    digits, N=10, f=3, E=1 under the title "Table II: FEMNIST, N=20, f=6" (a notebook audit, helper 50)."""
    paper = load_experiment("table2_femnist_n20").configs
    changed = load_experiment("table2_femnist_n20", overrides={"base": {"rounds": 50}}).configs
    assert len(changed) == len(paper) == 252
    assert [c.replace(rounds=50) for c in paper] == changed  # only the rounds moved
    one = load_experiment("table2_femnist_n20", overrides={"grid": {"attack": ["alie"]}}).configs
    assert {(c.defense, c.attack) for c in one} == {(c.defense, "alie") for c in paper}  # the other axes kept


@pytest.mark.parametrize(
    "key, value, holds",
    [("seeds", "[0, 1]", "a list of seeds"), ("base", "{rounds: 50}", "a mapping of run fields")],
)
def test_an_override_given_as_text_is_named_with_papermills_y(key, value, holds):
    """papermill's `-p seeds "[0, 1]"` arrives as text, and was reported four frames deep as the params
    file's mistake: "table2_femnist_n20.yaml: seeds='[0, 1]' must be a non-empty list of integers"."""
    given = rf"^{key}='{re.escape(value)}' \(a notebook parameter or override\) is text"
    where = rf"where table2_femnist_n20.yaml's {key} is {holds}"
    with pytest.raises(ConfigError, match=rf"{given} {where}: give it as YAML, with papermill -y \"{key}: "):
        load_experiment("table2_femnist_n20", overrides={key: value})


def test_overrides_replace_top_level_keys_and_fields_pin_an_axis():
    experiment = load_experiment("quickstart_digits", overrides={"seeds": [3, 4], "base": None})
    assert {c.seed for c in experiment.configs} == {3, 4} and len(experiment.configs) == 84
    assert {c.n_clients for c in experiment.configs} == {10}  # base=None keeps the file's base
    assert {c.seed for c in load_experiment("table2_femnist_n20", fields={"seed": 5}).configs} == {5}
    pinned = load_experiment("quickstart_digits", fields={"attack": "alie", "rounds": 2})
    assert sorted(c.defense for c in pinned.configs) == sorted(PAPER_DEFENSES)
    assert {(c.attack, c.rounds) for c in pinned.configs} == {("alie", 2)}


# ------------------------------------------------------------------------------------------- validation


X = "experiment: x\n"


@pytest.mark.parametrize(
    "text, pattern",
    [
        (X + "base: {n_cleints: 10}", r"exp\.yaml: base\.n_cleints .*did you mean 'n_clients'"),
        (X + "grid: {atack: [alie]}", r"exp\.yaml: grid\.atack .*did you mean 'attack'"),
        (X + "grids: {attack: [alie]}", r"exp\.yaml: unknown key 'grids'.*did you mean 'grid'"),
        (X + "base: {rounds: ten}", r"exp\.yaml: base\.rounds='ten'.*must be an integer"),
        (X + "grid: {local_steps: [1, 2.5]}", r"exp\.yaml: grid\.local_steps=2\.5.*must be an integer"),
        (X + "base: {n_clients: 10, n_byzantine: 5}", r"exp\.yaml: base\.n_byzantine=5.*N/2"),
        (X + "grid: {n_byzantine: [3, 6]}", r"exp\.yaml: grid\.n_byzantine=6.*n_clients=10"),
        (
            X + "base: {n_byzantine: 1}\ngrid: {defense: [median, prodigy]}",
            r"exp\.yaml: grid\.defense='prodigy'",
        ),
        (X + "grid: {defense: prodigy}", r"exp\.yaml: grid\.defense='prodigy' must be a non-empty list"),
        (X + "seeds: 0", r"exp\.yaml: seeds=0 must be a non-empty list"),
        (X + "grid: {seed: [1, 2]}", r"exp\.yaml: grid\.seed: list the seeds in"),
        (X + "base: {seed: 1}\nseeds: [0, 1]", r"exp\.yaml: base\.seed=1 and seeds=\[0, 1\]"),
        (X + "report: {rows: defence}", r"exp\.yaml: report\.rows='defence'.*did you mean 'defense'"),
        (X + "report: {colums: attack}", r"exp\.yaml: report: unknown key 'colums'.*'columns'"),
        ("experiment: 'a b'\n", r"exp\.yaml: experiment='a b' must be a folder name"),
        ("- 1\n- 2\n", r"exp\.yaml: expected a mapping"),
    ],
)
def test_invalid_params_name_the_file_key_and_value(tmp_path, text, pattern):
    path = write_yaml(tmp_path, text)
    with pytest.raises(ConfigError, match=pattern):
        load_experiment(path)


def test_prodigy_with_one_byzantine_is_rejected_with_the_limit():
    with pytest.raises(ConfigError, match=r"spec: base\.defense='prodigy'.*f"):
        experiment_from_spec(
            {"experiment": "x", "base": {"defense": "prodigy", "n_byzantine": 1}}, source="spec"
        )


def test_validation_comes_before_any_run_is_built():
    # ParamsSpec.parse checks the mapping alone; RunConfig's own checks are the expansion's (expand_params)
    spec = {"experiment": "x", "base": {"defense": "prodigy", "n_byzantine": 1}, "seeds": [0, 1],
            "grid": [{"attack": ["alie"]}, {"attack": ["alie", "sf"]}]}  # fmt: skip
    params = experiments.ParamsSpec.parse(spec, source="spec", fields={"rounds": 3})
    assert params.seeds == (0, 1) and params.base["rounds"] == 3 and len(params.grids) == 2
    assert [label for label, _ in params.grids] == ["grid[0]", "grid[1]"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.seeds = (0,)  # type: ignore[misc]
    with pytest.raises(ConfigError, match=r"spec: base\.defense='prodigy'"):
        experiments.expand_params(params)
    fine = experiments.ParamsSpec.parse({**spec, "base": {"n_byzantine": 2}}, source="spec")
    expanded = experiments.expand_params(fine)  # the two mappings' products share (alie, 0) and (alie, 1)
    assert [(c.attack, c.seed) for c in expanded.configs] == [("alie", 0), ("alie", 1), ("sf", 0), ("sf", 1)]
    assert expanded.configs == experiment_from_spec({**spec, "base": {"n_byzantine": 2}}).configs


# ------------------------------------------------------------------------------------------- smoke profile


@pytest.mark.parametrize("name", ALL_FILES)
def test_smoke_profile_is_small_fast_valid_and_labelled(name):
    full = load_experiment(name)
    smoke = load_experiment(name, smoke=True)
    assert smoke.smoke and smoke.results_name == f"{name}-smoke" and "SMOKE" in smoke.title
    assert 1 <= len(smoke.configs) <= SMOKE_MAX_RUNS
    assert all(
        c.rounds <= SMOKE_ROUNDS and c.local_steps <= 2 and c.dataset != "cifar10" for c in smoke.configs
    )
    assert {c.seed for c in smoke.configs} == {full.configs[0].seed}
    assert all(r <= c.rounds for c in smoke.configs for r in c.record_distances_at)
    if full.configs[0].dataset == "digits":
        assert smoke.stand_in is None and all(smoke.stand_in_for(c) is None for c in smoke.configs)
    else:
        real = full.configs[0].dataset
        assert real in smoke.stand_in.lower() and all(
            real in smoke.stand_in_for(c).lower() for c in smoke.configs
        )
    full_cells = {(c.defense, c.attack) for c in full.configs}
    assert {(c.defense, c.attack) for c in smoke.configs} <= full_cells
    assert smoke_profile(smoke) is smoke


def test_smoke_rule_on_the_paper_tables():
    def cells(name):
        return sorted((c.defense, c.attack) for c in load_experiment(name, smoke=True).configs)

    representative = sorted((d, a) for d in ("none", "nnm+trimmed_mean", "prodigy") for a in ("alie", "sf"))
    assert cells("table1_cifar10") == representative  # 42 defense x attack cells: the representative subset
    assert cells("quickstart_digits") == representative
    table4 = load_experiment("table4_fraction_byzantine", smoke=True)
    assert len(table4.configs) == 12 and {(c.n_clients, c.n_byzantine) for c in table4.configs} == {(10, 2)}
    table5 = load_experiment("table5_n_clients", smoke=True)
    assert {(c.n_clients, c.n_byzantine) for c in table5.configs} == {(10, 2)}  # first block
    (fig,) = load_experiment("figure1_pairwise_distances", smoke=True).configs
    assert fig.record_distances_at == (SMOKE_ROUNDS,) and fig.dataset == "digits"


def test_smoke_femnist_uses_the_leaf_subset_with_f_scaled(femnist_dir):
    for name, f in (("table2_femnist_n20", 3), ("table3_femnist_n100", 3)):
        smoke = load_experiment(name, smoke=True)
        assert {(c.dataset, c.n_clients, c.n_byzantine) for c in smoke.configs} == {("femnist", 10, f)}
        assert "FEMNIST" in smoke.stand_in and "stand-in" in smoke.stand_in


def test_smoke_femnist_without_the_subset_falls_back_to_digits(monkeypatch):
    monkeypatch.setattr("prodigy_core.data.default_femnist_dir", lambda *args: None)
    smoke = load_experiment("table2_femnist_n20", smoke=True)
    assert {c.dataset for c in smoke.configs} == {"digits"}
    assert smoke.stand_in == "digits (offline stand-in for femnist)"


def test_smoke_cifar10_runs_on_real_cifar10_when_this_machine_has_it(tmp_path, monkeypatch, jpeg_folder):
    from test_data import digest12

    from prodigy_core.data import decode_cifar10_jpeg

    monkeypatch.setenv("PRODIGY_DATA_DIR", str(tmp_path / "data"))
    path = decode_cifar10_jpeg(jpeg_folder(tmp_path / "jpeg", 1), per_class=1, progress=False)
    smoke = load_experiment("table1_cifar10", smoke=True)
    assert {c.dataset for c in smoke.configs} == {"cifar10"} and smoke.stand_in is None
    # the copy decoded here, in part (1 train / 1 test image a class), named by its arrays' digest by hand
    (source,) = {c.resolved().data_source for c in smoke.configs}
    assert source == f"cifar10-jpeg-first-1-1-{digest12(path)}"
    on_digits = load_experiment("table1_cifar10", smoke=True, fields={"data_dir": str(tmp_path / "none")})
    assert {c.dataset for c in on_digits.configs} == {"digits"}  # no CIFAR-10 there: the stand-in


def test_smoke_femnist_prefers_the_24_writer_folder(femnist24_dir, monkeypatch):
    monkeypatch.delenv("PRODIGY_FEMNIST_DIR", raising=False)
    smoke = load_experiment("table2_femnist_n20", smoke=True)
    assert {(c.dataset, c.data_dir, c.femnist_min_writer_samples) for c in smoke.configs} == {
        ("femnist", str(femnist24_dir), 350)
    }


def test_a_grid_needing_more_writers_than_the_folder_has_fails_before_any_run(femnist24_dir, tmp_path):
    experiment = load_experiment("table3_femnist_n100", fields={"data_dir": str(femnist24_dir)})
    with pytest.raises(ValueError) as info:
        run_grid(experiment, results_dir=tmp_path, progress=False)
    message = str(info.value)
    assert "24 of its 24 writers have >= 350 samples (train + test), need n_clients=100" in message
    assert "preprocess.sh -s niid --sf 1.0 -k 350 -t sample" in message
    assert not (tmp_path / "table3_femnist_n100").exists() or not list(
        (tmp_path / "table3_femnist_n100").glob("*.json")
    )


# ------------------------------------------------------------------------------------------- mini profile

# What the mini scale may change in a run; every other field is the paper's.
MINI_CHANGES = {"rounds", "seed", "eval_every", "lr_decay_at", "record_distances_at"}


@pytest.mark.parametrize("name", ALL_FILES)
def test_mini_profile_changes_only_rounds_and_seeds(name):
    paper = load_experiment(name)
    mini = load_experiment(name, scale="mini")
    assert mini.scale == "mini" and mini.results_name == f"{name}-mini" and "MINI" in mini.title
    # the mini rounds as the params file writes them (read here with yaml, not through the code under test)
    rounds = yaml.safe_load((PARAMS_DIR / f"{name}.yaml").read_text())["mini"]["rounds"]
    first_seed = paper.configs[0].seed
    expected = {}
    for c in paper.configs:
        if c.seed == first_seed:
            r = rounds[c.rounds] if isinstance(rounds, dict) else rounds
            expected[tuple((k, v) for k, v in c.to_dict().items() if k not in MINI_CHANGES)] = (c, r)
    assert len(mini.configs) == len(expected)  # one seed: one mini run per paper grid point
    for m in mini.configs:
        fixed = tuple((k, v) for k, v in m.to_dict().items() if k not in MINI_CHANGES)
        original, r = expected.pop(fixed)  # N, f, E, beta, split, defense, attack, lr...: the paper's
        assert (m.rounds, m.seed) == (r, first_seed) and r <= original.rounds
        decay, paper_decay = m.resolved().lr_decay_at, original.resolved().lr_decay_at
        if original.lr_decay_at is None:  # the default schedule: the decay of a run of r rounds
            assert decay == original.replace(rounds=r).resolved().lr_decay_at
        elif paper_decay >= original.rounds:  # an explicit decay after the run (Figure 1): none in mini
            assert decay >= r
        else:  # an explicit decay within the run: at the same fraction of the rounds
            assert abs(decay / r - paper_decay / original.rounds) <= 1 / r
        assert all(1 <= t <= r for t in m.record_distances_at) and m.eval_every <= r
    assert not expected


@pytest.mark.parametrize("name, table", PAPER_FILES.items())
def test_mini_has_one_run_per_paper_cell(name, table):
    cells = {paper_cell(r)[:7] + paper_cell(r)[8:] for r in paper_rows(table)}  # the cell without rounds
    mini = load_experiment(name, scale="mini").configs
    assert sorted(config_cell(c)[:7] + config_cell(c)[8:] for c in mini) == sorted(cells)


def test_mini_scales_an_explicit_decay_and_recorded_round(tmp_path):
    path = write_yaml(tmp_path, """
experiment: m
base: {dataset: digits, rounds: 90, lr_decay_at: 45, record_distances_at: [30, 90], eval_every: 50}
seeds: [4, 5]
mini: {rounds: 30}
""")  # fmt: skip
    (c,) = load_experiment(path, scale="mini").configs
    assert (c.rounds, c.lr_decay_at, c.record_distances_at, c.eval_every, c.seed) == (30, 15, (10, 30), 30, 4)


@pytest.mark.parametrize("mini, pattern", [
    (None, r"no mini scale: add a `mini` section"),
    ("{rounds: 0}", r"mini.rounds=0 must be a positive integer"),
    ("{round: 3}", r"mini: unknown key 'round' \(did you mean 'rounds'\?\)"),
    ("{rounds: {1000: 30}}", r"gives no mini rounds for the paper's \[90\]"),
    ("{rounds: 100}", r"more rounds than the paper's"),
])  # fmt: skip
def test_bad_mini_sections_are_clear_errors(tmp_path, mini, pattern):
    text = "experiment: m\nbase: {dataset: digits, rounds: 90}\n" + (f"mini: {mini}\n" if mini else "")
    with pytest.raises(ConfigError, match=pattern):
        load_experiment(write_yaml(tmp_path, text), scale="mini")


def test_scales_are_checked_and_profiles_do_not_stack():
    with pytest.raises(ValueError, match="valid: smoke, mini, paper"):
        load_experiment("quickstart_digits", scale="tiny")
    with pytest.raises(ValueError, match="give one of them"):
        load_experiment("quickstart_digits", smoke=True, scale="mini")
    mini = load_experiment("quickstart_digits", scale="mini")
    assert mini_profile(mini) is mini
    with pytest.raises(ValueError, match="no mini scale"):
        mini_profile(load_experiment("quickstart_digits", smoke=True))


# ------------------------------------------------------------------------------------------- executor + store


def fake_execute(task, threads=None):
    """Stands in for training: a record whose accuracy is a known function of the config."""
    config = RunConfig.from_dict(task.config)
    if config.attack == "lf":
        raise RuntimeError("boom")
    calls.append(config.key())
    accuracy = 10.0 * PAPER_DEFENSES.index(config.defense) + PAPER_ATTACKS.index(config.attack) + config.seed
    return {"config": task.config, "final_accuracy": accuracy, "final_loss": 1.0, "accuracy_curve": [],
            "environment": {"device": "cpu"}, "stand_in": task.stand_in}  # fmt: skip


def fake_group(tasks):
    """Stands in for a batched group: each run's fake record, as the group would stream them."""
    group_sizes.append(len(tasks))
    for task in tasks:
        key = RunConfig.from_dict(task.config).key()
        try:
            yield key, fake_execute(task)
        except RuntimeError as e:
            yield key, e


calls: list[str] = []
group_sizes: list[int] = []


@pytest.fixture
def fake_training(monkeypatch):
    calls.clear()
    group_sizes.clear()
    monkeypatch.setattr(experiments, "execute", fake_execute)
    monkeypatch.setattr(experiments, "_group_outcomes", fake_group)
    return calls


def small_grid(tmp_path: Path) -> experiments.Experiment:
    path = write_yaml(tmp_path, """
experiment: small
base: {dataset: cifar10, n_clients: 10, n_byzantine: 3, rounds: 50, engine: batched}
grid: {defense: [none, prodigy], attack: [alie, sf, lf]}
seeds: [0, 1]
report: {rows: defense, columns: attack}
""")  # fmt: skip
    return load_experiment(path, smoke=True)


def test_run_grid_stores_skips_finished_and_records_failures(tmp_path, fake_training):
    experiment = small_grid(tmp_path)
    assert len(experiment.configs) == 6  # smoke: seed 0 only
    df = run_grid(experiment, results_dir=tmp_path / "res", progress=False, batch_runs=6)
    assert group_sizes == [6]  # digits stand-ins, batch_runs=6: one batched group
    folder = tmp_path / "res" / "small-smoke"
    ok = [c for c in experiment.configs if c.attack != "lf"]
    assert sorted(calls) == sorted(c.key() for c in ok)
    assert sorted(p.name for p in folder.glob("*.json")) == sorted(
        [f"{c.key()}.json" for c in ok]
        + [f"{c.key()}.failed.json" for c in experiment.configs if c.attack == "lf"]
    )
    assert not list(folder.glob("*.lock")) and not list(folder.glob("*.tmp"))
    assert len(df) == 4 and set(df["stand_in"]) == {"digits (offline stand-in for cifar10)"}
    for _, row in df.iterrows():
        expected = 10.0 * PAPER_DEFENSES.index(row["defense"]) + PAPER_ATTACKS.index(row["attack"])
        assert row["final_accuracy"] == expected and row["status"] == "done" and row["rounds"] == SMOKE_ROUNDS
    failed = results.load(experiment, tmp_path / "res", include_failed=True)
    assert sorted(failed.loc[failed["status"] == "failed", "error"]) == ["RuntimeError: boom"] * 2

    before = {p.name: p.stat().st_mtime_ns for p in folder.glob("*.json")}
    calls.clear()
    run_grid(experiment, results_dir=tmp_path / "res", progress=False)
    assert calls == []  # nothing finished is redone (the two failed runs are retried, and fail again)
    for name, mtime in before.items():
        if not name.endswith(".failed.json"):
            assert (folder / name).stat().st_mtime_ns == mtime
    run_grid(experiment, results_dir=tmp_path / "res", progress=False, force=True)
    assert sorted(calls) == sorted(c.key() for c in ok)


def test_a_run_claimed_by_another_live_process_is_left_alone(tmp_path, fake_training):
    experiment = small_grid(tmp_path)
    folder = tmp_path / "res" / "small-smoke"
    other = results.Claims(folder)
    busy = experiment.configs[0]
    assert other.claim(busy.key())
    df = run_grid(experiment, results_dir=tmp_path / "res", progress=False)
    assert busy.key() not in calls and busy.key() not in set(df["key"])
    other.release(busy.key())
    run_grid(experiment, results_dir=tmp_path / "res", progress=False)
    assert calls.count(busy.key()) == 1


def test_a_grid_removes_a_finished_runs_dead_lock_and_leaves_a_live_ones(tmp_path, fake_training):
    # A kill between a record's write and its lock's release leaves the finished run's lock: no claim comes
    # to take it over, so the next grid removes it (the claimant is dead); a live claimant's lock stays.
    experiment = small_grid(tmp_path)
    run_grid(experiment, results_dir=tmp_path / "res", progress=False)
    folder = tmp_path / "res" / "small-smoke"
    done = [c.key() for c in experiment.configs if c.attack != "lf"]  # the fake fails the LF runs
    assert not list(folder.glob("*.lock"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    for key, pid in ((done[0], dead.pid), (done[1], os.getppid())):
        (folder / f"{key}.lock").write_text(json.dumps({"pid": pid, "host": host, "started": time.time()}))
    calls.clear()
    run_grid(experiment, results_dir=tmp_path / "res", progress=False)
    assert {p.stem for p in folder.glob("*.lock")} == {done[1]}
    assert not set(calls) & set(done)  # nothing finished is redone


def test_batch_runs_auto_trains_one_run_at_a_time_on_a_cpu(tmp_path, fake_training):
    experiment = small_grid(tmp_path)  # digits stand-ins on the CPU: stacking would only be slower there
    run_grid(experiment, results_dir=tmp_path / "res", progress=False)
    assert group_sizes == [] and len(calls) == 4  # every run alone (the fake fails the 2 LF runs early)


def test_jobs_auto_is_one_single_threaded_process_per_core_on_a_cpu(tmp_path, monkeypatch):
    import torch

    from prodigy_core import seeding

    configs = small_grid(tmp_path).configs
    monkeypatch.setattr(experiments.os, "cpu_count", lambda: 16)
    assert experiments.auto_jobs(configs, 3) == (3, 1)  # at most one process per work item
    assert experiments.auto_jobs(configs, 40) == (16, 1)
    monkeypatch.setattr(seeding, "resolve_device", lambda device: torch.device("cuda"))
    assert experiments.auto_jobs(configs, 40) == (1, None)  # a GPU: one process, its groups fill the card


def test_jobs_auto_trains_every_run_with_one_thread(tmp_path):
    experiment = experiment_from_spec({
        "experiment": "auto", "base": {"dataset": "digits", "n_clients": 5, "n_byzantine": 2, "rounds": 1,
                                       "local_steps": 1, "device": "cpu"},
        "grid": {"attack": ["alie", "sf"]}})  # fmt: skip
    df = run_grid(experiment, jobs="auto", results_dir=tmp_path, progress=False)
    folder = tmp_path / "auto"
    threads = [
        json.loads((folder / f"{key}.json").read_text())["environment"]["threads"] for key in df["key"]
    ]
    assert threads == [1, 1]


def test_jobs_auto_trains_a_lone_run_in_this_process_with_one_thread(tmp_path):
    import torch

    experiment = experiment_from_spec({
        "experiment": "lone", "base": {"dataset": "digits", "n_clients": 5, "n_byzantine": 2, "rounds": 1,
                                       "local_steps": 1, "device": "cpu", "attack": "sf"}})  # fmt: skip
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # this process as a 2-core machine starts it
    try:
        assert experiments.plan_grid(experiment, "local", "auto", False, tmp_path, "auto").jobs == 1
        df = run_grid(experiment, jobs="auto", results_dir=tmp_path, progress=False)
        assert torch.get_num_threads() == 2  # restored after the run
    finally:
        torch.set_num_threads(before)
    record = json.loads((tmp_path / "lone" / f"{df['key'][0]}.json").read_text())
    assert record["environment"]["threads"] == 1  # as a pool worker would: the help's promise
    assert record["environment"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_executor_and_jobs_are_checked(tmp_path):
    experiment = small_grid(tmp_path)
    with pytest.raises(ValueError, match="executor='slurm' is unknown; valid: local, ray"):
        run_grid(experiment, executor="slurm", results_dir=tmp_path)
    with pytest.raises(ValueError, match="jobs=0"):
        run_grid(experiment, jobs=0, results_dir=tmp_path)
    with pytest.raises(ValueError, match="jobs='all' must be 'auto' or an integer"):
        run_grid(experiment, jobs="all", results_dir=tmp_path)


def test_a_misspelt_defense_in_a_grid_keeps_its_list_of_valid_names_whole():
    """The text between two quoted values ("'prodigy'?); valid: ... [grid point: defense='", over 200
    characters) was cut as if it were one long value: "valid: average, none, median, trimme...' (416
    characters)prodigi'" (helper 50)."""
    from prodigy_core.aggregators import aggregator_names
    from prodigy_core.config import shorten_quoted

    with pytest.raises(ConfigError) as e:
        load_experiment("quickstart_digits", overrides={"grid": {"defense": ["prodigi"]}})
    message = str(e.value)
    assert "characters)" not in message and f"valid: {', '.join(aggregator_names())} [grid point" in message
    long = "x" * 300
    assert shorten_quoted(f"name='{long}': the file's '{long}'") == (
        f"name='{long[:40]}...' (300 characters): the file's '{long[:40]}...' (300 characters)"
    )
