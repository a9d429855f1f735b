"""Hostile round 4 (issue 42): the Flower strategy under hostile replies, config validation, groups and the
CLI. Each test is named after the finding it pins (report, GPU driver: test_hostile4_report.py)."""

import math

import pytest
import torch
from test_flower import reply_from

from prodigy_core import local_training
from prodigy_core.aggregators import make_aggregator

needs_flower = pytest.mark.usefixtures("flower_extra")  # skips without the flower extra; fails under CI

# ------------------------------------------------------------------------ the Flower strategy's aggregation
N, F, GAMMA = 10, 3, 0.05
# a small server model: two parameters and two BatchNorm statistics (its buffers)
SHAPES = {"w": (2, 3), "bn.running_mean": (4,), "b": (2,), "bn.num_batches_tracked": ()}
PARAMS = ("w", "b")  # the parameters, in the server model's order
D = 8


@pytest.fixture
def flower(monkeypatch, flower_extra):
    """Flower's records and message classes, with the identity a ServerApp sets before it makes messages."""
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, name, 1, raising=False)
    import flwr.app

    return flwr.app


def _theta() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    theta = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items() if k != "bn.num_batches_tracked"}
    return {**theta, "bn.num_batches_tracked": torch.tensor(5)}


def _honest_rows(n: int = N) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(2)) * 0.1 + 1.0


def _reply(flower, k, update=None, buffers=None, row=None, cid=None, node=None):
    """Client k's reply from node `node` (default 100 + k): `update` (default: `row` cut into w and b),
    `buffers` (default: none sent), partition-id `cid` (default k)."""
    if update is None:
        update = {"w": row[:6].reshape(2, 3), "b": row[6:]}
    content = {
        "arrays": flower.ArrayRecord(update),
        "metrics": flower.MetricRecord({"partition-id": k if cid is None else cid, "num-examples": 10}),
    }
    if buffers is not None:
        content["buffers"] = flower.ArrayRecord(buffers)
    return reply_from(100 + k if node is None else node, flower.RecordDict(content))


def _strategy(flower, defense="prodigy", n=N, f=F, theta=None, **kwargs):
    import types

    from prodigy_core.flower import RobustStrategy

    strategy = RobustStrategy(defense, f, n, lambda t: GAMMA, **kwargs)
    grid = types.SimpleNamespace(get_node_ids=lambda: list(range(100, 100 + n)))
    theta = _theta() if theta is None else theta
    list(strategy.configure_train(1, flower.ArrayRecord(theta), flower.ConfigRecord(), grid))
    return strategy, grid


def _expected(theta, G, defense="prodigy", n=N, f=F) -> torch.Tensor:
    """theta's parameters after the server step with make_aggregator's rule on the rows G (independent of
    the strategy)."""
    start = torch.cat([theta[k].reshape(-1) for k in PARAMS])
    return start - GAMMA * make_aggregator(defense, f, n)(G)


def _params(arrays) -> torch.Tensor:
    out = arrays.to_torch_state_dict()
    return torch.cat([out[k].reshape(-1) for k in PARAMS])


@needs_flower
@pytest.mark.parametrize("defense", ["prodigy", "median", "nnm+trimmed_mean"])
def test_42_1_a_nan_reply_is_a_byzantine_row_and_the_model_moves(flower, defense):
    """Attack none (a deployed server): replies with a NaN, an Inf and a float64 1e300 (inf once cast) are
    Byzantine rows; the model moves as the rule moves it on those rows, in round 1 and again in round 2."""
    theta = _theta()
    strategy, grid = _strategy(flower, defense, theta=theta)
    for server_round in (1, 2):
        if server_round == 2:
            list(strategy.configure_train(2, flower.ArrayRecord(theta), flower.ConfigRecord(), grid))
        G = _honest_rows()
        replies = [_reply(flower, k, row=G[k]) for k in range(3, N)]
        nan, inf = G[0].clone(), G[1].clone()
        nan[2], inf[5] = math.nan, math.inf
        replies += [_reply(flower, 0, row=nan), _reply(flower, 1, row=inf)]
        huge = torch.full((2,), 1e300, dtype=torch.float64)  # beyond float32's range
        replies.append(_reply(flower, 2, {"w": G[2, :6].reshape(2, 3).double(), "b": huge}))
        arrays, metrics = strategy.aggregate_train(server_round, replies)
        G_seen = G.clone()
        G_seen[0, 2], G_seen[1, 5], G_seen[2, 6:] = math.nan, math.inf, math.inf
        expected = _expected(theta, G_seen, defense)
        assert torch.isfinite(expected).all()
        assert torch.equal(_params(arrays), expected)
        assert metrics["non-finite"] == [0, 1, 2]
        assert strategy.diverged_at is None
        theta = arrays.to_torch_state_dict()


