"""The federated training engine: learning, engine equivalence, checkpoint/resume, divergence, attacks and the
result record, on tiny digits runs (CPU, seconds each)."""

import json
import platform

import pytest
import torch
from torch import nn

from prodigy_core import evaluation, local_training, training
from prodigy_core.config import ConfigError, RunConfig
from prodigy_core.data import load_federation
from prodigy_core.experiments import load_experiment
from prodigy_core.models import make_model
from prodigy_core.streams import ClientStreams
from prodigy_core.training import RunResult, run

# A few rounds of FedAVG on digits: small enough for CI, large enough to learn.
TINY = dict(dataset="digits", n_clients=6, n_byzantine=0, defense="average", attack="none", rounds=8,
            local_steps=4, batch_size=32, eval_every=4, device="cpu")  # fmt: skip


def tiny(**changes) -> RunConfig:
    return RunConfig(**{**TINY, **changes})


# ------------------------------------------------------------------------------------------------ learning
@pytest.mark.parametrize(("distribution", "engine"), [("iid", "batched"), ("dirichlet", "sequential")])
def test_digits_learns_well_above_chance(distribution, engine):
    # the other two combinations run in the tests below (auto is channels_last for digits on a CPU)
    result = run(tiny(distribution=distribution, engine=engine), progress=False)
    assert not result.diverged
    assert result.final_accuracy > 50.0  # chance is 10% on 10 balanced classes
    assert [r for r, _ in result.accuracy_curve] == [4, 8]
    assert len(result.round_times) == 8 and all(t > 0 for t in result.round_times)
    assert result.attack_params == [None] * 8
    assert result.environment["engine"] == engine


# ------------------------------------------------------------------------------------- engine equivalence
def _disable_dropout(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def _both_engines(fed, dataset: str, steps: int, batch_size: int, weight_decay: float, seed: int = 0):
    """Both engines' (pseudo-gradients, BN buffers) from the same model, streams (batches, dropout masks).

    The images get a 1e-3 jitter first: digits and FEMNIST have exactly constant backgrounds, which make
    exact ties in max-pooling; a 1-ulp difference between grouped and plain convolutions then routes a
    gradient to another pixel, a legitimate but discontinuous difference (dropout's zeros can still make a
    near-tie after training moved the weights). In general position the engines compute the same function
    and agree to float32 rounding."""
    jitter = torch.rand(fed.train_images.shape, generator=torch.Generator().manual_seed(2))
    fed.train_images = fed.train_images + 1e-3 * jitter
    torch.manual_seed(0)
    model = make_model(dataset).train()
    cfg = RunConfig(dataset=dataset, distribution=TINY_DISTRIBUTION[dataset], n_clients=fed.n_clients,
                    n_byzantine=0, defense="average", batch_size=batch_size,
                    weight_decay=weight_decay).resolved()  # fmt: skip
    out = []
    for local_steps in (local_training.local_steps_batched, local_training.local_steps_sequential):
        # the same batches and dropout masks for both engines. Which streams meet a max-pooling near-tie is
        # chance: digits iid seeded 1 (client 2's 2nd step: 6.6e-4, in the convolutions only), FEMNIST
        # seeded 0 and 2 (as the generators before `ClientStreams` seeded 4); the seeds here meet none
        rng = ClientStreams(seed, fed.n_clients)
        out.append(local_steps(model, fed, steps, 0.05, cfg, rng))
    return out


TINY_DISTRIBUTION = {"digits": "dirichlet", "femnist": "natural"}


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()


@pytest.mark.parametrize("distribution", ["iid", "dirichlet"])
def test_engines_agree_on_digits(distribution):
    # Dirichlet(0.1) gives clients smaller than the batch: the batched engine then vmaps width groups.
    fed = load_federation("digits", 6, distribution=distribution, seed=0)
    assert len(local_training._width_groups(fed, 100)) == (1 if distribution == "iid" else 2)
    (g_b, buf_b), (g_s, buf_s) = _both_engines(fed, "digits", steps=3, batch_size=100, weight_decay=1e-2)
    assert g_b.shape == g_s.shape == (6, sum(p.numel() for p in make_model("digits").parameters()))
    # float32, different kernels (grouped vs plain convolutions): agreement to ~1e-6 relative, 1e-4 stated
    assert _relative_error(g_b, g_s) < 1e-4
    assert buf_b.keys() == buf_s.keys() and buf_b
    for name in buf_b:
        torch.testing.assert_close(buf_b[name], buf_s[name], rtol=1e-4, atol=1e-5)


def test_engines_agree_on_femnist(femnist_dir):
    fed = load_federation("femnist", 3, distribution="natural", data_dir=femnist_dir)
    (g_b, _), (g_s, _) = _both_engines(fed, "femnist", steps=2, batch_size=32, weight_decay=0.0, seed=1)
    assert _relative_error(g_b, g_s) < 1e-4


@pytest.mark.parametrize("dropout", [False, True])
def test_compiled_engine_matches_batched(dropout):
    """engine="compiled" is the batched step under torch.compile: the same function and masks (the streams'
    counter-based draws), other kernels."""
    fed = load_federation("digits", 4, distribution="dirichlet", seed=0)
    assert len(local_training._width_groups(fed, 300)) == 2  # two batch widths: two shapes to compile
    torch.manual_seed(0)
    model = make_model("digits").train()
    model = model if dropout else _disable_dropout(model)
    assert any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()) is dropout
    cfg = tiny(n_clients=4, batch_size=300, weight_decay=1e-2).resolved()
    runs = []
    for grad_fn in (None, local_training.per_client_grad(model, compiled=True)):
        rng = ClientStreams(1, fed.n_clients)
        runs.append(local_training.local_steps_batched(model, fed, 3, 0.05, cfg, rng, grad_fn=grad_fn))
    (g_eager, buf_eager), (g_compiled, buf_compiled) = runs
    assert _relative_error(g_compiled, g_eager) < 1e-4
    for name in buf_eager:
        torch.testing.assert_close(buf_compiled[name], buf_eager[name], rtol=1e-4, atol=1e-5)


