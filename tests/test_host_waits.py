"""Waits for the device per training round, counted on an accelerator emulated on the CPU (`on_accelerator`
in conftest.py), and the divergence record that the fewer waits must leave unchanged."""

import functools

import pytest
import torch

from prodigy_core import local_training, training
from prodigy_core.config import RunConfig

ROUNDS = 4  # the last ends with an evaluation


@pytest.mark.parametrize(("defense", "most"), [("prodigy", 2), ("nnm+trimmed_mean", 3)])
def test_host_waits_per_round_are_bounded(on_accelerator, defense, most):
    """A round under ALIE on a GPU waits for: the finiteness of the honest momentum (with the last round's
    model's, when that round had no evaluation), the attack's line Gram matrix, which the aggregation takes
    too (`Attack.last_gram`), and its batch of candidates' damages (coordinate-wise rules). A round that ends
    with an evaluation also reads its model's finiteness and, in one wait, the evaluation's numbers. Before:
    3 waits a round for ProDiGy and 4 for NNM + trimmed mean (the aggregation copied its own Gram matrix);
    before that 5 and 36 (two per candidate of the search's 15, a second finiteness check, the rule's own
    all-finite check)."""
    config = RunConfig(dataset="digits", n_clients=10, n_byzantine=3, defense=defense, attack="alie",
                       rounds=ROUNDS, eval_every=ROUNDS, local_steps=1, batch_size=16)  # fmt: skip
    st = training.start_run(config, torch.device("cpu"), "batched")
    grad_fn = local_training.per_client_grad(st.model)
    local_steps = functools.partial(local_training.local_steps_batched, grad_fn=grad_fn)
    # the federation's tensors live on the device, except the copy of the client sizes it keeps on the host
    # (every client's batch is drawn there, from its own CPU generator: prodigy_core.streams); on a CPU the
    # two are one tensor, so the host's becomes a copy of its own here, as on a real device
    st.fed._cpu_sizes = st.fed._cpu_sizes.clone()
    data = [t for k, t in vars(st.fed).items() if isinstance(t, torch.Tensor) and k != "_cpu_sizes"]
    waits = []
    with on_accelerator(*st.model.parameters(), *st.model.buffers(), st.momentum, *data) as accelerator:
        for r in range(1, ROUNDS + 1):
            before = accelerator.waits
            grads, buffers = local_steps(st.model, st.fed, 1, 0.05, st.resolved, st.streams)
            assert training.server_round(st, r, 0.05, grads, buffers)
            assert training.end_round(st, r)
            waits.append(accelerator.waits - before)
        assert accelerator.holds(st.momentum)
    assert waits[:-1] == [most] * (ROUNDS - 1)  # no evaluation
    assert waits[-1] == most + 2


@pytest.mark.parametrize("eval_every", [4, 3])
def test_a_model_that_becomes_non_finite_is_recorded_at_its_round(monkeypatch, eval_every):
    """Round 3's server step makes the model non-finite (an infinite update averaged in). Whether that is
    read at once (round 3 ends with an evaluation) or with round 4's check (it does not), the record is
    the one of a run stopped at round 3: diverged there, 3 rounds completed, no round time for round 3,
    no evaluation at or after it."""
    calls = []
    real_input = training.server_input

    def server_input(momentum, f, attack, pipeline):
        calls.append(1)
        updates = real_input(momentum, f, attack, pipeline)
        return torch.full_like(updates, torch.inf) if len(calls) == 3 else updates

    monkeypatch.setattr(training, "server_input", server_input)
    config = RunConfig(dataset="digits", n_clients=6, n_byzantine=0, defense="average", rounds=8,
                       eval_every=eval_every, local_steps=1, batch_size=32, device="cpu")  # fmt: skip
    result = training.run(config, progress=False)
    assert result.diverged and result.diverged_at == 3 and result.rounds_completed == 3
    assert len(result.round_times) == 2 and len(result.attack_params) == 3
    assert result.accuracy_curve == []
    assert result.final_accuracy == pytest.approx(100 / 10) and result.final_loss is None
    assert len(calls) == 3  # round 4 stopped before its attack and aggregation