@needs_flower
def test_42_2_buffer_reports_are_robustly_aggregated_and_bad_ones_dropped(flower):
    """A NaN report, a wrong-shape report and a missing one are left out of the buffer's median (counted);
    an extra buffer name in the lowest-id reply is ignored; too few reports keep the server's buffer."""
    theta = _theta()
    strategy, _ = _strategy(flower, theta=theta)
    G = _honest_rows()
    reports = torch.randn(N, 4, generator=torch.Generator().manual_seed(3))
    replies = []
    for k in range(N):
        buffers = {"bn.running_mean": reports[k].clone(), "bn.num_batches_tracked": torch.tensor(6)}
        if k == 0:
            buffers["bn.extra"] = torch.zeros(3)  # a name the server's model does not have
        if k == 1:
            buffers["bn.running_mean"][0] = math.nan
        if k == 2:
            buffers["bn.running_mean"] = torch.zeros(5)
        replies.append(_reply(flower, k, row=G[k], buffers=None if k == 3 else buffers))
    arrays, metrics = strategy.aggregate_train(1, replies)
    out = arrays.to_torch_state_dict()
    assert set(out) == set(theta)
    assert torch.equal(out["bn.running_mean"], torch.quantile(reports[[0, *range(4, N)]], 0.5, dim=0))
    assert int(out["bn.num_batches_tracked"]) == 6
    assert metrics["dropped-buffers"] == 4  # k=1, 2 and 3 for running_mean, k=3 for num_batches_tracked

    # only a minority reports: the server keeps its buffers
    strategy, _ = _strategy(flower, theta=theta)
    replies = [
        _reply(flower, k, row=G[k], buffers={"bn.running_mean": torch.full((4,), 1e6)} if k < F else None)
        for k in range(N)
    ]
    out = strategy.aggregate_train(1, replies)[0].to_torch_state_dict()
    assert torch.equal(out["bn.running_mean"], theta["bn.running_mean"])


@needs_flower
def test_42_3_the_parameter_set_comes_from_the_servers_model(flower):
    """The lowest-id reply sends one of the two parameters and another an empty record: both are dropped,
    and every parameter of the server's model moves by the rule on the other rows."""
    theta = _theta()
    strategy, _ = _strategy(flower, theta=theta)
    G = _honest_rows()
    replies = [_reply(flower, 0, {"w": G[0, :6].reshape(2, 3)}), _reply(flower, 1, {})]
    replies += [_reply(flower, k, row=G[k]) for k in range(2, N)]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert torch.equal(_params(arrays), _expected(theta, G[2:]))
    assert metrics["dropped"] == 2 and metrics["clients"] == N - 2


@needs_flower
def test_42_6_flower_clients_train_in_the_runs_precision(flower, monkeypatch):
    """A bf16 run's Flower client takes its local steps under bfloat16 autocast (as `training.run`)."""
    from prodigy_core import flower as fl
    from prodigy_core.config import RunConfig
    from prodigy_core.models import make_model

    seen = []
    real = fl.local_steps_sequential

    def spy(*args, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16)
        return real(*args, **kwargs)

    monkeypatch.setattr(fl, "local_steps_sequential", spy)
    config = RunConfig(
        dataset="digits", n_clients=4, n_byzantine=1, rounds=2, defense="median", precision="bf16"
    )
    app = fl.client_app([config], [[]])
    model = make_model("digits")
    content = flower.RecordDict({
        "arrays": flower.ArrayRecord(model.state_dict()),
        "config": flower.ConfigRecord({"run": 0, "lr": 0.05, "server-round": 1}),
    })  # fmt: skip
    msg = flower.Message(content, dst_node_id=0, message_type=flower.MessageType.TRAIN)
    context = flower.Context(1, 1, {"partition-id": 0}, flower.RecordDict(), {})
    reply = app(msg, context)
    assert seen == [True]
    assert set(reply.content["arrays"]) == {n for n, _ in model.named_parameters()}


