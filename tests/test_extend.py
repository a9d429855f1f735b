"""Extending the package without editing it: a rule and an attack from files outside the package, run through
`grid` and `report` (real training on digits, 2 rounds); settings (defense_params, attack_params) from params
files and --set; and every result key made before settings existed hashes the same fields."""

import hashlib
import inspect
import json
import tarfile
from pathlib import Path

import pytest
import torch

from prodigy_core import results
from prodigy_core.aggregators import RULES, make_aggregator
from prodigy_core.attacks import ATTACKS, make_attack
from prodigy_core.cli import main, parse_fields
from prodigy_core.config import STREAMS_REVISION, ConfigError, RunConfig, parse_settings
from prodigy_core.experiments import experiment_from_spec, load_experiment

REPO = Path(__file__).resolve().parents[1]

# Keys printed by the code of commit 8c0b1d6, before rules and attacks had settings (FOE's eps lived in its
# name): stored results must keep them.
KEYS_BEFORE_SETTINGS = [
    ({}, "c93c76b619b3e9ca"),
    (dict(dataset="digits", defense="nnm+cclip", attack="foe_0.1", n_clients=10, n_byzantine=3,
          local_steps=10, local_momentum=0.9, rounds=90), "19ae46a2ce4ba68e"),
    (dict(dataset="digits", defense="none", attack="foe_100", rounds=90), "0e303d1c966c0747"),
    (dict(dataset="digits", defense="average", attack="alie", variant="authors"), "c2d1ad71bb5e771e"),
    (dict(dataset="digits", defense="bucketing+krum", attack="sf", n_byzantine=1), "0aba452c8a3accb5"),
    (dict(dataset="digits", defense="NNM+trimmed_mean", attack="LF", distribution="iid"), "839b537214b91dee"),
    (dict(dataset="cifar10", data_source="cifar10-jpeg", defense="prodigy", attack="alie", rounds=1000,
          local_steps=10, local_momentum=0.9), "925202a92fa96ff5"),
    (dict(dataset="digits", defense="prodigy", attack="alie_spread", n_byzantine=3), "b19231e7a12ebba8"),
]  # fmt: skip


def key_before_streams(config: RunConfig, authors_revision: int = 3) -> str:
    """The key as the code before `STREAMS_REVISION` (and `IDLE_REVISION`) hashed the same fields (`authors`:
    at revision 3)."""
    d = config.key_fields()
    assert d.pop("streams_revision") == STREAMS_REVISION
    d.pop("idle_revision", None)
    if "authors_revision" in d:
        d["authors_revision"] = authors_revision
    return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def test_fp32_keeps_every_key_made_before_precision_existed():
    # the default config's fields hash as the code before this field hashed them (before STREAMS_REVISION too)
    assert "precision" not in RunConfig(data_source="digits").key_fields()
    assert key_before_streams(RunConfig(data_source="digits")) == "c93c76b619b3e9ca"
    assert key_before_streams(RunConfig(data_source="digits", precision="fp32")) == "c93c76b619b3e9ca"
    # the committed GPU records: each file is named by its key, the same fields
    with tarfile.open(REPO / "figures" / "gpu" / "results.tar.gz") as tar:
        records = [(Path(m.name).stem, json.load(tar.extractfile(m))) for m in tar.getmembers()
                   if m.isfile() and m.name.startswith("results/") and ".failed" not in m.name]  # fmt: skip
    # the records made before the field (the 2026-11-26 window's); later windows' name their precision
    before = [
        (name, r)
        for name, r in records
        if r["config"]["variant"] == "paper" and "precision" not in r["config"]
    ]
    assert len(before) >= 12  # Table I mini rows, paper variant
    assert all(key_before_streams(RunConfig.from_dict(r["config"])) == name for name, r in before)


@pytest.mark.parametrize("fields, key", KEYS_BEFORE_SETTINGS)
def test_keys_recorded_before_settings_existed_hash_the_same_fields(fields, key):
    assert key_before_streams(RunConfig(**fields)) == key
    assert RunConfig(**fields).key() != key  # the streams changed every run's numbers: a new key


