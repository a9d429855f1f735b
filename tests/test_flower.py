"""The Flower strategy (`prodigy_core.flower`) against make_aggregator and against our own engine, under
Flower's own simulation engine (Ray). Skipped only where the ``flower`` extra is not installed."""

import pkgutil
import random
import re
import subprocess
import sys
import types

import pytest
import torch

import prodigy_core
from prodigy_core.aggregators import ProDiGy, make_aggregator
from prodigy_core.config import RunConfig
from prodigy_core.training import run

needs_flower = pytest.mark.usefixtures("flower_extra")  # skips without the flower extra; fails under CI

# The quickstart's setting (params/quickstart_digits.yaml) trained for ROUNDS rounds (lr decay after 2/3).
QUICKSTART = dict(
    dataset="digits", n_clients=10, n_byzantine=3, local_steps=10, local_momentum=0.9, eval_every=10
)
ROUNDS = 30
ALIE_ROUNDS = 10  # (b) checks each round's zeroed clients: 10 rounds tell it as 30 do, at a third of the cost
# (a)'s margin, in accuracy points. The two loops run the same model, split, initial weights, local SGD
# and server step, but draw different random numbers: our engine draws all clients' batches from one
# generator and the dropout masks from the global one, the Flower clients (one Ray worker each call) from a
# seed of (seed, client, round). So the Flower run is another random draw of the same training: over engine
# seeds 0, 1, 2 (same split) the round-30 accuracy was 79.4, 83.0, 80.2 (a 3.6-point spread), and the
# margin is about twice that spread.
MARGIN = 8.0


def reply_from(node: int, content, message_type: str = "train"):
    """A reply of node `node` (its ``metadata.src_node_id``) carrying the RecordDict `content`: Flower sets a
    reply's source to the node its instruction went to (a message made directly gets the TaskIdentity's
    node id, 1 in these tests, for every reply)."""
    from flwr.app import Message, RecordDict

    instruction = Message(RecordDict(), dst_node_id=node, message_type=message_type)
    return Message(content, reply_to=instruction)


def test_the_core_package_never_imports_flwr():
    """Every module but prodigy_core.flower imports without flwr being imported."""
    names = [
        f"prodigy_core.{m.name}" for m in pkgutil.iter_modules(prodigy_core.__path__) if m.name != "flower"
    ]
    code = f"import sys; import {', '.join(names)}; print('flwr' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@needs_flower
@pytest.mark.parametrize(
    ("defense", "params"), [("prodigy", None), ("nnm+trimmed_mean", None), ("nnm+cclip", {"tau": 5.0})]
)
def test_strategy_aggregates_bit_for_bit_as_make_aggregator(monkeypatch, defense, params):
    """(c) aggregate_train on 10 replies (in shuffled order) gives theta - gamma Agg(G) with Agg =
    make_aggregator's, bit for bit; BatchNorm buffers: the clients' median; ProDiGy's zeroed clients in
    the round's metrics."""
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from prodigy_core.flower import RobustStrategy

    for name in ("_run_id", "_node_id", "_task_id"):  # what a ServerApp sets before it makes messages
        monkeypatch.setattr(TaskIdentity, name, 1, raising=False)
    n, f, gamma = 10, 3, 0.05
    gen = torch.Generator().manual_seed(7)
    G = torch.randn(n, 8, generator=gen)
    G[:f] = G[f:].mean(0) - 1.5 * G[f:].std(0)  # ALIE-like rows
    theta = {
        "w": torch.randn(2, 3, generator=gen),
        "bn.running_mean": torch.randn(4, generator=gen),
        "b": torch.randn(2),
    }
    buffers = torch.randn(n, 4, generator=gen)
    strategy = RobustStrategy(defense, f, n, lambda t: gamma, defense_params=params)
    grid = types.SimpleNamespace(get_node_ids=lambda: list(range(100, 100 + n)))
    list(strategy.configure_train(1, ArrayRecord(theta), ConfigRecord(), grid))
    order = list(range(n))
    random.Random(0).shuffle(order)
    replies = []
    for k in order:
        content = RecordDict({
            "arrays": ArrayRecord({"w": G[k, :6].reshape(2, 3), "b": G[k, 6:]}),
            "buffers": ArrayRecord({"bn.running_mean": buffers[k]}),
            "metrics": MetricRecord({"partition-id": k, "num-examples": 10 + k}),
        })  # fmt: skip
        replies.append(reply_from(100 + k, content))
    arrays, metrics = strategy.aggregate_train(1, replies)

    pipeline = make_aggregator(defense, f, n, params=params)
    expected = torch.cat([theta["w"].reshape(-1), theta["b"]]) - gamma * pipeline(G)
    out = arrays.to_torch_state_dict()
    assert torch.equal(out["w"].reshape(-1), expected[:6]) and torch.equal(out["b"], expected[6:])
    assert torch.equal(out["bn.running_mean"], torch.quantile(buffers, 0.5, dim=0))
    if isinstance(pipeline.rule, ProDiGy):
        assert metrics["zeroed"] == torch.nonzero(pipeline.rule.last_scores.weight == 0).flatten().tolist()


