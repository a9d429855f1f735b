"""Aggregators against brute-force loops of the paper's formulas, invariants and hostile input."""

import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from prodigy_core import aggregators as agg
from prodigy_core.aggregators import (
    AGGREGATOR_NAMES,
    NNM,
    Average,
    Bucketing,
    Bulyan,
    CClip,
    GeoMed,
    Krum,
    Median,
    MultiKrum,
    Pipeline,
    ProDiGy,
    TrimmedMean,
    make_aggregator,
    pairwise_sq_distances,
)
from prodigy_core.attacks import make_attack

# ------------------------------------------------------------------ brute force (float64, Python loops)


def bf_dist(G):
    N = len(G)
    return [[float(((G[i] - G[j]) ** 2).sum()) for j in range(N)] for i in range(N)]


def bf_others(D, k):
    """(distance, index) to the other clients, increasing, ties by index."""
    return sorted((D[k][j], j) for j in range(len(D)) if j != k)


def bf_krum_scores(G, f):
    D = bf_dist(G)
    return [sum(v for v, _ in bf_others(D, k)[: len(G) - f - 2]) for k in range(len(G))]


def bf_krum(G, f):
    s = bf_krum_scores(G, f)
    return G[min(range(len(G)), key=lambda k: (s[k], k))]


def bf_krum_without(G, f, bad_rows):
    """Krum with bad rows infinitely far: the N-f-2 nearest others of a good row are all good."""
    good = G[[i for i in range(len(G)) if i not in bad_rows]].double()
    D = bf_dist(good)
    s = [sum(v for v, _ in bf_others(D, k)[: len(G) - f - 2]) for k in range(len(good))]
    return good[min(range(len(good)), key=lambda k: (s[k], k))]


def bf_multikrum(G, f, m=None):
    m = len(G) - f if m is None else m
    s = bf_krum_scores(G, f)
    chosen = sorted(range(len(G)), key=lambda k: (s[k], k))[:m]
    return sum(G[k] for k in chosen) / m


def bf_median_1d(values):
    v, n = sorted(values), len(values)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def bf_coordinatewise(G, fn):
    return torch.tensor(
        [fn([float(G[i, j]) for i in range(len(G))]) for j in range(G.shape[1])], dtype=torch.float64
    )


def bf_median(G):
    return bf_coordinatewise(G, bf_median_1d)


def bf_trimmed(G, f):
    return bf_coordinatewise(G, lambda v: sum(sorted(v)[f : len(v) - f]) / (len(v) - 2 * f))


def bf_geomed(G, nu=0.1, R=3):
    z = torch.zeros(G.shape[1], dtype=torch.float64)
    for _ in range(R):
        b = [1 / max(nu, float((z - g).norm())) for g in G]
        z = sum(bi * g for bi, g in zip(b, G, strict=True)) / sum(b)
    return z


def bf_cclip(G, prev, tau=10.0, L=3):
    v = prev.clone()
    for _ in range(L):
        step = torch.zeros_like(v)
        for g in G:
            x = g - v
            step += x * min(1.0, tau / float(x.norm())) if float(x.norm()) > 0 else x
        v = v + step / len(G)
    return v


def bf_prodigy(G, f):
    N = len(G)
    D = bf_dist(G)
    s_p, s_d = [], []
    for k in range(N):
        others = bf_others(D, k)
        s_p.append(1 / sum(v for v, _ in others[f - 1 : N - f - 1]))  # delta_{k,f} .. delta_{k,N-f-1}
        hood = [G[k]] + [G[j] for _, j in others[: f - 1]]
        mu = sum(hood) / f
        sigma = math.sqrt(sum(float(((g - mu) ** 2).sum()) for g in hood) / f)
        s_d.append(sigma / float(mu.norm()))
    s = [a * b for a, b in zip(s_p, s_d, strict=True)]
    threshold = sorted(s)[f - 1]
    w = [si if si > threshold else 0.0 for si in s]
    out = sum(wi * g for wi, g in zip(w, G, strict=True)) / sum(w) if sum(w) > 0 else bf_median(G)
    return out, s_p, s_d, s, w


def bf_nnm(G, f):
    D = bf_dist(G)
    return torch.stack(
        [
            (G[k] + sum(G[j] for _, j in bf_others(D, k)[: len(G) - f - 1])) / (len(G) - f)
            for k in range(len(G))
        ]
    )


def bf_bulyan(G, f):
    N = len(G)
    D = bf_dist(G)
    remaining, selected = list(range(N)), []
    for _ in range(N - 2 * f):
        k = max(len(remaining) - f - 2, 1)
        scores = [sum(sorted(D[i][j] for j in remaining if j != i)[:k]) for i in remaining]
        best = min(range(len(remaining)), key=lambda a: (scores[a], a))
        selected.append(remaining.pop(best))
    S = G[selected]

    def closest_mean(v):
        med = bf_median_1d(v)
        return sum(sorted(v, key=lambda x: abs(x - med))[: N - 4 * f]) / (N - 4 * f)

    return bf_coordinatewise(S, closest_mean)


