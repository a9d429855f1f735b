"""A run's random streams (`prodigy_core.streams`): the counter-based dropout masks against a pure-Python
splitmix64, and one key, one computation: the sequential and batched engines agree over 3 rounds."""

import pytest
import torch
from torch.nn.utils import parameters_to_vector

from prodigy_core import training
from prodigy_core.config import RunConfig
from prodigy_core.streams import ClientStreams, dropout_mask, uniforms

M = 2**64 - 1


def splitmix64(state: int) -> tuple[int, int]:
    """Vigna's splitmix64 next(): (new state, output), unsigned 64-bit, written from the reference C code."""
    state = (state + 0x9E3779B97F4A7C15) & M
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    return state, z ^ (z >> 31)


def folded(*words: int) -> int:
    """The stream key: each word xored into the state, then one splitmix64 output becomes the state."""
    z = 0
    for w in words:
        z = splitmix64(z ^ (w & M))[1]
    return z


@pytest.mark.parametrize("seed", [0, 7, -3, 2**63 + 5])
def test_dropout_masks_are_splitmix64_outputs_computed_in_pure_python(seed):
    """Entry i of a mask row with key K is the (i+1)-th splitmix64 output from state K, its top 24 bits as a
    uniform u, kept (1 / (1 - p)) when u >= p: integers only, so every device computes the same mask."""
    streams = ClientStreams(seed, 4)
    keys = streams.keys([streams.client_keys[k] for k in (0, 3)], 5, 1, torch.device("cpu"))
    assert [k % 2**64 for k in keys.tolist()] == [folded(folded(seed, 1, k), 5, 1) for k in (0, 3)]
    u, mask = uniforms(keys, 300), dropout_mask(keys, (3, 10, 10), 0.25, torch.float32)
    for row, key in enumerate(keys.tolist()):
        state = key % 2**64
        for i in range(300):
            state, out = splitmix64(state)
            expected = (out >> 40) / 2**24
            assert u[row, i].item() == expected, (row, i)
            assert mask[row].flatten()[i].item() == (0.0 if expected < 0.25 else pytest.approx(4 / 3))
    assert 0.2 < (mask == 0).float().mean().item() < 0.3  # about p of the entries dropped
    assert streams.eval_key(4) == folded(seed, 2, 4)  # the evaluation's own stream


def final_parameters(config: RunConfig, monkeypatch) -> tuple[torch.Tensor, training.RunResult]:
    """Run `config`; its server model's final parameters and record."""
    kept = {}
    finish = training.finish_run

    def keep(st, keep_checkpoint=False):
        kept["theta"] = parameters_to_vector(st.model.parameters()).detach().clone()
        return finish(st, keep_checkpoint)

    monkeypatch.setattr(training, "finish_run", keep)
    result = training.run(config, progress=False)
    return kept["theta"], result


@pytest.mark.parametrize("dataset", ["digits", "femnist"])
def test_sequential_and_batched_engines_run_one_computation(dataset, monkeypatch, request):
    """3 rounds of ProDiGy under ALIE with local momentum, dropout on (digits; the FEMNIST CNN has none):
    the same clients zeroed, the same z chosen, the parameters equal to float32 rounding (measured on a
    2-core CPU: 2.0e-8 relative for digits, 1.1e-8 for FEMNIST; stated 1e-6)."""
    fields = dict(dataset=dataset, n_clients=6, n_byzantine=2, defense="prodigy", attack="alie", rounds=3,
                  local_steps=3, batch_size=32, eval_every=1, local_momentum=0.9, device="cpu")  # fmt: skip
    if dataset == "femnist":
        fields.update(distribution="natural", n_clients=5, batch_size=16, local_steps=2,
                      data_dir=str(request.getfixturevalue("femnist_dir")))  # fmt: skip
    (theta_s, seq), (theta_b, bat) = (
        final_parameters(RunConfig(**fields, engine=e), monkeypatch) for e in ("sequential", "batched")
    )
    assert seq.zeroed_clients == bat.zeroed_clients and len(seq.zeroed_clients) == 3
    assert seq.attack_params == bat.attack_params
    assert ((theta_s - theta_b).norm() / theta_b.norm()).item() < 1e-6
    assert seq.final_loss == pytest.approx(bat.final_loss, rel=1e-5)