def _one_round(monkeypatch, reply, n: int = 10, connected: int | None = None, **options):
    """A RobustStrategy (nnm+trimmed_mean, f=3) through configure_train and aggregate_train on one reply a
    client, ``reply(k, theta)`` giving a client's RecordDict content; returns (strategy, arrays, metrics)."""
    from prodigy_core.flower import RobustStrategy

    _server_identity(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    theta = {"w": torch.randn(2, 3, generator=gen), "bn.running_mean": torch.randn(4, generator=gen)}
    strategy = RobustStrategy("nnm+trimmed_mean", 3, n, lambda t: 0.05, **options)
    return (strategy, theta, *_next_round(strategy, 1, theta, reply, n, connected))


def _server_identity(monkeypatch) -> None:
    """The identity a ServerApp sets before it makes messages."""
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, name, 1, raising=False)


def _next_round(strategy, server_round: int, theta: dict, reply, n: int = 10, connected: int | None = None):
    """One round of `strategy` from the model ``theta`` on n replies: (arrays, metrics) of aggregate_train."""
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    grid = types.SimpleNamespace(get_node_ids=lambda: list(range(100, 100 + (connected or n))))
    list(strategy.configure_train(server_round, ArrayRecord(theta), ConfigRecord(), grid))
    replies = [reply_from(100 + k, RecordDict(reply(k, theta))) for k in range(n)]
    return strategy.aggregate_train(server_round, replies)


def _reply(k, theta, update=None, key="arrays", buffers=True):
    from flwr.app import ArrayRecord, MetricRecord

    gen = torch.Generator().manual_seed(100 + k)
    content = {key: ArrayRecord({"w": torch.randn(2, 3, generator=gen) if update is None else update}),
               "metrics": MetricRecord({"partition-id": k})}  # fmt: skip
    if buffers:
        content["buffers"] = ArrayRecord({"bn.running_mean": torch.randn(4, generator=gen)})
    return content


@needs_flower
def test_strategy_warns_once_when_clients_send_weights_not_updates(monkeypatch, caplog):
    """Flower's FedAvg clients reply with their weights, under the same record and shapes: the step theta -
    gamma * Agg then shrank the model towards 0 with no word. One warning a run now says so; updates (the
    bit-for-bit test's) give none."""
    noise = torch.Generator().manual_seed(0)

    def weights(k, theta):
        return _reply(k, theta, theta["w"] + 0.01 * torch.randn(2, 3, generator=noise))

    strategy, theta, arrays, _ = _one_round(monkeypatch, weights)
    assert torch.allclose(arrays.to_torch_state_dict()["w"], 0.95 * theta["w"], atol=2e-3)  # the shrink
    _next_round(strategy, 2, arrays.to_torch_state_dict(), weights)  # weights again: no second warning
    warned = [r.getMessage() for r in caplog.records if "look like model weights" in r.getMessage()]
    assert len(warned) == 1 and "record 'arrays' must hold each client's update" in warned[0]
    caplog.clear()
    _one_round(monkeypatch, _reply)
    assert not [r for r in caplog.records if "look like model weights" in r.getMessage()]