@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled")
def test_compiled_engine_without_a_compiler_says_what_to_do():
    fed = load_federation("digits", 2, distribution="iid", seed=0)
    model = make_model("digits").train()
    cfg = tiny(n_clients=2, batch_size=8).resolved()
    no_compiler = {"cpp.cxx": (None, "/nonexistent/g++"), "force_disable_caches": True}
    torch._dynamo.reset()
    try:
        with torch._inductor.config.patch(no_compiler):
            grad_fn = local_training.ClientGrad(model, compiled=True)  # a new one: the process's may be built
            with pytest.raises(RuntimeError, match=r"engine='compiled'.*C\+\+ compiler.*engine='batched'"):
                streams = ClientStreams(0, 2)
                local_training.local_steps_batched(model, fed, 1, 0.05, cfg, streams, grad_fn=grad_fn)
    finally:
        torch._dynamo.reset()


def test_pseudo_gradient_of_one_plain_sgd_step():
    """E=1 without weight decay: (theta - theta') / lr is exactly the client's minibatch gradient."""
    fed = load_federation("digits", 3, distribution="iid", seed=0)
    torch.manual_seed(0)
    model = _disable_dropout(make_model("digits")).train()
    cfg = tiny(n_clients=3, batch_size=16, weight_decay=0.0).resolved()
    g, _ = local_training.local_steps_batched(model, fed, 1, 0.05, cfg, ClientStreams(5, 3))
    idx, _ = fed.sample_batch(16, fed.generators(5))
    for k in range(3):
        x, y = fed.train_batch(idx[k], None), fed.train_labels[idx[k]]
        reference = make_model("digits")
        reference.load_state_dict(model.state_dict())
        loss = nn.functional.cross_entropy(_disable_dropout(reference).train()(x), y)
        expected = torch.cat([p.flatten() for p in torch.autograd.grad(loss, list(reference.parameters()))])
        assert _relative_error(g[k], expected) < 1e-4


# ------------------------------------------------------------------------------------- checkpoint/resume
@pytest.mark.parametrize("engine", ["auto", "compiled"])
def test_killed_run_resumes_to_the_same_result(tmp_path, engine):
    # stateful pieces on purpose: local momentum, CClip's previous aggregate, ALIE's search, the streams
    cfg = tiny(n_byzantine=2, defense="cclip", attack="alie", local_momentum=0.9, rounds=6, eval_every=2,
               checkpoint_every=2, engine=engine)  # fmt: skip
    reference = run(cfg, progress=False)
    with training.killed_after(5):  # "killed"
        partial = training.run(cfg, progress=False, checkpoint_dir=tmp_path)
    checkpoint = tmp_path / f"{cfg.key()}.pt"
    assert partial.rounds_completed == 5 and checkpoint.exists()
    assert torch.load(checkpoint, weights_only=False)["round"] == 4
    resumed = run(cfg, progress=False, checkpoint_dir=tmp_path)
    assert resumed.round_times[:4] == partial.round_times[:4]  # restored from the checkpoint, not rerun
    assert not checkpoint.exists()  # removed once the run completed
    for name in ("final_accuracy", "final_loss", "accuracy_curve", "attack_params", "rounds_completed"):
        assert getattr(resumed, name) == getattr(reference, name), name