def test_foe_written_with_its_setting_is_the_preset_and_its_old_key():
    old = RunConfig(attack="foe_0.1", rounds=90)
    new = RunConfig(attack="foe", attack_params={"eps": 0.1}, rounds=90)
    assert (new.attack, dict(new.attack_params), new.key()) == ("foe_0.1", {}, old.key())
    assert RunConfig(attack="foe_0.1", attack_params={"eps": 100}).attack == "foe_100"
    other = RunConfig(attack="foe", attack_params={"eps": 1})
    assert other.attack == "foe" and other.key() not in (old.key(), RunConfig(attack="foe_100").key())
    assert make_attack("foe", params={"eps": 1}).eps == 1.0


def test_the_committed_gpu_records_hash_the_fields_of_their_configs():
    with tarfile.open(REPO / "figures" / "gpu" / "results.tar.gz") as tar:
        records = [json.load(tar.extractfile(m)) for m in tar.getmembers() if m.name.endswith(".json")]
    records = [r for r in records if isinstance(r, dict) and "config" in r and "key" in r]
    assert len(records) >= 30
    current = 0
    for r in records:
        if r["config"].get("variant") == "authors":  # older revisions are stored apart on purpose
            continue
        config = RunConfig.from_dict(r["config"])
        if "precision" in r["config"]:  # a window after the precision field and STREAMS_REVISION (2026-11-27)
            assert config.key() == r["key"]
            current += 1
        else:
            assert key_before_streams(config) == r["key"] != config.key()  # made before STREAMS_REVISION
    assert current >= 5  # the 2026-11-27 H200 window's Table II cells


def test_settings_default_values_leave_the_key_alone_and_others_change_it():
    base = RunConfig(defense="nnm+cclip")
    assert RunConfig(defense="nnm+cclip", defense_params={"tau": 10, "L": 3}).key() == base.key()
    changed = RunConfig(defense="nnm+cclip", defense_params={"tau": 5})
    assert changed.key() != base.key() and changed.defense_params == {"tau": 5.0}
    assert RunConfig(defense="nnm+cclip", defense_params={"tau": 5.0}).key() == changed.key()  # 5 is 5.0
    assert make_aggregator("nnm+cclip", 3, params={"tau": 5}).rule.tau == 5
    bucketed = RunConfig(defense="bucketing+krum", n_clients=20, n_byzantine=1, defense_params={"s": 3})
    assert make_aggregator(bucketed.defense, 1, params=bucketed.defense_params).pre[0].s == 3


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"defense": "cclip", "defense_params": {"tua": 5}}, r"defense_params=.*no setting 'tua'.*'tau'"),
        ({"defense": "krum", "defense_params": {"tau": 5}}, r"defense_params=.*no setting 'tau'; it has no"),
        ({"attack": "foe"}, r"attack='foe'.*needs the setting\(s\) eps"),
        ({"attack": "alie", "attack_params": {"z": [1, {}]}}, r"must be a number"),
        ({"defense": "cclip", "defense_params": "tau=5"}, r"defense_params='tau=5' must be a mapping"),
    ],
)
def test_bad_settings_are_named_with_the_fix(fields, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(**fields)


def test_settings_from_the_command_line_and_a_text_box():
    fields = parse_fields(["defense_params.tau=5", "defense_params.L=2", "attack_params={eps: 1}"])
    assert fields == {"defense_params": {"tau": 5, "L": 2}, "attack_params": {"eps": 1}}
    with pytest.raises(ConfigError, match="only defense_params and attack_params take a dotted"):
        parse_fields(["rounds.x=5"])
    assert parse_settings("defense_params", "tau=5, L=2") == {"tau": 5, "L": 2}
    assert parse_settings("defense_params", " ") == {}
    with pytest.raises(ConfigError, match="setting=value pairs"):
        parse_settings("defense_params", "tau 5")


def test_registries_name_display_and_symbol_come_from_the_classes():
    assert RULES.display("none") == "No defense" and RULES.display("cclip", {"tau": 5}) == "CClip (tau=5)"
    assert ATTACKS.display("foe_100") == "FOE ε=100" and ATTACKS.lookup("alie").cls.symbol == "z"
    assert "foe" in ATTACKS and "foe" not in ATTACKS.ready()  # FOE needs its eps; its presets do not


# ------------------------------------------------------------------------------------------- plug-ins

RULE_FILE = '''
import torch
from prodigy_core.aggregators import Rule


class ClosestToMedian(Rule):
    """Mean of the N - 2f vectors closest to the coordinate-wise median."""

    display = "Closest to median"

    def __init__(self, f: int, keep_extra: int = 0):
        self.f, self.keep_extra = f, keep_extra

    def aggregate(self, G):
        far = (G - G.median(dim=0).values).norm(dim=1)
        return G[far.argsort()[: len(G) - 2 * self.f + self.keep_extra]].mean(dim=0)
'''

ATTACK_FILE = '''
from prodigy_core.attacks import Attack


class Shift(Attack):
    """Every Byzantine client sends the honest mean plus a constant."""

    display = "Shift"

    def __init__(self, by: float = 1.0):
        super().__init__()
        self.by = by

    def send(self, honest, own, server):
        return (honest.mean(dim=0) + self.by).expand(own.shape).clone()
'''


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """my_rules.py and my_attacks.py in a folder of their own, the current folder."""
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "my_rules.py").write_text(RULE_FILE)
    (folder / "my_attacks.py").write_text(ATTACK_FILE)
    monkeypatch.chdir(folder)
    return folder