@needs_flower
def test_strategy_warns_when_no_reply_reports_the_buffers_and_names_why_a_reply_is_dropped(
    monkeypatch, caplog
):
    _, theta, arrays, metrics = _one_round(monkeypatch, lambda k, theta: _reply(k, theta, buffers=False))
    assert torch.equal(arrays.to_torch_state_dict()["bn.running_mean"], theta["bn.running_mean"])
    assert any(
        "report the buffers ['bn.running_mean'] (record 'buffers')" in r.getMessage() for r in caplog.records
    )
    caplog.clear()
    _, _, arrays, metrics = _one_round(monkeypatch, lambda k, theta: _reply(k, theta, key="model"))
    assert arrays is None and metrics["dropped"] == 10 and metrics["skipped"] == 1
    assert any("dropped: no ArrayRecord 'arrays' (it has ['buffers', 'model'])" in r.getMessage()
               for r in caplog.records)  # fmt: skip


@needs_flower
@pytest.mark.parametrize(
    ("options", "message"),
    [({"fraction_train": 0.5}, "fraction_train=0.5 is not supported: every round trains every connected node "
                               "(up to n_clients=10)"),
     ({"min_train_nodes": 5}, "min_train_nodes=5 is outside 7..10: nnm+trimmed_mean with n_byzantine=3 "
                              "needs 7 updates a round"),
     ({"min_train_nodes": 11}, "min_train_nodes=11 is outside 7..10"),
     ({"arrayrecord_key": "model"}, "arrayrecord_key='model' is not supported")],
)  # fmt: skip
def test_strategy_refuses_what_would_train_other_than_the_connected_nodes_up_to_n(
    monkeypatch, options, message
):
    """FedAvg's sampling options: fraction_train=0.5 sampled all N anyway (min_train_nodes=N); with
    min_train_nodes=5 a round with 5 replies would be skipped (f=3 needs N > 6), and above N it would wait
    for nodes the strategy never trains."""
    with pytest.raises(ValueError, match=re.escape(message)):
        _one_round(monkeypatch, _reply, **options)


def _rows(n: int) -> torch.Tensor:
    """The updates `_reply` sends for clients 0..n-1, as rows (w flattened)."""
    return torch.stack([torch.randn(6, generator=torch.Generator().manual_seed(100 + k)) for k in range(n)])


@needs_flower
def test_min_train_nodes_may_be_lowered_to_the_fewest_rows_the_rule_runs_on(monkeypatch):
    """min_train_nodes was forced to N: one node lost for good made FedAvg's sampling wait forever. Now it
    defaults to N (min_available_nodes to it) and may be set down to the rule's minimum, 7 for
    nnm+trimmed_mean with f=3: with 7 of the 10 nodes connected, round 1 trains those 7 without waiting and
    steps by the rule on their 7 rows."""
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.serverapp.strategy import strategy_utils

    from prodigy_core.flower import RobustStrategy

    def sleep(seconds):
        raise AssertionError("the strategy waits for nodes")

    monkeypatch.setattr(strategy_utils, "sleep", sleep)
    _server_identity(monkeypatch)
    default = RobustStrategy("nnm+trimmed_mean", 3, 10, lambda t: 0.05)
    assert (default.min_train_nodes, default.min_available_nodes) == (10, 10)
    strategy = RobustStrategy("nnm+trimmed_mean", 3, 10, lambda t: 0.05, min_train_nodes=7)
    assert (strategy.min_train_nodes, strategy.min_available_nodes) == (7, 7)
    theta = {"w": torch.randn(2, 3, generator=torch.Generator().manual_seed(3))}
    grid = types.SimpleNamespace(get_node_ids=lambda: list(range(100, 107)))
    sent = strategy.configure_train(1, ArrayRecord(theta), ConfigRecord(), grid)
    assert sorted(m.metadata.dst_node_id for m in sent) == list(range(100, 107))
    arrays, metrics = _next_round(strategy, 1, theta, lambda k, theta: _reply(k, theta, buffers=False), n=7)
    expected = theta["w"].reshape(-1) - 0.05 * make_aggregator("nnm+trimmed_mean", 3, 7)(_rows(7))
    assert torch.equal(arrays.to_torch_state_dict()["w"].reshape(-1), expected) and metrics["clients"] == 7