# ------------------------------------------------------------------------------------------- inputs

SHAPES = [(7, 1, 5), (10, 3, 6), (11, 2, 4), (15, 3, 5), (20, 4, 3)]


def random_inputs(N, f, d, seed):
    gen = torch.Generator().manual_seed(seed)
    plain = torch.randn(N, d, generator=gen, dtype=torch.float64)
    twins = plain.clone()
    twins[:f] = torch.randn(d, generator=gen, dtype=torch.float64) * 3  # identical Byzantine rows
    offset = plain + 5.0  # a shared component
    return [plain, twins, offset]


def cases(ok):
    return [
        pytest.param(G, f, id=f"N{N}-f{f}-d{d}-{i}")
        for N, f, d in SHAPES
        if ok(N, f)
        for i, G in enumerate(random_inputs(N, f, d, seed=N * 100 + f))
    ]


def close(a, b, tol=1e-8):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------- brute-force checks


@pytest.mark.parametrize("G,f", cases(lambda N, f: True))
def test_distances_median_trimmed_mean_geomed_cclip(G, f):
    close(pairwise_sq_distances(G), torch.tensor(bf_dist(G), dtype=torch.float64))
    close(Median()(G), bf_median(G))
    close(TrimmedMean(f)(G), bf_trimmed(G, f))
    close(GeoMed()(G), bf_geomed(G))
    rule, prev = CClip(tau=1.5), torch.zeros(G.shape[1], dtype=torch.float64)
    for _ in range(2):  # the second round starts from the first round's aggregate
        prev = bf_cclip(G, prev, tau=1.5)
        close(rule(G), prev)


@pytest.mark.parametrize("G,f", cases(lambda n, f: n > 2 * f + 2))
def test_krum_multikrum_nnm(G, f):
    close(Krum(f)(G), bf_krum(G, f))
    close(MultiKrum(f)(G), bf_multikrum(G, f))
    close(MultiKrum(f, m=2)(G), bf_multikrum(G, f, m=2))
    close(NNM(f)(G), bf_nnm(G, f))


@pytest.mark.parametrize("G,f", cases(lambda n, f: n > 2 * f + 2))
def test_nnm_pipelines_equal_the_brute_force_composition(G, f):
    """nnm+krum and friends run from one Gram matrix: check them against NNM then the rule, by brute force."""
    mixed = bf_nnm(G, f)
    close(make_aggregator("nnm+krum", f)(G), bf_krum(mixed, f))
    close(make_aggregator("nnm+multikrum", f)(G), bf_multikrum(mixed, f))
    close(make_aggregator("nnm+geomed", f)(G), bf_geomed(mixed))
    close(make_aggregator("nnm+average", f)(G), mixed.mean(dim=0))
    close(make_aggregator("nnm+krum", f).peek(G), bf_krum(mixed, f))


@pytest.mark.parametrize("G,f", cases(lambda N, f: 2 <= f < N / 2))
def test_nnm_prodigy_from_one_gram_matrix_equals_nnm_then_prodigy(G, f):
    """The pipeline (NNM's mixing and ProDiGy's scores from one Gram matrix) against NNM's output handed to
    ProDiGy: on these inputs NNM maps clients with the same neighbourhood to equal vectors, whose scores are
    rounding, so no brute force of ProDiGy applies (that is the next test's)."""
    pipeline = Pipeline("nnm+prodigy", ProDiGy(f), [NNM(f)])  # refused by name, buildable in Python
    peeked = pipeline.peek(G)
    assert pipeline.rule.last_scores is None  # peek records nothing
    expected = ProDiGy(f)(NNM(f)(G))
    close(peeked, expected, tol=1e-6)
    close(pipeline(G), expected, tol=1e-6)


def on_a_circle(N: int, d: int, seed: int) -> torch.Tensor:
    """N clients near a circle, jittered: with N odd and f even, each one's f farthest are the f/2 pairs
    opposite it, a different set for every client, so NNM's neighbourhoods, and its mixed vectors, all
    differ (an odd f would leave the last one to the jitter, and neighbours could share it)."""
    g = torch.Generator().manual_seed(seed)
    angle = (
        2 * math.pi * torch.arange(N, dtype=torch.float64) / N + 0.05 * torch.rand(N, generator=g).double()
    )
    radius = 1 + 0.1 * torch.rand(N, generator=g).double()
    G = 0.01 * torch.randn(N, d, generator=g).double() + 3.0  # a common offset too
    G[:, 0] += radius * torch.cos(angle)
    G[:, 1] += radius * torch.sin(angle)
    return G