GRID = """
experiment: own_defense
title: "My rule beside ProDiGy"
base: {dataset: digits, n_clients: 10, n_byzantine: 3, rounds: 2, eval_every: 1}
grid:
  defense: [prodigy, "my_rules.py:ClosestToMedian"]
  attack: [none, "my_attacks.py:Shift"]
seeds: [0]
report: {rows: defense, columns: attack}
"""


def test_a_rule_and_an_attack_from_files_outside_the_package_run_through_grid_and_report(plugins, capsys):
    (plugins / "own.yaml").write_text(GRID)
    args = ["--results-dir", str(plugins / "results")]
    assert main(["grid", "own.yaml", "--jobs", "2", *args]) == 0  # pool workers import the files again
    experiment = load_experiment(plugins / "own.yaml")
    df = results.load(experiment, plugins / "results")
    assert len(df) == 4 and df["final_accuracy"].between(0, 100).all()
    record = json.loads(
        (plugins / "results" / "own_defense" / f"{experiment.configs[-1].key()}.json").read_text()
    )
    assert set(record["plugins"]) == {"my_rules.py:ClosestToMedian", "my_attacks.py:Shift"}
    capsys.readouterr()
    assert main(["report", "own.yaml", "--out-dir", str(plugins / "figures"), *args]) == 0
    table = (plugins / "figures" / "own_defense.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| Defense"))
    assert "| Shift |" in header + " " and "| Closest to median |" in table  # the classes' display names


def test_a_plugin_key_follows_its_file_and_settings(plugins):
    config = RunConfig(defense="nnm+my_rules.py:ClosestToMedian", attack="my_attacks.py:Shift")
    assert config.defense == "nnm+my_rules.py:ClosestToMedian"  # case kept: a path and a class name
    with_setting = RunConfig(defense="my_rules.py:ClosestToMedian", defense_params={"keep_extra": 1})
    assert with_setting.key() != RunConfig(defense="my_rules.py:ClosestToMedian").key()
    before = config.key()
    (plugins / "my_rules.py").write_text(RULE_FILE + "\n# edited\n")
    assert config.key() != before  # an edited rule never reads the old one's records
    G = torch.cat([torch.full((2, 3), 1e6), torch.ones(6, 3)])
    assert torch.equal(make_aggregator("my_rules.py:ClosestToMedian", 2)(G), torch.ones(3))