@needs_flower
def test_more_nodes_than_n_clients_train_n_of_them_drawn_from_the_seed_and_round(monkeypatch, caplog):
    """20 nodes connected with N=10 raised ValueError in configure_train, mid-run. Now each round trains 10
    distinct connected nodes, the same 10 for the same (seed, round) whatever order the grid lists them in,
    another draw in the next round, with one warning a run naming the counts."""
    from flwr.app import ArrayRecord, ConfigRecord

    from prodigy_core.flower import RobustStrategy

    strategy, theta, _, _ = _one_round(monkeypatch, _reply, connected=20, seed=5)
    nodes = list(range(100, 120))

    def drawn(strategy, server_round, listed):
        grid = types.SimpleNamespace(get_node_ids=lambda: listed)
        sent = list(strategy.configure_train(server_round, ArrayRecord(theta), ConfigRecord(), grid))
        assert all(m.content["config"]["server-round"] == server_round for m in sent)
        assert all(m.content["config"]["lr"] == 0.05 for m in sent)
        return [m.metadata.dst_node_id for m in sent]

    first, second = drawn(strategy, 1, nodes), drawn(strategy, 2, nodes)
    assert len(set(first)) == 10 == len(first) and set(first) <= set(nodes)
    again = RobustStrategy("nnm+trimmed_mean", 3, 10, lambda t: 0.05, seed=5)
    assert drawn(again, 1, nodes[::-1]) == first
    assert len(set(second)) == 10 and set(second) != set(first)
    warned = [r.getMessage() for r in caplog.records if "nodes connected" in r.getMessage()]
    assert (
        warned
        == [
            "RobustStrategy: 20 nodes connected but n_clients=10: each round trains 10 of them, drawn from "
            "(seed, round)"
        ]
        * 2
    )  # one for each strategy's run


@needs_flower
def test_a_float64_parameter_steps_in_float64(monkeypatch):
    """The step flattened theta to float32 and cast back: a float64 parameter lost its last digits every
    round (1 + 1e-12 became 1.0 under a zero update). Now each tensor steps in its own dtype."""
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

    from prodigy_core.flower import RobustStrategy

    _server_identity(monkeypatch)
    theta = {"w": torch.full((2, 3), 1 + 1e-12, dtype=torch.float64)}
    strategy = RobustStrategy("median", 3, 10, lambda t: 0.05)
    grid = types.SimpleNamespace(get_node_ids=lambda: list(range(100, 110)))
    list(strategy.configure_train(1, ArrayRecord(theta), ConfigRecord(), grid))
    zero = ArrayRecord({"w": torch.zeros(2, 3)})
    replies = [
        reply_from(100 + k, RecordDict({"arrays": zero, "metrics": MetricRecord({"partition-id": k})}))
        for k in range(10)
    ]
    out = strategy.aggregate_train(1, replies)[0].to_torch_state_dict()["w"]
    assert out.dtype == torch.float64 and torch.equal(out, theta["w"]) and float(out[0, 0]) != 1.0