@pytest.mark.parametrize(("N", "f"), [(7, 2), (9, 2), (11, 2), (11, 4), (13, 4)])  # odd N, even f: see below
@pytest.mark.parametrize("seed", [0, 1])
def test_nnm_prodigy_equals_the_brute_force_composition_and_records_scores(N, f, seed):
    G = on_a_circle(N, 12, seed)
    mixed = bf_nnm(G, f)
    D = [v for i, row in enumerate(bf_dist(mixed)) for j, v in enumerate(row) if i != j]
    assert min(D) > 1e-6 * max(D)  # general position after NNM: the brute force applies
    pipeline = Pipeline("nnm+prodigy", ProDiGy(f), [NNM(f)])
    peeked = pipeline.peek(G)
    assert pipeline.rule.last_scores is None  # peek records nothing
    out = pipeline(G)
    expected, *_, w = bf_prodigy(mixed, f)
    close(pipeline.rule.last_scores.weight, torch.tensor(w) / sum(w), tol=1e-6)
    close(peeked, expected, tol=1e-6)
    close(out, expected, tol=1e-6)


@pytest.mark.parametrize("G,f", cases(lambda n, f: 2 * f < n))
def test_nnm_cclip_equals_the_brute_force_composition_and_commits_like_cclip(G, f):
    pipeline = Pipeline("nnm+cclip", CClip(f, tau=1.5), [NNM(f)])  # a small tau: clipping happens
    mixed, prev = bf_nnm(G, f), torch.zeros(G.shape[1], dtype=G.dtype)
    for _ in range(2):  # the second round starts from the first round's aggregate
        close(pipeline.peek(G), bf_cclip(mixed, prev, tau=1.5))  # peek commits nothing
        prev = bf_cclip(mixed, prev, tau=1.5)
        close(pipeline(G), prev)
    close(pipeline.rule.prev, prev)


@pytest.mark.parametrize("G,f", cases(lambda n, f: n >= 4 * f + 3))
def test_bulyan(G, f):
    close(Bulyan(f)(G), bf_bulyan(G, f))


@pytest.mark.parametrize("G,f", cases(lambda N, f: 2 <= f < N / 2))
def test_prodigy(G, f):
    out, s_p, s_d, s, w = bf_prodigy(G, f)
    scores = ProDiGy(f).scores(G)
    close(scores.proximity, torch.tensor(s_p), tol=1e-6)
    close(scores.dissimilarity, torch.tensor(s_d), tol=1e-6)
    close(scores.composite, torch.tensor(s), tol=1e-6)
    close(scores.weight, torch.tensor(w) / sum(w), tol=1e-6)
    close(ProDiGy(f)(G), out, tol=1e-6)
    if len(set(s)) == len(s):  # no ties: exactly the f lowest scores are zeroed
        lowest = set(torch.tensor(s).argsort()[:f].tolist())
        assert set((scores.weight == 0).nonzero().squeeze(1).tolist()) == lowest


@pytest.mark.parametrize("zeros", [6, 8])  # more than half the clients send 0: every median guard is 0
def test_prodigy_where_most_clients_send_zero_is_the_formula_at_every_scale(zeros):
    """The guards' floor scales with the input (the smallest positive value where the median is 0): a median
    of 0 once floored every division at an absolute 1, so that at scale 1 every s_d of a small update was
    sigma / 1, not sigma / ||mu||, and the output changed with the units. Against the formula, 0 / 0 = 0 (a
    neighbourhood of zeros: sigma = ||mu|| = 0), at three scales."""
    N, f = 11, 3
    G = torch.zeros(N, 5, dtype=torch.float64)
    gen = torch.Generator().manual_seed(7)
    G[: N - zeros] = 0.1 * torch.randn(N - zeros, 5, generator=gen, dtype=G.dtype)
    D = bf_dist(G)
    s = []
    for k in range(N):
        others = bf_others(D, k)
        spread = sum(v for v, _ in others[f - 1 : N - f - 1])
        hood = [G[k]] + [G[j] for _, j in others[: f - 1]]
        mu = sum(hood) / f
        sigma = math.sqrt(sum(float(((g - mu) ** 2).sum()) for g in hood) / f)
        s.append(0.0 if sigma == 0 or spread == 0 else sigma / float(mu.norm()) / spread)
    threshold = sorted(s)[f - 1]
    w = torch.tensor([si if si > threshold else 0.0 for si in s], dtype=G.dtype)
    expected = w @ G / w.sum()
    for scale in (1.0, 1e3, 1e-3):
        close(ProDiGy(f)(scale * G), scale * expected, tol=1e-9)
        close(ProDiGy(f).scores(scale * G).weight, w / w.sum(), tol=1e-9)


