"""Runs trained as one batched group (`prodigy_core.groups`) against the same runs alone: float64 digits
runs on a CPU, a few rounds each."""

import pytest
import torch

from prodigy_core import evaluation, groups, local_training, training
from prodigy_core.config import RunConfig
from prodigy_core.data import Federation

# Dirichlet(0.1) digits: clients smaller than the batch, so the stacked step also runs width groups.
# One data split (data_seed) for every seed, so that runs of different seeds share a group.
BASE = dict(dataset="digits", distribution="dirichlet", n_clients=6, n_byzantine=2, rounds=3, local_steps=2,
            batch_size=16, eval_every=2, checkpoint_every=1, device="cpu", engine="batched",
            data_seed=0)  # fmt: skip
CONFIGS = [  # different defenses (CClip's state), attacks (ALIE's search, LF's labels), momentum, seeds, lr
    RunConfig(**BASE, defense="cclip", attack="alie", local_momentum=0.9, seed=0),
    RunConfig(**BASE, defense="prodigy", attack="lf", local_momentum=0.0, seed=1),
    RunConfig(**BASE, defense="nnm+trimmed_mean", attack="sf", local_momentum=0.9, seed=1, lr=0.1),
    RunConfig(**BASE, defense="average", attack="none", local_momentum=0.0, seed=0),
]
STOP = 2  # rounds after which the states are compared (from the checkpoints both paths leave)


@pytest.fixture(autouse=True)
def float64(monkeypatch):
    """Models, data and momentum in float64, so that 1e-10 separates a wrong random number from rounding."""
    normalise = Federation.normalise
    monkeypatch.setattr(Federation, "normalise", lambda self, x: normalise(self, x).double())
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _solo_states(configs, folder):
    for config in configs:
        with training.killed_after(STOP):
            training.run(config, progress=False, checkpoint_dir=folder)
    return {c.key(): torch.load(folder / f"{c.key()}.pt", weights_only=False) for c in configs}


def _group_states(configs, folder):
    with training.killed_after(STOP):
        assert list(groups.iter_group(configs, checkpoint_dir=folder)) == []
    return {c.key(): torch.load(folder / f"{c.key()}.pt", weights_only=False) for c in configs}


def _assert_same_run(a, b, tol=1e-10):
    assert a["round"] == b["round"] == STOP
    for name, value in a["model"].items():
        torch.testing.assert_close(value, b["model"][name], rtol=0, atol=tol, msg=name)
    torch.testing.assert_close(a["momentum"], b["momentum"], rtol=0, atol=tol)
    assert ("batch_stream" in a) == ("batch_stream" in b)  # authors: each run's own epochs and positions
    for name, value in a.get("batch_stream", {}).items():
        assert torch.equal(value, b["batch_stream"][name]), name
    ra, rb = a["result"], b["result"]
    for field in ("accuracy_curve", "zeroed_clients", "rounds_completed", "diverged"):
        assert ra[field] == rb[field], field
    assert ra["final_loss"] == pytest.approx(rb["final_loss"], abs=tol)
    assert ra["attack_params"] == pytest.approx(rb["attack_params"], abs=tol)


def test_group_equals_each_run_alone(tmp_path):
    solo = _solo_states(CONFIGS, tmp_path / "solo")
    group = _group_states(CONFIGS, tmp_path / "group")
    for config in CONFIGS:
        _assert_same_run(group[config.key()], solo[config.key()])
        assert group[config.key()]["result"]["environment"]["group_size"] == len(CONFIGS)


def test_group_composition_and_order_change_no_result(tmp_path):
    whole = _group_states(CONFIGS, tmp_path / "whole")
    other = _group_states([CONFIGS[3], CONFIGS[0]], tmp_path / "other")  # other company, other order
    for config in (CONFIGS[0], CONFIGS[3]):
        _assert_same_run(other[config.key()], whole[config.key()])


def test_killed_group_resumes_to_the_uninterrupted_records(tmp_path):
    configs = CONFIGS[:3]
    reference = groups.run_group(configs)
    with training.killed_after(1):
        partial = list(groups.iter_group(configs, checkpoint_dir=tmp_path))  # "killed"
    assert partial == [] and all((tmp_path / f"{c.key()}.pt").exists() for c in configs)
    resumed = groups.run_group(configs, checkpoint_dir=tmp_path)
    for a, b in zip(resumed, reference, strict=True):
        for field in ("final_accuracy", "final_loss", "accuracy_curve", "attack_params", "zeroed_clients",
                      "rounds_completed", "detection_precision"):  # fmt: skip
            assert getattr(a, field) == getattr(b, field), field
        assert len(a.round_times) == a.rounds_completed == 3
    assert not any(tmp_path.iterdir())  # every checkpoint removed once its run completed