@needs_flower
def test_a_round_whose_replies_all_lack_the_same_entries_says_which_and_the_fix(monkeypatch, caplog):
    """parameters=None counts a non-BatchNorm buffer (an int64 step counter) as a parameter, so every reply
    was dropped for lacking it and the round skipped with no word of why. The skip warning now names the
    entry and the fix; replies lacking different things get no such hint."""
    theta = {"w": torch.randn(2, 3), "step": torch.tensor(5)}
    strategy = _one_round(monkeypatch, lambda k, theta: _reply(k, theta, buffers=False))[0]
    arrays, metrics = _next_round(strategy, 2, theta, lambda k, theta: _reply(k, theta, buffers=False))
    assert arrays is None and metrics["skipped"] == 1 and metrics["dropped"] == 10
    skipped = [r.getMessage() for r in caplog.records if "round 2 skipped" in r.getMessage()]
    assert len(skipped) == 1 and "no usable reply; every reply's update lacks ['step']" in skipped[0]
    assert "pass parameters=[n for n, _ in model.named_parameters()]" in skipped[0]
    assert "RobustStrategy.from_config" in skipped[0]
    caplog.clear()
    _next_round(strategy, 3, theta, lambda k, theta: _reply(k, theta, key="arrays" if k % 2 else "model"))
    skipped = [r.getMessage() for r in caplog.records if "round 3 skipped" in r.getMessage()]
    assert len(skipped) == 1 and "lacks" not in skipped[0]


@needs_flower
def test_lr_at_may_be_a_number_and_anything_else_not_callable_is_refused(monkeypatch):
    """lr_at=0.05 failed in round 1 ("'float' object is not callable"). A number is now a constant rate:
    every round sends lr 0.05 and steps theta - 0.05 Agg; a string is refused at construction, in one line."""
    from prodigy_core.flower import RobustStrategy

    strategy, theta, arrays, metrics = _one_round(monkeypatch, _reply)  # lr_at=lambda t: 0.05, the reference
    constant = RobustStrategy("nnm+trimmed_mean", 3, 10, 0.05)
    for server_round in (1, 7):
        out, m = _next_round(constant, server_round, theta, _reply)
        assert m["lr"] == 0.05 and torch.equal(
            out.to_torch_state_dict()["w"], arrays.to_torch_state_dict()["w"]
        )
    expected = theta["w"].reshape(-1) - 0.05 * make_aggregator("nnm+trimmed_mean", 3, 10)(_rows(10))
    assert torch.equal(arrays.to_torch_state_dict()["w"].reshape(-1), expected)
    with pytest.raises(TypeError, match=re.escape("lr_at='0.05' is neither a callable")) as e:
        RobustStrategy("median", 3, 10, "0.05")
    assert "\n" not in str(e.value)


@needs_flower
def test_honest_known_makes_an_honest_clients_non_finite_row_the_runs_divergence(monkeypatch):
    """In `simulate` every client is the package's own, yet an honest client's NaN row was absorbed as a
    Byzantine row and the model moved on, where `training.run` records divergence. With honest_known (what
    simulate sets) a NaN row of a label outside `byzantine` freezes the run at that round (diverged_at),
    also in the next round; a NaN in a Byzantine label's row is a Byzantine row as before."""

    def nan_in(bad):
        def reply(k, theta):
            return _reply(k, theta, torch.full((2, 3), float("nan")) if k == bad else None)

        return reply

    G = _rows(10)
    for bad in (1, 5):  # byzantine=[0, 1, 2]: 1 is a Byzantine label, 5 an honest one
        for known in (False, True):
            strategy, theta, arrays, metrics = _one_round(
                monkeypatch, nan_in(bad), byzantine=[0, 1, 2], honest_known=known
            )
            assert metrics["non-finite"] == [bad]
            if known and bad == 5:
                assert strategy.diverged_at == 1 and torch.equal(
                    arrays.to_torch_state_dict()["w"], theta["w"]
                )
                again, _ = _next_round(strategy, 2, theta, _reply)  # finite replies: still frozen
                assert torch.equal(again.to_torch_state_dict()["w"], theta["w"])
            else:
                seen = G.clone()
                seen[bad] = float("nan")
                expected = theta["w"].reshape(-1) - 0.05 * make_aggregator("nnm+trimmed_mean", 3, 10)(seen)
                assert strategy.diverged_at is None
                assert torch.equal(arrays.to_torch_state_dict()["w"].reshape(-1), expected)