def test_exact_ties():
    # +-e_i: the mean is exactly 0 and every distance is exactly 0, 2 or 4, so ties are exact.
    d = 5
    G = torch.cat([torch.eye(d), -torch.eye(d)]).double()
    f = 2
    close(pairwise_sq_distances(G), torch.tensor(bf_dist(G), dtype=torch.float64))
    close(Krum(f)(G), bf_krum(G, f))  # all scores tie: the lowest index wins
    close(MultiKrum(f)(G), bf_multikrum(G, f))
    close(NNM(f)(G), bf_nnm(G, f))
    close(Median()(G), bf_median(G))
    close(TrimmedMean(f)(G), bf_trimmed(G, f))
    # Every ProDiGy score ties, so every client sits at the threshold: all zeroed, median fallback.
    scores = ProDiGy(f).scores(G)
    assert (scores.weight == 0).all()
    close(ProDiGy(f)(G), bf_prodigy(G, f)[0])


def test_even_median_and_identical_rows():
    G = torch.tensor([[1.0, 5.0], [4.0, 5.0], [2.0, 5.0], [3.0, 7.0]])
    close(Median()(G), torch.tensor([2.5, 5.0]))
    same = torch.ones(7, 3)
    for name in ["median", "trimmed_mean", "krum", "multikrum", "geomed", "prodigy", "nnm+krum"]:
        close(make_aggregator(name, 2)(same), torch.ones(3), tol=1e-6)
    assert (pairwise_sq_distances(same) == 0).all()


# ---------------------------------------------------------------------------------------- invariants

NAMES = [n for n in AGGREGATOR_NAMES if not n.startswith("bucketing+")]


@pytest.mark.parametrize("name", NAMES)
def test_permutation_invariance(name):
    N, f = 15, 3
    G = torch.randn(N, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(2))
    close(make_aggregator(name, f)(G[perm]), make_aggregator(name, f)(G), tol=1e-7)


TRANSLATION = ["average", "median", "trimmed_mean", "krum", "multikrum", "bulyan", "nnm+krum", "nnm+median"]
SCALING = TRANSLATION + ["prodigy"]