@needs_flower
def test_42_11_a_reply_of_the_wrong_size_or_missing_a_tensor_is_dropped_and_counted(flower):
    """A reply whose w has another shape, and one without b: dropped, counted; the round goes on."""
    theta = _theta()
    strategy, _ = _strategy(flower, theta=theta)
    G = _honest_rows()
    replies = [_reply(flower, 0, {"w": torch.zeros(7), "b": G[0, 6:]}), _reply(flower, 1, {"w": G[1, :6]})]
    replies += [_reply(flower, k, row=G[k]) for k in range(2, N)]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert torch.equal(_params(arrays), _expected(theta, G[2:]))
    assert metrics["dropped"] == 2


@needs_flower
def test_42_12_fewer_replies_than_the_rule_needs_skip_the_round_and_keep_the_model(flower):
    """N=5, f=2 and 3 replies: the round is skipped (no arrays: Flower keeps the model; ``skipped`` in its
    metrics), nothing raises, and the next round with 5 replies moves the model."""
    theta = _theta()
    strategy, grid = _strategy(flower, n=5, f=2, theta=theta)
    G = _honest_rows(5)
    arrays, metrics = strategy.aggregate_train(1, [_reply(flower, k, row=G[k]) for k in range(3)])
    assert arrays is None and metrics["skipped"] == 1
    arrays, metrics = strategy.aggregate_train(1, [])
    assert arrays is None and metrics["skipped"] == 1
    list(strategy.configure_train(2, flower.ArrayRecord(theta), flower.ConfigRecord(), grid))
    arrays, metrics = strategy.aggregate_train(2, [_reply(flower, k, row=G[k]) for k in range(5)])
    assert torch.equal(_params(arrays), _expected(theta, G, n=5, f=2)) and "skipped" not in metrics


@needs_flower
def test_42_13_an_id_is_a_label_one_row_a_node_and_a_non_integer_id_drops_the_reply(flower, caplog):
    """Rows are the replying nodes', not the claimed ids': a second node claiming id 4 gets a row of its own
    (ordered by (id, node): before node 104's, as its node id is lower), listed in ``repeated-ids`` and a
    warning; a node's second reply and a reply whose id is a list are dropped (counted); nothing raises."""
    theta = _theta()
    strategy, _ = _strategy(flower, theta=theta)
    G = _honest_rows()
    replies = [_reply(flower, k, row=G[k]) for k in range(2, N)]
    replies += [_reply(flower, 4, row=G[0] * 1e3, node=50), _reply(flower, 1, row=G[1], cid=[1, 2])]
    replies.append(_reply(flower, 3, row=G[0] * -1e3))  # node 103 again
    arrays, metrics = strategy.aggregate_train(1, replies)
    rows = torch.stack([G[2], G[3], G[0] * 1e3, *G[4:]])  # (2, 102), (3, 103), (4, 50), (4, 104), ...
    assert torch.equal(_params(arrays), _expected(theta, rows))
    assert metrics["dropped"] == 2 and metrics["clients"] == N - 1 and metrics["repeated-ids"] == [4]
    assert any("ids [4] are each claimed by more than one node" in r.getMessage() for r in caplog.records)


@needs_flower
def test_42_13b_a_byzantine_node_claiming_an_honest_id_no_longer_removes_its_row(flower, caplog):
    """The audit's spoofing case, N=7, f=3: the three Byzantine nodes (node ids 100-102, below the honest
    ones) claim the honest ids 3, 4 and 5. The first claim kept the id, so the honest rows 3-5 were dropped
    every round (4 rows left: the round skipped, or a Byzantine majority). Now all 7 rows are aggregated, in
    (id, node) order."""
    theta = _theta()
    strategy, _ = _strategy(flower, n=7, f=3, theta=theta)
    G = _honest_rows(7)
    bad = torch.full((3, D), 50.0)
    replies = [_reply(flower, k, row=G[k]) for k in range(3, 7)]
    replies += [_reply(flower, 3 + i, row=bad[i], node=100 + i) for i in range(3)]
    arrays, metrics = strategy.aggregate_train(1, replies)
    rows = torch.stack([bad[0], G[3], bad[1], G[4], bad[2], G[5], G[6]])  # (3, 100), (3, 103), (4, 101), ...
    assert torch.equal(_params(arrays), _expected(theta, rows, n=7, f=3))
    assert metrics["clients"] == 7 and metrics["repeated-ids"] == [3, 4, 5] and "dropped" not in metrics
    assert any("ids [3, 4, 5] are each claimed" in r.getMessage() for r in caplog.records)


