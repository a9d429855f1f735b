"""Hostile round 5, the rules and the library's names: what a reviewer broke, each as a test."""

from __future__ import annotations

import pytest
import torch

from prodigy_core import aggregators as agg
from prodigy_core.aggregators import (
    AGGREGATOR_NAMES,
    NNM,
    RULES,
    Pipeline,
    ProDiGy,
    Rule,
    aggregator_names,
    make_aggregator,
)
from prodigy_core.attacks import make_attack
from prodigy_core.config import ConfigError, RunConfig


def far_distinct_byzantine(scale: float = 1e6) -> tuple[torch.Tensor, torch.Tensor]:
    """7 honest rows (N(0, 1), d=5) and 3 Byzantine rows at `scale`, each distinct from the others."""
    honest = torch.randn(7, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    byzantine = torch.zeros(3, 5, dtype=torch.float64)
    byzantine[:, 0] = scale
    byzantine[0, 1], byzantine[1, 2], byzantine[2, 3] = scale, scale, scale
    return byzantine, honest


def test_r5_1_nnm_prodigy_is_refused_by_name_because_nnm_makes_the_honest_clients_identical():
    """Why: with the Byzantine rows far away, every honest client's N-f nearest are the honest ones, so NNM
    maps them to one vector (their mean); identical vectors have sigma = 0, so ProDiGy scores them 0 and
    keeps the Byzantine ones: the output lies about the scale away from the honest mean (the reviewer's
    example), where ProDiGy alone and NNM + median stay within the honest rows' spread. So a params file, a
    RunConfig and make_aggregator refuse the name with that reason; Python still builds the pipeline."""
    byzantine, honest = far_distinct_byzantine()
    G = torch.cat([byzantine, honest])
    mean, spread = honest.mean(dim=0), (honest - honest.mean(dim=0)).norm(dim=1).max()
    mixed = NNM(3)(G)
    assert torch.allclose(mixed[3:], mean.expand(7, 5), atol=1e-9)  # the honest clients, identical
    composed = Pipeline("nnm+prodigy", ProDiGy(3), [NNM(3)])
    assert (composed(G) - mean).norm() > 1e5  # a breakdown, hand-predicted above
    assert composed.rule.last_scores.weight[3:].eq(0).all()  # every honest client discarded
    assert (make_aggregator("prodigy", 3)(G) - mean).norm() <= spread
    assert (make_aggregator("nnm+median", 3)(G) - mean).norm() <= spread

    for name in ("nnm+prodigy", " NNM+ProDiGy "):
        with pytest.raises(ValueError, match=r"is refused: NNM mixes the honest clients.*use prodigy alone"):
            make_aggregator(name, 3)
    with pytest.raises(ConfigError, match="is refused"):
        RunConfig(dataset="digits", defense="nnm+prodigy")
    assert "nnm+prodigy" not in AGGREGATOR_NAMES and "bucketing+prodigy" in AGGREGATOR_NAMES


def test_r5_2_prodigy_discards_a_cluster_of_identical_vectors_as_its_docstring_says():
    """The paper's s_d is sigma / ||mu|| of a neighbourhood: 0 for identical vectors, whatever the guards
    (which keep only the divisions finite). 7 identical honest rows and 3 distinct others: the 7 score 0 and
    every one is zeroed (ties at the threshold), the output the mean of the 3 weighted by their scores."""
    others = 1 + torch.randn(3, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    G = torch.cat([others, torch.ones(7, 5, dtype=torch.float64)])
    rule = ProDiGy(3)
    scores = rule.scores(G)
    assert scores.dissimilarity[3:].eq(0).all() and scores.composite[3:].eq(0).all()
    assert scores.weight[3:].eq(0).all()
    assert torch.isclose(scores.weight.sum(), torch.tensor(1.0, dtype=G.dtype))
    expected = (scores.composite[:3, None] * others).sum(dim=0) / scores.composite[:3].sum()
    assert torch.allclose(rule(G), expected)


@pytest.fixture
def own_registry(monkeypatch):
    """RULES as it is, restored after the test (a rule registered here is gone afterwards)."""
    monkeypatch.setattr(RULES, "_entries", dict(RULES._entries))


def register_mean2() -> type:
    """A notebook's rule: the mean, registered by name (`own_registry` forgets it after the test)."""

    @RULES.register
    class Mean2(Rule):
        name = "mean2"

        def __init__(self, f: int):
            self.f = f

        def aggregate(self, G):
            return G.mean(dim=0)

    return Mean2


def test_r5_3_a_rule_registered_after_import_is_built_by_name_alone_and_behind_nnm(own_registry):
    """`@RULES.register` in a notebook, then the name in make_aggregator and a RunConfig: the names are
    read from the registry when asked, not from a list made at import."""

    register_mean2()

    G = torch.arange(15.0).view(5, 3)
    assert torch.equal(make_aggregator("mean2", 1)(G), G.mean(dim=0))
    assert torch.equal(make_aggregator("nnm+mean2", 1)(G), NNM(1)(G).mean(dim=0))
    assert {"mean2", "nnm+mean2"} <= set(aggregator_names()) and "mean2" not in AGGREGATOR_NAMES
    assert RunConfig(dataset="digits", defense="mean2", n_byzantine=1).defense == "mean2"


def test_a_grid_refuses_a_rule_registered_by_name_whose_code_no_key_holds(
    own_registry, tmp_path, monkeypatch
):
    """The same registered rule, then edited and registered again (a notebook's cell run twice): its runs'
    key held the name only, so a grid found the first version's records and reported them for the edit. A
    grid (a store) now refuses such a name, a rule's or an attack's, in one line naming the plug-in way
    (whose code the key holds); the package's own names pass."""
    from prodigy_core.attacks import ATTACKS, Attack
    from prodigy_core.experiments import check_code_is_keyed, experiment_from_spec, run_grid

    monkeypatch.setattr(ATTACKS, "_entries", dict(ATTACKS._entries))

    register_mean2()

    @ATTACKS.register
    class Zero(Attack):
        name = "zero"

    base = {"dataset": "digits", "n_clients": 6, "n_byzantine": 1, "rounds": 1}
    spec = {"experiment": "mine", "base": base, "grid": {"defense": ["nnm+mean2"], "attack": ["sf"]}}
    with pytest.raises(ValueError, match=r"defense 'mean2' is registered by name from .*test_hostile5_rules: "
                       r"a stored run's key would hold its name, not its code .* plug-in \(defense: "
                       r"my_code.py:Mean2\)"):  # fmt: skip
        run_grid(experiment_from_spec(spec), results_dir=tmp_path, progress=False)
    assert not any(tmp_path.rglob("*.json"))  # nothing trained, nothing stored
    zero = RunConfig(dataset="digits", n_clients=6, n_byzantine=1, defense="nnm+median", attack="zero")
    with pytest.raises(ValueError, match="attack 'zero' is registered by name"):
        check_code_is_keyed([zero])
    check_code_is_keyed([zero.replace(attack="alie"), zero.replace(attack="sf", defense="nnm+krum")])


@pytest.mark.parametrize("name", ["", "Mean3", "my rule", "nnm+x", "my.py:X", None])
def test_r5_4_a_rule_without_a_name_a_params_file_can_write_is_refused_when_registered(own_registry, name):
    """A class without a name was filed under '' (an empty entry in the menus); a name with capitals, a
    space, '+' or ':' could never be read back (names are read in lower case and split at '+' and ':')."""
    attributes = {"__init__": lambda self, f: None, "aggregate": lambda self, G: G.mean(dim=0)}
    if name is not None:
        attributes["name"] = name
    cls = type("Nameless", (Rule,), attributes)
    with pytest.raises(ValueError, match=r"defense Nameless: the name .* cannot be written in a params file"):
        RULES.register(cls)
    assert name not in RULES and "" not in RULES


def test_r5_5_a_rule_with_neither_aggregate_nor_by_weights_names_the_fix():
    """It gave combine only and forgot by_weights: the error says which two ways fix it (was a bare,
    empty NotImplementedError)."""

    class CombineOnly(Rule):
        def __init__(self, f: int):
            self.f = f

    with pytest.raises(NotImplementedError, match="CombineOnly has no aggregate.*set by_weights = True"):
        CombineOnly(1)(torch.ones(4, 2))


def test_r5_6_a_rules_weight_on_a_non_finite_row_is_an_error_not_a_silent_zero():
    """A user's medoid by `D.sum(1).argmin()` picks the NaN row when one is there (every row's sum is inf,
    argmin takes the first): its weight, dropped with the row by the weighted sum, gave the zero vector. It
    is now an error naming the rows; with every row finite the medoid is the brute-force one."""
    from prodigy_core.aggregators import Combination

    class Medoid(Rule):
        by_weights = True

        def __init__(self, f: int):
            self.f = f

        def combine(self, K, D, bad):
            w = torch.zeros(D.shape[-1] + 1, dtype=torch.float64)
            w[int(D.sum(dim=1).argmin())] = 1.0
            return Combination(w)

    G = torch.randn(10, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    brute = G[torch.cdist(G, G).pow(2).sum(dim=1).argmin()]
    assert torch.equal(Medoid(3)(G), brute)
    G[0] = float("nan")
    for pipeline in (Medoid(3), Pipeline("nnm+medoid", Medoid(3), [NNM(3)])):
        with pytest.raises(ValueError, match=r"weight to non-finite input rows \(0\).*give 0 to the rows"):
            pipeline(G)


# ------------------------------------------------------------------ the rules audit of 2026-11-28 (helper-23)


def test_a_shared_component_beyond_float32s_range_keeps_prodigy_and_geomed_the_formula():
    """Updates sharing a component of norm ~3e19 (finite float32 entries): the recentred Gram pass puts the
    origin at -c, whose squared norm overflowed float32 unseen (only the clients' were checked). ProDiGy then
    zeroed all 11 clients (the median fallback) and GeoMed returned NaN from finite input. Now both are the
    brute-force formulas on the same float32 values, to the input's resolution (~1e-3 of the spread)."""
    from test_aggregators import bf_geomed, bf_prodigy

    spread = 1e14
    g = torch.Generator().manual_seed(0)
    G = ((torch.randn(11, 1000, generator=g, dtype=torch.float64) + 1e4) * spread).float()
    exact = G.double()  # the float32 input's values, for the float64 brute force
    reference, *_, weights = bf_prodigy(exact, 3)
    pipeline = make_aggregator("prodigy", 3)
    out = pipeline(G)
    assert [k for k, w in enumerate(weights) if w == 0] == pipeline.rule.last_scores.weight.eq(0).nonzero()[
        :, 0
    ].tolist()
    assert len([w for w in weights if w == 0]) == 3  # the formula zeroes f clients here, not all N
    assert float((out.double() - reference).abs().max()) < 1e-2 * spread
    geomed = make_aggregator("geomed", 3)(G)
    assert torch.isfinite(geomed).all()
    assert float((geomed.double() - bf_geomed(exact)).abs().max()) < 1e-2 * spread


@pytest.mark.parametrize("defense", ["geomed", "cclip", "nnm+median", "prodigy"])
def test_an_attack_whose_rows_overflow_hands_the_server_no_gram_matrix(defense):
    """FOE with eps = 1e39 sends rows that are +-inf in float32 while the float64 Gram matrix of the search
    stays finite: given it, the server took every row as finite and returned NaN (a diverged run), where the
    same input alone gives a finite aggregate. The attack now keeps no Gram matrix for such rows, and the
    training loop's call equals a fresh pipeline's to the bit."""
    from prodigy_core.attacks import make_attack

    g = torch.Generator().manual_seed(0)
    honest, own = torch.randn(8, 5, generator=g) + 1, torch.zeros(2, 5)
    attack, server = make_attack("foe", params={"eps": 1e39}), make_aggregator(defense, 2)
    G = torch.cat([attack.craft(honest, own, server), honest])  # as training.server_input stacks them
    # ProDiGy's search picks a finite row here, but with a squared norm beyond float32's range: no Gram
    # matrix either (the threshold is the sent row's squared norm, read on the host)
    assert (defense == "prodigy") != (not torch.isfinite(G[:2]).all()) and attack.last_gram is None
    out = server(G, gram=attack.last_gram)
    torch.testing.assert_close(out, make_aggregator(defense, 2)(G), rtol=0, atol=0)
    assert torch.isfinite(out).all()


def test_more_non_finite_rows_than_f_give_multikrum_a_nan_aggregate_not_a_plugin_authors_error():
    """Three NaN rows with f = 2: Multi-Krum must give weight to one of them (m = N - f rows). That is
    beyond every rule's contract (at most f), and the coordinate-wise rules return a non-finite aggregate
    (the training loop then records the divergence; Flower skips the round); Multi-Krum raised the error
    meant for a plug-in whose combine ignores `bad`. With f NaN rows it is the brute force on the rest."""
    G = torch.randn(11, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    G[:3] = float("nan")
    for name in ("multikrum", "nnm+multikrum"):
        assert torch.isnan(make_aggregator(name, 2)(G)).all()
    G[2] = torch.randn(4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    finite = G[2:]
    D = torch.cdist(finite, finite).pow(2)
    scores = D.sort(dim=1).values[:, 1 : 11 - 2 - 1].sum(dim=1)  # over the N-f-2 nearest others, N = 11
    chosen = scores.argsort()[: 11 - 2]  # the NaN rows score inf: the m = 9 chosen are finite ones
    torch.testing.assert_close(make_aggregator("multikrum", 2)(G), finite[chosen].mean(dim=0))


def test_f_may_be_a_numpy_or_tensor_integer_but_not_a_bool_or_float():
    """f from a numpy array or a 0-d tensor (a sweep's `np.arange`) was refused with "f must be an integer,
    got f=np.int64(2)"; it is stored as a Python int. Booleans and floats stay refused."""
    import numpy as np

    for f in (np.int64(2), torch.tensor(2)):
        pipeline = make_aggregator("nnm+krum", f)
        assert type(pipeline.rule.f) is int and pipeline.rule.f == 2 and type(pipeline.pre[0].f) is int
    for f in (True, np.True_, 2.0, np.float64(2.0)):
        with pytest.raises(ValueError, match=r"f must be an integer >= 0"):
            make_aggregator("krum", f)


@pytest.mark.parametrize(
    ("call", "message"),
    [(lambda: make_aggregator("bucketing+median", 0, n_clients=10, params={"s": 10}),
      r"^bucketing\+median with 10 clients \(1 vectors after Bucketing\(s=10\)\): Median\(f=0\) needs at "
      r"least 2 vectors, got 1$"),
     (lambda: make_aggregator("cclip", 2).new_round([1.0]),
      r"^cclip.new_round takes the model parameters as one vector \(d,\), e.g. parameters_to_vector"),
     (lambda: make_aggregator("cclip", 2).load_state_dict(None),
      r"^cclip.load_state_dict takes what state_dict\(\) returned, a mapping, got NoneType$"),
     (lambda: make_aggregator("cclip", 2).load_state_dict({"rule": {"prev": [1.0]}}),
      r"^CClip\(tau=10.0, L=3\).load_state_dict: prev must be the last aggregate \(d,\) or None, got list$"),
     (lambda: agg.geometry([[1.0], [2.0]]),
      r"^geometry: expected a torch.Tensor of client updates, got list$"),
     (lambda: agg.geometry(torch.ones(5)),
      r"^geometry: expected a 2-D \(N clients, d\) tensor, got shape \(5,\)$"),
     (lambda: make_attack("alie_spread", params={"rhos": ["a"]}),
      r"^alie_spread: rhos=\['a'\] must be a non-empty tuple of numbers >= 0$")],
)  # fmt: skip
def test_library_calls_a_researcher_gets_wrong_are_named(call, message):
    """Helper 47's minor findings: a Bucketing that leaves one vector passed RunConfig and failed at round 1
    naming Median alone; the rest met AttributeErrors ('list' object has no attribute 'detach' / 'clone',
    'NoneType' object has no attribute 'get'), a bare unpacking error or an unwrapped float() error."""
    with pytest.raises(ValueError, match=message):
        call()