@pytest.mark.filterwarnings("ignore:.*non-finite:RuntimeWarning")
def test_diverging_member_is_frozen_and_the_others_match_their_solo_runs(tmp_path):
    blowup = CONFIGS[3].replace(lr=1e300)  # float64 weights overflow within a round or two
    configs = [CONFIGS[0], blowup, CONFIGS[1]]
    with training.killed_after(STOP):
        order = [i for i, _ in groups.iter_group(configs, checkpoint_dir=tmp_path / "group")]
    assert order == [1]  # the diverged run is reported at once; the others are still training
    diverged = groups.run_group([blowup])[0]
    assert diverged.diverged and diverged.final_loss is None
    assert diverged.final_accuracy == pytest.approx(10.0)  # chance level
    solo = _solo_states([CONFIGS[0], CONFIGS[1]], tmp_path / "solo")
    for config in (CONFIGS[0], CONFIGS[1]):
        group = torch.load(tmp_path / "group" / f"{config.key()}.pt", weights_only=False)
        _assert_same_run(group, solo[config.key()])


AUTHORS = [  # the authors' variant: SF written into the momentum, CClip from theta_t, train-mode evaluation
    RunConfig(**BASE, defense="cclip", attack="sf", local_momentum=0.9, seed=0, variant="authors"),
    RunConfig(**BASE, defense="cclip", attack="alie", local_momentum=0.9, seed=1, variant="authors"),
    RunConfig(**BASE, defense="trimmed_mean", attack="sf", local_momentum=0.0, seed=1, variant="authors"),
]


def test_authors_variant_members_equal_their_solo_runs(tmp_path):
    configs = AUTHORS
    assert len({groups.group_key(c) for c in configs}) == 1
    # a paper run has another split (torch's draw, not numpy's): it goes to another group
    assert groups.group_key(AUTHORS[2].replace(variant="paper")) != groups.group_key(AUTHORS[2])
    solo = _solo_states(configs, tmp_path / "solo")
    group = _group_states(configs, tmp_path / "group")
    for config in configs:
        _assert_same_run(group[config.key()], solo[config.key()])
    # the in-place SF changed the Byzantine rows of the momentum: they are no longer honest momentum
    paper = AUTHORS[0].replace(variant="paper")
    honest = _solo_states([paper], tmp_path / "paper")[paper.key()]["momentum"]
    assert not torch.allclose(group[AUTHORS[0].key()]["momentum"][:2], honest[:2])