@needs_flower
def test_42_13c_federated_evaluation_is_the_unweighted_median_and_never_raises(flower):
    """FedAvg's aggregate_evaluate raised on a reply lacking num-examples (InconsistentMessageReplies, the
    ServerApp down) and weighted by the claimed count (1e9 examples with accuracy 0 gave 7e-7). Now each
    metric is the unweighted median of the finite numbers the replies give for it: a list, a NaN or a
    node's second reply does not count. 9 honest replies, one malformed, one claiming 1e9 examples (and its
    node's second reply): the medians worked by hand below."""
    accuracy = [0.81, 0.79, 0.90, 0.85, 0.70, 0.88, 0.83, 0.86, 0.80]
    loss = [0.50, 0.60, 0.40, 0.55, 0.90, 0.45, 0.52, 0.48, 0.58]
    metrics = [{"accuracy": a, "loss": loss[k], "num-examples": 100 + k} for k, a in enumerate(accuracy)]
    metrics += [{"accuracy": [0.1, 0.2], "loss": math.nan},  # malformed: no num-examples
                {"accuracy": 0.0, "loss": 0.0, "num-examples": 10**9},
                {"accuracy": 0.0, "loss": 0.0, "num-examples": 10**9}]  # fmt: skip
    nodes = [*range(100, 111), 110]
    replies = [
        reply_from(node, flower.RecordDict({"metrics": flower.MetricRecord(m)}), flower.MessageType.EVALUATE)
        for node, m in zip(nodes, metrics, strict=True)
    ]
    strategy, _ = _strategy(flower)
    out = strategy.aggregate_evaluate(1, replies)
    # 10 values each; sorted accuracies 0.0, 0.70, 0.79, 0.80, 0.81 | 0.83, ...; losses 0.0, ..., 0.50 | 0.52
    assert out["accuracy"] == pytest.approx((0.81 + 0.83) / 2) and out["loss"] == pytest.approx(0.51)
    assert out["num-examples"] == (104 + 105) / 2
    assert strategy.aggregate_evaluate(1, replies[9:10]) is None  # nothing countable


@needs_flower
def test_42_14_simulate_of_no_configs_is_no_runs():
    from prodigy_core.flower import simulate

    assert simulate([]) == []


@needs_flower
def test_42_29_a_strategy_with_an_attack_and_no_byzantine_client_is_refused():
    """As RunConfig refuses attack != none with n_byzantine=0."""
    from prodigy_core.flower import RobustStrategy

    with pytest.raises(ValueError, match="attack='alie' with n_byzantine=0"):
        RobustStrategy("median", 0, N, lambda t: GAMMA, attack="alie")


# --------------------------------------------------------------------------- config, groups and the CLI
@pytest.mark.parametrize("engine", ["batched", "channels_last"])
def test_42_7_a_grouped_run_is_the_run_alone_to_rounding_in_every_precision(engine):
    """Round 4 found a bf16 run grouped 0.56 points from the run alone and stopped grouping bf16; round 5
    measured why: grouping changes a local round by rounding only, in fp32 as in bf16 (1e-8 to 2e-6 relative
    on an AVX-512 CPU), as the engine does (which the key also leaves out), and the points were that
    rounding amplified by training. So every precision groups again, and a run's local round in a group of 4
    is the run alone's within 1e-4 relative: under one bf16 unit of rounding (2^-8 = 3.9e-3), so the stacked
    step is the same computation, not a coarser one."""
    from prodigy_core import groups, training
    from prodigy_core.config import RunConfig
    from prodigy_core.models import make_model
    from prodigy_core.seeding import precision_mode
    from prodigy_core.streams import ClientStreams

    base = dict(dataset="digits", rounds=2, device="cpu", engine=engine)
    fp32 = [RunConfig(**base, defense=d) for d in ("prodigy", "nnm+median", "median")]
    bf16 = [c.replace(precision="bf16") for c in fp32]
    for configs in (fp32, bf16):
        assert groups.make_groups(configs, size=4) == [configs]
    resolved = fp32[0].resolved()
    fed = training.run_federation(resolved, torch.device("cpu"))

    def local_round(members: list, precision: str) -> torch.Tensor:
        """The first run's pseudo-gradients after one local round of `members` stacked."""
        grad_fn = local_training.per_client_grad(members[0], engine=engine)
        with precision_mode(precision, torch.device("cpu")):
            rounds = local_training.local_steps_stacked(
                members, [fed] * len(members), resolved.local_steps, [resolved.lr] * len(members),
                resolved, [ClientStreams(i, resolved.n_clients) for i in range(len(members))], grad_fn,
            )  # fmt: skip
        return rounds[0][0]

    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        models = [make_model("digits").train() for _ in range(4)]
        alone, grouped = local_round(models[:1], precision), local_round(models, precision)
        assert float((grouped - alone).norm() / alone.norm()) <= 1e-4, (precision, engine)


