"""Robust aggregation rules of the ProDiGy paper, vectorised in torch on any device.

A rule maps the client updates ``G`` (N, d) to one vector (d,); a pre-aggregator (NNM, Bucketing) maps (N, d)
to (M, d). ``make_aggregator(name, f)`` builds the server pipeline from a name of `RULES` (``prodigy``,
``nnm+krum``, a plug-in ``my_rules.py:MyRule``); a new rule subclasses `Rule` (its docstring has an example).
Every distance comes from one Gram matrix (`geometry`); docs/semantics.md gives the numerics and the hostile
input contract, benchmarks/README.md the timings. Reference: the ProDiGy paper; each baseline's own paper is
named on its class.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import operator
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from prodigy_core.names import check_variant, did_you_mean
from prodigy_core.registry import (
    Registry,
    Settings,
    check_settings,
    contract,
    is_plugin,
    packaged,
    settings_of,
    spec_hint,
)

# Every rule a params file can name, filled by `@RULES.register` below (BASE_NAMES, AGGREGATOR_NAMES, the
# report's names and the explorer's menu derive from it).
RULES = Registry(
    "defense",
    needs={"f": "a rule takes f first, the number of Byzantine clients it must tolerate "
                "(def __init__(self, f, ...)), even one that does not use it"},
)  # fmt: skip

# Recentre on a central client when the centre (first the origin) lies this many times further from it
# (squared) than its median distance to the others: float32 cancellation costs about RATIO * eps relative
# on the distances (measured: docs/semantics.md, "Geometry").
_RECENTRE_RATIO = 10.0
# Rows x columns of one chunk of the Gram matrix: 4 MB in float32 stays in a CPU's cache; a GPU wants few,
# large products, as kernel launches dominate small ones (float64 accumulation across chunks either way;
# timings: benchmarks/aggregators.py, benchmarks/README.md).
_CHUNK_ELEMENTS = {"cpu": 1 << 20, "other": 1 << 26}
_FLOOR = 1e-12  # relative floor for ProDiGy's divisions (see ProDiGy)
# float64 products when the median squared norm is below _TINY * d: products under float32's smallest normal
# (1.2e-38) flush or go denormal, about d * 1.2e-38 absolute on a sum, i.e. < 1e-7 relative above this.
_TINY = 1e-30


def shape_of(x: Any) -> str:
    """What an error says a value was: ``shape (3, 7) on cpu`` for a tensor, else its type's name."""
    return f"shape {tuple(x.shape)} on {x.device}" if isinstance(x, Tensor) else type(x).__name__


def _check_input(G: Tensor, rule: str) -> None:
    if not isinstance(G, Tensor):
        raise ValueError(f"{rule}: expected a torch.Tensor of client updates, got {type(G).__name__}")
    if G.dim() != 2:
        raise ValueError(f"{rule}: expected a 2-D (N clients, d) tensor, got shape {tuple(G.shape)}")
    if not G.is_floating_point():
        raise ValueError(f"{rule}: expected a floating-point tensor, got dtype {G.dtype}")
    if G.shape[0] < 2:
        raise ValueError(f"{rule}: needs at least 2 client vectors, got N={G.shape[0]}")
    if G.shape[1] == 0:
        raise ValueError(f"{rule}: the client vectors are empty (d=0)")


# The most iterations per round a rule's setting may ask for (CClip's L, GeoMed's R; the papers use 1 to 3):
# a typo such as L=1000000000 is refused instead of hanging a run.
MAX_ITERATIONS = 100


def check_f(rule: str, f: int, minimum: int = 0, what: str = "f") -> int:
    """f, or a ValueError naming ``rule`` when f is not an integer >= minimum (for a rule's ``__init__``;
    ``what``: the argument's name in the message)."""
    if not isinstance(f, bool):
        with contextlib.suppress(TypeError):
            f = operator.index(f)  # a numpy or 0-d tensor integer too, stored as an int
    if isinstance(f, bool) or not isinstance(f, int) or f < minimum:
        raise ValueError(f"{rule}: {what} must be an integer >= {minimum}, got {what}={f!r}")
    return f


# ---------------------------------------------------------------------------------------------- geometry


class Geometry(NamedTuple):
    """Inner products K (P, P) of the points [G; extra] about a common centre (float64), the squared
    distances D (N, N) between client vectors (float64, exact zero diagonal, >= 0, +inf to bad vectors) and
    the mask of bad vectors (N,). Rows and columns of K that belong to bad vectors are zero."""

    K: Tensor
    D: Tensor
    bad: Tensor


def _no_bad(n: int, like: Tensor) -> Tensor:
    """The all-False mask of bad vectors for n finite vectors, on ``like``'s device."""
    return torch.zeros(n, dtype=torch.bool, device=like.device)


