"""RunConfig: field checks, did-you-mean, resolved defaults and the result key."""

import pytest

from prodigy_core.config import (
    DEFAULT_WEIGHT_DECAY,
    IDLE_REVISION,
    ConfigError,
    RunConfig,
    idle_moves_numbers,
    parse_value,
)


def test_defaults_are_a_valid_run():
    cfg = RunConfig()
    assert cfg.dataset == "digits" and cfg.n_byzantine < cfg.n_clients / 2


def test_unknown_field_suggests_the_close_name():
    with pytest.raises(ConfigError, match=r"unknown field 'n_byzantines'.*did you mean 'n_byzantine'"):
        RunConfig.from_dict({"n_byzantines": 2}, source="my.yaml")


def test_error_names_the_source_file():
    with pytest.raises(ConfigError, match=r"my\.yaml: n_byzantine=5 with n_clients=10"):
        RunConfig.from_dict({"n_byzantine": 5, "n_clients": 10}, source="my.yaml")


@pytest.mark.parametrize(
    "changes, pattern",
    [
        ({"rounds": "10"}, r"rounds='10' must be an integer, not str"),
        ({"rounds": 2.5}, r"rounds=2.5 must be an integer, not float"),
        ({"download": 1}, r"download=1 must be true or false, not int"),
        ({"dataset": "mnist"}, r"dataset='mnist' is unknown; valid: digits, femnist, cifar10"),
        ({"dataset": "femnist", "distribution": "iid"}, r"distribution='iid' is not available"),
        ({"dirichlet_alpha": 0.0}, r"dirichlet_alpha=0.0 must be > 0"),
        ({"local_momentum": 1.0}, r"local_momentum=1.0 must be in \[0, 1\)"),
        ({"defense": "prodigy", "n_byzantine": 1}, r"defense='prodigy'"),
        ({"defense": "krumm"}, r"defense='krumm'"),
        ({"attack": "alie", "n_byzantine": 0, "defense": "average"}, r"n_byzantine=0"),
        ({"record_distances_at": [1, "x"]}, r"record_distances_at=.* must be a list of integers"),
    ],
)
def test_bad_values_are_rejected_with_the_field_named(changes, pattern):
    with pytest.raises(ConfigError, match=pattern):
        RunConfig.from_dict(changes)


def test_resolved_fills_dependent_defaults():
    cfg = RunConfig(dataset="digits", rounds=30).resolved()
    assert cfg.lr_decay_at == 21  # the text: gamma_t = lr for t <= 2T/3 = 20 (0-indexed t)
    assert cfg.weight_decay == DEFAULT_WEIGHT_DECAY["digits"]
    assert RunConfig(rounds=30, lr_decay_at=5).resolved().lr_decay_at == 5


def test_lr_schedule_steps_down_at_two_thirds():
    cfg = RunConfig(rounds=30, lr=0.05, lr_decay_factor=0.1)
    assert cfg.lr_at(0) == cfg.lr_at(20) == 0.05  # t <= 2T/3 = 20
    assert cfg.lr_at(21) == pytest.approx(0.005)