@pytest.mark.parametrize(
    "defense, message",
    [
        ("missing.py:Rule", r"no file missing.py \(looked in"),
        ("my_rules.py:ClosestToMedain", r"has no class 'ClosestToMedain' \(did you mean 'ClosestToMedian'"),
        ("my_attacks.py:Shift", r"Shift must subclass prodigy_core.aggregators.Rule"),
        ("no_such_module:Rule", r"no module 'no_such_module'"),
        ("my_rules.py:", r"a plug-in is written path/to/file.py:ClassName"),
    ],
)
def test_a_broken_plugin_is_named_with_the_fix(plugins, defense, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(defense=defense)


def test_a_plugin_that_fails_to_import_says_so(plugins):
    (plugins / "broken.py").write_text("import no_such_package_here\n")
    with pytest.raises(ConfigError, match="broken.py failed to import: ModuleNotFoundError"):
        RunConfig(defense="broken.py:Rule")


def test_settings_in_a_grid_make_rows_of_their_own(fake_training, tmp_path):
    spec = {"experiment": "taus", "base": {"defense": "nnm+cclip", "rounds": 2},
            "grid": {"defense_params": [{}, {"tau": 5}], "attack": ["alie"]}}  # fmt: skip
    experiment = experiment_from_spec(spec)
    assert [dict(c.defense_params) for c in experiment.configs] == [{}, {"tau": 5.0}]
    from prodigy_core.experiments import run_grid

    df = run_grid(experiment, results_dir=tmp_path, progress=False)
    assert list(df["defense"]) == ["nnm+cclip", "nnm+cclip(tau=5.0)"]  # tau is a float: 5.0
    from prodigy_core.report import display_value

    assert [display_value("defense", d) for d in df["defense"]] == ["NNM+CClip", "NNM+CClip (tau=5.0)"]


def test_a_notebooks_papermill_parameters_carry_settings():
    base = {"dataset": "digits", "rounds": 2, "defense_params": {"tau": 5}}
    grid = {"defense": ["nnm+cclip"], "attack": ["foe", "alie"], "attack_params": [{"eps": 2}]}
    with pytest.raises(ConfigError, match=r"attack_params=\{'eps': 2\}.*'alie' has no setting 'eps'"):
        load_experiment("quickstart_digits", overrides={"base": base, "grid": grid})
    grid = {"defense": ["nnm+cclip"], "attack": ["foe"], "attack_params": [{"eps": 2}, {"eps": 0.1}]}
    experiment = load_experiment("quickstart_digits", overrides={"base": base, "grid": grid})
    assert [(c.attack, dict(c.attack_params), dict(c.defense_params)) for c in experiment.configs] == [
        ("foe", {"eps": 2.0}, {"tau": 5.0}),
        ("foe_0.1", {}, {"tau": 5.0}),
    ]


def test_a_plugin_from_a_module_path(tmp_path, monkeypatch):
    package = tmp_path / "lab_rules"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "rules.py").write_text(RULE_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))  # as an installed package would be
    config = RunConfig(defense="nnm+lab_rules.rules:ClosestToMedian", defense_params={"keep_extra": 1})
    assert config.defense_params == {"keep_extra": 1}
    G = torch.cat([torch.full((2, 3), 1e6), torch.ones(6, 3)])
    pipeline = make_aggregator(config.defense, 2, params=config.defense_params)
    assert pipeline.rule.keep_extra == 1 and torch.equal(pipeline(G), torch.ones(3))
    before = config.key()
    edited = RULE_FILE.replace('display = "Closest to median"', 'display = "Edited"')
    (package / "rules.py").write_text(edited)
    assert config.key() != before  # the module's file is hashed like a .py path...
    assert RULES.display("lab_rules.rules:ClosestToMedian") == "Edited"  # ...and the edited code is what runs


# A report reads records and a params file: it runs no plug-in (the names and keys come from the file's text).
MARKED_RULE = RULE_FILE.replace(
    "import torch\n", "import torch\nfrom pathlib import Path\nPath('imported').write_text('ran')\n", 1
).replace("keep_extra: int = 0", "keep_extra: int = 0, tau: float = 1.0")


def test_a_report_and_a_dry_run_run_no_plugin_yet_name_and_find_its_runs(plugins, capsys):
    (plugins / "my_rules.py").write_text(MARKED_RULE)
    grid = GRID.replace('"my_attacks.py:Shift"', "alie").replace('[prodigy, "my_rules', '["nnm+my_rules')
    (plugins / "own.yaml").write_text(grid)
    # default values, one written as an integer for a float default: the key drops both, as training does
    args = ["--results-dir", str(plugins / "results"), "--set", "defense_params.tau=1",
            "--set", "defense_params.keep_extra=0"]  # fmt: skip
    assert main(["grid", "own.yaml", *args]) == 0
    assert (plugins / "imported").exists()  # training imports it
    (plugins / "imported").unlink()
    capsys.readouterr()
    assert main(["grid", "own.yaml", "--dry-run", *args]) == 0
    assert "2 runs (2 stored, 0 to run)" in capsys.readouterr().out
    assert main(["report", "own.yaml", "--out-dir", str(plugins / "figures"), *args]) == 0
    assert not (plugins / "imported").exists()  # neither the dry run nor the report ran its code
    table = (plugins / "figures" / "own_defense.md").read_text()
    assert "| NNM+Closest to median |" in table  # the class's display, as the imported class names it


