"""Hostile inputs and faults (issue 18): one regression test per finding, each against an independent
expectation (a brute-force reference, an invariant, or the file system's state after the fault)."""

import math
import re
import warnings

import pytest
import torch

from prodigy_core.aggregators import AGGREGATOR_NAMES, make_aggregator

# --------------------------------------------------------------------------- 3: exact trimmed mean


def bf_trimmed_mean(G: torch.Tensor, f: int) -> torch.Tensor:
    """Sort every coordinate in float64 and average the middle N - 2f values."""
    N = G.shape[0]
    return G.double().sort(dim=0).values[f : N - f].mean(dim=0)


@pytest.mark.parametrize("name", ["trimmed_mean", "nnm+trimmed_mean"])
@pytest.mark.parametrize("magnitude", [1e6, 1e8, 1e30, -1e30])
def test_trimmed_mean_is_exact_whatever_the_dropped_values(name, magnitude):
    N, f = 10, 3
    gen = torch.Generator().manual_seed(0)
    G = torch.rand(N, 1000, generator=gen) * 6 - 3  # honest values in [-3, 3]
    G[:f] = magnitude
    out = make_aggregator(name, f)(G).double()
    # nnm+: the mixing of the brute force is NNM's own (checked elsewhere); f huge rows stay far from it
    mixed = G if name == "trimmed_mean" else make_aggregator("nnm+average", f).pre[0](G)
    torch.testing.assert_close(out, bf_trimmed_mean(mixed, f), rtol=0, atol=1e-5)


def test_trimmed_mean_with_ties_at_the_kept_range_ends():
    G = torch.tensor([[1e8], [1e8], [2.0], [2.0], [2.0], [-1e8], [5.0]])
    assert make_aggregator("trimmed_mean", 2)(G).item() == 3.0  # kept: 2, 2, 5


# ---------------------------------------------------------------------- 4: non-finite rows, every rule

BAD_VALUES = {"inf": math.inf, "nan": math.nan, "-inf": -math.inf}
ROBUST_NAMES = [n for n in AGGREGATOR_NAMES if n.split("+")[-1] not in ("average", "none")]
SETTINGS = [(10, 3), (10, 2), (7, 3), (11, 2), (30, 3)]


@pytest.mark.parametrize("name", ROBUST_NAMES)
def test_every_accepted_robust_rule_is_finite_with_f_non_finite_rows(name):
    """The README's promise for every name make_aggregator accepts: finite while at most f rows are
    non-finite (all +inf, all NaN, all -inf, or one bad entry per row); a setting it cannot keep is rejected
    with the bound."""
    accepted = 0
    for N, f in SETTINGS:
        try:
            make_aggregator(name, f, n_clients=N)
        except ValueError as e:
            assert re.search(r"needs .*\d.*got N=\d+", str(e)), str(e)
            continue
        accepted += 1
        for seed in range(12):  # x 5 settings: 60 inputs per name
            gen = torch.Generator().manual_seed(seed)
            G = torch.randn(N, 8, generator=gen)
            rows = torch.randperm(N, generator=gen)[:f]
            value = list(BAD_VALUES.values())[seed % 3]
            if seed % 2:
                G[rows] = value
            else:
                G[rows, seed % 8] = value
            torch.manual_seed(seed)  # bucketing's shuffle
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                out = make_aggregator(name, f, n_clients=N)(G)
            assert torch.isfinite(out).all(), (name, N, f, seed)
    assert accepted, f"{name} accepts none of {SETTINGS}"


def test_bucketing_median_rejects_what_its_buckets_cannot_tolerate_with_the_bound():
    # 10 clients in buckets of 2: 5 buckets, of which 3 bad rows can spoil 3, a majority
    bound = r"bucketing\+median with 10 clients \(5 vectors.*N > 2f = 6, got N=5"
    with pytest.raises(ValueError, match=bound):
        make_aggregator("bucketing+median", 3, n_clients=10)
    make_aggregator("bucketing+median", 2, n_clients=10)  # 2 of 5 buckets: tolerated


# ------------------------------------------------------------------------------ 6: scale-equivariance

# GeoMed's nu and CClip's tau are absolute lengths (documented), so they are not scale-equivariant.
EQUIVARIANT = [n for n in AGGREGATOR_NAMES if n.split("+")[-1] not in ("geomed", "cclip")]


@pytest.mark.parametrize("name", EQUIVARIANT)
@pytest.mark.parametrize("scale", [1e19, 1e-25])
def test_rules_are_scale_equivariant_over_the_float32_range(name, scale):
    N, f = 30, 3  # every rule accepts it, bucketed ones included
    G = torch.randn(N, 64, generator=torch.Generator().manual_seed(1))
    # mild outliers: far ones would give every honest client the same NNM neighbourhood, hence equal mixed
    # vectors, whose ProDiGy scores are rounding noise at any scale
    G[:f] = G[:f] + 1.0
    torch.manual_seed(0)
    reference = make_aggregator(name, f)(G).double()
    torch.manual_seed(0)
    scaled = make_aggregator(name, f)(G * scale).double() / scale
    assert torch.isfinite(scaled).all()
    # G * scale rounds every entry once (float32), and the scaled geometry comes from float64 products
    torch.testing.assert_close(scaled, reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))