@contextlib.contextmanager
def _full_float32_matmul() -> Iterator[None]:
    """float32 products at full precision whatever the caller chose: a TF32 or bf16 product (after
    ``torch.set_float32_matmul_precision("high")``) is off by about 1e-3 relative, which the cancellation
    in distances amplifies into wrong neighbours and scores."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def column_step(rows: int, d: int, device: torch.device) -> int:
    """Columns per chunk of a pass over ``rows`` rows of d columns (`_CHUNK_ELEMENTS` elements a chunk)."""
    return min(d, max(1, _CHUNK_ELEMENTS["cpu" if device.type == "cpu" else "other"] // rows))


@_full_float32_matmul()
def _gram(
    G: Tensor,
    extra: Tensor | None,
    origin: bool,
    centre: Tensor | None = None,
    bad: Tensor | None = None,
    wide: bool = False,
) -> Tensor:
    """K = Y Y^T for the points Y = [G; extra; 0 if origin] - centre, in float32 chunks of columns summed in
    float64 (a float32 sum over millions of terms would drift); ``wide``: float64 products (`_ranged_gram`).

    ``centre=None``: about the origin. The chunks are multiplied where they lie (strided views, no copy),
    so the pass costs about one Gram product; bad rows come out non-finite (or huge) in their own rows and
    columns only. Otherwise each chunk is centred, with the extra points, into one reused buffer (the rows
    marked in ``bad`` zeroed): one pass over G and one product per chunk. Full float32 precision always."""
    compute = torch.float64 if wide or G.dtype == torch.float64 else torch.float32
    N, d = G.shape
    E = 0 if extra is None else len(extra)
    P = N + E + int(origin)
    K = torch.zeros(P, P, dtype=torch.float64, device=G.device)
    step = column_step(P, d, G.device)
    if centre is None:  # add_ of a float32 product into float64 K: summed in float64, no extra copy
        for start in range(0, d, step):
            X = G[:, start : start + step].to(compute)
            K[:N, :N].add_(X @ X.T)
            if extra is not None:  # the origin's row and column stay 0: it is the centre
                Z = extra[:, start : start + step].to(compute)
                K[:N, N : N + E].add_(X @ Z.T)
                K[N : N + E, N : N + E].add_(Z @ Z.T)
        if extra is not None:
            K[N : N + E, :N] = K[:N, N : N + E].T
        return K
    buffer = torch.empty(P, step, dtype=compute, device=G.device)
    for start in range(0, d, step):
        X = G[:, start : start + step].to(compute)
        Y = buffer[:, : X.shape[1]]
        c = centre[start : start + step].to(compute)
        torch.sub(X, c, out=Y[:N])
        if bad is not None:
            Y[:N].masked_fill_(bad[:, None], 0)
        if extra is not None:
            torch.sub(extra[:, start : start + step].to(compute), c, out=Y[N : N + E])
        if origin:
            torch.neg(c, out=Y[N + E])
        K.add_(Y @ Y.T)
    return K


def _ranged_gram(
    G: Tensor, extra: Tensor | None, origin: bool, centre: Tensor | None = None, bad: Tensor | None = None
) -> Tensor:
    """`_gram` on the CPU, recomputed from float64 products where float32 ones lost the range: a vector with
    finite entries whose squared norm came out non-finite (overflow), or a median squared norm below
    `_TINY` * d (underflow). The check reads K only, plus the rows with a non-finite squared norm. The origin
    is finite by construction, so a non-finite entry of its own (a recentred pass, where it lies at -centre)
    is an overflow too."""
    K = _gram(G, extra, origin, centre, bad).cpu()
    if G.dtype == torch.float64:
        return K
    N = len(G)
    diag = K.diagonal()[: N + (0 if extra is None else len(extra))]
    finite = torch.isfinite(diag)
    over = (~finite).nonzero().squeeze(1).tolist()
    rows = [G[[i for i in over if i < N]]] if over else []
    if over and extra is not None:
        rows.append(extra[[i - N for i in over if i >= N]])
    # a vector with finite entries whose squared norm overflowed (one wait per source, not per row), or the
    # origin's own, which is 0 but about a centre
    overflow = any(bool(torch.isfinite(r).all(dim=1).any()) for r in rows if len(r)) or (
        origin and centre is not None and not math.isfinite(float(K[-1, -1]))
    )
    finite = diag[finite]
    underflow = len(finite) > 0 and float(finite.median()) < _TINY * G.shape[1]
    if overflow or underflow:
        K = _gram(G, extra, origin, centre, bad, wide=True).cpu()
    return K


def _diagonal(K: Tensor) -> Tensor:
    """The diagonal of each matrix of a batch (..., P, P): (..., P)."""
    return K.diagonal(dim1=-2, dim2=-1)


def _distances(K: Tensor, bad: Tensor) -> Tensor:
    """Squared distances between the first len(bad) points of the Gram matrix K (about any common centre);
    K may be a batch (..., P, P), with one mask ``bad`` for all."""
    n = len(bad)
    Kn = K[..., :n, :n]
    sq = _diagonal(Kn)
    # K[i, j] + K[j, i], not 2 K[i, j]: a float32 product G Gᵀ need not be symmetric, and D must be
    D = (sq.unsqueeze(-1) + sq.unsqueeze(-2) - (Kn + Kn.mT)).clamp_(min=0)
    if bad.any():
        D.masked_fill_(bad[:, None] | bad[None, :], math.inf)
    _diagonal(D).zero_()
    return D


def _clean(K: Tensor, bad: Tensor) -> Tensor:
    """K with the rows and columns of bad vectors zeroed (their products may be NaN or infinite)."""
    if not bad.any():
        return K
    keep = torch.cat([~bad, bad.new_ones(K.shape[0] - len(bad))])
    return torch.where(keep[:, None] & keep[None, :], K, 0.0)


def geometry(G: Tensor, extra: Tensor | None = None, origin: bool = False) -> Geometry:
    """Gram matrix of the points [G; extra; 0 if origin] about a common centre, and the client distances.

    First pass about the origin (one Gram product's cost; again from float64 products when float32 ones
    over- or underflowed, see `_ranged_gram`). A vector is bad when its squared norm comes out non-finite.
    If the central client (smallest median distance to the others) lies more than `_RECENTRE_RATIO` squared
    median distances from the origin, the vectors share a component large enough for float32 cancellation
    to matter, and a second pass centres every chunk on that client.

    K, D and bad are on the CPU whatever G's device, since the rules' N x N algebra runs on the host: moving K
    there is the one wait for the device (two when recentring)."""
    _check_input(G, "geometry")
    N = G.shape[0]
    K = _ranged_gram(G, extra, origin)
    bad = ~torch.isfinite(K.diagonal()[:N])
    K = _clean(K, bad)
    D = _distances(K, bad)
    median = D.median(dim=1).values
    r = int(torch.where(bad, math.inf, median).argmin())
    if not bad.all() and not K[r, r] <= _RECENTRE_RATIO * median[r]:
        K = _clean(_ranged_gram(G, extra, origin, centre=G[r], bad=bad.to(G.device)), bad)
        D = _distances(K, bad)
    return Geometry(K, D, bad)


def pairwise_sq_distances(G: Tensor) -> Tensor:
    """Squared distances ||g_i - g_j||^2 as an (N, N) float64 tensor on G's device.

    Accurate when the vectors share a large common component (`geometry` then recentres on a central client;
    float64 accumulation across chunks), exact zero diagonal, no negative entries, +inf between a non-finite
    vector and any other.
    """
    _check_input(G, "pairwise_sq_distances")
    return geometry(G).D.to(G.device)


def _sort_without_self(D: Tensor) -> tuple[Tensor, Tensor]:
    """Each row of D (..., N, N) sorted without its own entry: values and indices (..., N, N-1)."""
    self_first = D.clone()
    _diagonal(self_first).fill_(-1)  # self sorts first, ahead of a zero distance to a twin
    values, index = self_first.sort(dim=-1, stable=True)
    return values[..., 1:], index[..., 1:]


def _neighbourhood(index: Tensor, m: int, dtype: torch.dtype) -> Tensor:
    """(..., N, N) averaging matrix of N_m(k): client k and its m-1 nearest others, each with weight 1/m,
    from the indices of each client's others by distance (..., N, N-1)."""
    N = index.shape[-2]
    A = torch.zeros(*index.shape[:-1], N, dtype=dtype, device=index.device)
    A.scatter_(-1, index[..., : m - 1], 1.0 / m)
    _diagonal(A).fill_(1.0 / m)
    return A


def _weighted_sum(G: Tensor, w: Tensor, bad: Tensor | None) -> Tensor:
    """sum_i w_i g_i with bad vectors excluded (their weight must be 0: 0 * NaN would poison a matmul);
    ``bad=None``: every vector is known to be finite. w and bad on any device (the geometry's: the CPU)."""
    w = w.to(G.device, G.dtype, non_blocking=w.device.type == "cpu")  # pageable: staged first
    if bad is not None and bad.any():
        good = (~bad).nonzero().squeeze(1).to(G.device)
        return w[good] @ G[good]
    return w @ G


def _times(M: Tensor, v: Tensor) -> Tensor:
    """M v for a matrix M (..., P, Q) and a vector v (..., Q), batches included."""
    return M @ v if v.dim() == 1 else (M @ v.unsqueeze(-1)).squeeze(-1)


