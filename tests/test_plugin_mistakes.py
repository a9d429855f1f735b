"""A plug-in author's mistakes, each named with its fix (found by a plug-in author's walk through the docs):
a search attack whose rows are not what its `line` / `affine` declares, a search over two parameters, a
rule without f, a `combine` that breaks its contract, and a plug-in spec written with '.' for ':'."""

import json
import warnings

import pytest
import torch

from prodigy_core import aggregators as agg
from prodigy_core.aggregators import make_aggregator
from prodigy_core.attacks import ALIESpread, Attack, LineSearchAttack, make_attack
from prodigy_core.config import RunConfig
from prodigy_core.training import run

F = 3


def updates(n: int = 10, d: int = 200, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(d, generator=g) + torch.randn(n, d, generator=g)


class Tilt(LineSearchAttack):
    """mu - t sigma: the line (mu, mu - sigma), ALIE's, written as a plug-in author would."""

    name = "tilt"

    def grid(self, n, f):
        return [0.5, 1.0, 1.5]

    def rows(self, t, stats):
        return stats["mean"] - t * stats["sigma"]

    def line(self, stats):
        return stats["mean"], stats["mean"] - stats["sigma"]


class DirectionNotEnd(Tilt):
    def rows(self, t, stats):  # its own rows, so its own line is trusted: and checked
        return super().rows(t, stats)

    def line(self, stats):
        return stats["mean"], -stats["sigma"]  # a direction where the end point p1 belongs


class Plane(LineSearchAttack):
    """mu - z sigma + t u, u a fixed direction: two parameters (z, t), from `affine`."""

    name = "plane"
    swapped = False

    def grid(self, n, f):
        return [(z, t) for z in (0.5, 1.0) for t in (0.0, 2.0)]

    def statistics(self, honest, f):
        stats = super().statistics(honest, f)
        stats["u"] = torch.ones_like(stats["mean"])  # in stats: `rows` must work on its column slices
        return stats

    def rows(self, param, stats):
        z, t = param
        return stats["mean"] - z * stats["sigma"] + t * stats["u"]

    def affine(self, stats):
        points = torch.stack([stats["mean"], stats["mean"] - stats["sigma"], stats["mean"] + stats["u"]])
        moves = [[[-1.0, 1.0, 0.0]], [[-1.0, 0.0, 1.0]]]  # z, then t (a float32 S: taken as float64)
        return points, torch.tensor(moves[::-1] if self.swapped else moves, dtype=torch.float32)


def assert_scored_as_alie_line(attack: LineSearchAttack, server, G: torch.Tensor) -> None:
    """The search's damages equal the pipeline's on each candidate (mu - t sigma, F times; G's honest)."""
    mean, sigma = G[F:].mean(0), G[F:].std(0, unbiased=False)
    damages = [
        torch.linalg.vector_norm(server.peek(torch.cat([(mean - t * sigma).expand(F, -1), G[F:]])) - mean)
        for t in attack.grid(10, F)
    ]
    assert [x for _, x in attack.last_search] == pytest.approx([float(x) for x in damages], rel=1e-4)


def test_a_plugin_line_is_scored_from_one_gram_matrix_and_equals_the_pipeline_on_each_candidate():
    G = updates()
    server = make_aggregator("prodigy", F)
    attack = Tilt()
    attack.craft(G[F:], G[:F], server)
    assert attack.last_gram is not None  # scored from the line's Gram matrix
    assert_scored_as_alie_line(attack, server, G)


@pytest.mark.parametrize("attack", [DirectionNotEnd(), Plane()], ids=["line", "affine"])
def test_rows_that_are_not_what_the_plugin_declares_are_named(attack):
    """The search would score other rows than those sent, and the server aggregate the sent ones with a
    Gram matrix of others (the plug-in author saw the defense's output off by 119%, silently)."""
    if isinstance(attack, Plane):
        attack.swapped = True  # (t, z) where the grid gives (z, t)
    G = updates()
    where = "line" if isinstance(attack, DirectionNotEnd) else "affine"
    with pytest.raises(ValueError, match=rf"rows\(.*\) are not the combination of points that its {where}"):
        attack.craft(G[F:], G[:F], make_aggregator("prodigy", F))


def test_two_parameters_run_through_training_and_are_recorded_as_lists(tmp_path, monkeypatch):
    """`last_param` a tuple (z, t): training failed with "float() argument must be ... not 'tuple'"."""
    G = updates()
    attack = Plane()
    attack.craft(G[F:], G[:F], make_aggregator("prodigy", F))
    assert attack.last_gram is not None and attack.last_param in attack.grid(10, F)
    source = "import torch\nfrom prodigy_core.attacks import LineSearchAttack\n\n\n"
    import inspect

    (tmp_path / "plane.py").write_text(source + inspect.getsource(Plane))
    monkeypatch.chdir(tmp_path)
    config = RunConfig(dataset="digits", n_clients=10, n_byzantine=F, defense="prodigy", rounds=2,
                       attack="plane.py:Plane", local_steps=1, batch_size=16, eval_every=2)  # fmt: skip
    result = run(config, progress=False)
    assert len(result.attack_params) == 2
    assert all(list(p) in [list(c) for c in Plane().grid(10, F)] for p in result.attack_params)
    json.dumps(result.to_dict(), allow_nan=False)


def test_an_affine_with_rows_of_s_that_do_not_sum_to_0_is_named():
    class Off(Plane):
        def rows(self, param, stats):
            return super().rows(param, stats)

        def affine(self, stats):
            points, moves = super().affine(stats)
            return points, moves + 0.5

    G = updates()
    with pytest.raises(ValueError, match=r"plane.affine: each row of S must sum to 0"):
        Off().craft(G[F:], G[:F], make_aggregator("prodigy", F))


# ------------------------------------------------------------------------------------------------ rules
class NoF(agg.Rule):
    def __init__(self, extra: int = 0):
        self.extra = extra

    def aggregate(self, G):
        return G.mean(dim=0)


def test_a_rule_without_f_is_refused_naming_f(tmp_path, monkeypatch):
    """It was built with the class's f = 0 (a rule meant to drop 2f clients dropped none), or, with a
    required setting instead of f, told to give that setting."""
    (tmp_path / "nof.py").write_text(
        "from prodigy_core.aggregators import Rule\n\n\nclass NoF(Rule):\n"
        "    def __init__(self, k):\n        self.k = k\n\n    def aggregate(self, G):\n"
        "        return G.mean(dim=0)\n"
    )
    monkeypatch.chdir(tmp_path)
    message = r"NoF.__init__ takes no f: a rule takes f first, the number of Byzantine clients"
    with pytest.raises(ValueError, match=message):
        make_aggregator("nof.py:NoF", 2)
    monkeypatch.setattr(agg.RULES, "_entries", dict(agg.RULES._entries))  # registered for this test only
    with pytest.raises(ValueError, match=r"no_f_rule.*NoFRule.__init__ takes no f"):  # at its definition
        agg.RULES.register(type("NoFRule", (NoF,), {"name": "no_f_rule"}))
    assert "no_f_rule" not in agg.RULES


class Combining(agg.Rule):
    """A plug-in rule giving its output as weights; ``mistake`` breaks the contract one way."""

    by_weights = True

    def __init__(self, f: int, mistake: str = ""):
        self.f, self.mistake = f, mistake

    def combine(self, K, D, bad):
        n = D.shape[-1]
        w = torch.full((n,), 1.0 / n, dtype=torch.float64)
        if self.mistake == "tensor":
            return w
        if self.mistake == "n":
            return agg.Combination(w)
        if self.mistake == "sum":
            return agg.Combination(torch.cat([10 * w, w.new_zeros(1)]))
        return agg.Combination(torch.cat([w, w.new_zeros(1)]))


@pytest.mark.parametrize(
    ("mistake", "pre", "message"),
    [
        ("tensor", [], r"returned a Tensor, not a Combination"),
        ("n", [], r"gave weights of shape \(10,\) on cpu, not shape \(11,\)"),
        ("n", [agg.NNM(F)], r"gave weights of shape \(10,\) on cpu, not shape \(11,\)"),
        ("sum", [], r"gave weights that do not sum to 1"),
    ],
)
def test_a_combine_that_breaks_its_contract_is_named(mistake, pre, message):
    """They met a torch error (`'Tensor' object has no attribute 'weights'`, `mat1 and mat2 shapes cannot be
    multiplied`) or, for weights summing to 10, an output 10 times too large, silently."""
    G = updates()
    pipeline = agg.Pipeline("mine", Combining(F, mistake), pre)
    with pytest.raises(ValueError, match=rf"Combining\(f=3\).combine {message}"):
        pipeline(G, gram=agg.geometry(G, origin=True).K)
    assert torch.allclose(agg.Pipeline("mine", Combining(F))(G), G.mean(dim=0), atol=1e-6)


def test_a_batched_claim_with_a_one_matrix_combine_is_named():
    class Claims(Combining):
        batched = True

        def combine(self, K, D, bad):  # one matrix only, though it says batched
            w = torch.full((D.shape[-1],), 1.0 / D.shape[-1], dtype=torch.float64)
            return agg.Combination(torch.cat([w, w.new_zeros(1)]))

    G = updates()
    message = r"combine \(a batch: it says batched = True\) gave weights of shape"
    with pytest.raises(ValueError, match=message):
        make_attack("alie").craft(G[F:], G[:F], agg.Pipeline("claims", Claims(F)))


@pytest.mark.parametrize("kind", ["defense", "attack"])
def test_a_plugin_spec_with_a_dot_for_its_colon_gets_the_form(kind):
    build = make_aggregator if kind == "defense" else make_attack
    args = (2,) if kind == "defense" else ()
    with pytest.raises(ValueError, match=r"a plug-in is written path/to/file.py:ClassName \(a ':' before"):
        build("rules/my_defense.py.Closest", *args)


def test_a_line_redefined_without_its_rows_is_said_to_be_unused_once():
    """A subclass that gives ALIE another line but keeps ALIE's rows: its line cannot be trusted for those
    rows, so the search runs the pipeline on each candidate; it was silent, now one warning per class."""

    class OtherLine(LineSearchAttack):
        def grid(self, n, f):
            return [0.5, 1.0]

        def rows(self, t, stats):
            return stats["mean"] - t * stats["sigma"]

    class Redeclared(OtherLine):
        def line(self, stats):
            return stats["mean"], stats["mean"] - stats["sigma"]

    G = updates()
    server = make_aggregator("prodigy", F)
    with pytest.warns(RuntimeWarning, match=r"Redeclared.line is not used: its rows are OtherLine's"):
        Redeclared().craft(G[F:], G[:F], server)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attack = Redeclared()
        attack.craft(G[F:], G[:F], server)  # once per class
    assert attack.last_gram is None


class Narrowed(ALIESpread):
    """ALIE-spread's constructor and statistics, searched over z alone on its own line (rho = 0): Tilt's."""

    grid, rows, line = Tilt.grid, Tilt.rows, Tilt.line  # defined here: this class's own rows and line

    def _record(self, best):
        self.last_param = best


class NarrowedWrongly(Narrowed):
    def rows(self, t, stats):  # its own rows, so its own line is trusted: and checked
        return super().rows(t, stats)

    def line(self, stats):
        return stats["mean"], stats["mean"] + stats["sigma"]


def test_a_line_of_its_own_under_an_inherited_affine_is_the_one_scored_and_checked():
    """A subclass of ALIE-spread with its own rows and line: the search took ALIE-spread's `affine` for
    its points, found them not its rows' and ran the pipeline on each candidate, silently. Its line is
    used now, and checked."""
    G = updates()
    server = make_aggregator("prodigy", F)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attack = Narrowed()
        attack.craft(G[F:], G[:F], server)
    assert attack.last_gram is not None  # scored from its line's Gram matrix
    assert_scored_as_alie_line(attack, server, G)
    with pytest.raises(ValueError, match=r"NarrowedWrongly: rows\(0.5\) are not .* that its line declares"):
        NarrowedWrongly().craft(G[F:], G[:F], server)


class Thirds(LineSearchAttack):
    """p0 + t (0.1 p1 + 0.9 p2 - p0), its S given in float32 (a row sums to 2e-8 there, not 0)."""

    name = "thirds"

    def grid(self, n, f):
        return [[1.0], [0.5]]  # candidates as lists; the most damaging first (not the last one wins)

    def statistics(self, honest, f):
        stats = super().statistics(honest, f)
        stats["p2"] = stats["mean"] + 2 * stats["sigma"]
        return stats

    def rows(self, param, stats):
        (t,) = param
        mean, sigma = stats["mean"], stats["sigma"]
        return mean + t * (0.1 * (mean - sigma) + 0.9 * stats["p2"] - mean)

    def affine(self, stats):
        points = [stats["mean"], stats["mean"] - stats["sigma"], stats["p2"]]  # a list: stacked
        return points, torch.tensor([[[-1.0, 0.1, 0.9]]], dtype=torch.float32)


def test_a_float32_s_lists_of_points_and_list_candidates_are_taken():
    """S's rows sum to 0 to float32's rounding (refused by a float64 tolerance before the review), the
    points may be a list, and a candidate a list like a tuple."""
    G = updates()
    attack, server = Thirds(), make_aggregator("prodigy", F)
    attack.craft(G[F:], G[:F], server)
    assert attack.last_gram is not None  # scored from the points' Gram matrix
    stats = attack.statistics(G[F:], F)
    damages = [  # the pipeline run on each candidate's rows, the damage as the search defines it
        float(torch.linalg.vector_norm(server.peek(torch.cat([attack.rows(t, stats).expand(F, -1), G[F:]]))
                                       - stats["mean"]))
        for t in attack.grid(10, F)
    ]  # fmt: skip
    assert [x for _, x in attack.last_search] == pytest.approx(damages, rel=1e-4)
    assert attack.last_param == attack.grid(10, F)[damages.index(max(damages))]
    assert damages.index(max(damages)) < len(damages) - 1  # a search where the last candidate won would fail


def test_the_points_are_checked_at_both_ends_of_the_grid():
    """Swapped S: at (0, 0) every S gives P[0], so a check at the grid's last candidate alone let it by."""

    class EndsAtZero(Plane):
        swapped = True

        def grid(self, n, f):
            return [(1.0, 2.0), (0.0, 0.0)]

        def rows(self, param, stats):
            return super().rows(param, stats)

        def affine(self, stats):
            return super().affine(stats)

    G = updates()
    with pytest.raises(ValueError, match=r"rows\(\(1.0, 2.0\)\) are not the combination of points"):
        EndsAtZero().craft(G[F:], G[:F], make_aggregator("prodigy", F))


def test_the_line_s_moves_are_a_copy_for_whoever_changes_them():
    """`affine` of a line hands out S; a plug-in scaling it in place changed ALIE's and FOE's for the whole
    process (a module constant)."""
    stats = {"mean": torch.zeros(3), "sigma": torch.ones(3)}
    _, moves = Tilt().affine(stats)
    moves *= 2
    assert Tilt().affine(stats)[1].tolist() == [[[-1.0, 1.0]]]


class Returns(agg.Rule):
    """A plug-in rule whose ``aggregate`` returns ``shape`` (G itself, one row kept 2-D, a list)."""

    def __init__(self, f: int, shape: str = ""):
        self.f, self.shape = f, shape

    def aggregate(self, G):
        return {"all": G, "row": G[:1], "list": G.mean(dim=0).tolist()}[self.shape]


@pytest.mark.parametrize(
    "shape, got",
    [("all", r"shape \(10, 200\) on cpu"), ("row", r"shape \(1, 200\) on cpu"), ("list", "list")],
)
def test_a_rule_whose_aggregate_is_not_one_vector_is_named(shape, got):
    """(N, d) came back as the 'aggregate' outside training (and a torch reshape error after a round inside);
    a list gave `'list' object has no attribute 'to'`."""
    G = updates()
    message = rf"Returns\(f=3\).aggregate returned {got}; a rule returns one vector \(d,\) = \(200,\) on cpu"
    for pre in ([], [agg.NNM(F)]):
        pipeline = agg.Pipeline("mine", Returns(F, shape), pre)
        with pytest.raises(ValueError, match=message):
            pipeline(G)
        with pytest.raises(ValueError, match=message):
            pipeline.peek(G)


class Sends(Attack):
    """A plug-in attack whose ``send`` returns ``rows`` (too few, too many, one row 1-D, a list)."""

    name = "sends"

    def __init__(self, rows: str = ""):
        super().__init__()
        self.rows = rows

    def send(self, honest, own, server):
        return {"fewer": own[:1], "more": torch.cat([own, own[:2]]), "1-d": own[0], "list": own.tolist(),
                "right": -own}[self.rows]  # fmt: skip


@pytest.mark.parametrize(
    "rows, got",
    [("fewer", r"shape \(1, 200\) on cpu"), ("more", r"shape \(5, 200\) on cpu"),
     ("1-d", r"shape \(200,\) on cpu"), ("list", "list")],
)  # fmt: skip
def test_an_attack_that_sends_other_than_one_row_per_byzantine_client_is_named(rows, got):
    """One row for f = 3 trained the whole run with N = 8 instead of 10 and stored it as valid; a 1-D row
    met a torch.cat error inside the training loop."""
    G = updates()
    message = (rf"attack 'sends': send returned {got}; it must return one row per Byzantine client, "
               r"\(f, d\) = \(3, 200\) on cpu")  # fmt: skip
    with pytest.raises(ValueError, match=message):
        Sends(rows).craft(G[F:], G[:F], make_aggregator("median", F))
    assert torch.equal(Sends("right").craft(G[F:], G[:F], make_aggregator("median", F)), -G[:F])


def test_a_gram_matrix_that_is_not_the_pipeline_inputs_is_named():
    """A Gram matrix of another N met an IndexError deep in ProDiGy's scoring, a list an AttributeError."""
    G = updates()
    pipeline = make_aggregator("prodigy", F)
    right = agg.geometry(G, origin=True).K
    assert torch.allclose(pipeline.peek(G, gram=right), pipeline.peek(G), atol=1e-6)
    wrongs = [(right[1:, 1:], r"shape \(10, 10\) on cpu \(torch.float64\)"), (right.tolist(), "list"),
              (right.float(), r"shape \(11, 11\) on cpu \(torch.float32\)")]  # fmt: skip
    start = r"prodigy: gram must be the float64 Gram matrix \(N\+1, N\+1\) = \(11, 11\) of \[G; reference\]"
    for wrong, got in wrongs:
        for call in (pipeline, pipeline.peek):
            with pytest.raises(ValueError, match=rf"{start} on cpu, got {got}: pass the attack's last_gram"):
                call(G, gram=wrong)


@pytest.mark.parametrize("rule, pre, got", [(agg.Median, [], "the class Median"), ("median", [], "str"),
                                            (agg.Median(F), [agg.NNM], "the class NNM")])  # fmt: skip
def test_a_pipeline_of_a_class_or_a_name_instead_of_a_rule_is_named(rule, pre, got):
    """A class met `Median.check_n() missing 1 required positional argument` at the first call, a name an
    AttributeError."""
    with pytest.raises(TypeError, match=rf"Pipeline 'mine': its rule and pre-aggregators are Rule instances, "
                       rf"e.g. Median\(f\) or NNM\(f\), got {got}$"):  # fmt: skip
        agg.Pipeline("mine", rule, pre)