def test_key_ignores_fields_that_do_not_change_results():
    base = RunConfig()
    assert base.key() == RunConfig().key()
    assert base.key() == base.replace(device="cpu", engine="sequential", checkpoint_every=7).key()
    # an explicit value equal to the resolved default is the same run
    assert base.key() == base.replace(lr_decay_at=2 * base.rounds // 3 + 1).key()
    assert base.key() == base.replace(lr=0.05).key() == base.replace(lr_decay_factor=0.1).key()
    iid = base.replace(distribution="iid")
    assert iid.key() == iid.replace(dirichlet_alpha=5.0).key()


@pytest.mark.parametrize(
    "changes",
    [{"seed": 1}, {"data_seed": 1}, {"rounds": 99}, {"attack": "alie"}, {"defense": "nnm+krum"},
     {"local_momentum": 0.9}, {"dirichlet_alpha": 0.5}, {"lr": 0.1}, {"eval_every": 5},
     {"variant": "authors"}],
)  # fmt: skip
def test_key_changes_with_every_result_field(changes):
    assert RunConfig().key() != RunConfig().replace(**changes).key()


def test_replace_keeps_the_settings_of_the_same_defense_or_attack_however_spelled_and_drops_another_s():
    """replace(defense="CClip") on a cclip with tau = 5 dropped tau (back to its default 10: another run)."""
    cclip = RunConfig(defense="cclip", defense_params={"tau": 5}, attack="foe", attack_params={"eps": 5})
    for same in ("CClip", " cclip "):
        assert cclip.replace(defense=same) == cclip
    assert cclip.replace(attack="FOE") == cclip
    assert dict(cclip.replace(defense="nnm+cclip").defense_params) == {}  # another rule: its own settings
    assert dict(cclip.replace(attack="alie").attack_params) == {}
    assert dict(cclip.replace(defense="CClip", defense_params={"tau": 3}).defense_params) == {"tau": 3.0}


def test_keys_changed_with_the_per_seed_split_so_old_records_are_never_reused():
    # keys computed by the code before `variant` and `data_seed: null` (every seed's split was data_seed=0)
    old = {"default": "bfb2c7c14ba1e310", "seed=1, data_seed=1": "86c46ca27a7f0f12",
           "seed=1, data_seed=0": "d86199b234ed397c"}  # fmt: skip
    new = {RunConfig().key(), RunConfig(seed=1).key(), RunConfig(seed=1, data_seed=0).key()}
    assert not new & set(old.values())


def test_int_and_float_spellings_give_one_key():
    assert RunConfig(lr=1).key() == RunConfig(lr=1.0).key()


def test_parse_value_reads_yaml_scalars():
    assert parse_value("rounds", "12") == 12
    assert parse_value("local_momentum", "0.9") == 0.9
    assert parse_value("download", "true") is True
    assert parse_value("record_distances_at", "[1, 5]") == [1, 5]
    assert parse_value("defense", "nnm+krum") == "nnm+krum"
    with pytest.raises(ConfigError, match="did you mean 'rounds'"):
        parse_value("round", "3")


@pytest.mark.parametrize(
    ("fields", "moves"),
    [
        (dict(attack="alie"), True),  # ALIE reads only the honest updates; digits' model has BatchNorm
        (dict(attack="foe_100"), True),
        (dict(attack="mimic"), True),
        (dict(attack="none"), False),  # every client trains
        (dict(attack="sf"), False),  # SF sends minus their own honest momentum
        (dict(attack="lf"), False),  # LF's Byzantine clients train on flipped labels
        (dict(attack="alie", variant="authors"), False),  # the authors' ALIE may send the honest update
        (dict(attack="foe_0.1", variant="authors"), False),  # train-mode evaluation: no server buffers read
        (dict(attack="alie", dataset="femnist", distribution="natural"), False),  # no BatchNorm
    ],
)
def test_idle_revision_is_in_the_key_of_exactly_the_runs_whose_numbers_it_moved(fields, moves):
    """`IDLE_REVISION` (idle Byzantine clients report the server's BatchNorm buffers) renews the key of a run
    only where it changes the numbers, so that no record of the training before is read as current and no
    other record is thrown away."""
    config = RunConfig(**{"n_clients": 10, "n_byzantine": 3, **fields})
    assert ("idle_revision" in config.key_fields()) == moves
    if moves:
        assert config.key_fields()["idle_revision"] == IDLE_REVISION


def test_a_plug_in_attack_gets_the_idle_revision_without_being_imported():
    """Whether a plug-in's ``send`` reads its own updates is in its class, which a key never imports
    (records are data), so a plug-in attack on a BatchNorm model always carries the revision."""
    assert idle_moves_numbers(dict(variant="paper", n_byzantine=3, attack="no_such_file.py:Attack",
                                   dataset="digits"))  # fmt: skip
    assert not idle_moves_numbers(dict(variant="paper", n_byzantine=3, attack="no_such_file.py:Attack",
                                       dataset="femnist"))  # fmt: skip