def test_checkpoint_of_another_config_is_not_used(tmp_path):
    cfg = tiny(rounds=3, local_steps=1, checkpoint_every=1)
    with training.killed_after(2):
        training.run(cfg, progress=False, checkpoint_dir=tmp_path)
    assert (tmp_path / f"{cfg.key()}.pt").exists()
    other = run(cfg.replace(seed=1), progress=False, checkpoint_dir=tmp_path)
    assert other.config["seed"] == 1 and other.rounds_completed == 3  # a resumed run would carry seed 0
    assert (tmp_path / f"{cfg.key()}.pt").exists()  # the first config's checkpoint is left alone


# -------------------------------------------------------------------------------------------- divergence
def test_non_finite_model_is_recorded_as_diverged_not_raised():
    # lr = 1e38 drives float32 weights past 3.4e38 within a round
    result = run(tiny(lr=1e38, rounds=5), progress=False)
    assert result.diverged
    assert 1 <= result.diverged_at <= 5 and result.rounds_completed == result.diverged_at
    assert result.final_accuracy == pytest.approx(100 / 10)  # chance level on 10 classes
    assert result.final_loss is None
    json.dumps(result.to_dict(), allow_nan=False)


def test_divergence_under_attack_is_recorded_not_raised():
    # FOE with eps=100 against a plain average sends the model far away; the next round's honest training
    # is then non-finite, which the attack would refuse: the run must end as diverged, not as an error.
    result = run(tiny(attack="foe_100", n_byzantine=2, lr=1.0, rounds=6), progress=False)
    assert result.diverged and result.rounds_completed == result.diverged_at
    assert result.final_accuracy == pytest.approx(100 / 10)


# --------------------------------------------------------------------------------------------- attacks
def test_alie_harms_average_and_prodigy_reports_detection():
    base = tiny(distribution="dirichlet", n_clients=10, n_byzantine=3, rounds=6, eval_every=6)
    clean = run(base.replace(defense="average"), progress=False)
    attacked = run(base.replace(defense="average", attack="alie"), progress=False)
    # ALIE shifts the mean by f/N * z * sigma against the honest mean every round (z > 0 chosen to maximise
    # the deviation), so the plain average ends below the unattacked run
    assert attacked.final_accuracy < clean.final_accuracy
    assert all(p is not None and p > 0 for p in attacked.attack_params)

    prodigy = run(base.replace(defense="prodigy", attack="alie"), progress=False)
    assert len(prodigy.zeroed_clients) == 6
    assert all(len(z) >= 3 and all(0 <= k < 10 for k in z) for z in prodigy.zeroed_clients)
    # micro-averaged over rounds, recomputed from the per-round sets
    hits = sum(len(set(z) & {0, 1, 2}) for z in prodigy.zeroed_clients)
    assert prodigy.detection_precision == pytest.approx(hits / sum(len(z) for z in prodigy.zeroed_clients))
    assert prodigy.detection_recall == pytest.approx(hits / (6 * 3))
    assert clean.detection_precision is None and clean.zeroed_clients == []


def test_label_flip_flips_only_byzantine_clients():
    cfg = tiny(n_byzantine=2, attack="lf", rounds=1)
    shared = training.run_federation(cfg.resolved(), torch.device("cpu"))
    before = shared.train_labels.clone()
    fed = training.start_run(cfg, torch.device("cpu"), "batched", fed=shared).fed
    byzantine = torch.cat(fed.client_indices[:2])
    honest = torch.cat(fed.client_indices[2:])
    assert torch.equal(fed.train_labels[byzantine], 9 - before[byzantine])
    assert torch.equal(fed.train_labels[honest], before[honest])
    assert torch.equal(shared.train_labels, before)  # a federation shared by a group of runs is not touched


# ----------------------------------------------------------------------------------------- result record
def test_result_round_trips_through_json_with_distance_matrices():
    # under ALIE the server's input (the Byzantine rows crafted, the honest momentum) is not the momentum
    changes = dict(rounds=3, eval_every=3, record_distances_at=(1, 3), n_byzantine=2, attack="alie")
    seen = {}
    result = run(tiny(**changes), progress=False, on_round=lambda r, u, *_: seen.setdefault(r, u.clone()))
    assert sorted(result.distance_matrices) == [1, 3]
    for r in (1, 3):  # the squared distances between the updates the server received that round
        d, u = torch.tensor(result.distance_matrices[r], dtype=torch.float64), seen[r].double()
        expected = ((u[:, None, :] - u[None, :, :]) ** 2).sum(dim=-1)
        torch.testing.assert_close(d, expected, rtol=1e-5, atol=1e-6 * expected.max().item())
        assert torch.equal(d.diagonal(), torch.zeros(6, dtype=torch.float64))
    text = json.dumps(result.to_dict(), allow_nan=False)
    assert RunResult.from_dict(json.loads(text)) == result
    config = tiny(**changes)
    stored = RunConfig.from_dict(json.loads(text)["config"])
    assert stored == config.replace(data_source="digits")  # the record names the data source it used
    assert stored.key() == config.key()