@needs_flower
def test_simulate_records_divergence_as_training_run_and_lists_the_skipped_rounds(monkeypatch):
    """Without Ray: Flower's run_simulation is replaced by a grid that runs `client_app` in this process and
    plays two faults: in round 2 only two of the 4 clients reply (median with f=1 needs 3: the round is
    skipped), in round 4 an honest client's update is NaN. The run is recorded as `training.run` records
    one that diverged at round 4 (diverged_at = rounds_completed = 4; rounds_completed was 6 and the NaN was
    absorbed as a Byzantine row) and round 2 is listed in skipped_rounds, with one warning naming it (it was
    recorded nowhere)."""
    import flwr.simulation
    from flwr.app import ArrayRecord, Context, RecordDict

    from prodigy_core import flower

    _server_identity(monkeypatch)
    config = RunConfig(dataset="digits", n_clients=4, n_byzantine=1, rounds=6, local_steps=2, eval_every=3,
                       defense="median")  # fmt: skip
    honest = next(k for k in range(4) if k not in flower.byzantine_ids(4, 1, config.seed))

    def run_simulation(server, apps, num_supernodes, backend_config):
        nodes = {100 + k: Context(1, 100 + k, {"partition-id": k}, RecordDict(), {}) for k in range(4)}

        def send_and_receive(messages, timeout=None):
            replies = [apps(m, nodes[m.metadata.dst_node_id]) for m in messages]
            server_round = messages[0].content["config"]["server-round"] if messages else None
            for reply in replies:
                if server_round == 4 and reply.content["metrics"]["partition-id"] == honest:
                    update = reply.content["arrays"].to_torch_state_dict()
                    reply.content["arrays"] = ArrayRecord({n: torch.full_like(t, float("nan"))
                                                           for n, t in update.items()})  # fmt: skip
            return replies[:2] if server_round == 2 else replies

        grid = types.SimpleNamespace(get_node_ids=lambda: list(nodes), send_and_receive=send_and_receive)
        server(grid, Context(1, 0, {}, RecordDict(), {}))

    monkeypatch.setattr(flwr.simulation, "run_simulation", run_simulation)
    monkeypatch.setattr(flower, "_start_ray", lambda num_cpus: None)
    with pytest.warns(RuntimeWarning, match=re.escape("run 0 (median, attack none) skipped rounds [2]:")):
        [out] = flower.simulate([config])
    assert out.skipped_rounds == [2]
    assert (out.result.diverged, out.result.diverged_at, out.result.rounds_completed) == (True, 4, 4)
    assert [r for r, _ in out.result.accuracy_curve] == [3]  # evaluated before it diverged only
    # a diverged run's accuracy (variant paper): chance, 100 / the 10 digit classes of its test labels
    fed = flower.run_federation(config.resolved(), torch.device("cpu"))
    assert sorted(set(fed.test_labels.tolist())) == list(range(10))
    assert out.result.final_accuracy == 10.0


def _config(**changes) -> RunConfig:
    return RunConfig(**{**QUICKSTART, "rounds": ROUNDS, "defense": "prodigy", **changes})


@pytest.fixture(scope="module")
def flower_runs(flower_extra):
    """ProDiGy without an attack and under ALIE, in one Flower simulation (one Ray start)."""
    from prodigy_core.flower import simulate

    return simulate([_config(), _config(attack="alie", rounds=ALIE_ROUNDS)], num_cpus=2)


@needs_flower
@pytest.mark.slow
def test_flower_accuracy_matches_our_engine_without_attack(flower_runs):
    """(a) the final accuracy under Flower's simulation is within MARGIN of our engine's, same rounds."""
    ours = run(_config(), progress=False).final_accuracy
    theirs = flower_runs[0].result
    assert [r for r, _ in theirs.accuracy_curve] == [10, 20, 30]
    assert abs(theirs.final_accuracy - ours) <= MARGIN, (theirs.final_accuracy, ours)
    assert theirs.final_accuracy > 60  # it trained (10 classes: chance is 10)


