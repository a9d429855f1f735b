"""Audit 7 (the library's API): one key for 1 and 1.0 whatever declares the float, settings text with lists,
the explorer's cache and a failed download, a notebook's rule registered again, NumPy scalars, labels of a
plug-in path with brackets, the explorer's views and arguments."""

from __future__ import annotations

import json
import math
import textwrap
import urllib.error
import warnings
from pathlib import Path

import numpy as np
import pytest

from prodigy_core import explorer
from prodigy_core.aggregators import RULES, Rule, make_aggregator
from prodigy_core.cli import build_parser, main
from prodigy_core.config import ConfigError, RunConfig, as_row, parse_settings, parse_value
from prodigy_core.registry import label, records_are_data, settings_text, split_label

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "explore_attacks.ipynb"


@pytest.fixture(autouse=True)
def _headless(monkeypatch):
    monkeypatch.setattr(explorer, "show", lambda *figures: None)  # no figure windows from the widget


def key_settings(config: RunConfig, field: str) -> dict:
    """The settings a key hashes, read back from the JSON it hashes (which writes 1 and 1.0 apart)."""
    return json.loads(json.dumps(config.key_fields())).get(field, {})


# ------------------------------------------------------------------- 1: 1 and 1.0, one key by annotation


@pytest.mark.parametrize(
    ("fields", "as_int", "as_float", "shown"),
    [
        ({"attack": "foe"}, {"eps": 1}, {"eps": 1.0}, "foe(eps=1.0)"),  # eps: float, no default
        (
            {"attack": "alie", "variant": "authors"},
            {"z": 1},
            {"z": 1.0},
            "alie(z=1.0)",
        ),  # float | None = None
        ({"attack": "alie_spread"}, {"rhos": [0.5, 1]}, {"rhos": [0.5, 1.0]}, "alie_spread(rhos=[0.5, 1.0])"),
    ],
)
def test_1_a_whole_number_for_a_declared_float_is_one_run(fields, as_int, as_float, shown):
    """An integer became a float only for a float default: FOE's eps (no default), ALIE's z (None) and
    alie_spread's rhos (a tuple of floats) kept 1, so eps=1 and eps=1.0 stored two records and two rows."""
    one, other = RunConfig(attack_params=as_int, **fields), RunConfig(attack_params=as_float, **fields)
    assert one.key() == other.key()
    assert key_settings(one, "attack_params") == as_float  # JSON keeps 1.0 apart from 1: floats hashed
    assert as_row(one.to_dict())["attack"] == as_row(other.to_dict())["attack"] == shown


def test_1_the_default_tuple_written_with_integers_is_the_default_and_an_int_or_float_stays_int(
    tmp_path, monkeypatch
):
    assert RunConfig(attack="alie_spread", attack_params={"rhos": [0.25, 0.5, 1]}).attack_params == {}
    (tmp_path / "either.py").write_text(
        textwrap.dedent("""
        from __future__ import annotations

        from prodigy_core.aggregators import Rule


        class Either(Rule):  # Unknown resolves nowhere: each setting's type is read from its text
            def __init__(
                self, f: int, k: int | float = 2, eps: float | None = None, rhos: tuple[float, ...] = (1.0,),
                scale: float = 1, other: Unknown | None = None,
            ):
                self.f = f

            def aggregate(self, G):
                return G.mean(dim=0)
        """)
    )
    monkeypatch.chdir(tmp_path)
    given = {"k": 1, "eps": 1, "rhos": [1, 2], "scale": 1}  # scale=1 is its default: dropped
    trained = RunConfig(defense="either.py:Either", n_byzantine=1, defense_params=given)
    assert dict(trained.defense_params) == {"eps": 1.0, "k": 1, "rhos": [1.0, 2.0]}
    assert type(trained.defense_params["k"]) is int  # int | float: an integer is an integer there
    with records_are_data():  # a dry run or a report reads the file as text: the same key
        read = RunConfig(defense="either.py:Either", n_byzantine=1, defense_params=given)
    assert read.defense_params == trained.defense_params and read.key() == trained.key()
    assert {type(v) for v in read.defense_params["rhos"]} == {float}