def _mm(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for matrices, or for batches of them (C, P, Q) @ (C, Q, R) (by torch.bmm: the same product as
    ``@``, fewer steps on the host)."""
    return torch.bmm(a, b) if a.dim() == 3 else a @ b


def _dot(a: Tensor, b: Tensor) -> Tensor:
    """<a, b> over the last axis of (..., P) vectors, (..., 1) for a batch (a scalar for one pair)."""
    return a @ b if a.dim() == 1 else (a * b).sum(dim=-1, keepdim=True)


def _nan_to_inf(G: Tensor) -> Tensor:
    """G with NaN as +inf (infinities kept): one pass, no test for a NaN first (that would wait for a GPU)."""
    return torch.nan_to_num(G, nan=math.inf, posinf=math.inf, neginf=-math.inf)


# The coordinate-wise helpers below reduce over axis -2 of (..., N, d) values, so that the attack search can
# run all its candidates as one (C, N, d) batch (`Rule.coordinatewise`); per coordinate they compute the
# same values for a batch as for each (N, d) slice alone.


def _coordinate_median(values: Tensor) -> Tensor:
    """Coordinate-wise median of (..., N, d) values (no NaN) over N, the mean of the two middle values when N
    is even: from one sort (a GPU sorts the N values of a column in one pass; a median or a topk over short
    columns takes a pass per call)."""
    N = values.shape[-2]
    ordered = values.sort(dim=-2).values
    lower, upper = ordered[..., (N - 1) // 2, :], ordered[..., N // 2, :]
    return lower if N % 2 else 0.5 * lower + 0.5 * upper  # not (a + b) / 2: no overflow near the float range


def _mean_closest_to_median(values: Tensor, k: int) -> Tensor:
    """Per coordinate, the mean of the k values of (..., N, d) ``values`` (no NaN) closest to the
    coordinate-wise median (`_coordinate_median`). Of values equally far at the cut, topk's pick, not
    necessarily the first rows as the authors' ``np.argsort`` (defenses.py line 92) keeps them at N <= 16
    (docs/semantics.md, row TrimmedMean)."""
    distance = (values - _coordinate_median(values).unsqueeze(-2)).abs()
    closest = distance.topk(k, dim=-2, largest=False).indices
    return values.gather(-2, closest).mean(dim=-2)


# ------------------------------------------------------------------------------------------------- rules


class Combination(NamedTuple):
    """A rule's output as an affine combination of its N inputs and one reference point (the origin unless
    the rule names another, see `Rule.reference`): ``out = sum_i w_i g_i + w_N * reference``."""

    weights: Tensor | None  # (N+1,) float64 on [inputs; reference], summing to 1; None: not for this input
    record: Any = None  # what the rule's own call keeps (ProDiGy: its scores), see `Rule.commit`


def _on_inputs(w: Tensor, record: Any = None) -> Combination:
    """The Combination with weights w (..., N) on the inputs and 0 on the reference point."""
    return Combination(torch.cat([w, w.new_zeros(*w.shape[:-1], 1)], dim=-1), record)


class Rule:
    """A robust aggregation rule: ``rule(G) -> (d,)``. ``peek`` gives the same result and changes no state.

    A new rule needs ``__init__(f, **settings)`` and ``aggregate(G) -> (d,)`` alone. This one averages the
    N - 2f vectors closest to the coordinate-wise median; NNM goes in front of it as in front of any rule, and
    ``RULES.register`` (or a plug-in spec, ``defense: my_rules.py:Closest``) lets params files name it:

    >>> import torch
    >>> from prodigy_core.aggregators import NNM, Pipeline, Rule
    >>> class Closest(Rule):
    ...     display = "Closest to the median"  # what tables print
    ...     def __init__(self, f: int):
    ...         self.f = f
    ...     def aggregate(self, G):
    ...         far = (G - G.median(dim=0).values).norm(dim=1)
    ...         return G[far.argsort()[: len(G) - 2 * self.f]].mean(dim=0)
    >>> G = torch.cat([torch.full((2, 3), 1e6), torch.ones(6, 3)])  # 2 Byzantine rows, 6 honest
    >>> Closest(2)(G), Pipeline("nnm+closest", Closest(2), [NNM(2)])(G)
    (tensor([1., 1., 1.]), tensor([1., 1., 1.]))

    Optional, by need: ``check_n(n)`` raises on an N the rule cannot run on (``need`` words the error,
    `check_f` checks f); a rule whose output is a weighted combination of its inputs may give it as
    ``combine(K, D, bad) -> Combination`` from the Gram matrix alone (NNM in front and the attack search
    then cost no pass over G; ``by_weights = True`` uses it when the rule runs alone too, ``reference`` names
    the one extra point it may weigh); ``coordinatewise = True`` says that ``aggregate`` reduces each
    coordinate over axis -2 of (..., N, d) values alone (median, trimmed mean: the attack search then runs
    all its candidates as one batch); ``batched = True`` says that ``combine`` also takes a batch of Gram
    matrices (..., N+1, N+1) with one ``bad`` mask (N,) for all, and returns weights (..., N+1) (the attack
    search scores all its candidates as one computation); a stateful rule keeps its state in ``commit``
    (never in ``peek``) and implements ``reset``, ``state_dict``, ``load_state_dict``, and ``new_round`` if
    it reads the model.
    """

    name: str = ""  # what a params file writes (`RULES.register` files the class under it)
    display: str = ""  # what a table prints
    presets: dict[str, tuple[str, dict[str, Any]]] = {}  # other names: {name: (display, settings)}
    f: int = 0
    by_weights: bool = False
    coordinatewise: bool = False
    batched: bool = False

    def __call__(self, G: Tensor) -> Tensor:
        out, record = self._run(G)
        self.commit(out, record)
        return out

    def peek(self, G: Tensor) -> Tensor:
        return self._run(G)[0]

    def _run(self, G: Tensor) -> tuple[Tensor, Any]:
        _check_input(G, repr(self))
        self.check_n(G.shape[0])
        out, record = _aggregate_from_gram(self, G, []) if self.by_weights else (None, None)
        if out is None:
            out = self.aggregate(G)
            if not isinstance(out, Tensor) or out.shape != G.shape[1:] or out.device != G.device:
                raise ValueError(f"{self!r}.aggregate returned {shape_of(out)}; a rule returns one vector "
                                 f"(d,) = ({G.shape[1]},) on {G.device}, e.g. G.mean(dim=0)")  # fmt: skip
        return out.to(G.dtype), record

    def aggregate(self, G: Tensor) -> Tensor:
        raise NotImplementedError(
            f"{type(self).__name__} has no aggregate(G): implement it, or set by_weights = True when the "
            "rule gives its output as combine(K, D, bad)"
        )

    def reference(self, G: Tensor) -> Tensor | None:
        """The one point besides the inputs that ``combine`` may weigh (CClip: its start v_0), (d,) like a
        row of G; None: the origin."""
        return None

    def combine(self, K: Tensor, D: Tensor, bad: Tensor) -> Combination | None:
        """The output as a `Combination`, from the geometry alone: K the Gram matrix of [inputs; reference]
        about any common centre ((N+1, N+1), float64, rows and columns of bad vectors zeroed), D the squared
        distances between the inputs (N, N), ``bad`` their mask (N,). None when the rule is not such a
        combination (coordinate-wise rules). This lets NNM + rule run from one Gram matrix, and the attack
        search evaluate every candidate of a line from one. A ``batched`` rule takes K (C, N+1, N+1) and D
        (C, N, N) too and returns weights (C, N+1), a row of NaN where a candidate's output is not such a
        combination."""
        return None

    def commit(self, out: Tensor, record: Any) -> None:
        """Keep what a call (not a ``peek``) keeps: CClip its output as its next start, ProDiGy its scores."""

    def new_round(self, model: Tensor) -> None:
        """Told the current model parameters theta_t (d,) before a round's aggregation and attack search (the
        training loop calls it; only CClip under the ``authors`` variant uses them)."""

    def check_n(self, n: int) -> int | None:
        """Raise a ValueError when the rule cannot run on n vectors; a pre-aggregator (NNM, Bucketing) returns
        how many vectors it outputs."""

    def need(self, ok: bool, n: int, limit: str) -> None:
        if not ok:
            raise ValueError(f"{self!r} needs {limit}, got N={n}")

    def reset(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}(f={self.f})"


@RULES.register
class Average(Rule):
    """Plain mean (1/N) sum_i g_i: FedAvg (McMahan et al., "Communication-Efficient Learning of Deep Networks
    from Decentralized Data", AISTATS 2017), the paper's ``none`` defense.

    Not robust: one Byzantine vector moves it arbitrarily, and a NaN/Inf vector makes it non-finite. It
    returns that mean as is, with no check that would wait for the device: the training loop records the
    divergence (`RunResult.diverged`)."""

    name = "average"
    display = "Average"
    presets = {"none": ("No defense", {})}
    batched = True

    def __init__(self, f: int = 0):
        self.f = check_f("Average", f)

    def aggregate(self, G: Tensor) -> Tensor:
        return G.mean(dim=0)

    def combine(self, K: Tensor, D: Tensor, bad: Tensor) -> Combination | None:
        if bad.any():  # the mean of a bad vector is not a finite combination
            return None
        N = D.shape[-1]
        return _on_inputs(torch.full(D.shape[:-1], 1.0 / N, dtype=torch.float64, device=D.device))


@RULES.register
class Median(Rule):
    """Coordinate-wise median; the mean of the two middle values when N is even (Yin et al., 2018).

    NaN counts as +inf, so the output is finite while fewer than N/2 vectors are bad in each coordinate;
    hence f < N/2 (checked: after Bucketing, N is the number of buckets, each of which one bad vector
    spoils).

    Reference: Yin et al., "Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates",
    ICML 2018."""

    name = "median"
    display = "Median"
    coordinatewise = True

    def __init__(self, f: int = 0):
        self.f = check_f("Median", f)

    def check_n(self, n: int) -> None:
        self.need(2 * self.f < n, n, f"f < N/2, i.e. N > 2f = {2 * self.f}")

    def aggregate(self, G: Tensor) -> Tensor:
        return _coordinate_median(_nan_to_inf(G))


@RULES.register
class TrimmedMean(Rule):
    """Coordinate-wise trimmed mean (Yin et al., 2018): drop the f largest and f smallest values, average the
    N-2f others (``variant="paper"``, the paper's text).

    From one sort per coordinate: the sum of the sorted values f+1 .. N-f over N-2f, so the dropped values
    never enter a sum whatever their magnitude.
    NaN counts as +inf; a coordinate whose kept range reaches an infinity (more than f infinite values on one
    side) gives that infinity, or NaN when it reaches both (f = 0: the plain mean, where a NaN stays NaN).
    Per coordinate, so no test of the whole input (no wait for a GPU).

    ``variant="authors"`` (the authors' code): per coordinate, the mean of the N-2f values closest to the
    coordinate-wise median (the mean of the two middle values for even N), as in Bulyan's last step.

    Reference: Yin et al., "Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates",
    ICML 2018."""

    name = "trimmed_mean"
    display = "Trimmed mean"
    coordinatewise = True

    def __init__(self, f: int, variant: str = "paper"):
        self.f = check_f("TrimmedMean", f)
        self.variant = check_variant("TrimmedMean", variant)

    def check_n(self, n: int) -> None:
        self.need(n > 2 * self.f, n, f"N > 2f = {2 * self.f}")

    def aggregate(self, G: Tensor) -> Tensor:
        N, f = G.shape[-2], self.f
        if f == 0:
            return G.mean(dim=-2)
        G = _nan_to_inf(G)
        if self.variant == "authors":
            return _mean_closest_to_median(G, N - 2 * f)
        return G.sort(dim=-2).values[..., f : N - f, :].sum(dim=-2) / (N - 2 * f)


@RULES.register
class GeoMed(Rule):
    """Geometric median by the smoothed Weiszfeld algorithm of RFA (Pillutla et al., 2022):
    z_{r+1} = sum_i b_i g_i / sum_i b_i, b_i = 1 / max(nu, ||z_r - g_i||), R iterations from z_0 = 0
    (as in the authors' code). Runs on the Gram matrix of [G; 0]; bad vectors get b_i = 0. Needs f < N/2
    (its breakdown point; after Bucketing, N is the number of buckets). nu is an absolute length, so the
    rule is not scale-equivariant below it.

    Reference: Pillutla, Kakade and Harchaoui, "Robust Aggregation for Federated Learning", IEEE Transactions
    on Signal Processing, 2022."""

    name = "geomed"
    display = "GeoMed"

    by_weights = True
    batched = True

    def __init__(self, f: int = 0, nu: float = 0.1, R: int = 3):
        self.f = check_f("GeoMed", f)
        if not nu > 0 or not 1 <= R <= MAX_ITERATIONS:
            raise ValueError(f"GeoMed: needs nu > 0 and 1 <= R <= {MAX_ITERATIONS}, got nu={nu}, R={R}")
        self.nu, self.R = nu, R

    def check_n(self, n: int) -> None:
        self.need(2 * self.f < n, n, f"f < N/2, i.e. N > 2f = {2 * self.f}")

    def combine(self, K: Tensor, D: Tensor, bad: Tensor) -> Combination:
        N = len(bad)  # point N, the reference, is the origin z_0
        sq = _diagonal(K)[..., :N]
        dist = (sq - 2 * K[..., :N, N] + K[..., N, N, None]).clamp(min=0).sqrt()
        for _ in range(self.R):
            beta = torch.where(bad, 0.0, 1.0 / dist.clamp(min=self.nu))
            w = beta / beta.sum(dim=-1, keepdim=True)
            Kw = _times(K[..., :N, :N], w)
            dist = (_dot(w, Kw) - 2 * Kw + sq).clamp(min=0).sqrt()
        return _on_inputs(w)

    def __repr__(self) -> str:
        return f"GeoMed(nu={self.nu}, R={self.R})"


def krum_scores(D: Tensor, f: int) -> Tensor:
    """Krum score of each client: the sum of its N-f-2 smallest squared distances to other clients (D may be
    a batch (..., N, N))."""
    return _sort_without_self(D)[0][..., : D.shape[-1] - f - 2].sum(dim=-1)


@RULES.register
class Krum(Rule):
    """Krum (Blanchard et al., 2017): the g_k minimising the sum of squared distances to its N-f-2 nearest
    others. Ties go to the lowest index. Needs N > 2f+2.

    Computed as the weights e_k on the inputs (``by_weights``), so the attack search's Gram matrix serves
    the aggregation too, as for Multi-Krum (the weighted sum of a one-hot weight vector is g_k itself).

    Reference: Blanchard et al., "Machine Learning with Adversaries: Byzantine Tolerant Gradient Descent",
    NeurIPS 2017."""

    name = "krum"
    display = "Krum"
    by_weights = True
    batched = True

    def __init__(self, f: int):
        self.f = check_f("Krum", f)

    def check_n(self, n: int) -> None:
        self.need(n > 2 * self.f + 2, n, f"N > 2f+2 = {2 * self.f + 2}")

    def combine(self, K: Tensor, D: Tensor, bad: Tensor) -> Combination:
        w = torch.zeros(D.shape[:-1], dtype=torch.float64, device=D.device)
        return _on_inputs(w.scatter_(-1, krum_scores(D, self.f).argmin(dim=-1, keepdim=True), 1.0))


@RULES.register
class MultiKrum(Rule):
    """Multi-Krum (Blanchard et al., 2017): the mean of the m vectors with the lowest Krum scores
    (default m = N - f; ties go to the lower index). Needs N > 2f+2 and 1 <= m <= N - f.

    Reference: Blanchard et al., "Machine Learning with Adversaries: Byzantine Tolerant Gradient Descent",
    NeurIPS 2017."""

    name = "multikrum"
    display = "Multi-Krum"

    by_weights = True
    batched = True

    def __init__(self, f: int, m: int | None = None):
        self.f = check_f("MultiKrum", f)
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"MultiKrum: m must be an integer >= 1 or null (N - f), got m={m!r}")
        self.m = m

    def check_n(self, n: int) -> None:
        self.need(n > 2 * self.f + 2, n, f"N > 2f+2 = {2 * self.f + 2}")
        m = n - self.f if self.m is None else self.m
        self.need(1 <= m <= n - self.f, n, f"1 <= m <= N - f, m={m}")

    def combine(self, K: Tensor, D: Tensor, bad: Tensor) -> Combination:
        m = D.shape[-1] - self.f if self.m is None else self.m
        chosen = krum_scores(D, self.f).sort(dim=-1, stable=True).indices[..., :m]
        w = torch.zeros(D.shape[:-1], dtype=torch.float64, device=D.device)
        return _on_inputs(w.scatter_(-1, chosen, 1.0 / m))

    def __repr__(self) -> str:
        return f"MultiKrum(f={self.f}, m={self.m})"


@RULES.register
class Bulyan(Rule):
    """Bulyan (El Mhamdi et al., 2018), Algorithm 1: select theta = N-2f vectors by applying Krum
    repeatedly to the remaining ones (scores over the max(n_R-f-2, 1) nearest remaining others, so that
    the last picks among 2f+1 vectors stay meaningful), then per coordinate average the beta = N-4f
    selected values closest to the coordinate-wise median of the selection. Needs N >= 4f+3.

    Reference: El Mhamdi, Guerraoui and Rouault, "The Hidden Vulnerability of Distributed Learning in
    Byzantium", ICML 2018."""

    name = "bulyan"
    display = "Bulyan"

    def __init__(self, f: int):
        self.f = check_f("Bulyan", f)

    def check_n(self, n: int) -> None:
        self.need(n >= 4 * self.f + 3, n, f"N >= 4f+3 = {4 * self.f + 3}")

    def aggregate(self, G: Tensor) -> Tensor:
        N, f = G.shape[0], self.f
        D = geometry(G).D
        remaining = torch.arange(N)
        selected = []
        for _ in range(N - 2 * f):
            sub = D[remaining][:, remaining]
            k = max(len(remaining) - f - 2, 1)
            j = int(_sort_without_self(sub)[0][:, :k].sum(dim=1).argmin())
            selected.append(remaining[j])
            remaining = torch.cat([remaining[:j], remaining[j + 1 :]])
        S = G[torch.stack(selected).to(G.device)]  # bad vectors have infinite scores and are never selected
        return _mean_closest_to_median(S, N - 4 * f)


@RULES.register
class CClip(Rule):
    """Centred clipping (Karimireddy et al., 2021): v_{l+1} = v_l + (1/N) sum_i clip_tau(g_i - v_l),
    clip_tau(x) = x min(1, tau/||x||), L iterations, from v_0 =

    - ``variant="paper"``: the previous committed aggregate (0 at the start). Stateful: ``__call__`` commits
      v_L as the next start, ``peek`` does not, ``reset`` returns to 0;
    - ``variant="authors"``: the current model parameters theta_t, as the authors' code passes the weights
      (given by ``new_round(theta_t)``, which the training loop calls before each round's aggregation and
      attack search; calling the rule before any ``new_round`` is an error).

    A bad vector contributes 0 (it is infinitely far: its clipped direction is undefined). Runs on the Gram
    matrix of [G; v_0]: every iterate is an affine combination of these points.

    Reference: Karimireddy, He and Jaggi, "Learning from History for Byzantine Robust Optimization",
    ICML 2021."""

    name = "cclip"
    display = "CClip"

    by_weights = True
    batched = True

    def __init__(self, f: int = 0, tau: float = 10.0, L: int = 3, variant: str = "paper"):
        self.f = check_f("CClip", f)
        if not tau > 0 or not 1 <= L <= MAX_ITERATIONS:
            raise ValueError(f"CClip: needs tau > 0 and 1 <= L <= {MAX_ITERATIONS}, got tau={tau}, L={L}")
        self.tau, self.L = tau, L
        self.variant = check_variant("CClip", variant)
        self.prev: Tensor | None = None
        self.model: Tensor | None = None

    def new_round(self, model: Tensor) -> None:
        self.model = model.detach().clone() if self.variant == "authors" else None

    def reference(self, G: Tensor) -> Tensor:
        """v_0 for the client vectors G: the committed aggregate, or 0 before the first call (``paper``);
        the model parameters of the last ``new_round`` (``authors``)."""
        d = G.shape[1]
        if self.variant == "authors":
            if self.model is None:
                raise ValueError(
                    f"{self!r} starts from the model parameters theta_t: call new_round(theta_t) (or "
                    f"pipeline.new_round(theta_t)) before aggregating"
                )
            prev = self.model.to(G.device, G.dtype)
        else:
            prev = G.new_zeros(d) if self.prev is None else self.prev.to(G.device, G.dtype)
        if prev.shape != (d,):
            raise ValueError(f"{self!r}: previous aggregate has shape {tuple(prev.shape)}, G has d={d}")
        return prev

    def combine(self, K: Tensor, D: Tensor, bad: Tensor) -> Combination:
        N = len(bad)
        w = torch.zeros(K.shape[:-1], dtype=torch.float64, device=K.device)
        w[..., N] = 1.0  # v = sum_a w_a P_a, always an affine combination (weights sum to 1)
        for _ in range(self.L):
            Kw = _times(K, w)
            dist = (_dot(w, Kw) - 2 * Kw[..., :N] + _diagonal(K)[..., :N]).clamp(min=0).sqrt()
            scale = torch.where(dist > self.tau, self.tau / dist, 1.0).masked_fill(bad, 0.0)
            w = w * (1 - scale.sum(dim=-1, keepdim=True) / N)
            w[..., :N] += scale / N
        return Combination(w)

    def commit(self, out: Tensor, record: Any) -> None:
        self.prev = out.clone()

    def reset(self) -> None:
        self.prev = None

    def state_dict(self) -> dict:
        return {"prev": None if self.prev is None else self.prev.clone()}

    def load_state_dict(self, state: dict) -> None:
        prev = state.get("prev")
        if prev is not None and not isinstance(prev, Tensor):
            raise ValueError(f"{self!r}.load_state_dict: prev must be the last aggregate (d,) or None, got "
                             f"{shape_of(prev)}")  # fmt: skip
        self.prev = None if prev is None else prev.clone()

    def __repr__(self) -> str:
        variant = ", variant='authors'" if self.variant == "authors" else ""
        return f"CClip(tau={self.tau}, L={self.L}{variant})"


class ProDiGyScores(NamedTuple):
    """Per-client ProDiGy scores (float64, length N); bad vectors have all four equal to 0."""

    proximity: Tensor
    dissimilarity: Tensor
    composite: Tensor
    weight: Tensor  # normalised: sums to 1 over the kept clients, 0 for the zeroed ones


@RULES.register
class ProDiGy(Rule):
    """ProDiGy: proximity x dissimilarity scoring (Ergisi, Maßny, Bitar, "ProDiGy: Proximity- and
    Dissimilarity-Based Byzantine-Robust Federated Learning", arXiv:2509.09534, 2025: the paper's rule).
    A plain reference implementation, loop by loop: tests/test_aggregators.py, `bf_prodigy`.

    s_p(k) = 1 / sum_{i=f}^{N-f-1} delta_{k,i}  (delta_{k,i}: i-th smallest squared distance to the others)
    s_d(k) = sigma(N_f(k)) / ||mu(N_f(k))||    (N_f(k): k and its f-1 nearest others;
                                                sigma^2 = mean_i ||g^i - mu||^2 = sum_ij D_ij / (2 f^2))
    s(k) = s_p(k) s_d(k); every client whose score is <= the f-th lowest gets weight 0 (ties too);
    output = sum_k s(k) g^k / sum_k s(k) over the kept clients.

    Guards: a zero distance sum is floored at 1e-12 x the median one and a zero mean norm at 1e-12 x the
    median client norm (medians over the good clients, which no Byzantine vector of any size can move out of
    the honest range; the smallest positive value where the median is 0), so that no division is by 0.
    Identical vectors still score 0: their neighbourhood has sigma = 0, which is how the rule discards
    colluders sending one vector (ALIE), and a cluster of identical honest vectors is discarded the same way
    (hence no NNM in front: `REFUSED_DEFENSES`). If every kept score is 0 (e.g. all vectors equal), the output
    is the coordinate-wise median. Needs 2 <= f < N/2 (f = 1 makes every s_d zero). A call (not a ``peek``)
    keeps the scores of its input in ``last_scores``, on the CPU (logging them waits for no device);
    ``scores(G)`` returns them on G's device."""

    name = "prodigy"
    display = "ProDiGy"

    by_weights = True
    batched = True

    def __init__(self, f: int):
        self.f = check_f("ProDiGy", f)
        if self.f < 2:
            raise ValueError(f"ProDiGy: needs f >= 2 (with f < 2 every dissimilarity score is 0), got f={f}")
        self.last_scores: ProDiGyScores | None = None

    def check_n(self, n: int) -> None:
        self.need(2 * self.f < n, n, f"f < N/2, i.e. N > 2f = {2 * self.f}")

    def scores(self, G: Tensor) -> ProDiGyScores:
        _check_input(G, repr(self))
        self.check_n(G.shape[0])
        return ProDiGyScores(*(s.to(G.device) for s in self._scores_from(*geometry(G, origin=True))))

    def _scores_from(self, K: Tensor, D: Tensor, bad: Tensor) -> ProDiGyScores:
        """The scores from the Gram matrix K of [G; 0] (point N is the origin, for ||mu||); K (..., N+1, N+1)
        and D (..., N, N) may be batches, the scores then (..., N)."""
        N, f = D.shape[-1], self.f
        delta, index = _sort_without_self(D)
        spread = delta[..., f - 1 : N - f - 1].sum(dim=-1)  # delta_{k,f} .. delta_{k,N-f-1}, 1-indexed
        bad = bad if bad.any() else None  # None: no test of the mask again
        to_origin = K[..., :N, N]  # <g_k - centre, 0 - centre>
        origin = K[..., N, N].unsqueeze(-1)
        norms = (_diagonal(K[..., :N, :N]) - 2 * to_origin + origin).clamp(min=0).sqrt()
        spread_floor, norm_floor = _floor(torch.stack([spread, norms]), bad)  # both guards in one pass
        proximity = 1.0 / spread.clamp(min=spread_floor)
        A = _neighbourhood(index, f, torch.float64)
        D_good = D.masked_fill(torch.isinf(D), 0.0)  # neighbourhoods of good clients hold good clients only
        sigma = (0.5 * (_mm(A, D_good) * A).sum(dim=-1)).clamp(min=0).sqrt()
        AK = _mm(A, K[..., :N, :])
        mean_norm = ((AK[..., :N] * A).sum(dim=-1) - 2 * AK[..., N] + origin).clamp(min=0).sqrt()
        dissimilarity = sigma / mean_norm.clamp(min=norm_floor)
        if bad is not None:
            proximity, dissimilarity = proximity.masked_fill(bad, 0.0), dissimilarity.masked_fill(bad, 0.0)
        composite = proximity * dissimilarity
        kept = torch.where(composite > composite.kthvalue(f, dim=-1, keepdim=True).values, composite, 0.0)
        total = kept.sum(dim=-1, keepdim=True)
        weight = kept / torch.where(total > 0, total, 1.0)
        return ProDiGyScores(proximity, dissimilarity, composite, weight)

    def combine(self, K: Tensor, D: Tensor, bad: Tensor) -> Combination:
        scores = self._scores_from(K, D, bad)
        some = scores.weight.sum(dim=-1, keepdim=True) > 0  # every score 0: the median fallback, no weights
        if K.dim() > 2:
            return Combination(torch.where(some, _on_inputs(scores.weight).weights, math.nan), scores)
        return _on_inputs(scores.weight, scores) if some else Combination(None, scores)

    def aggregate(self, G: Tensor) -> Tensor:
        """The fallback where every kept score is 0 (e.g. all vectors equal): the coordinate-wise median."""
        return _coordinate_median(_nan_to_inf(G))

    def commit(self, out: Tensor, record: Any) -> None:
        self.last_scores = record

    def reset(self) -> None:
        self.last_scores = None


def _floor(values: Tensor, bad: Tensor | None) -> Tensor:
    """ProDiGy's guard for a division by `values` (..., N), non-negative: `_FLOOR` x their median over the
    good clients, (..., 1); where that median is 0 (half the good clients or more sent 0, or vectors equal),
    `_FLOOR` x their smallest positive value, so that the guard scales with the input as the rule does; inf
    where every value is 0 (every such division then gives 0). A median, not the largest value: with
    f < N/2 it lies within the honest clients' range, so a Byzantine client cannot raise the floor with a
    huge vector and push every honest score down to its own; nor can it raise the smallest positive value.
    A tensor, so the guard runs on any device without a sync. ``bad=None``: no bad client."""
    good = values if bad is None else values[..., ~bad]
    if not good.shape[-1]:
        return values.new_ones(*values.shape[:-1], 1)
    median = good.median(dim=-1, keepdim=True).values
    smallest = good.masked_fill(good <= 0, math.inf).amin(dim=-1, keepdim=True)
    return _FLOOR * torch.where(median > 0, median, smallest)


# --------------------------------------------------------------------------------------- pre-aggregators


class NNM(Rule):
    """Nearest-neighbour mixing (Allouah et al., 2023): g_k -> mean of N_{N-f}(k), k and its N-f-1 nearest
    others, as an (N, N) averaging matrix times G. A bad vector's own output is NaN (so that the next rule
    still sees it as bad); while at most f are bad, a good vector's neighbourhood never holds a bad one.
    Needs f < N/2.

    Reference: Allouah et al., "Fixing by Mixing: A Recipe for Optimal Byzantine ML under Heterogeneity",
    AISTATS 2023."""

    name = "nnm"
    display = "NNM"

    def __init__(self, f: int):
        self.f = check_f("NNM", f)

    def check_n(self, n: int) -> int:
        self.need(2 * self.f < n, n, f"f < N/2, i.e. N > 2f = {2 * self.f}")
        return n

    def __call__(self, G: Tensor) -> Tensor:
        return self.peek(G)

    def peek(self, G: Tensor, distances: Tensor | None = None) -> Tensor:
        """Mixed vectors (N, d); ``distances``: G's squared distances when the caller already has them (then
        every vector must be finite)."""
        _check_input(G, repr(self))
        self.check_n(G.shape[0])
        if distances is None:
            _, D, bad = geometry(G)
        else:
            D, bad = distances, _no_bad(G.shape[0], distances)
        A = self.mixing(D).to(G.device, G.dtype)
        if not bad.any():
            return A @ G
        good, bad = (~bad).nonzero().squeeze(1).to(G.device), bad.to(G.device)
        return (A[:, good] @ G[good]).masked_fill(bad[:, None], math.nan)

    def mixing(self, D: Tensor) -> Tensor:
        """The (N, N) float64 averaging matrix A of the mixed vectors A G, from the squared distances D; a
        batch (..., N, N) of each for a batch of D."""
        return _neighbourhood(_sort_without_self(D)[1], D.shape[-1] - self.f, torch.float64)


class Bucketing(Rule):
    """Bucketing (Karimireddy et al., 2022): shuffle the N vectors, split them into ceil(N/s) buckets of s
    (the last may be smaller) and return the bucket means (M, d). ``peek`` restores the generator, so it
    returns the same buckets as the next ``__call__``. generator=None uses torch's default CPU generator.

    Reference: Karimireddy, He and Jaggi, "Byzantine-Robust Learning on Heterogeneous Datasets via
    Bucketing", ICLR 2022."""

    name = "bucketing"
    display = "Bucketing"

    def __init__(self, s: int = 2, generator: torch.Generator | None = None):
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(f"Bucketing: bucket size s must be an integer >= 1, got s={s!r}")
        self.s, self.generator = s, generator

    def check_n(self, n: int) -> int:
        return -(-n // self.s)

    def __call__(self, G: Tensor) -> Tensor:
        _check_input(G, repr(self))
        generator = self.generator or torch.default_generator
        perm = torch.randperm(G.shape[0], generator=generator, device=generator.device).to(G.device)
        return torch.stack([G[bucket].mean(dim=0) for bucket in perm.split(self.s)])

    def peek(self, G: Tensor) -> Tensor:
        generator = self.generator or torch.default_generator
        state = generator.get_state()
        try:
            return self(G)
        finally:
            generator.set_state(state)

    def state_dict(self) -> dict:
        return {} if self.generator is None else {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if self.generator is not None and "generator" in state:
            self.generator.set_state(state["generator"])

    def __repr__(self) -> str:
        return f"Bucketing(s={self.s})"


# -------------------------------------------------------------------------------------------- pipelines


def _mix_geometry(gram: Tensor, D: Tensor, mixers: list[NNM]) -> tuple[Tensor, Tensor, Tensor]:
    """Through the mixers (NNMs): from the Gram matrix of [G; p] (any last point p) and G's squared
    distances D to those of [A G; p] and A G, and the total mixing matrix A (N, N); batches (..., N+1, N+1)
    of Gram matrices too. Every vector finite."""
    n = gram.shape[-1] - 1
    mix = None
    for p in mixers:
        A = p.mixing(D)
        P = torch.zeros_like(gram)
        P[..., :n, :n] = A
        P[..., n, n] = 1.0
        gram, mix = P @ gram @ P.mT, A if mix is None else A @ mix
        D = _distances(gram, _no_bad(n, gram))
    return gram, D, mix


def _combine(rule: Rule, K: Tensor, D: Tensor, bad: Tensor) -> Combination | None:
    """rule.combine(K, D, bad), its result checked when the rule is not the package's own (a plug-in's
    mistake is named here, not met as a shape error inside torch or as a silently scaled output)."""
    c = rule.combine(K, D, bad)
    if packaged(type(rule)):
        return c
    shape, why = tuple(K.shape[:-1]), ""
    if c is not None and not isinstance(c, Combination):
        why = f"returned a {type(c).__name__}, not a Combination (or None)"
    elif c is not None and c.weights is not None:
        w = c.weights
        if not isinstance(w, Tensor) or tuple(w.shape) != shape:
            why = f"gave weights of {shape_of(w)}, not shape {shape} (the N inputs, then the reference point)"
        elif bool(((w.sum(dim=-1) - 1).abs() > 1e-6).any()):
            why = "gave weights that do not sum to 1 (they are an affine combination of its points)"
    if why:
        batch = " (a batch: it says batched = True)" if K.dim() == 3 else ""
        raise ValueError(f"{rule!r}.combine{batch} {why}: see Rule.combine and Combination")
    return c


def _combination_through_mixers(
    rule: Rule, mixers: list[NNM], K: Tensor, D: Tensor, bad: Tensor
) -> Combination | None:
    """rule(mixers(G)) as a Combination of [G; reference], from K the Gram matrix of [G; reference]: the
    mixers map it to the Gram matrix of [A G; reference] and the rule's weights w' back to A^T w'."""
    if not mixers:
        return _combine(rule, K, D, bad)
    K, D, mix = _mix_geometry(K, D, mixers)
    c = _combine(rule, K, D, bad)
    if c is None or c.weights is None:
        return c
    return c._replace(weights=torch.cat([_times(mix.mT, c.weights[..., :-1]), c.weights[..., -1:]], dim=-1))


def _aggregate_from_gram(
    rule: Rule, G: Tensor, mixers: list[NNM], gram: Tensor | None = None, known: Combination | None = None
) -> tuple[Tensor | None, Any]:
    """(rule(mixers(G)), what its call records) from one Gram matrix of [G; rule.reference(G)] and one
    weighted sum over G: no pass over the mixed vectors A G (N, d), which are never formed. ``gram``: that
    Gram matrix when the caller has it (every vector finite), else computed here (`geometry`); ``known``:
    the Combination it gives, when already scored. The output is None where the rule gives no weights for
    this input, or mixers meet a non-finite vector."""
    ref = rule.reference(G)
    if known is not None:
        c, bad = known, None
    elif gram is not None:
        bad = _no_bad(G.shape[0], gram)
        c, bad = _combination_through_mixers(rule, mixers, gram, _distances(gram, bad), bad), None
    else:
        K, D, bad = geometry(G, extra=None if ref is None else ref[None], origin=ref is None)
        if mixers and bad.any():
            return None, None
        c = _combination_through_mixers(rule, mixers, K, D, bad)
    if c is None or c.weights is None:
        return None, None if c is None else c.record
    if bad is not None and not mixers and bad.any() and bool(c.weights[:-1][bad.to(c.weights.device)].any()):
        if int(bad.sum()) > rule.f:  # beyond the rule's contract: no robust answer (NaN, as coordinate rules)
            return G.new_full(G.shape[1:], math.nan), c.record
        rows = ", ".join(map(str, bad.nonzero().flatten().tolist()))
        raise ValueError(f"{rule!r}: its combine gave weight to non-finite input rows ({rows}), which a "
                         "weighted sum cannot take: give 0 to the rows `bad` marks")  # fmt: skip
    out = _weighted_sum(G, c.weights[:-1], None if mixers else bad)  # None: known finite
    return (out if ref is None else out.add_(ref, alpha=c.weights[-1].item())), c.record


class Pipeline:
    """Pre-aggregators then a rule: ``pipeline(G)`` commits state (CClip), ``peek(G)`` changes none.

    NNM followed by a rule that is a weighted combination (Krum, Multi-Krum, GeoMed, average, ProDiGy,
    CClip) runs from one Gram matrix and one weighted sum (`_aggregate_from_gram`). The call path:
    `__call__` / `peek` -> `_aggregate_by_weights` (a weighted pipeline; the attack search's scored candidate
    reused through `_scored_combination`) -> `_aggregate_from_gram` -> `_combination_through_mixers` (the NNMs
    as mixing matrices on the Gram matrix, `_mix_geometry`) -> the rule's `combine`; any other pipeline runs
    its pre-aggregators on the vectors, then the rule."""

    def __init__(self, name: str, rule: Rule, pre: list[Rule] | None = None):
        self.name, self.rule, self.pre = name, rule, list(pre or [])
        for part in (rule, *self.pre):
            if not isinstance(part, Rule):
                what = f"the class {part.__name__}" if isinstance(part, type) else shape_of(part)
                raise TypeError(f"Pipeline {name!r}: its rule and pre-aggregators are Rule instances, e.g. "
                                f"Median(f) or NNM(f), got {what}")  # fmt: skip
        # The last batch of Gram matrices that `weights` scored and its Combination (the attack search's
        # candidates): an aggregation given one of them (`Attack.last_gram`) takes its weights from there.
        self._scored: tuple[Tensor, Combination] | None = None

    def check_n(self, n: int) -> None:
        m = n
        try:
            for p in self.pre:
                m = p.check_n(m)
            if self.pre and m < 2:  # a rule's input is at least 2 vectors (`_check_input`)
                raise ValueError(f"{self.rule!r} needs at least 2 vectors, got {m}")
            self.rule.check_n(m)
        except ValueError as e:
            via = f" ({m} vectors after {', '.join(map(repr, self.pre))})" if self.pre else ""
            raise ValueError(f"{self.name} with {n} clients{via}: {e}") from None

    def __call__(self, G: Tensor, gram: Tensor | None = None) -> Tensor:
        """The aggregate, committing the rule's state. ``gram``: the Gram matrix of [G; reference] as
        `weights` takes it, when the caller already has it (the attack search's `Attack.last_gram`; every
        vector finite): a pipeline that gives weights, or a leading NNM, then makes no pass over G for it."""
        _check_input(G, self.name)
        self.check_n(G.shape[0])
        self._check_gram(gram, G)
        out, record = self._aggregate_by_weights(G, gram, self._scored_combination(gram))
        self._scored = None
        if out is not None:
            self.rule.commit(out, record)
            return out
        for i, p in enumerate(self.pre):
            first = i == 0 and self._nnm_takes_gram(gram)
            G = p.peek(G, distances=self._distances(gram)) if first else p(G)
        return self.rule(G)

    def peek(self, G: Tensor, gram: Tensor | None = None) -> Tensor:
        """The aggregate without changing any state. ``gram``: the Gram matrix of [G; reference] about any
        centre, as `__call__` takes it, when the caller already has it (every vector finite); a leading NNM
        then takes its distances from its first N points."""
        _check_input(G, self.name)
        self.check_n(G.shape[0])
        self._check_gram(gram, G)
        out = self._aggregate_by_weights(G)[0] if gram is None else None
        if out is not None:
            return out
        for i, p in enumerate(self.pre):
            first = i == 0 and self._nnm_takes_gram(gram)
            G = p.peek(G, distances=self._distances(gram)) if first else p.peek(G)
        return self.rule.peek(G)

    def _check_gram(self, gram: Tensor | None, G: Tensor) -> None:
        """A given ``gram`` must be the (N+1, N+1) float64 Gram matrix of [G; reference] on G's device. Its
        rows must be in G's order (cat[crafted, honest] for `Attack.last_gram`): that is not checked, as it
        would cost a pass over G and a wait for the device."""
        n = G.shape[0]
        ok = isinstance(gram, Tensor) and gram.shape == (n + 1, n + 1) and gram.dtype == torch.float64
        if gram is not None and not (ok and gram.device == G.device):
            raise ValueError(
                f"{self.name}: gram must be the float64 Gram matrix (N+1, N+1) = ({n + 1}, {n + 1}) of [G; "
                f"reference] on {G.device}, got {shape_of(gram)}"
                f"{f' ({gram.dtype})' if isinstance(gram, Tensor) else ''}: pass the attack's last_gram of "
                "this round with G = cat[crafted, honest], or no gram"
            )

    def _nnm_takes_gram(self, gram: Tensor | None) -> bool:
        """Whether the first pre-aggregator takes its distances from ``gram`` (a leading NNM)."""
        return gram is not None and isinstance(self.pre[0], NNM)

    def _aggregate_by_weights(
        self, G: Tensor, gram: Tensor | None = None, known: Combination | None = None
    ) -> tuple[Tensor | None, Any]:
        """NNM then a combining rule, from one Gram matrix (`_aggregate_from_gram`), ``gram`` when given
        (then a rule that runs by its weights alone too; ``known``: its Combination); (None, None) for other
        pipelines (a rule alone runs its own route)."""
        alone = gram is not None and not self.pre and self.rule.by_weights
        if not ((self.pre and self._gives_weights) or alone):
            return None, None
        return _aggregate_from_gram(self.rule, G, self.pre, gram, known)

    def _scored_combination(self, gram: Tensor | None) -> Combination | None:
        """The Combination of ``gram`` when `weights` scored it, to the bit, in its last batch (the attack
        search's chosen candidate): the same weights and record without scoring it again. None otherwise,
        or when that candidate gave no weights."""
        if gram is None or self._scored is None or self._scored[0].shape[1:] != gram.shape:
            return None
        batch, c = self._scored
        hits = (batch == gram).flatten(1).all(dim=1).nonzero().flatten().tolist()  # on the host: no wait
        if not hits or c.weights[hits[0]].isnan().any():
            return None
        i, record = hits[0], c.record
        if record is not None:
            record = type(record)(*(x[i] for x in record))
        return Combination(c.weights[i], record)

    def reference(self, G: Tensor) -> Tensor | None:
        """The reference point of ``weights`` for the client vectors G (CClip: its start v_0); None: the
        origin."""
        return self.rule.reference(G)

    @property
    def coordinatewise(self) -> bool:
        """Whether the pipeline is a coordinate-wise rule (`Rule.coordinatewise`), alone or after one NNM:
        ``rule.aggregate(M @ X)`` then gives its outputs for a batch X (C, N, w) of inputs' column chunks,
        M the NNM's mixing matrices (`mixing`) where there is one (the attack search)."""
        pre_ok = not self.pre or (len(self.pre) == 1 and isinstance(self.pre[0], NNM))
        return self.rule.coordinatewise and pre_ok

    def mixing(self, gram: Tensor) -> Tensor:
        """The leading NNM's mixing matrix A (N, N), float64, from the Gram matrix of N finite vectors G and
        one more point ((N+1, N+1), about any centre): ``peek(G, gram)`` feeds A G to the rest."""
        return self.pre[0].mixing(self._distances(gram))

    @staticmethod
    def _distances(gram: Tensor) -> Tensor:
        """Squared distances between the first N points of the Gram matrix of N finite vectors and a point."""
        return _distances(gram, _no_bad(gram.shape[-1] - 1, gram))

    @property
    def takes_gram(self) -> bool:
        """Whether a Gram matrix given to ``peek`` or ``weights`` saves work: a leading NNM, or no
        pre-aggregator and a rule whose output is a weighted combination of its inputs."""
        if self.pre:
            return isinstance(self.pre[0], NNM)
        return self._rule_gives_weights

    @property
    def _gives_weights(self) -> bool:
        """Whether the pipeline's output is a weighted combination of its inputs: every pre-aggregator an NNM
        (a mixing matrix A, so the inputs reach the rule as A G) and a rule that combines."""
        return self._rule_gives_weights and all(isinstance(p, NNM) for p in self.pre)

    @property
    def _rule_gives_weights(self) -> bool:
        """Whether the rule implements `Rule.combine` (its output is a weighted combination)."""
        return type(self.rule).combine is not Rule.combine

    def weights(self, gram: Tensor) -> Tensor | None:
        """The aggregate of N finite vectors G as weights w (N+1,) on [G; reference], ``peek(G) =
        sum_i w_i g_i + w_N reference`` (`reference`, the origin for every rule but CClip), from ``gram``
        alone: the Gram matrix of [G; reference] about any centre ((N+1, N+1), float64), no pass over G.
        None when the pipeline is not such a combination (a coordinate-wise rule, Bucketing).

        A batch of C Gram matrices (C, N+1, N+1) (the attack search's candidates) gives weights (C, N+1)
        in one computation (a `Rule.batched` rule; else one at a time), a row of NaN where that input's
        output is not a combination (ProDiGy's median fallback)."""
        ok = isinstance(gram, Tensor) and gram.dim() in (2, 3) and gram.shape[-2] == gram.shape[-1] >= 3
        if not ok:
            raise ValueError(
                f"{self.name}.weights: expected the (N+1, N+1) Gram matrix of [G; reference] with N >= 2 "
                f"(e.g. geometry(G, extra=reference[None]).K, or geometry(G, origin=True).K for the origin), "
                f"or a batch (C, N+1, N+1) of them, got {shape_of(gram)}"
            )
        n = gram.shape[-1] - 1
        self.check_n(n)
        if not self._gives_weights:
            return None
        if gram.dim() == 3 and not self.rule.batched:  # a plug-in's combine takes one matrix
            each = [self.weights(g) for g in gram]
            return torch.stack([gram.new_full((n + 1,), math.nan) if w is None else w for w in each])
        bad = _no_bad(n, gram)
        c = _combination_through_mixers(self.rule, self.pre, gram, _distances(gram, bad), bad)
        if gram.dim() == 3 and (c is None or c.weights is None):
            return gram.new_full(gram.shape[:-1], math.nan)
        if gram.dim() == 3 and (c.record is None or isinstance(c.record, tuple)):
            self._scored = (gram, c)
        return None if c is None else c.weights

    def new_round(self, model: Tensor) -> None:
        """Tell the rule the current model parameters theta_t (d,) (see `Rule.new_round`)."""
        if not isinstance(model, Tensor) or model.dim() != 1:
            raise ValueError(f"{self.name}.new_round takes the model parameters as one vector (d,), e.g. "
                             f"parameters_to_vector(model.parameters()), got {shape_of(model)}")  # fmt: skip
        self.rule.new_round(model)

    def reset(self) -> None:
        self.rule.reset()

    def state_dict(self) -> dict:
        return {"rule": self.rule.state_dict(), "pre": [p.state_dict() for p in self.pre]}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, Mapping):
            raise ValueError(f"{self.name}.load_state_dict takes what state_dict() returned, a mapping, got "
                             f"{shape_of(state)}")  # fmt: skip
        self.rule.load_state_dict(state.get("rule", {}))
        for p, s in zip(self.pre, state.get("pre", []), strict=False):
            p.load_state_dict(s)

    def __repr__(self) -> str:
        return f"Pipeline({self.name!r}, rule={self.rule!r}, pre={self.pre!r})"


contract("defense", Rule)
# Pre-aggregators a defense name may put in front of a rule: ``nnm+krum``.
PRE_AGGREGATORS: dict[str, type[Rule]] = {"nnm": NNM, "bucketing": Bucketing}
PRE_PREFIXES = tuple(p + "+" for p in PRE_AGGREGATORS)
# Compositions refused by name, with the reason: the pre-aggregator's output defeats the rule. NNM's output
# is still `Pipeline("nnm+prodigy", ProDiGy(f), [NNM(f)])` in Python, for whoever studies the failure.
REFUSED_DEFENSES = {
    "nnm+prodigy": "NNM mixes the honest clients into (near-)identical vectors, whose dissimilarity score "
    "(the spread of a neighbourhood over its mean's norm) is 0, so ProDiGy discards them and f distinct "
    "Byzantine vectors far away move the output without bound (docs/semantics.md); use prodigy alone",
}


def aggregator_names() -> tuple[str, ...]:
    """Every defense name a params file can write now: each registered rule (`RULES`, those registered after
    import too), alone and behind each pre-aggregator, less `REFUSED_DEFENSES`."""
    base = RULES.names()
    composed = (p + b for p in PRE_PREFIXES for b in base)
    return base + tuple(n for n in composed if n not in REFUSED_DEFENSES)


BASE_NAMES = RULES.names()  # the package's own rules, as imported (menus, tests)
AGGREGATOR_NAMES = aggregator_names()


def split_defense(name: str) -> tuple[str, str]:
    """("nnm", "krum") for ``nnm+krum``; ("", rule) without a pre-aggregator."""
    prefix, plus, rest = name.partition("+")
    return (prefix, rest) if plus and prefix in PRE_AGGREGATORS else ("", name)


def normalise_defense(name: str) -> str:
    """A defense name as stored: lower case, except a plug-in's path and class (``nnm+my.py:MyRule``)."""
    if not isinstance(name, str):  # str(None) is "none", the plain average
        raise ValueError(f"defense must be a name such as 'prodigy' or 'nnm+krum', got {name!r}")
    prefix, base = split_defense(name.strip().lower())
    if is_plugin(name):
        base = name.strip()[len(prefix) + 1 if prefix else 0 :]
    return f"{prefix}+{base}" if prefix else base


def canonical_defense(name: str, params: dict[str, Any] | None = None) -> tuple[str, Settings]:
    """(name, settings) as a result key stores them (`Registry.canonical`): a pre-aggregator's settings
    (Bucketing's ``s``) checked against it, the rule's against the rule."""
    key = normalise_defense(name)
    prefix, base = split_defense(key)
    if key in REFUSED_DEFENSES:
        raise ValueError(f"defense {name!r} is refused: {REFUSED_DEFENSES[key]}")
    names = aggregator_names()
    if not is_plugin(base) and key not in names:
        hint = did_you_mean(key, names)
        if not hint.startswith("; valid"):
            hint += f"; valid: {', '.join(names)}"
        raise ValueError(f"unknown defense {name!r}{hint}{spec_hint(name)}")
    pre_cls, pre, params = _split_settings(prefix, params or {})
    base, rule = RULES.canonical(base, params)
    if pre_cls is not None:
        pre = check_settings(f"defense {key!r} ({pre_cls.__name__})", pre_cls, pre)
    return (f"{prefix}+{base}" if prefix else base), Settings(sorted({**pre, **rule}.items()))


def make_aggregator(
    name: str,
    f: int,
    n_clients: int | None = None,
    variant: str = "paper",
    params: dict[str, Any] | None = None,
) -> Pipeline:
    """Build the server pipeline for a defense name (``nnm+krum``, ``prodigy``, ``my_rules.py:MyRule``; see
    `RULES`) with f assumed Byzantine clients and the rule's ``params`` (its ``__init__`` keywords, e.g.
    ``{"tau": 5}`` for CClip; a pre-aggregator's, such as Bucketing's ``s``, too); with n_clients, check every
    N-dependent limit now. ``variant``: ``paper`` (the text) or ``authors`` (the authors' code; a class that
    differs takes a ``variant`` keyword)."""
    key = normalise_defense(name)
    prefix, base = split_defense(key)
    if params is not None and not isinstance(params, Mapping):
        raise ValueError(f"{key}: params must be a mapping of settings, e.g. {{'tau': 5}}, got {params!r}")
    canonical_defense(key, params)  # the name and the settings checked, with did-you-mean hints
    f = check_f(key, f)
    if n_clients is not None:
        n_clients = check_f(key, n_clients, 1, "n_clients")
    check_variant(key, variant)
    entry = RULES.lookup(base)
    pre_cls, pre_params, params = _split_settings(prefix, {**entry.params, **(params or {})})
    pre = [] if pre_cls is None else [_build(pre_cls, key, f, variant, pre_params)]
    pipeline = Pipeline(key, _build(entry.cls, key, f, variant, params), pre)
    if n_clients is not None:
        pipeline.check_n(n_clients)
    return pipeline


def _split_settings(
    prefix: str, params: dict[str, Any]
) -> tuple[type[Rule] | None, dict[str, Any], dict[str, Any]]:
    """(pre-aggregator class, its settings, the rule's settings): a defense's settings split between the
    pre-aggregator its ``prefix`` names (Bucketing's ``s``) and its rule."""
    pre_cls = PRE_AGGREGATORS.get(prefix)
    own = settings_of(pre_cls) if pre_cls is not None else {}
    return (pre_cls, {k: v for k, v in params.items() if k in own},
            {k: v for k, v in params.items() if k not in own})  # fmt: skip


def _build(cls: type[Rule], name: str, f: int, variant: str, params: dict[str, Any]) -> Rule:
    """cls(f, **params), with ``variant`` when cls takes it; a setting it lacks is named in the error."""
    accepts = inspect.signature(cls.__init__).parameters
    kwargs = {**params, **({"variant": variant} if "variant" in accepts else {})}
    try:
        return cls(f, **kwargs) if "f" in accepts else cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"defense {name!r}: {cls.__name__} cannot be built: {e}") from None