def test_a_module_plugin_is_found_without_running_its_packages(tmp_path, monkeypatch):
    """`registry.find_module` locates ``package.sub.module`` as the import system would, but runs neither
    package's ``__init__`` (importlib.util.find_spec imports them) nor the module: reading records that name
    such a plug-in runs no code."""
    import importlib.util
    import sys

    from prodigy_core.registry import plugin_file, plugin_source, records_are_data

    package = tmp_path / "marked_pkg"
    (package / "sub").mkdir(parents=True)
    for folder in (package, package / "sub"):  # each package's import leaves a file named after it
        (folder / "__init__.py").write_text(
            f"from pathlib import Path\nPath({str(tmp_path)!r}, 'ran-{folder.name}').write_text('x')\n"
        )
    (package / "sub" / "rules.py").write_text(MARKED_RULE)  # its import writes ./imported
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    spec = "marked_pkg.sub.rules:ClosestToMedian"
    try:
        with records_are_data():
            assert plugin_file(spec) == (package / "sub" / "rules.py").resolve()
            assert plugin_source(spec).display == "Closest to median"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["marked_pkg"]  # nothing ran
        for bad, words in [("marked_pkg.nope:X", "no module 'marked_pkg.nope'"),
                           ("marked_pkg.sub.rules.deeper:X", "no module 'marked_pkg.sub.rules.deeper'"),
                           (".relative:X", "cannot find module '.relative'")]:  # fmt: skip
            with pytest.raises(ValueError, match=words):
                plugin_file(bad)
        # the import system's own answer (it imports both packages: the reference, so last)
        reference = importlib.util.find_spec("marked_pkg.sub.rules").origin
        assert Path(reference).resolve() == plugin_file(spec)
        assert {p.name for p in tmp_path.iterdir()} == {"marked_pkg", "ran-marked_pkg", "ran-sub"}
    finally:
        for name in [n for n in sys.modules if n.startswith("marked_pkg")]:
            del sys.modules[name]


SOURCES = """
import math
from prodigy_core.aggregators import Rule, TrimmedMean
import prodigy_core.aggregators as agg


class Plain(Rule):
    def __init__(self, f, a=1, /, b: float = 2.5, c=(0.25, 0.5), *, d="x", e, g=None, h=-3, generator=None):
        self.f = f


class Shown(agg.Rule):
    display = "A name"
    display: str = "The last one"

    def __init__(self, f: int, tau=math.inf, items=[1, 2], name="n" * 3):
        self.f = f


class Empty(Rule):
    display = ""


class Computed(Rule):
    display = "Computed".upper()


class Inherits(TrimmedMean):
    pass


class Clash(Rule):
    display = "ProDiGy"
"""


def test_a_plugins_text_says_what_its_import_finds(plugins):
    from prodigy_core.registry import NOT_LITERAL, plugin_source, records_are_data, settings_of
    from prodigy_core.report import display_value

    (plugins / "sources.py").write_text(SOURCES)
    for name in ("Plain", "Shown", "Empty", "Computed", "Inherits", "Clash"):
        spec = f"sources.py:{name}"
        source = plugin_source(spec, "defense")
        imported = display_value("defense", spec)  # the import's name for it
        with records_are_data():
            read = display_value("defense", spec)
        assert read == (imported if source.display is not None else spec), name  # as imported, or its spec
        if source.settings is None:
            continue
        cls = RULES.lookup(spec).cls
        real = settings_of(cls)
        assert set(source.settings) == set(real), name  # the same names (a as positional-only: none)
        for key, value in source.settings.items():
            assert value is NOT_LITERAL or value == real[key] and type(value) is type(real[key]), (name, key)
    sources = {n: plugin_source(f"sources.py:{n}", "defense") for n in ("Plain", "Shown", "Inherits")}
    assert sources["Plain"].display == "Plain" and sources["Plain"].settings["e"] is inspect.Parameter.empty
    assert sources["Shown"].display == "The last one" and sources["Shown"].settings["tau"] is NOT_LITERAL
    assert sources["Shown"].settings["name"] is NOT_LITERAL and sources["Shown"].settings["items"] == [1, 2]
    # a built-in base: only the import knows its name and settings
    assert sources["Inherits"] == (None, None, None)
    assert plugin_source("sources.py:Missing", "defense") == (None, None, None)
    assert plugin_source("gone.py:X", "defense") == (None, None, None)
