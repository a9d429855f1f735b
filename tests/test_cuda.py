"""The same semantics on a GPU: every rule, attack and engine on CUDA against the CPU reference.

Skipped where torch sees no CUDA device (CI has none); run on a GPU machine with `pytest tests/test_cuda.py`.
"""

import warnings

import pytest
import torch

from prodigy_core import local_training, training
from prodigy_core.aggregators import BASE_NAMES, make_aggregator, pairwise_sq_distances
from prodigy_core.attacks import make_attack
from prodigy_core.config import RunConfig
from prodigy_core.data import load_federation
from prodigy_core.models import make_model
from prodigy_core.streams import ClientStreams, dropout_mask

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
CUDA = torch.device("cuda")


def updates(n: int = 20, d: int = 3000, seed: int = 0) -> torch.Tensor:
    """Heterogeneous rows sharing a large offset (where a float32 Gram on raw vectors would fail)."""
    g = torch.Generator().manual_seed(seed)
    return 50.0 + torch.linspace(0.5, 2.0, n)[:, None] * torch.randn(n, d, generator=g)


@pytest.mark.parametrize(
    "name", [n for n in BASE_NAMES if n != "none"] + ["nnm+krum", "nnm+geomed", "nnm+cclip"]
)
def test_every_rule_matches_the_cpu(name):
    G = updates()
    f = 3
    cpu = make_aggregator(name, f, n_clients=len(G))(G)
    gpu = make_aggregator(name, f, n_clients=len(G))(G.to(CUDA))
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-4, atol=1e-4)


def test_prodigy_zeroes_the_same_clients_on_cuda():
    G = updates(seed=3)
    G[:4] = G[4:].mean(0) - 0.5 * G[4:].std(0)  # ALIE-like identical rows
    cpu = make_aggregator("prodigy", 4)
    gpu = make_aggregator("prodigy", 4)
    cpu(G), gpu(G.to(CUDA))
    assert torch.equal(cpu.rule.last_scores.weight == 0, gpu.rule.last_scores.weight.cpu() == 0)


def test_the_n_by_n_algebra_runs_on_the_host():
    """geometry brings the Gram matrix to the CPU; public results stay on G's device, logged scores on the
    CPU; and a ProDiGy call waits for the device once (sync debug mode warns at each wait)."""
    from prodigy_core.aggregators import ProDiGy, geometry

    G = updates().to(CUDA) - 50.0  # no shared offset: no recentring pass
    assert all(t.device.type == "cpu" for t in geometry(G, origin=True))
    assert pairwise_sq_distances(G).device.type == "cuda"
    assert ProDiGy(3).scores(G).weight.device.type == "cuda"
    pipeline = make_aggregator("prodigy", 3)
    pipeline(G)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = pipeline(G)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.device.type == "cuda" and pipeline.rule.last_scores.weight.device.type == "cpu"
    waits = [w for w in caught if "synchroniz" in str(w.message)]
    assert 1 <= len(waits) <= 2, [str(w.message) for w in waits]  # K to the host (weights back: pageable)


@pytest.mark.parametrize("defense", ["nnm+trimmed_mean", "prodigy", "nnm+cclip"])  # each route of the search
@pytest.mark.parametrize("attack", ["alie", "foe_100", "minmax"])
def test_attack_search_picks_the_same_candidate(attack, defense):
    G = updates(n=13, seed=5)
    honest, own = G[3:], G[:3]
    chosen = []
    for device in ("cpu", CUDA):
        server = make_aggregator(defense, 3, n_clients=13)
        server(G.to(device))  # a committed round: CClip's start is not the origin
        atk = make_attack(attack)
        out = atk.craft(honest.to(device), own.to(device), server)
        assert out.device.type == torch.device(device).type and torch.isfinite(out).all()
        chosen.append(atk.last_param)
    assert chosen[0] == pytest.approx(chosen[1])


@pytest.fixture
def no_tf32():
    """cuDNN convolutions default to TF32 (10-bit mantissa) on Ampere and later; compare in full float32."""
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = before


