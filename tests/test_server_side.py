"""The server side of a round (attack search and aggregation) without needless host work: host ops, waits and
device kernels counted with the emulated accelerator of conftest.py (`on_accelerator`) at FEMNIST's shape,
and the batched search's choices and aggregates against a search that runs the pipeline on every candidate."""

from __future__ import annotations

import math

import pytest
import torch

from prodigy_core import aggregators as agg
from prodigy_core.aggregators import column_step, geometry, make_aggregator
from prodigy_core.attacks import FOE, ALIESpread, make_attack

FEMNIST = (20, 1_690_046)  # N clients x d parameters of the paper's FEMNIST CNN
F = 6


def gpu_chunks(monkeypatch, scale: int = 1) -> None:
    """The emulated accelerator cuts its passes into a GPU's chunks (`agg._CHUNK_ELEMENTS`), divided by
    ``scale`` for a d divided by it: the same number of chunks, hence kernels, at a fraction of the work."""
    monkeypatch.setitem(agg._CHUNK_ELEMENTS, "cpu", agg._CHUNK_ELEMENTS["other"] // scale)


def updates(n: int, d: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Client updates sharing a small drift, each with its own noise (momentum-like magnitudes)."""
    g = torch.Generator().manual_seed(seed)
    drift = 1e-3 * torch.randn(d, generator=g, dtype=torch.float64)
    return (drift + 1e-2 * torch.randn(n, d, generator=g, dtype=torch.float64)).to(dtype)


def server_side(G: torch.Tensor, defense: str, attack_name: str, f: int = F):
    """One round's server side as `training.server_round` runs it: the attack's search on the honest rows,
    then the aggregation of [crafted; honest] given the search's Gram matrix."""
    server = make_aggregator(defense, f, n_clients=len(G))
    attack = make_attack(attack_name)
    byzantine = attack.craft(G[f:], G[:f], server, honest_finite=True)
    return attack, server, server(torch.cat([byzantine, G[f:]]), gram=attack.last_gram)


def test_prodigy_under_alie_at_femnist_shape_costs_few_host_ops_and_one_wait(on_accelerator, monkeypatch):
    """ProDiGy + ALIE at (20, 1,690,046), f = 6: the 11 candidates scored as one (C, N+1, N+1) batch on the
    host, the aggregation from the search's Gram matrix and weights. Before: 1,555 host ops (about 120 per
    candidate, scored one at a time) and 2 waits here, the Gram matrix copied to the host by the search and
    again by the aggregation (3 a round with the momentum's finiteness check, test_host_waits.py: now 2)."""
    gpu_chunks(monkeypatch)
    G = updates(*FEMNIST)
    with on_accelerator(G) as accelerator:
        attack, server, out = server_side(G, "prodigy", "alie")
        assert accelerator.holds(out)
    assert len(attack.last_search) == 11
    assert accelerator.host_ops <= 200
    assert accelerator.waits == 1  # the line's Gram matrix
    assert not accelerator.holds(server.rule.last_scores.weight)  # the training loop logs it


def test_prodigy_under_alie_spread_scores_its_candidates_as_one_batch(on_accelerator, monkeypatch):
    """ALIE-spread's f distinct rows mu - z sigma + rho xi_j sigma are affine combinations of f + 2 points
    (`ALIESpread.affine`), so its 33 candidates (11 z x 3 rho) are scored from one Gram matrix, as ALIE's 11
    are from its line, and the aggregation takes the chosen one's. Before: 67 waits and 4,562 host ops at
    (20, 169,004), ProDiGy run on each candidate (two waits each)."""
    gpu_chunks(monkeypatch)
    G = updates(*FEMNIST)
    with on_accelerator(G) as accelerator:
        attack, server, out = server_side(G, "prodigy", "alie_spread")
        assert accelerator.holds(out)
    assert len(attack.last_search) == 33 and attack.last_gram is not None
    assert accelerator.waits == 1  # the points' Gram matrix
    assert accelerator.host_ops <= 250


def test_krum_alone_takes_the_search_s_gram_matrix_and_sends_its_choice_to_the_bit(
    on_accelerator, monkeypatch
):
    """Krum alone gives its output as weights (`Rule.by_weights`), so the aggregation under ALIE takes the
    search's Gram matrix (one wait a round, was two: Krum computed its own), and the one-hot weighted sum is
    the chosen row itself: the row of the lowest brute-force Krum score (float64 distances)."""
    gpu_chunks(monkeypatch, 10)
    G = updates(FEMNIST[0], FEMNIST[1] // 10)
    with on_accelerator(G) as accelerator:
        attack, _, out = server_side(G, "krum", "alie")
    assert accelerator.waits == 1 and attack.last_gram is not None
    sent = candidate(attack, attack.last_param, G[F:], F)
    X = sent.double()
    D = ((X[:, None] - X[None]) ** 2).sum(-1)
    n = len(X)
    scores = [sorted(D[i, j].item() for j in range(n) if j != i)[: n - F - 2] for i in range(n)]
    assert torch.equal(out, sent[min(range(n), key=lambda i: sum(scores[i]))])


def test_nnm_trimmed_mean_under_alie_launches_few_kernels_per_chunk(on_accelerator, monkeypatch):
    """NNM + trimmed mean + ALIE, f = 6, at d = 1,690,046 / 10 with a GPU's chunks / 10: the same 6 chunks
    of the 11 candidates as at FEMNIST's shape (which takes 2 GB and 30 s on this CPU), so the same kernels.
    Per chunk: the candidates' rows written as one (were 3 kernels per candidate), one sort for the trimmed
    mean (were 2 topk), which sums the kept sorted values (4 kernels, were 20). Before: 394 kernels (198
    per-candidate row writes, 14 topk calls); 126 with the rows at once and the trimmed mean's former sum."""
    scale = 10
    n, d = FEMNIST[0], FEMNIST[1] // scale
    C = len(make_attack("alie").grid(n, F))
    rows = C * n
    per_gpu = agg._CHUNK_ELEMENTS["other"]
    chunks = math.ceil(FEMNIST[1] / min(FEMNIST[1], per_gpu // rows))
    assert math.ceil(d / min(d, per_gpu // scale // rows)) == chunks == 6
    gpu_chunks(monkeypatch, scale)
    G = updates(n, d)
    with on_accelerator(G) as accelerator:
        attack, _, out = server_side(G, "nnm+trimmed_mean", "alie")
        assert accelerator.holds(out)
    assert column_step(rows, d, G.device) * (chunks - 1) < d  # it did run in 6 chunks
    assert len(attack.last_search) == C
    assert accelerator.kernels <= 80
    assert accelerator.waits == 2  # the line's Gram matrix, the candidates' damages


def candidate(attack, param, honest: torch.Tensor, f: int) -> torch.Tensor:
    """The server's input [rows; honest] when the attack sends ``param``'s rows."""
    return torch.cat([attack.rows(param, attack.statistics(honest, f)).expand(f, honest.shape[1]), honest])


def one_by_one(attack, honest: torch.Tensor, f: int, defense: str) -> list[float]:
    """The reference: the parameters a search may choose, from the pipeline run on every candidate's matrix
    (its own Gram matrix, no line, no batch): those within rounding (1e-14) of the largest damage, where
    rounding decides (CClip clips FOE ε=100's rows alike: equal damages in exact arithmetic), and of equal
    damages only the first (the same aggregate: a tie, which the first candidate wins)."""
    mean = honest.mean(0)
    grid = attack.grid(f + len(honest), f)
    damages = [
        torch.linalg.vector_norm(
            make_aggregator(defense, f).peek(candidate(attack, p, honest, f)) - mean
        ).item()
        for p in grid
    ]
    first = {
        x: p for p, x in reversed(list(zip(grid, damages, strict=True)))
    }  # each damage's first candidate
    return [p for x, p in first.items() if x >= max(damages) * (1 - 1e-14)]


WEIGHTED = [
    "prodigy",
    "krum",
    "multikrum",
    "geomed",
    "cclip",
    "average",
    "nnm+krum",
    "nnm+cclip",
]
COORDINATEWISE = ["trimmed_mean", "nnm+trimmed_mean", "median", "nnm+median"]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("attack_name", ["alie", "foe_0.1", "foe_100"])
@pytest.mark.parametrize("defense", WEIGHTED + COORDINATEWISE)
def test_the_batched_search_and_the_aggregation_from_its_gram_matrix_equal_the_one_by_one_ones(
    defense, attack_name, seed
):
    """float64: the parameter the search chooses, and the aggregate of [crafted; honest] given the search's
    Gram matrix (and, for a pipeline that gives weights, its batch's weights), equal the pipeline's own on
    each candidate. Krum under FOE ε=100 (seed 1) has exact ties among candidates (the same honest client
    chosen): one product over all candidates' rows rounded equal candidates apart and chose another. GeoMed's
    Weiszfeld iterations carry a product's last bits: 6e-12 relative with two threads' sums, hence 1e-10."""
    G = updates(20, 3000, seed, torch.float64) + 0.3 * seed
    attack, server, out = server_side(G, defense, attack_name)
    assert attack.last_param in one_by_one(make_attack(attack_name), G[F:], F, defense)
    want = make_aggregator(defense, F)
    torch.testing.assert_close(
        out, want(candidate(attack, attack.last_param, G[F:], F)), rtol=1e-10, atol=1e-12
    )
    if defense.endswith("prodigy"):
        for got, ref in zip(server.rule.last_scores, want.rule.last_scores, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)


@pytest.mark.parametrize("defense", WEIGHTED + COORDINATEWISE)
def test_alie_spread_scored_from_one_gram_matrix_equals_the_pipeline_on_each_candidate(defense):
    """float64: each (z, rho)'s damage from the points' Gram matrix equals the pipeline run on that
    candidate's rows (the same draw xi, from the same seed), the search chooses a largest one, and the
    aggregation given the chosen candidate's Gram matrix equals the pipeline's own on the rows sent."""
    G = updates(20, 3000, 0, torch.float64) + 0.3
    honest = G[F:]
    attack = ALIESpread(generator=torch.Generator().manual_seed(5))
    server = make_aggregator(defense, F)
    sent = attack.craft(honest, G[:F], server, honest_finite=True)
    out = server(torch.cat([sent, honest]), gram=attack.last_gram)
    reference = ALIESpread(generator=torch.Generator().manual_seed(5))
    stats, mean = reference.statistics(honest, F), honest.mean(0)
    grid = reference.grid(20, F)
    damages = [
        torch.linalg.vector_norm(
            make_aggregator(defense, F).peek(torch.cat([reference.rows(p, stats), honest])) - mean
        ).item()
        for p in grid
    ]
    assert [p for p, _ in attack.last_search] == grid
    assert [x for _, x in attack.last_search] == pytest.approx(damages, rel=1e-9, abs=1e-12)
    chosen = (attack.last_param, attack.last_rho)
    assert damages[grid.index(chosen)] >= max(damages) * (1 - 1e-9)
    assert torch.equal(sent, reference.rows(chosen, stats))
    assert len({tuple(row.tolist()) for row in sent}) == F  # f distinct rows
    want = make_aggregator(defense, F)(torch.cat([sent, honest]))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("seed", [2, 3])
def test_candidates_with_the_same_aggregate_get_the_same_damage_to_the_bit(seed):
    """Krum under FOE ε=100 picks the same honest client for every candidate: their damages are ties, which
    the first candidate wins. One product over all the candidates' rows rounded them apart (2 values here);
    each candidate's own product (`_AffineGeometry._sandwich`) keeps them equal."""
    G = torch.randn(20, 3000, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.3
    attack = make_attack("foe_100")
    attack.craft(G[F:], G[:F], make_aggregator("krum", F))
    assert len({damage for _, damage in attack.last_search}) == 1
    assert attack.last_param == attack.grid(20, F)[0]


class OneAtATime(agg.Rule):
    """A plug-in combining rule, no batched ``combine``: the mean of the N - f inputs nearest the origin."""

    def __init__(self, f: int):
        self.f = f

    def combine(self, K, D, bad):
        N = len(bad)
        norms = K.diagonal()[:N] - 2 * K[:N, N] + K[N, N]
        w = torch.zeros(N, dtype=torch.float64).index_fill_(
            0, norms.argsort()[: N - self.f], 1 / (N - self.f)
        )
        return agg.Combination(torch.cat([w, w.new_zeros(1)]))


@pytest.mark.parametrize("defense", WEIGHTED)
def test_weights_of_a_batch_of_gram_matrices_are_each_ones(defense):
    """`Pipeline.weights` on (C, N+1, N+1) gives each matrix's weights; ProDiGy's median fallback (all
    vectors equal: no weights) is a row of NaN; a plug-in rule without a batched combine runs one by one."""
    grams = torch.stack([geometry(updates(10, 200, s, torch.float64), origin=True).K for s in range(3)])
    pipeline = make_aggregator(defense, 3)
    batch = pipeline.weights(grams)
    for w, gram in zip(batch, grams, strict=True):
        torch.testing.assert_close(w, pipeline.weights(gram), rtol=1e-13, atol=1e-15)
    equal = geometry(torch.ones(10, 200, dtype=torch.float64), origin=True).K
    both = pipeline.weights(torch.stack([grams[0], equal]))
    assert both.shape == (2, 11)
    if defense == "prodigy":
        assert pipeline.weights(equal) is None and both[1].isnan().all()
    plug = agg.Pipeline("one", OneAtATime(3))
    for w, gram in zip(plug.weights(grams), grams, strict=True):
        assert torch.equal(w, plug.weights(gram))


def old_median(values: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise median as it was computed before one sort: torch's lower middle value, and for
    even N the next value up."""
    N = values.shape[-2]
    lower = values.median(dim=-2).values
    if N % 2:
        return lower
    n_at_most = (values <= lower.unsqueeze(-2)).sum(dim=-2)
    above = torch.where(values > lower.unsqueeze(-2), values, math.inf).amin(dim=-2)
    return 0.5 * lower + 0.5 * torch.where(n_at_most >= N // 2 + 1, lower, above)


def old_trimmed_mean(G: torch.Tensor, f: int) -> torch.Tensor:
    """The trimmed mean as it was computed before one sort: the ends of the kept range from two topk."""
    N = G.shape[-2]
    G = torch.where(torch.isnan(G), math.inf, G)
    hi = G.topk(f + 1, dim=-2).values[..., -1, :]
    lo = G.topk(f + 1, dim=-2, largest=False).values[..., -1, :]
    kept = (G.clamp(min=lo.unsqueeze(-2), max=hi.unsqueeze(-2)).sum(dim=-2) - f * (lo + hi)) / (N - 2 * f)
    return torch.where(torch.isfinite(lo) & torch.isfinite(hi), kept, lo + hi)


@pytest.mark.parametrize("n", [9, 10])
def test_median_and_trimmed_mean_from_one_sort_equal_the_topk_ones(n):
    """float32, ties, and ±inf and NaN in some coordinates (several on one side in one, on both sides in
    another): the median to the bit; the trimmed mean, which now sums the kept values instead of clamping
    every value to the kept range, within float32 rounding, with the same infinities and NaN."""
    g = torch.Generator().manual_seed(n)
    G = torch.randn(4, n, 300, generator=g).round(decimals=1)  # a batch of 4, with ties
    G[:, :2, :5], G[:, :4, 5:8], G[:, 0, 8:10], G[:, :3, 10:12] = math.inf, -math.inf, math.nan, math.nan
    G[:, :4, 12], G[:, 4:8, 12] = math.inf, -math.inf
    for f in (1, 3):
        torch.testing.assert_close(agg.TrimmedMean(f).aggregate(G), old_trimmed_mean(G, f), equal_nan=True)
    assert torch.equal(agg.Median(3).aggregate(G), old_median(torch.where(G.isnan(), math.inf, G)))


def test_alie_and_foe_rows_from_a_column_equal_each_candidates_to_the_bit():
    """The batched search forms every candidate's rows from the parameters as a column (C, 1): the same
    float32 bits as the rows of each parameter alone, which the attack then sends."""
    honest = updates(14, 1000)
    for name in ("alie", "foe_0.1"):
        attack = make_attack(name)
        stats, grid = attack.statistics(honest, F), attack.grid(20, F)
        column = torch.tensor(grid, dtype=torch.float64)[:, None].to(honest.dtype)
        assert torch.equal(attack.rows(column, stats), torch.stack([attack.rows(p, stats) for p in grid]))


@pytest.mark.parametrize("defense", WEIGHTED + ["nnm+trimmed_mean", "nnm+median", "trimmed_mean"])
def test_an_aggregation_given_its_gram_matrix_equals_the_one_that_computes_it(defense):
    """``pipeline(G, gram=K)``, K the Gram matrix of [G; reference] that no batch scored (the route of an
    ALIE ``authors`` search that keeps its typed z), equals ``pipeline(G)`` in float64, state included:
    ProDiGy's scores, CClip's next start (the reference point is the origin before its first call)."""
    G = updates(20, 500, 7, torch.float64)
    given, own = make_aggregator(defense, F), make_aggregator(defense, F)
    K = geometry(G, origin=True).K
    torch.testing.assert_close(given(G, gram=K), own(G), rtol=1e-12, atol=1e-15)
    if defense.endswith("prodigy"):
        for got, ref in zip(given.rule.last_scores, own.rule.last_scores, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)
    if defense.endswith("cclip"):
        torch.testing.assert_close(given.rule.prev, own.rule.prev, rtol=1e-12, atol=1e-15)


def test_an_attack_whose_rows_leave_its_line_hands_the_server_no_gram_matrix():
    """The search's Gram matrix describes rows on the attack's line; a subclass that overrides ``rows``
    alone may send others, so the server computes its own Gram matrix from what it receives."""

    class Shifted(FOE):
        def rows(self, eps, stats):
            return super().rows(eps, stats) + 1.0

    G = updates(20, 300)
    server = make_aggregator("prodigy", F)
    for attack, handed in ((FOE(eps=0.1), True), (Shifted(eps=0.1), False)):
        attack.craft(G[F:], G[:F], server)
        assert (attack.last_gram is not None) == handed


@pytest.mark.parametrize("name", ["alie", "alie_spread"])
def test_the_attack_benchmark_s_one_by_one_route_runs_the_pipeline_on_every_candidate(scripts, name):
    """benchmarks/attacks.py compares the search with the route before it (``one_by_one``): there the
    pipeline runs on each candidate (one ``peek`` each), where the search itself runs it on none."""
    bench = scripts("benchmarks/attacks.py")
    G = updates(20, 500)
    server = make_aggregator("prodigy", F)
    peeks = []
    real = server.peek
    server.peek = lambda *a, **k: peeks.append(1) or real(*a, **k)
    attack = make_attack(name)
    attack.craft(G[F:], G[:F], server)
    assert not peeks and attack.last_gram is not None
    with bench.one_by_one():
        attack.craft(G[F:], G[:F], server)
    assert len(peeks) == len(attack.grid(20, F)) and attack.last_gram is None
    attack.craft(G[F:], G[:F], server)  # the route restored
    assert len(peeks) == len(attack.grid(20, F))


def test_an_affine_span_of_the_wrong_shape_is_named():
    """A plug-in's `affine` whose moves do not fit its points is an error that names the expected shape,
    not a broadcasting error from inside torch."""

    class Bent(ALIESpread):
        def rows(self, param, stats):  # its own rows and points (else its points are not trusted: no Gram)
            return super().rows(param, stats)

        def affine(self, stats):
            points, moves = super().affine(stats)
            return points, moves[:, :, :-1]  # one column short of its f + 2 points

    G = updates(20, 300)
    shape = r"alie_spread.affine: S must be \(m, f or 1, k\) = \(m, 6 or 1, 8\)"
    with pytest.raises(ValueError, match=shape):
        Bent().craft(G[F:], G[:F], make_aggregator("prodigy", F))