@needs_flower
@pytest.mark.slow
def test_prodigy_zeroes_exactly_the_byzantine_clients_under_alie(flower_runs):
    """(b) under ALIE ProDiGy zeroes exactly the Byzantine clients in every round, in Flower's history too,
    as our engine does on this split (where the Byzantine clients are 0..f-1)."""
    ours = run(_config(attack="alie", rounds=ALIE_ROUNDS), progress=False)
    assert ours.zeroed_clients == [[0, 1, 2]] * ALIE_ROUNDS
    theirs = flower_runs[1]
    assert len(theirs.byzantine) == 3 and theirs.byzantine != [0, 1, 2]  # drawn from the seed
    assert theirs.result.zeroed_clients == [theirs.byzantine] * ALIE_ROUNDS
    history = theirs.history.train_metrics_clientapp
    zeroed = [history[r]["zeroed-byzantine"] for r in range(1, ALIE_ROUNDS + 1)]
    assert zeroed == [theirs.byzantine] * ALIE_ROUNDS


@needs_flower
def test_simulate_refuses_the_authors_variant_and_a_running_ray_cluster_in_one_line(monkeypatch):
    """The Flower clients draw the paper's batches and the server evaluates in eval mode: an ``authors``
    config is refused before Ray starts, not trained under the paper's semantics and recorded as authors'.
    A `ray start` cluster on the machine makes Ray refuse the simulation's own start: the line says so,
    not "retry when the machine is quieter"."""
    import ray

    from prodigy_core import flower

    with pytest.raises(ValueError, match="variant='authors' is not simulated"):
        flower.simulate([_config(variant="authors")])

    def init(*args, **kwargs):
        raise Exception("When connecting to an existing cluster, num_cpus and num_gpus must not be provided.")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    with pytest.raises(RuntimeError, match=r"a Ray cluster runs on this machine \(ray start\): stop it"):
        flower._start_ray(2)


@needs_flower
def test_a_search_over_two_parameters_reports_both_in_the_round_metrics(tmp_path, monkeypatch):
    """`attack-param` was float(last_param), which a tuple of parameters broke; now a list of both, the
    candidate whose aggregate lands farthest from the honest mean: the argmax of the damages computed here by
    brute force, which on these updates is the grid's middle candidate (neither its first nor its last)."""
    from flwr.app import MetricRecord

    from prodigy_core.flower import RobustStrategy

    grid = [(0.5, 0.0), (1.0, 0.0), (1.0, 2.0)]
    (tmp_path / "plane.py").write_text(
        "import torch\nfrom prodigy_core.attacks import LineSearchAttack\n\n\n"
        "class Plane(LineSearchAttack):\n"
        f"    def grid(self, n, f):\n        return {grid!r}\n\n"
        "    def rows(self, p, stats):\n        return stats['mean'] - p[0] * stats['sigma'] + p[1]\n"
    )
    monkeypatch.chdir(tmp_path)
    strategy = RobustStrategy("prodigy", 3, 10, lambda t: 0.05, attack="plane.py:Plane")
    metrics = MetricRecord({})
    G = torch.randn(10, 20, generator=torch.Generator().manual_seed(0))
    strategy.server_input(G, list(range(10)), metrics)
    honest = G[[k for k in range(10) if k not in strategy.byzantine]]
    mean, sigma = honest.mean(0), honest.std(0, unbiased=False)  # the population std, as ALIE's
    server = make_aggregator("prodigy", 3, 10)

    def damage(z: float, t: float) -> float:  # |server(3 rows of mu - z sigma + t, then the honest) - mu|
        sent = torch.cat([(mean - z * sigma + t).expand(3, -1), honest])
        return float(torch.linalg.vector_norm(server.peek(sent) - mean))

    damages = [damage(z, t) for z, t in grid]
    best = max(range(len(grid)), key=damages.__getitem__)
    assert best == 1 and min(damages[best] - x for i, x in enumerate(damages) if i != best) > 0.05
    assert metrics["attack-param"] == [1.0, 0.0] == list(grid[best])