def test_batched_engine_matches_sequential_on_cuda(no_tf32):
    fed = load_federation("digits", 6, distribution="dirichlet", seed=0, device=CUDA)
    jitter = torch.rand(fed.train_images.shape, device=CUDA)
    fed.train_images = fed.train_images + 1e-3 * jitter  # no max-pooling ties (see test_training)
    torch.manual_seed(0)
    model = make_model("digits").to(CUDA).train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    cfg = RunConfig(dataset="digits", distribution="dirichlet", n_clients=6, n_byzantine=0, defense="average",
                    batch_size=100, device="cuda").resolved()  # fmt: skip
    out = []
    for local_steps in (local_training.local_steps_batched, local_training.local_steps_sequential):
        gen = ClientStreams(1, fed.n_clients)  # the same batches and dropout masks for both engines
        out.append(local_steps(model, fed, 3, 0.05, cfg, gen)[0])
    assert out[0].device.type == "cuda"
    assert (torch.linalg.vector_norm(out[0] - out[1]) / torch.linalg.vector_norm(out[1])).item() < 1e-4


def test_a_cuda_run_learns_and_records_its_device():
    cfg = RunConfig(dataset="digits", distribution="iid", n_clients=8, n_byzantine=2, defense="prodigy",
                    attack="alie", rounds=8, local_steps=4, batch_size=32, eval_every=4,
                    device="cuda")  # fmt: skip
    result = training.run(cfg, progress=False)
    assert not result.diverged and result.final_accuracy > 50.0  # chance is 10%
    assert result.environment["device"].startswith("cuda") and result.environment["engine"] == "batched"


@pytest.mark.parametrize("offset", [0.5, 3.0, 1e3])  # about the origin (ratio 0.6, 5), recentred
def test_distances_stay_accurate_with_a_shared_offset(offset):
    """The GPU's large Gram chunks (one chunk here) stay accurate, with or without recentring."""
    g = torch.Generator().manual_seed(7)
    G = offset + torch.randn(30, 200_000, generator=g)
    exact = torch.cdist(G.double(), G.double()).square()
    D = pairwise_sq_distances(G.to(CUDA)).cpu()
    off_diagonal = ~torch.eye(30, dtype=torch.bool)
    # About the origin, float32 error grows with the shared component (bounded by the recentre ratio) and
    # with the 200k-term sums of one chunk (MKL on a CPU: 6e-6 at offset 3); a raw float32 Gram at offset
    # 1e3 is off by about 4e-2.
    tolerance = 1e-5 if offset > 100 else 1e-4
    assert ((D - exact).abs()[off_diagonal] / exact[off_diagonal]).max() < tolerance


def test_distances_stay_accurate_when_the_caller_turns_on_tf32():
    G = updates(d=200_000, seed=9)  # offset 50: a TF32 product would be off by ~1e-3 before cancellation
    exact = torch.cdist(G.double(), G.double()).square()
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        D = pairwise_sq_distances(G.to(CUDA)).cpu()
    finally:
        torch.set_float32_matmul_precision(previous)
    off_diagonal = ~torch.eye(len(G), dtype=torch.bool)
    assert ((D - exact).abs()[off_diagonal] / exact[off_diagonal]).max() < 1e-4


def test_dropout_masks_and_client_batches_are_the_same_on_cuda():
    """One key, one computation: the counter-based masks and CPU-drawn batches do not depend on the device."""
    streams = ClientStreams(3, 5)
    for device in ("cpu", CUDA):
        keys = streams.keys(streams.client_keys, 7, 2, torch.device(device))
        masks = dropout_mask(keys, (64, 128, 8, 8), 0.25, torch.float32).cpu()
        if device == "cpu":
            reference = masks
    assert torch.equal(masks, reference)
    fed_cpu, fed_cuda = (load_federation("digits", 5, seed=0, device=d) for d in ("cpu", CUDA))
    idx_cpu, idx_cuda = (
        fed_cpu.sample_batch(32, fed_cpu.generators(1)),
        fed_cuda.sample_batch(32, fed_cuda.generators(1)),
    )
    assert torch.equal(idx_cpu[0], idx_cuda[0].cpu()) and torch.equal(idx_cpu[1], idx_cuda[1].cpu())