# ---------------------------------------------------------------------------------------- config errors
def test_misspelled_field_is_an_error_with_a_hint():
    with pytest.raises(ConfigError, match="did you mean 'local_steps'"):
        RunConfig.from_dict({**TINY, "local_step": 2})
    with pytest.raises(ConfigError, match="rounds='ten' must be an integer, not str"):
        RunConfig.from_dict({**TINY, "rounds": "ten"})


def test_run_rejects_a_plain_dict():
    with pytest.raises(TypeError, match="RunConfig.from_dict"):
        run(dict(TINY), progress=False)


def test_auto_engine_is_batched_on_cuda_and_the_measured_choice_on_cpu():
    # the CPU's choices: the fastest engine per dataset in benchmarks/README.md ("the `auto` engine on a CPU")
    measured = {"digits": "channels_last", "femnist": "sequential", "cifar10": "sequential"}
    assert local_training.pick_engine("auto", torch.device("cuda"), "cifar10") == "batched"
    for dataset, engine in measured.items():
        assert local_training.pick_engine("auto", torch.device("cpu"), dataset) == engine
    assert local_training.pick_engine("sequential", torch.device("cuda"), "digits") == "sequential"


def test_the_public_signatures_have_no_test_only_parameter():
    # stopping a run or a group early ("killed") is a test-only block, training.killed_after, not a parameter
    import inspect

    from prodigy_core import groups

    for public in (run, groups.iter_group):
        names = set(inspect.signature(public).parameters)
        assert not any(n.startswith("_") or "stop" in n for n in names), names
    assert training._KILLED_AFTER is None
    with training.killed_after(3):
        assert training._KILLED_AFTER == 3
    assert training._KILLED_AFTER is None  # restored even for the next test


def test_one_dropout_mask_draw_per_round_gives_the_bits_of_one_draw_per_client_step():
    # Issue 43: the sequential engine draws a round's dropout masks in one counter-based draw per layer,
    # each row cut to its client's batch width; every mask must be, bit for bit, the per-step draw it
    # replaced (`_train_masks`), small clients (Dirichlet 0.1: batches narrower than b) included.
    config = RunConfig(dataset="digits", distribution="dirichlet", dirichlet_alpha=0.1, n_clients=10,
                       n_byzantine=3, local_steps=3, seed=1)  # fmt: skip
    st = training.start_run(config, torch.device("cpu"), "sequential")
    st.streams.step = 7  # a later round: the counters carry on
    resolved = config.resolved()
    batches = [local_training._draw_batch(st.fed, resolved.batch_size, st.streams) for _ in range(3)]
    net = local_training.FunctionalNet(st.model)
    drawn = local_training._round_masks(net, st.streams, batches, 10)
    widths = set()
    for e, (x, _, mask) in enumerate(batches):
        for k in range(10):
            xk = x[k][mask[k]]
            widths.add(len(xk))
            expected = local_training._train_masks(net, st.streams, [k], xk[None], st.streams.step + e)
            got = drawn[e * 10 + k]
            assert got.keys() == expected.keys() == net.dropouts.keys() and len(got) == 1
            assert all(torch.equal(got[n], expected[n][0]) for n in got), (e, k)
    assert len(widths) > 1 and max(widths) == resolved.batch_size  # narrow clients were cut, not padded


def test_a_compiled_step_is_built_once_per_process_and_architecture():
    # Issue 43: the compiled engine compiled its step for every run (about 100 s each on a 2-core CPU); one
    # per worker process and architecture is reused by every run of it (torch.compile is lazy: nothing
    # compiles here).
    first = local_training.per_client_grad(make_model("digits").train(), compiled=True)
    other_weights = make_model("digits").train()
    assert local_training.per_client_grad(other_weights, compiled=True) is first
    no_dropout = _disable_dropout(make_model("digits")).train()
    assert local_training.per_client_grad(no_dropout, compiled=True) is not first
    assert local_training.per_client_grad(make_model("femnist").train(), compiled=True) is not first
    assert local_training.per_client_grad(make_model("digits").eval(), compiled=True) is not first
    eager = local_training.per_client_grad(make_model("digits").train())
    assert eager is not local_training.per_client_grad(make_model("digits").train()) and not eager.compiled