# ------------------------------------------------------------------------ 2: settings text with lists


@pytest.mark.parametrize(
    "settings",
    [
        {"rhos": [0.25, 0.5]},
        {"L": 2, "tau": 5.0},
        {"deviation": "a, b", "rhos": [1.0]},
        {"note": "it's", "rounds": [1, 2], "flag": True, "none": None},
        {"quoted": 'say "x, y"', "bracket": "[x"},
    ],
)
def test_2_settings_text_reads_back_as_the_same_mapping(settings):
    """`settings_text` shows a list as rhos=[0.25, 0.5]; reading it split at every comma and failed with
    a yaml ParserError."""
    text = settings_text(settings)
    assert parse_settings("attack_params", text) == settings, text


def test_2_text_yaml_cannot_read_is_one_config_error_naming_field_and_text(capsys):
    with pytest.raises(ConfigError, match=r"attack_params: rhos='\[0.25, 0.5' cannot be read as a YAML"):
        parse_settings("attack_params", "rhos=[0.25, 0.5")
    with pytest.raises(ConfigError, match=r"record_distances_at='\[1' cannot be read as a YAML value"):
        parse_value("record_distances_at", "[1")
    assert main(["run", "--set", "record_distances_at=[1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "record_distances_at='[1'" in err and "Traceback" not in err


def test_2_the_explorer_trains_a_list_setting_from_its_box():
    box = explorer.explorer(n_clients=6, n_byzantine=2, rounds=1, attack="alie_spread", defense="median")
    assert box.controls["attack"].value == "alie_spread"
    box.controls["attack_params"].value = "rhos=[0.5, 1]"
    ex = box.train()
    assert ex is not None and ex.config.attack_params == {"rhos": [0.5, 1.0]}


# ------------------------------------------------------------------- 3: the cache knows the plug-in's code

SHIFT = """
from prodigy_core.attacks import Attack


class Shift(Attack):
    def __init__(self, by: float = 1.0):
        super().__init__()
        self.by = by

    def send(self, honest, own, server):
        return (honest.mean(dim=0) + {by}).expand(own.shape).clone()
"""


def test_3_an_edited_plugin_is_trained_again_not_shown_from_the_cache(tmp_path, monkeypatch):
    """The cache compared the controls only: after the plug-in's file changed, train() gave the old run."""
    path = tmp_path / "shift.py"
    path.write_text(SHIFT.format(by=1.0))
    calls = []
    real = explorer.explore
    monkeypatch.setattr(explorer, "explore", lambda **kw: calls.append(kw) or real(**kw))
    box = explorer.explorer(n_clients=6, n_byzantine=2, rounds=1, attack=f"{path}:Shift", defense="none")
    first = box.train()
    key = first.config.key()
    assert box.train() is first and len(calls) == 1  # unchanged: shown again
    path.write_text(SHIFT.format(by=100.0))
    second = box.train()
    assert second is not first and len(calls) == 2 and second.config.key() != key
    # under the mean the Byzantine rows move the aggregate by f/N * by per coordinate: 100 times as far
    assert math.isclose(second.damage / first.damage, 100.0, rel_tol=1e-3)


# ------------------------------------------------------------------------ 4: a failed CIFAR-10 download


def test_4_a_failed_download_is_one_line_naming_the_offline_command(tmp_path, monkeypatch, capsys):
    """A URLError (an OSError) escaped the widget's button, which caught FileNotFoundError only."""
    import torchvision.datasets.cifar as cifar

    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(cifar, "download_and_extract_archive", offline)
    folder = tmp_path / "cifar"
    box = explorer.explorer(n_clients=6, n_byzantine=2, rounds=1, attack="sf", defense="median")
    c = box.controls
    c["dataset"].value, c["data_dir"].value, c["download"].value = "cifar10", str(folder), True
    assert box.train() is None
    shown = [line for line in capsys.readouterr().out.splitlines() if "cannot run" in line]
    assert len(shown) == 1 and "downloading CIFAR-10 failed" in shown[0] and "offline?" in shown[0]
    shown = shown[0]
    command = shown.split("`")[1]
    assert command.startswith(f"prodigy-fl data cifar10 {folder} --from ")
    args = build_parser().parse_args(command.split()[1:])  # a command the CLI takes
    assert (args.dataset, args.path, args.source is not None) == ("cifar10", folder, True)
    assert not box.children[1].children[0].disabled  # the button is back


def test_4_the_notebook_cell_says_the_same_line(monkeypatch, capsys):
    """explore_attacks.ipynb's first-setting cell caught FileNotFoundError only."""
    cell = next(
        "".join(c["source"])
        for c in json.loads(NOTEBOOK.read_text())["cells"]
        if c["cell_type"] == "code" and "first = explore(" in "".join(c["source"])
    )

    def offline(**fields):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(explorer, "explore", offline)
    setting = {"dataset": "cifar10", "download": True, "data_dir": None}
    exec(cell, {"n_rounds": 1, "setting": setting, "box": None, "scale": "interactive"})
    out = capsys.readouterr().out
    assert out.startswith("cannot run this setting: downloading CIFAR-10 failed (no network; offline?)")
    assert "`prodigy-fl data cifar10 --from " in out and out.count("\n") == 1
    with pytest.raises(urllib.error.URLError):  # headless (papermill, reproduce): a failure
        exec(cell, {"n_rounds": 1, "setting": setting, "box": None, "scale": "smoke"})


# ------------------------------------------------------------------ 5: a notebook's cell run again


def define(body: str = "mean", name: str = "mine", presets: dict | None = None) -> type:
    """The same class statement each call, as a notebook cell run again defines it (one module, one
    qualified name, a new class)."""

    class Mine(Rule):
        def __init__(self, f: int):
            self.f = f

        def aggregate(self, G):
            return G.mean(dim=0) if body == "mean" else G.max(dim=0).values

    Mine.name, Mine.presets = name, presets or {}
    return Mine


@pytest.fixture
def own_registry(monkeypatch):
    monkeypatch.setattr(RULES, "_entries", dict(RULES._entries))


def test_5_a_cell_run_again_replaces_its_rule_with_a_warning(own_registry):
    import torch

    RULES.register(define("mean", presets={"mine_1": ("Mine 1", {})}))
    with pytest.warns(UserWarning, match=r"defense 'mine': .*Mine from .*test_hostile7 replaced its earlier"):
        edited = RULES.register(define("max"))
    assert RULES.lookup("mine").cls is edited and "mine_1" not in RULES  # the old presets go with it
    G = torch.tensor([[0.0, 1.0], [4.0, -1.0], [2.0, 3.0]])
    assert torch.equal(make_aggregator("mine", 1)(G), torch.tensor([4.0, 3.0]))  # the edit's max, not mean


def test_5_another_class_under_a_taken_name_says_where_it_came_from_and_what_to_do(own_registry):
    RULES.register(define())

    class Other(Rule):
        name = "mine"

        def __init__(self, f: int):
            self.f = f

    taken = (r"'mine' is taken by define.<locals>.Mine, registered earlier in this kernel from "
             r".*test_hostile7: give this class another name, or restart the kernel")  # fmt: skip
    with pytest.raises(ValueError, match=taken):
        RULES.register(Other)
    Other.name = "median"
    with pytest.raises(ValueError, match=r"'median' is taken by the package's Median: give yours another"):
        RULES.register(Other)


def test_5_a_rule_without_f_is_refused_where_it_is_registered(own_registry):
    class NoF(Rule):
        name = "no_f"

        def __init__(self, k: int = 1):
            self.k = k

    with pytest.raises(ValueError, match=r"defense 'no_f': NoF.__init__ takes no f: a rule takes f first"):
        RULES.register(NoF)
    assert "no_f" not in RULES


# ---------------------------------------------------------------------------------- 6: NumPy scalars


def test_6_numpy_scalars_are_the_plain_values_they_hold():
    plain = RunConfig(seed=1, n_clients=10, lr=0.5, download=True, record_distances_at=[1],
                      defense="cclip", defense_params={"L": 2, "tau": 5.0})  # fmt: skip
    numpy = RunConfig(seed=np.int64(1), n_clients=np.int32(10), lr=np.float32(0.5), download=np.bool_(True),
                      record_distances_at=[np.int64(1)], defense="cclip",
                      defense_params={"L": np.int64(2), "tau": np.float64(5)})  # fmt: skip
    assert numpy.key() == plain.key() and numpy.to_dict() == plain.to_dict()
    assert type(numpy.seed) is int and type(numpy.download) is bool and type(numpy.lr) is float
    assert type(numpy.defense_params["L"]) is int and type(numpy.record_distances_at[0]) is int
    assert as_row(numpy.to_dict())["defense"] == "cclip(L=2, tau=5.0)"  # not tau=np.float64(5.0)
    with pytest.raises(ConfigError, match=r"seed=1.5 must be an integer"):
        RunConfig(seed=np.float64(1.5))


# --------------------------------------------------------------------------- 7-10: the smaller ones


def test_7_a_label_of_a_plugin_path_with_brackets_splits_at_its_class(tmp_path):
    folder = tmp_path / "rules (copy)"
    folder.mkdir()
    (folder / "mine.py").write_text(
        "from prodigy_core.aggregators import Rule\n\n\nclass Mine(Rule):\n"
        "    def __init__(self, f: int, tau: float = 1.0):\n        self.f = f\n"
    )
    spec = f"{folder / 'mine.py'}:Mine"
    for name, settings in [(spec, {"tau": 5.0}), (f"nnm+{spec}", {}), ("cclip", {"deviation": "a(b):c"}),
                           ("pkg.mod:Mine", {"x": "y:Z(1)"})]:  # fmt: skip
        assert split_label(label(name, settings)) == (name, settings_text(settings))
    with records_are_data():  # a report of the records: named from its text, with its settings
        assert RULES.display_label(label(spec, {"tau": 5.0})) == "Mine (tau=5.0)"


def test_8_write_exploration_refuses_unknown_views_and_names_the_missing_ones(tmp_path):
    ex = explorer.explore(n_clients=6, n_byzantine=1, rounds=1, attack="sf", defense="median")  # f < 2
    with pytest.raises(
        ValueError, match=r"unknown view\(s\) \['distance'\]; valid: distances, scores, damage"
    ):
        explorer.write_exploration(ex, "x", smoke=True, out_dir=tmp_path, views=["distance"])
    with pytest.warns(UserWarning, match=r"no scores view \(scores: ProDiGy's scores need f >= 2\); saved "
                      r"distances"):  # fmt: skip
        paths = explorer.write_exploration(
            ex, "x", smoke=True, out_dir=tmp_path, views=["distances", "scores"]
        )
    assert sorted(p.name for p in paths) == ["x_distances.pdf", "x_distances.png"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one name as a string; all views (None): those it has, no warning
        assert [p.name for p in explorer.write_exploration(ex, "y", True, tmp_path, views="distances")] == [
            "y_distances.pdf", "y_distances.png"
        ]  # fmt: skip
        assert [p.stem for p in explorer.write_exploration(ex, "z", True, tmp_path)] == ["z_distances"] * 2


def test_9_explore_given_a_mapping_says_what_to_pass():
    with pytest.raises(TypeError, match=r"config must be a RunConfig or None, not dict; give fields as "
                       r"keywords \(explore\(rounds=2\)"):  # fmt: skip
        explorer.explore({"rounds": 2})


def test_10_a_path_object_is_a_data_folder_and_docstrings_show_the_real_labels(tmp_path):
    assert RunConfig(data_dir=tmp_path).data_dir == str(tmp_path)
    assert settings_text({"tau": 5.0, "L": 2}) == "L=2, tau=5.0"
    assert '"L=2, tau=5.0"' in settings_text.__doc__
    real = label("cclip", {"tau": 5.0})
    assert real in as_row.__doc__ and real in label.__doc__
    assert "(tau=5.0)" in explorer.names_with_settings.__doc__
    assert (
        "(tau=5.0)" in explorer.names_with_settings(RunConfig(defense="cclip", defense_params={"tau": 5}))[0]
    )