@pytest.mark.parametrize("device", ["meta", "mps", "xla", "ipu", "cuda:x"])
def test_42_22_a_device_these_runs_cannot_train_on_is_refused_in_one_line(device):
    from prodigy_core.config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match=f"device='{device}' cannot train these runs; valid: auto, cpu"):
        RunConfig(device=device)
    assert RunConfig(device="cuda:1").device == "cuda:1"  # refused only where it runs, without CUDA


@pytest.mark.parametrize(
    ("fields", "name"),
    [({"lr": 1e39}, "lr"), ({"weight_decay": 1e39}, "weight_decay"),
     ({"lr": 1e30, "lr_decay_factor": 1e10}, "lr \\* lr_decay_factor")],
)  # fmt: skip
def test_42_23_a_step_size_beyond_float32_is_refused(fields, name):
    from prodigy_core.config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match=f"{name}=1e\\+(39|40) is beyond float32's range"):
        RunConfig(**fields)
    RunConfig(lr=1e38)  # within float32's range: a run that may diverge, recorded as diverged


def test_42_24_prodigy_fl_run_respects_a_grids_lock(tmp_path, capsys):
    """A live process holds the run's lock: `prodigy-fl run` refuses in one line naming the lock and trains
    nothing; once the lock is gone it trains, holding the lock meanwhile and leaving none behind."""
    import json
    import os
    import socket
    import time

    from prodigy_core import results
    from prodigy_core.cli import main
    from prodigy_core.config import RunConfig

    folder = results.experiment_dir("runs", tmp_path)
    folder.mkdir(parents=True)
    key = RunConfig(rounds=2).key()
    lock = folder / f"{key}.lock"
    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}))
    assert main(["run", "--set", "rounds=2", "--results-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(lock) in err and "rerun when it is done" in err
    assert not results.record_path(folder, key).exists()
    lock.unlink()
    assert main(["run", "--set", "rounds=2", "--results-dir", str(tmp_path)]) == 0
    assert results.record_path(folder, key).exists() and not lock.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="tf32 trains on CUDA")
def test_42_25_a_tf32_grid_on_a_cpu_is_refused_up_front_in_one_line(tmp_path, capsys):
    """No failure records, exit 2 and one line; the dry run says so under its count."""
    from prodigy_core.cli import main

    grid = tmp_path / "g.yaml"
    grid.write_text(
        "experiment: g\ntitle: g\nbase: {dataset: digits, rounds: 2, precision: tf32}\n"
        "grid: {defense: [prodigy, median], attack: [none, sf]}\nseeds: [0]\n"
    )
    assert main(["grid", str(grid), "--dry-run", "--results-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "4 runs (0 stored, 4 to run)" in out and "4 of the 4 runs cannot train here" in out
    assert main(["grid", str(grid), "--results-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "precision=tf32 exists only on CUDA" in err
    assert not list(tmp_path.rglob("*.json"))


@pytest.mark.parametrize(("seed", "data_seed"), [(-1, None), (5_000_000_000, None), (0, -1)])
def test_42_28_an_authors_split_seed_outside_numpys_range_is_refused(seed, data_seed):
    from prodigy_core.config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match="under variant='authors': its split seeds numpy's RandomState"):
        RunConfig(variant="authors", seed=seed, data_seed=data_seed)
    RunConfig(seed=-1)  # the paper variant's split is torch's, which takes it
    RunConfig(variant="authors", seed=-1, data_seed=3)  # the split's seed is data_seed


def test_42_36_a_huge_defense_name_is_not_echoed_in_full():
    from prodigy_core.config import ConfigError, RunConfig

    for field in ("defense", "attack"):
        with pytest.raises(ConfigError) as e:
            RunConfig(**{field: "x" * 10_000})
        assert len(str(e.value)) < 1000 and "(10000 characters)" in str(e.value)