# ------------------------------------------------------------------------------- where a round goes (41)
# eval's sleep outweighs two real evaluations on a loaded 2-core CI machine (0.057 s once, over the 0.05 s of
# slack a 0.05 s sleep left); the aggregate's is short because an attack's search calls the pipeline often
SLEEP = {"craft": 0.04, "aggregate": 0.03, "eval": 0.25}


def _slowed(monkeypatch):
    """Each attack craft, aggregation and evaluation made slower by a known sleep (`SLEEP`)."""
    import time

    from prodigy_core.aggregators import Pipeline

    real_input, real_call, real_eval = training.server_input, Pipeline.__call__, evaluation.evaluate_runs

    def slow(seconds, fn):
        def wrapped(*args, **kwargs):
            time.sleep(seconds)
            return fn(*args, **kwargs)

        return wrapped

    def server_input(momentum, f, attack, pipeline):  # a craft only where there is an attack
        return (slow(SLEEP["craft"], real_input) if attack else real_input)(momentum, f, attack, pipeline)

    monkeypatch.setattr(training, "server_input", server_input)
    monkeypatch.setattr(Pipeline, "__call__", slow(SLEEP["aggregate"], real_call))
    monkeypatch.setattr(evaluation, "evaluate_runs", slow(SLEEP["eval"], real_eval))


def test_a_record_says_where_its_rounds_went_issue_41_item_1(monkeypatch):
    """`phase_seconds`: local steps, attack craft, aggregation, evaluation and the rest, summed over rounds.
    Each phase holds its own known sleep, not another's, and the phases add up to the rounds' time."""
    _slowed(monkeypatch)
    config = tiny(n_byzantine=2, attack="alie", defense="prodigy", rounds=4, eval_every=2, local_steps=1)
    result = run(config, progress=False)
    phases = result.phase_seconds
    assert list(phases) == list(training.PHASES)
    assert json.loads(json.dumps(result.to_dict()))["phase_seconds"] == pytest.approx(phases)
    rounds, evaluations = 4, 2  # an attack's search calls the pipeline too: aggregate only counts the last
    assert SLEEP["craft"] * rounds <= phases["craft"] < SLEEP["craft"] * rounds + 2.0
    assert SLEEP["aggregate"] * rounds <= phases["aggregate"] < SLEEP["aggregate"] * (rounds + 2)
    assert SLEEP["eval"] * evaluations <= phases["eval"] < SLEEP["eval"] * (evaluations + 1)
    timed = sum(result.round_times) + phases["eval"]  # round_times: from the local steps to the server step
    assert timed <= sum(phases.values()) <= timed + 0.1


def test_a_group_member_records_its_share_of_the_shared_phases(monkeypatch):
    """In a group the local steps and evaluations are shared: each member counts its share, so the members'
    evaluations add up to the group's (one pass each time), and only the attacked member crafts."""
    from prodigy_core import groups

    _slowed(monkeypatch)
    base = tiny(n_byzantine=2, rounds=2, eval_every=2, local_steps=1, engine="batched")
    records = groups.run_group([base.replace(attack="alie"), base.replace(attack="none")])
    attacked, clean = (r.phase_seconds for r in records)
    assert attacked["craft"] >= SLEEP["craft"] * 2 > clean["craft"]
    assert SLEEP["eval"] <= attacked["eval"] + clean["eval"] < 2 * SLEEP["eval"]
    assert attacked["local"] == pytest.approx(clean["local"])


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only"
)
def test_a_local_step_reuses_freed_memory_instead_of_page_faulting_it_in_anew():
    """glibc's defaults hand a step's activations back to the OS and page-fault them in again at the next
    step: 4,000-7,000 minor faults a quickstart round on the 2-core EPYC. With `keep_freed_memory` (every run
    calls it) the rounds after the first allocate from memory the process already holds: 10-60 faults a round
    were measured (Python's own arenas), bounded here at 500, a tenth of the default's."""
    import resource

    assert training.keep_freed_memory()
    faults: list[int] = []
    config = load_experiment("quickstart_digits").configs[0].replace(rounds=8, eval_every=100)
    training.run(
        config,
        progress=False,
        on_round=lambda r, *rest: faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt),
    )
    per_round = (faults[-1] - faults[2]) / (len(faults) - 3)  # after the warm-up rounds
    assert per_round < 500, f"{per_round:.0f} minor page faults a round"