@pytest.mark.parametrize("name", SCALING)
def test_translation_and_scaling_equivariance(name):
    N, f = 15, 3
    G = torch.randn(N, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    shift = torch.randn(8, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 10
    out = make_aggregator(name, f)(G)
    close(make_aggregator(name, f)(3.5 * G), 3.5 * out, tol=1e-7)
    if name in TRANSLATION:
        close(make_aggregator(name, f)(G + shift), out + shift, tol=1e-7)


def test_distances_accurate_with_large_shared_offset():
    gen = torch.Generator().manual_seed(0)
    d = 200_000
    G = 100.0 + 1e-2 * torch.randn(12, d, generator=gen)  # float32: the offset is 1e4 times the spread
    truth = torch.cdist(G.double(), G.double()) ** 2
    D = pairwise_sq_distances(G)
    off = ~torch.eye(12, dtype=torch.bool)
    assert ((D - truth).abs()[off] / truth[off]).max() < 1e-4
    assert (D.diagonal() == 0).all() and (D >= 0).all()
    # A Byzantine outlier drags the mean far away: the distances must stay accurate (recentring).
    G[0] = 1e5
    truth = torch.cdist(G.double(), G.double()) ** 2
    D = pairwise_sq_distances(G)
    assert ((D - truth).abs()[off] / truth[off]).max() < 1e-4


# ----------------------------------------------------------------------------------- hostile input


@pytest.mark.parametrize("name", [n for n in AGGREGATOR_NAMES if not n.endswith(("average", "none"))])
def test_non_finite_rows_give_finite_output(name):
    N = 20
    f = {"bucketing+bulyan": 1}.get(name, 2 if name.startswith("bucketing+") else 4)
    G = torch.randn(N, 6, generator=torch.Generator().manual_seed(5))
    bad_rows = [3, 7, 11, 15][:f]
    G[3] = math.nan
    G[7, 2] = math.inf
    G[11, 0] = -math.inf
    G[15] = 3e38  # finite, but its squared norm overflows
    G[[i for i in (3, 7, 11, 15) if i not in bad_rows]] = 0.5  # rows beyond f stay honest
    before = G.clone()
    out = make_aggregator(name, f, n_clients=N)(G)
    assert torch.isfinite(out).all(), name
    assert torch.equal(G.isnan(), before.isnan()) and torch.equal(G.nan_to_num(), before.nan_to_num())
    if name == "krum":
        close(out, bf_krum_without(G, f, bad_rows), tol=1e-6)


@pytest.mark.parametrize("scale", [1e10, 1e25, 1e38])
@pytest.mark.parametrize("n_huge", ["one", "f"])
@pytest.mark.parametrize("name", [n for n in AGGREGATOR_NAMES if not n.endswith(("average", "none"))])
def test_huge_finite_byzantine_rows_leave_the_aggregate_near_the_honest_mean(name, n_huge, scale):
    """Finite Byzantine rows of any size (up to float32's 3.4e38) cannot move a robust rule's output far from
    the honest vectors: its distance to the honest mean stays within the honest vectors' own spread (the
    largest distance of an honest vector to their mean, x2 for the randomised and iterative rules' slack).
    CClip's clipping radius tau is an absolute length, so its bound adds what L clipped steps can move:
    L tau (at most one clipped vector of tau per client per step, averaged), whatever the Byzantine scale."""
    N, d = 20, 50
    f = {"bucketing+bulyan": 1}.get(name, 2 if name.startswith("bucketing+") else 4)
    gen = torch.Generator().manual_seed(7)
    honest = 1e-3 * (1.0 + torch.randn(N - f, d, generator=gen))  # honest updates of a late round: ~1e-3
    byzantine = torch.full((f, d), scale)
    byzantine[1::2] *= -1  # mixed signs: no cancellation trick helps a rule
    if n_huge == "one":
        byzantine[1:] = honest[: f - 1] + 1e-4  # the others look honest
    G = torch.cat([byzantine, honest])
    out = make_aggregator(name, f, n_clients=N)(G)
    mean = honest.double().mean(dim=0)
    radius = (honest.double() - mean).norm(dim=1).max()
    assert torch.isfinite(out).all(), name
    if name.endswith("cclip"):
        rule = make_aggregator(name, f, n_clients=N).rule
        radius = radius + rule.L * rule.tau / 2
    assert (out.double() - mean).norm() <= 2 * radius, (
        name,
        float((out.double() - mean).norm()),
        float(radius),
    )


def test_non_finite_distances_and_nnm():
    G = torch.randn(8, 4)
    G[2, 1] = math.nan
    D = pairwise_sq_distances(G)
    assert torch.isinf(D[2, [0, 1, 3]]).all() and D[2, 2] == 0
    out = NNM(2)(G)
    assert out[2].isnan().all() and torch.isfinite(out[[0, 1, 3, 4, 5, 6, 7]]).all()
    close(ProDiGy(2).scores(G).weight[2], torch.tensor(0.0))
    close(Krum(2)(G), bf_krum_without(G, 2, [2]), tol=1e-6)


def test_average_of_a_non_finite_vector_is_non_finite_and_makes_no_wait(on_accelerator):
    """The mean as it is, NaN where a vector is, with no finiteness check that would wait for the device
    each round (it warned before, at the cost of one wait a round); the training loop records a divergence."""
    G = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    G[1, 0] = math.nan
    with on_accelerator(G) as accelerator:
        out = Average()(G)
    assert accelerator.waits == 0
    assert out[0].isnan()
    # float32 rounding of a sum of 5 terms, relative to the terms (a mean near 0 cancels them)
    scale = float(G[:, 1:].abs().max())
    assert torch.allclose(out[1:].double(), G[:, 1:].double().mean(dim=0), rtol=0, atol=1e-6 * scale)


@pytest.mark.parametrize(
    "rule,G,match",
    [
        (Median(), torch.randn(5), r"Median.*2-D"),
        (Median(), torch.randn(2, 3, 4), r"2-D"),
        (Krum(1), torch.randn(1, 4), r"needs at least 2 client vectors, got N=1"),
        (TrimmedMean(1), torch.randn(5, 0), r"the client vectors are empty \(d=0\)"),
        (Krum(3), torch.randn(8, 4), r"Krum\(f=3\).*N > 2f\+2 = 8, got N=8"),
        (ProDiGy(3), torch.randn(6, 4), r"ProDiGy\(f=3\).*f < N/2.*got N=6"),
        (Bulyan(2), torch.randn(10, 4), r"Bulyan\(f=2\).*N >= 4f\+3 = 11, got N=10"),
        (TrimmedMean(3), torch.randn(6, 4), r"TrimmedMean\(f=3\).*N > 2f = 6"),
        (MultiKrum(1, m=9), torch.randn(8, 4), r"m <= N - f"),
        (Median(), torch.ones(4, 3, dtype=torch.int64), r"expected a floating-point tensor, got dtype"),
    ],
)
def test_bad_input_errors(rule, G, match):
    with pytest.raises(ValueError, match=match):
        rule(G)


def test_bad_parameters():
    with pytest.raises(ValueError, match=r"Krum: f must be an integer >= 0, got f=-1"):
        Krum(-1)
    for one in (1, np.int64(1), torch.tensor(1)):  # a numpy or tensor 1 was let through (every weight 0)
        with pytest.raises(ValueError, match=r"ProDiGy: needs f >= 2.*got f=1"):
            make_aggregator("prodigy", one)
    with pytest.raises(ValueError, match=r"unknown defense 'krumm'.*did you mean 'krum'.*valid:.*nnm\+krum"):
        make_aggregator("krumm", 2)
    with pytest.raises(ValueError, match=r"krum with 8 clients: Krum\(f=3\) needs N > 2f\+2 = 8"):
        make_aggregator("krum", 3, n_clients=8)
    with pytest.raises(ValueError, match=r"5 vectors after Bucketing"):
        make_aggregator("bucketing+krum", 2, n_clients=10)
    assert make_aggregator(" NNM+Krum ", 3, n_clients=10).name == "nnm+krum"
    assert make_aggregator(" ProDiGy ", 3, n_clients=10).name == "prodigy"
    assert isinstance(make_aggregator("none", 0).rule, Average)


# ------------------------------------------------------------------------------------ state and peek


def test_cclip_state_peek_and_checkpoint():
    G = torch.randn(10, 5, dtype=torch.float64) * 20
    pipeline = make_aggregator("nnm+cclip", 3)
    first = pipeline.peek(G)
    assert pipeline.rule.prev is None  # peek commits nothing
    close(pipeline(G), first)
    state = pipeline.state_dict()
    second = pipeline(G)
    assert not torch.allclose(second, first)  # started from the committed aggregate
    pipeline.load_state_dict(state)
    close(pipeline.peek(G), second)
    pipeline.reset()
    close(pipeline(G), first)


def test_prodigy_last_scores_and_bucketing_peek():
    G = torch.randn(10, 5)
    rule = ProDiGy(3)
    rule.peek(G)
    assert rule.last_scores is None
    rule(G)
    close(rule.last_scores.weight, rule.scores(G).weight)
    bucketing = Bucketing(s=3, generator=torch.Generator().manual_seed(0))
    peeked = bucketing.peek(G)
    assert peeked.shape == (4, 5)
    close(bucketing(G), peeked)
    # Buckets of 3, 3, 3 and 1 rows: the size-weighted bucket means add up to the sum of the rows.
    close(3 * peeked[:3].sum(0) + peeked[3], G.sum(0), tol=1e-5)
    assert any(torch.allclose(peeked[-1], g) for g in G)


def test_dtype_and_device_follow_input():
    # on the CPU here; tests/test_cuda.py checks the device half on a GPU
    for dtype in (torch.float32, torch.float64):
        G = torch.randn(10, 7, dtype=dtype)
        for name in ["average", "median", "prodigy", "nnm+geomed", "cclip", "bucketing+trimmed_mean"]:
            out = make_aggregator(name, 2)(G)
            assert out.dtype == dtype and out.device == G.device and out.shape == (7,)


def test_chunked_gram_matches_unchunked(monkeypatch):
    G = torch.randn(9, 1000, dtype=torch.float64)
    monkeypatch.setitem(agg._CHUNK_ELEMENTS, "cpu", 50)  # many chunks of 5 columns
    close(pairwise_sq_distances(G), torch.tensor(bf_dist(G), dtype=torch.float64))


def _all_distances(K):
    sq = K.diagonal()
    return sq[:, None] + sq[None, :] - 2 * K


@pytest.mark.parametrize("offset", [0.0, 1e3])  # about the origin / recentred on a client
@pytest.mark.parametrize("chunk", [50, 1 << 20])
def test_gram_of_points_extras_and_origin_has_their_distances(monkeypatch, offset, chunk):
    """Whatever centre geometry() picks, K must hold the distances between all of [G; extra; 0]."""
    monkeypatch.setitem(agg._CHUNK_ELEMENTS, "cpu", chunk)
    gen = torch.Generator().manual_seed(1)
    G = offset + torch.randn(9, 1000, dtype=torch.float64, generator=gen)
    extra = G[:4].mean(0) + torch.randn(2, 1000, dtype=torch.float64, generator=gen)
    points = torch.cat([G, extra, G.new_zeros(1, 1000)])
    truth = torch.cdist(points, points) ** 2
    K = agg.geometry(G, extra=extra, origin=True).K
    assert K.shape == (12, 12)
    close(_all_distances(K), truth, tol=1e-9 * float(truth.max()))
    close(K, agg.geometry(G, extra=torch.cat([extra, G.new_zeros(1, 1000)])).K, tol=1e-9 * float(truth.max()))


def test_geometry_takes_one_pass_unless_a_shared_component_dominates(monkeypatch):
    centres = []
    real_gram = agg._gram

    def gram(G, extra, origin, centre=None, bad=None):
        centres.append(centre)
        return real_gram(G, extra, origin, centre, bad)

    monkeypatch.setattr(agg, "_gram", gram)
    gen = torch.Generator().manual_seed(2)
    spread = torch.randn(12, 20_000, generator=gen)
    agg.geometry(spread + 0.5)  # |g|^2 about 1.1x the median squared distance
    assert centres == [None]
    centres.clear()
    shared = 100.0 + 1e-2 * spread
    agg.geometry(shared)
    assert len(centres) == 2 and centres[0] is None
    assert any(torch.equal(centres[1], row) for row in shared)  # recentred on a client


def test_distances_accurate_just_below_the_recentre_threshold(monkeypatch):
    """A shared component 5x the spread (squared) is still computed about the origin, and accurately."""
    passes = []
    real_gram = agg._gram
    monkeypatch.setattr(agg, "_gram", lambda *a, **k: passes.append(1) or real_gram(*a, **k))
    gen = torch.Generator().manual_seed(3)
    d = 200_000
    G = 3.0 + torch.randn(12, d, generator=gen)  # |g|^2 / median distance^2 = (3^2 + 1) / 2, about 5
    truth = torch.cdist(G.double(), G.double()) ** 2
    D = pairwise_sq_distances(G)
    assert len(passes) == 1
    off = ~torch.eye(12, dtype=torch.bool)
    assert ((D - truth).abs()[off] / truth[off]).max() < 1e-5


@pytest.mark.parametrize(
    ("name", "offset", "most"),
    [("prodigy", 0.5, 1), ("krum", 0.5, 1), ("nnm+krum", 0.5, 1), ("nnm+cclip", 0.5, 1), ("prodigy", 50.0, 2),
     ("trimmed_mean", 0.5, 0), ("nnm+trimmed_mean", 0.5, 1), ("median", 0.5, 0)],
)  # fmt: skip
def test_one_wait_for_the_device_per_aggregation(on_accelerator, name, offset, most):
    """Small-N aggregation on a GPU is bound by launches and waits: the Gram matrix comes to the host once
    (twice when recentring on a shared offset), the N x N algebra runs there, one weighted sum goes back.
    A coordinate-wise rule does not wait (it treats non-finite values coordinate by coordinate; it waited
    once for an all-finite check before); NNM before it waits for the Gram matrix."""
    G = torch.randn(10, 5000, generator=torch.Generator().manual_seed(0)) + offset
    pipeline = make_aggregator(name, 3)
    with on_accelerator(G) as accelerator:
        out = pipeline(G)
        assert accelerator.holds(out)
    assert min(1, most) <= accelerator.waits <= most
    # the Gram pass and the weighted sum, no N x N algebra (was 40-130); a coordinate-wise rule's own ops
    assert accelerator.kernels <= (30 if pipeline.rule.coordinatewise else 20)
    if name == "prodigy":
        assert not accelerator.holds(pipeline.rule.last_scores.weight)  # the training loop logs it


@pytest.mark.parametrize(
    ("name", "most"), [("prodigy", 2), ("nnm+trimmed_mean", 3), ("nnm+median", 3), ("trimmed_mean", 2)]
)
def test_the_attack_search_does_not_wait_per_candidate(on_accelerator, name, most):
    """Every candidate of the line search is scored from one Gram matrix on the host, or (coordinate-wise
    rules) all candidates run as one batch: no wait for each. The waits: craft's check that the honest
    updates are finite, the line's Gram matrix (not for a rule alone), the batch's damages (run one by one,
    the 15 candidates waited twice each: 32 waits for NNM + trimmed mean or median, 31 for trimmed mean)."""
    G = torch.randn(13, 4000, generator=torch.Generator().manual_seed(1)) + 0.5
    server = make_aggregator(name, 3, n_clients=13)
    attack = make_attack("alie")
    with on_accelerator(G) as accelerator:
        honest, own = G[3:], G[:3]
        out = attack.craft(honest, own, server)
        assert accelerator.holds(out)
    assert len(attack.last_search) >= 5
    assert accelerator.waits == most


def test_a_non_finite_extra_point_is_not_hidden():
    """The attack search relies on it: a non-finite line point must leave K non-finite (then it peeks)."""
    G = torch.randn(8, 30)
    K = agg.geometry(G, extra=torch.full((1, 30), math.nan), origin=True).K
    assert not torch.isfinite(K).all() and torch.isfinite(K[:8, :8]).all()


# ------------------------------------------------------------------------------- weights from a Gram matrix
LINEAR = ["average", "krum", "multikrum", "geomed", "prodigy", "cclip"]


@pytest.mark.parametrize("name", LINEAR + ["nnm+" + n for n in LINEAR if n != "prodigy"])
@pytest.mark.parametrize(("N", "f"), [(10, 2), (15, 4)])
def test_weights_from_the_gram_matrix_reproduce_the_aggregate(name, N, f):
    """The attack search's shortcut: w from the Gram matrix of [G; reference] alone, sum_i w_i g_i +
    w_N reference equals peek(G); the reference is the origin except for CClip (its committed start)."""
    gen = torch.Generator().manual_seed(N + f)
    G = torch.randn(N, 300, dtype=torch.float64, generator=gen)
    G[:f] = G[f:].mean(0) - 0.7 * G[f:].std(0)  # identical Byzantine rows: ties in the distances
    pipeline = make_aggregator(name, f)
    pipeline(torch.randn(N, 300, dtype=torch.float64, generator=gen) + 2)  # CClip commits a start v_0 != 0
    reference = pipeline.reference(G)
    assert (reference is None) == ("cclip" not in name)
    P = torch.cat([G, G.new_zeros(1, 300) if reference is None else reference[None]])
    w = pipeline.weights(agg.geometry(P).K)
    assert w.shape == (N + 1,) and w.dtype == torch.float64
    assert float(w.sum()) == pytest.approx(1.0)
    if reference is None:
        assert w[-1] == 0
    close(w @ P, pipeline.peek(G))


@pytest.mark.parametrize("name", ["median", "trimmed_mean", "nnm+trimmed_mean", "bucketing+krum"])
def test_weights_are_none_for_rules_that_are_not_combinations(name):
    G = torch.randn(16, 50, dtype=torch.float64)
    assert make_aggregator(name, 2).weights(agg.geometry(G, extra=G.new_zeros(1, 50)).K) is None


def test_peek_with_a_given_gram_matrix_is_the_same_aggregate():
    G = torch.randn(12, 200, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    gram = agg.geometry(G, extra=G.new_zeros(1, 200)).K
    for name in ("nnm+trimmed_mean", "nnm+median", "trimmed_mean"):
        close(make_aggregator(name, 3).peek(G, gram=gram), make_aggregator(name, 3).peek(G))


def test_weights_reject_a_matrix_that_is_not_a_gram_matrix_of_points_and_origin():
    with pytest.raises(ValueError, match=r"prodigy.weights: expected the \(N\+1, N\+1\) Gram matrix"):
        make_aggregator("prodigy", 2).weights(torch.zeros(5, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="needs f < N/2"):  # 4 points and the origin: N=4 <= 2f
        make_aggregator("prodigy", 2).weights(torch.eye(5, dtype=torch.float64))


class Medoid(agg.Rule):
    """A user's rule, as the README describes: the client with the smallest sum of squared distances."""

    by_weights = True

    def combine(self, K, D, bad):
        w = torch.zeros(D.shape[0], dtype=torch.float64, device=D.device)
        return agg.Combination(torch.cat([w.index_fill_(0, D.sum(dim=1).argmin(), 1.0), w.new_zeros(1)]))


def test_a_users_combination_rule_runs_alone_after_nnm_and_in_the_line_search(monkeypatch):
    G = torch.randn(9, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    medoid = lambda X: X[int(torch.tensor(bf_dist(X)).sum(dim=1).argmin())]  # noqa: E731
    close(Medoid()(G), medoid(G))
    pipeline = Pipeline("nnm+medoid", Medoid(), [NNM(2)])
    close(pipeline(G), medoid(bf_nnm(G, 2)))
    monkeypatch.setattr(Pipeline, "peek", lambda *a, **k: pytest.fail("the search should use the weights"))
    attack = make_attack("alie")
    attack.craft(G[2:], G[:2], pipeline)
    assert len(attack.last_search) == len(attack.grid(9, 2))


def test_gram_products_run_in_full_float32_whatever_the_callers_setting():
    """TF32/bf16 matmuls (torch.set_float32_matmul_precision("high")) would cost the distances ~1e-3."""
    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.mm.default and args[0].dtype == torch.float32:
                seen.append(torch.get_float32_matmul_precision())
            return func(*args, **(kwargs or {}))

    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        G = 1e3 + torch.randn(6, 50)  # a shared offset: the recentred second pass runs too
        with Spy():
            agg.geometry(G)
        assert len(seen) == 2 and set(seen) == {"highest"}
        assert torch.get_float32_matmul_precision() == "medium"  # the caller's setting is restored
    finally:
        torch.set_float32_matmul_precision(previous)


def test_the_rule_contracts_example_runs_as_written():
    """The `Rule` docstring's example of a new rule (a doctest: its printed outputs are checked)."""
    import doctest

    from prodigy_core.aggregators import Rule

    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    (test,) = doctest.DocTestFinder(recurse=False).find(Rule, "Rule")
    assert len(test.examples) >= 5
    assert runner.run(test).failed == 0