def test_authors_members_draw_their_own_batch_streams(tmp_path):
    group = _group_states(AUTHORS, tmp_path / "group")
    states = [group[c.key()]["batch_stream"] for c in AUTHORS]
    # one split, one batch size: after STOP rounds of 2 steps every member is equally far into its epochs
    sizes = [
        len(ix) for ix in training.run_federation(AUTHORS[0].resolved(), torch.device("cpu")).client_indices
    ]
    steps, b = STOP * BASE["local_steps"], BASE["batch_size"]
    for state in states:
        assert state["pos"].tolist() == [((steps - 1) % (n // b) + 1) * b for n in sizes]
    # ... but in epochs of its own: seeds 0 and 1 shuffle differently, and two members of seed 1 alike
    assert not torch.equal(states[0]["perms"], states[1]["perms"])
    assert torch.equal(states[1]["perms"], states[2]["perms"])


def test_authors_member_with_a_too_small_client_fails_alone(tmp_path, monkeypatch):
    # a paper run and an authors run on one split (possible in a group with FEMNIST's natural split; forced
    # here on digits, where the group takes its first member's split): the authors member cannot start
    # (client 0 holds 64 < 100 samples), the other goes on
    paper = RunConfig(**{**BASE, "batch_size": 100}, defense="average", attack="none", seed=0)
    authors = paper.replace(variant="authors")
    fed = training.run_federation(paper.resolved(), torch.device("cpu"))
    assert len(fed.client_indices[0]) == 64
    monkeypatch.setattr(groups, "group_key", lambda config: ("one group",))
    with training.killed_after(STOP):
        outcomes = list(groups.iter_group([paper, authors], checkpoint_dir=tmp_path / "group"))
    assert len(outcomes) == 1 and outcomes[0][0] == 1  # reported before the group's first step
    assert isinstance(outcomes[0][1], local_training.ClientTooSmallError) and "client 0 has 64" in str(
        outcomes[0][1]
    )
    group = torch.load(tmp_path / "group" / f"{paper.key()}.pt", weights_only=False)
    _assert_same_run(group, _solo_states([paper], tmp_path / "solo")[paper.key()])


@pytest.mark.filterwarnings("ignore:.*non-finite:RuntimeWarning")
def test_diverged_authors_member_records_the_class_0_share():
    blowup = AUTHORS[2].replace(lr=1e300)
    grouped = groups.run_group([AUTHORS[0], blowup])[1]
    alone = training.run(blowup, progress=False)
    assert grouped.diverged and alone.diverged and grouped.final_loss is None
    fed = training.run_federation(blowup.resolved(), torch.device("cpu"))
    share = 100.0 * (fed.test_labels == 0).sum().item() / len(fed.test_labels)
    assert grouped.final_accuracy == alone.final_accuracy == pytest.approx(share)


def test_group_key_compares_the_resolved_data_seed():
    implicit = CONFIGS[0].replace(data_seed=None, seed=1)  # data_seed None: the split of seed 1
    assert groups.group_key(implicit) == groups.group_key(CONFIGS[0].replace(data_seed=1))
    assert groups.group_key(implicit) != groups.group_key(implicit.replace(seed=0))


def test_make_groups_stacks_only_compatible_runs():
    other_split = CONFIGS[0].replace(data_seed=1)
    alone = CONFIGS[0].replace(engine="sequential")
    made = groups.make_groups([CONFIGS[0], other_split, CONFIGS[1], alone, CONFIGS[2]], size=2)
    assert made == [[CONFIGS[0], CONFIGS[1]], [other_split], [alone], [CONFIGS[2]]]
    assert groups.make_groups(CONFIGS, size=1) == [[c] for c in CONFIGS]
    with pytest.raises(ValueError, match="cannot share a group"):
        groups.run_group([CONFIGS[0], other_split])


def test_grid_records_are_the_same_batched_or_one_at_a_time(tmp_path):
    from prodigy_core.experiments import experiment_from_spec, run_grid

    base = {k: v for k, v in BASE.items() if k != "engine"} | {"rounds": 2, "eval_every": 1}
    grid = {"defense": ["cclip", "prodigy"], "attack": ["alie", "lf"]}
    experiment = experiment_from_spec({"experiment": "g", "base": base, "grid": grid})
    one = run_grid(experiment, results_dir=tmp_path / "one", progress=False, batch_runs=1)
    batched = run_grid(experiment, results_dir=tmp_path / "batched", progress=False, batch_runs=3)
    assert list(one["key"]) == list(batched["key"]) and len(one) == 4
    assert list(one["final_accuracy"]) == list(batched["final_accuracy"])
    assert list(one["final_loss"]) == pytest.approx(list(batched["final_loss"]), abs=1e-10)


@pytest.mark.parametrize("train_mode", [False, True])
def test_evaluate_runs_gives_each_model_what_its_own_forward_pass_gives(train_mode):
    # The reference is each model's own nn.Module forward (its nn.Dropout replaced by a multiplication with
    # the key's mask for that test batch, nn.BatchNorm in the mode asked), batch after batch, not the
    # functional path under test.
    from prodigy_core.data import load_federation
    from prodigy_core.models import make_model
    from prodigy_core.streams import ClientStreams, dropout_mask

    fed = load_federation("digits", 4, seed=0)
    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        model = make_model("digits")
        with torch.no_grad():  # distinct running statistics in every model
            model.train()(fed.normalise(fed.train_images[seed * 50 : seed * 50 + 40]))
        models.append(model)
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    keys = [100 + i for i in range(3)]
    batched = evaluation.evaluate_runs(models, fed, train_mode, keys, batch_size=128)
    for i, model in enumerate(models):
        for k, v in model.state_dict().items():  # the models' buffers are left as they were
            torch.testing.assert_close(v, before[i][k], rtol=0, atol=0)
        (dropout,) = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
        correct, loss = 0, 0.0
        with torch.no_grad():
            for j, (x, y) in enumerate(fed.test_batches(128)):
                row = ClientStreams.keys([keys[i]], j, 0, x.device)  # layer 0: the model's one dropout
                mask = dropout_mask(row, (len(y), 96), 0.25, x.dtype)[0] if train_mode else 1.0
                hook = dropout.register_forward_hook(lambda _m, inputs, _out, mask=mask: inputs[0] * mask)
                out = model.train(train_mode)(x)
                hook.remove()
                correct += int((out.argmax(dim=1) == y).sum())
                loss += float(torch.nn.functional.cross_entropy(out, y, reduction="sum"))
        model.load_state_dict(before[i])  # train mode moved the reference's running statistics
        total = len(fed.test_labels)
        assert batched[i][0] == pytest.approx(100.0 * correct / total, abs=1e-12)
        assert batched[i][1] == pytest.approx(loss / total, abs=1e-10)
        alone = evaluation.evaluate(model, fed, 128, train_mode, keys[i])
        assert alone == pytest.approx(batched[i], abs=1e-10)
    assert len({round(s[1], 6) for s in batched}) == 3  # three different models, three different losses


def test_group_rounding_benchmark_prints_each_source_of_difference_and_a_group_moves_a_run_least():
    """benchmarks/group_rounding.py (docs/usage.md quotes it): one row per source of difference with the
    gate's measures; a group's rounding moves a run far less (under 1/100) than another stream, the noise
    floor (of which the gate admits twice), in fp32 and bf16."""
    import contextlib
    import io
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import group_rounding

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert group_rounding.main(["--rounds", "1"]) == 0
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in out.getvalue().splitlines()
            if line.startswith("| ") and not line.startswith("| what")}  # fmt: skip
    assert list(rows) == list(group_rounding.PAIRS)
    floor = float(rows["another stream, fp32 (the floor)"][0])
    assert floor > 0
    for group in ("a group of 4, fp32", "a group of 4, bf16"):
        assert float(rows[group][0]) < floor / 100, (group, rows[group][0], floor)
