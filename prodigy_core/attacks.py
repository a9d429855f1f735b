"""Byzantine attacks: what the f colluding, omniscient Byzantine clients send each round.

``make_attack(name, params=...)`` builds one from a name of `ATTACKS` (``alie``, ``foe_0.1``, ``sf``, a
plug-in ``my_attacks.py:MyAttack``); ``attack.craft(honest, own, server) -> (f, d)`` crafts the Byzantine
rows, which the server sees first (client ids 0..f-1, as in the paper). Search attacks (ALIE, FOE) are tuned
against the real defense (`LineSearchAttack`); a new attack subclasses `Attack` and implements ``send``.
The search's geometry and tie rules are in docs/semantics.md. Reference: the ProDiGy paper's attacks
(ALIE, FOE, SF, LF).
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from prodigy_core.aggregators import Pipeline, column_step, geometry, pairwise_sq_distances, shape_of
from prodigy_core.names import NO_ATTACK, check_variant, did_you_mean
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

# Every attack a params file can name, filled below the classes (`Registry.register`).
ATTACKS = Registry("attack")

# ALIE's grid: z* in {0.25 z_max, 0.5 z_max, ...} up to the largest multiple <= 2 (the paper).
ALIE_Z_STEP = 0.25
# The most candidates a typed z may give the authors' grid (`alie_authors_grid`): z = 1e-9 asked numpy for
# 8e9 of them (60 GiB); their typed z give 10 to 66.
ALIE_AUTHORS_MAX_CANDIDATES = 1000
ALIE_AUTHORS_END = 2.01  # the authors' grid ends before this (malicious.py line 55)
ALIE_Z_CAP = 2.0
# FOE's grid: eps* in {0.1 eps, 0.2 eps, ..., eps}.
FOE_STEPS = 10

Server = Callable[[Tensor], Tensor]


def alie_z_max(n: int, f: int) -> float:
    """Largest "undetectable" ALIE shift (Baruch, Baruch and Goldberg, "A Little Is Enough", NeurIPS 2019).

    s = floor(n/2 + 1) - f honest clients must be "won over"; z_max = Phi^-1((n - s) / n). Needs 0 <= f <= n/2
    (otherwise s <= 0 and the Byzantine clients are a majority). The value is <= 0 exactly when f = 0, or
    f = 1 with n even (n=10, f=1 gives 0; n=2, f=0 gives -inf): see `alie_grid` for how the attack handles it.
    """
    if not (isinstance(n, int) and isinstance(f, int)) or n < 1 or not 0 <= f < n:
        raise ValueError(f"alie_z_max(n={n!r}, f={f!r}): need integers n >= 1 and 0 <= f < n")
    s = math.floor(n / 2 + 1) - f
    if s <= 0:
        raise ValueError(
            f"alie_z_max(n={n}, f={f}): s = floor(n/2 + 1) - f = {s} <= 0, the Byzantine clients are a "
            f"majority; ALIE needs f <= n/2 = {n / 2:g}"
        )
    return torch.special.ndtri(torch.tensor((n - s) / n, dtype=torch.float64)).item()


def alie_grid(n: int, f: int) -> list[float]:
    """ALIE's candidates z = k * 0.25 * z_max, k = 1, 2, ..., while z <= 2 (so 15 for n=10, f=3).

    When z_max <= 0 (f = 0, or f = 1 with n even: no shift is undetectable by Baruch et al.'s argument)
    the unit falls back to z_max = 1, i.e. z in {0.25, 0.5, ..., 2}: the search still picks the most damaging
    shift, which is the attack's intent, instead of sending the honest mean or failing mid-run.
    """
    z_max = alie_z_max(n, f)
    unit = ALIE_Z_STEP * (z_max if z_max > 0 else 1.0)
    count = max(1, math.floor(ALIE_Z_CAP / unit * (1 + 1e-12)))
    return [k * unit for k in range(1, count + 1)]


# The authors' ALIE z, typed in by hand per setting (senaergisi/prodigy main.py lines 24-30, comments of the
# ALIE_optim branch; the code reads z from input() at line 31): {(n, f): z}.
ALIE_AUTHORS_Z = {
    (20, 2): 0.12,
    (10, 2): 0.25,
    (20, 4): 0.38,
    (30, 6): 0.41,
    (50, 10): 0.50,
    (20, 6): 0.67,
    (100, 30): 0.8,
}


def alie_authors_z(n: int, f: int) -> float:
    """ALIE's z as the authors' code uses it (``variant="authors"``): their hand-typed value where main.py
    lists one (`ALIE_AUTHORS_Z`), else z_max truncated to 2 decimals (`alie_z_max`).

    Truncation, not rounding: it gives 5 of their 7 typed values (0.12, 0.25, 0.38, 0.67, 0.8 where z_max is
    0.1257, 0.2533, 0.3853, 0.6745, 0.8064), rounding only 2; no rule gives their 0.41 (z_max 0.4307 at
    N=30, f=6) or 0.50 (z_max 0.4677 at N=50, f=10), so the typed values are used as they are. Their README's
    table gives 0.46 at N=50, f=10 (the truncation); main.py's 0.50, the value their code ran with, is kept.
    """
    if (n, f) in ALIE_AUTHORS_Z:
        return ALIE_AUTHORS_Z[n, f]
    if f == 0:  # z_max = Phi^-1 of at most 1/2 - 1/(2n): -inf at n = 2; no Byzantine client to send it anyway
        raise ValueError(f"alie_authors_z(n={n}, f=0): no Byzantine client, so no z; ALIE needs f >= 1")
    return math.trunc(round(alie_z_max(n, f) * 100, 6)) / 100  # round(.., 6): 0.29 * 100 = 28.999999...


def check_authors_z(z: float) -> float:
    """A typed z for the authors' grid: finite, and none smaller than gives `ALIE_AUTHORS_MAX_CANDIDATES`."""
    if not math.isfinite(z):
        raise ValueError(f"alie: z={z} must be a finite number (the authors typed 0.12 to 0.8)")
    smallest = ALIE_AUTHORS_END / (ALIE_Z_STEP * ALIE_AUTHORS_MAX_CANDIDATES)
    if 0 < z < smallest:
        count = ALIE_AUTHORS_END / (ALIE_Z_STEP * z)
        raise ValueError(
            f"alie: z={z} gives {count:.3g} candidates (the authors' grid arange(0.25 z, {ALIE_AUTHORS_END}, "
            f"0.25 z)), more than {ALIE_AUTHORS_MAX_CANDIDATES}; use z >= {smallest:.4f} (the authors "
            "typed 0.12 to 0.8), or z=0 to send the honest update"
        )
    return z


def alie_authors_grid(z: float) -> list[float]:
    """The authors' ALIE candidates: ``np.arange(0.25 z, 2.01, 0.25 z)`` (malicious.py line 55), so up to 2.01
    (10 candidates at N=100, f=30 where `alie_grid` has 9); empty when z < 0. z must not be 0 (their code
    sends the honest update then, see `ALIE`)."""
    import numpy as np  # the authors' own float arithmetic for the grid

    if z == 0:
        raise ValueError("alie_authors_grid: z = 0 has no grid (the authors' ALIE sends the honest update)")
    return np.arange(ALIE_Z_STEP * z, ALIE_AUTHORS_END, ALIE_Z_STEP * z).tolist()


class Attack:
    """An attack: ``craft(honest, own, server) -> (f, d)`` Byzantine updates, plus what it chose.

    A new attack calls ``super().__init__()`` and implements ``send(honest, own, server) -> (f, d)``:
    ``honest`` (h, d) this round's honest updates, ``own`` (f, d) what the Byzantine clients would honestly
    send, ``server`` the defense (``server.peek(G)`` aggregates without changing its state). ``craft`` checks
    the input (``honest_finite=True``: the caller has checked that the honest updates are finite, as the
    training loop does), handles f = 0 and runs ``send`` without autograd. ``ATTACKS.register`` (or a
    plug-in spec, ``attack: my_attacks.py:Shift``) lets params files name it; its ``__init__`` keywords are
    its settings:

    >>> import torch
    >>> from prodigy_core.aggregators import make_aggregator
    >>> class Shift(Attack):
    ...     display = "Shift"  # what tables print
    ...     def __init__(self, by: float = 1.0):
    ...         super().__init__()
    ...         self.by = by
    ...     def send(self, honest, own, server):
    ...         return (honest.mean(dim=0) + self.by).expand(own.shape).clone()
    >>> Shift(by=2.0).craft(torch.zeros(5, 3), torch.zeros(2, 3), make_aggregator("median", 2))
    tensor([[2., 2., 2.],
            [2., 2., 2.]])

    A search over one parameter against the real defense subclasses `LineSearchAttack` instead (ALIE, FOE).
    """

    name: str = "attack"  # what a params file writes (`ATTACKS.register` files the class under it)
    display: str = ""  # what a table prints
    symbol: str = "parameter"  # the searched parameter, as figures print it (ALIE's z)
    presets: dict[str, tuple[str, dict[str, Any]]] = {}  # other names: {name: (display, settings)}
    flips_labels: bool = False
    # True: what the Byzantine clients send becomes their local momentum buffer (the training loop writes it
    # back, see `training.server_input`): SF under the authors' code.
    sent_is_momentum: bool = False
    # False: ``send`` reads only the shape of ``own``, never its values, so the Byzantine clients need not
    # train: the training loop skips their local steps (`Attack.needs_own`). Read from the class that
    # defines ``send``: a subclass that overrides ``send`` says it again, or its clients train.
    reads_own: bool = True

    def __init__(self) -> None:
        self.last_param: float | None = None
        self.last_search: list[tuple[Any, float]] = []
        # The Gram matrix of [crafted rows; honest; the server's reference point] when the attack derived it
        # (a line search, `LineSearchAttack`), for the server's aggregation of cat[crafted, honest]
        # (``pipeline(G, gram=...)``): the round then copies one Gram matrix to the host, not two.
        self.last_gram: Tensor | None = None

    def craft(self, honest: Tensor, own: Tensor, server: Server, honest_finite: bool = False) -> Tensor:
        _check_shapes(self.name, honest, own)
        if not callable(server):
            raise ValueError(f"{self.name}: server must be the pipeline it plays against (make_aggregator), "
                             f"got {server!r}")  # fmt: skip
        self.last_param, self.last_search, self.last_gram = None, [], None
        if own.shape[0] == 0:
            return own.new_empty((0, own.shape[1]))
        _check_honest(self.name, honest, honest_finite)
        with torch.no_grad():
            sent = self.send(honest, own, server)
        _check_sent(self.name, sent, own)
        return sent

    def send(self, honest: Tensor, own: Tensor, server: Server) -> Tensor:
        raise NotImplementedError

    def needs_own(self) -> bool:
        """Whether ``craft`` reads the Byzantine clients' honest updates ``own``. False (ALIE,
        ALIE-spread, FOE, Gaussian, Mimic, Min-Max, Min-Sum under ``paper``): the training loop does not train
        clients 0..f-1; they keep the server's model, so they report a zero pseudo-gradient and the server's
        BatchNorm buffers (`training.RunState.idle`). True for any ``send`` that does not declare
        ``reads_own = False``."""
        return self.reads_own or "reads_own" not in vars(self._owner("send"))

    def _owner(self, method: str) -> type:
        """The class of this attack's that defines ``method``."""
        return next(cls for cls in type(self).__mro__ if method in vars(cls))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class NoAttack(Attack):
    """No attack: the f clients behave honestly and send ``own``."""

    name = NO_ATTACK
    display = "No attack"

    def send(self, honest: Tensor, own: Tensor, server: Server) -> Tensor:
        return own


class SignFlip(Attack):
    """Sign flip: each Byzantine client sends -m, the negation of the update it would honestly send.
    Reference: Allen-Zhu et al., "Byzantine-Resilient Non-Convex Stochastic Gradient Descent", ICLR 2021;
    ProDiGy's SF.

    ``variant="paper"`` (the text): the client keeps honest local momentum m_t = beta m_{t-1} + (1-beta) g_t
    and negates only what it sends, s_t = -m_t.

    ``variant="authors"`` (the authors' code): the client negates its momentum buffer in place, so the buffer
    holds what it sent (``sent_is_momentum``) and s_t = -(beta s_{t-1} + (1 - beta) g_t). At beta = 0 the two
    agree; at beta = 0.9 and a steady g, s_t tends to the fixed point -(1 - beta)/(1 + beta) g = -0.053 g,
    a flip about 19 times weaker than the text's -g. Its sign never changes (it stays opposite to g); its
    size oscillates while it converges: at beta = 0.9 and g = 1, s_t = -0.1, -0.01, -0.091, -0.018, -0.084...
    """

    name = "sf"
    display = "SF"

    def __init__(self, variant: str = "paper") -> None:
        super().__init__()
        self.variant = check_variant("sf", variant)
        self.sent_is_momentum = variant == "authors"

    def send(self, honest: Tensor, own: Tensor, server: Server) -> Tensor:
        return -own


class LabelFlip(Attack):
    """Label flip (data-level): the Byzantine clients train honestly on labels y' = C-1-y and send the result.

    ``flips_labels`` tells the training loop to call ``Federation.flip_labels`` on clients 0..f-1; ``craft``
    returns ``own`` unchanged. Reference: the LF attack of the ProDiGy paper (arXiv:2509.09534, 2025: 9-y on
    CIFAR-10, 61-y on FEMNIST).
    """

    name = "lf"
    display = "LF"
    flips_labels = True

    def send(self, honest: Tensor, own: Tensor, server: Server) -> Tensor:
        return own


class GaussianNoise(Attack):
    """Gaussian noise: each Byzantine client sends an independent draw from N(mean, std^2 I).

    Reference: Xie, Koyejo and Gupta, "Generalized Byzantine-tolerant SGD", arXiv:1802.10116 (std = 200).
    ``generator`` (any device) makes the draws repeatable.
    """

    name = "gaussian"
    display = "Gaussian"
    reads_own = False

    def __init__(
        self, mean: float = 0.0, std: float = 200.0, generator: torch.Generator | None = None
    ) -> None:
        super().__init__()
        if not std >= 0:
            raise ValueError(f"gaussian: std={std} must be >= 0")
        self.mean, self.std, self.generator = float(mean), float(std), generator

    def send(self, honest: Tensor, own: Tensor, server: Server) -> Tensor:
        return self.mean + self.std * _randn(own.shape, honest, self.generator)


class Mimic(Attack):
    """Mimic: every Byzantine client copies the honest update that most increases the apparent heterogeneity.

    Karimireddy, He and Jaggi, "Byzantine-Robust Learning on Heterogeneous Datasets via Bucketing", ICLR 2022:
    target i* = argmax_i <g_i - mu_H, v> along the top principal direction v of the honest updates. Theirs
    keeps a running power-iteration estimate of v over warm-up rounds and then fixes the target; this version
    takes this round's exact v (top eigenvector of the centred Gram matrix, from the pairwise distances) and,
    since the sign of v is arbitrary, the largest |projection|. ``last_param`` is the index of the copied
    honest client in ``honest``.
    """

    name = "mimic"
    display = "Mimic"
    reads_own = False

    def send(self, honest: Tensor, own: Tensor, server: Server) -> Tensor:
        dist = geometry(honest).D  # float64 on the host, like every N x N computation (see aggregators)
        h = dist.shape[0]
        centring = torch.eye(h, dtype=dist.dtype, device=dist.device) - 1.0 / h
        gram = -0.5 * centring @ dist @ centring  # <g_i - mu, g_j - mu> (classical MDS)
        _, vectors = torch.linalg.eigh(gram)
        # projection of g_i - mu on v is sqrt(lambda_max) * u_i for the top eigenvector u
        target = int(vectors[:, -1].abs().argmax())
        self.last_param = target
        return honest[target].expand(own.shape).clone()


class _MinMaxMinSum(Attack):
    """Shared part of Min-Max and Min-Sum (Shejwalkar and Houmansadr, "Manipulating the Byzantine: Optimizing
    Model Poisoning Attacks and Defenses for Federated Learning", NDSS 2021).

    Byzantine update m = mu_H - gamma * p for a deviation direction p: ``std`` (the honest per-coordinate
    population std, the paper's strongest), ``unit_vec`` (mu_H / norm(mu_H)) or ``sign`` (sign(mu_H)).
    gamma is the largest value meeting the attack's constraint, which is a sum or a maximum of quadratics
    q_i(gamma) = norm(mu_H - g_i - gamma p)^2, convex in gamma and met at gamma = 0: the paper finds it by
    bisection; here it is the exact root of the quadratic (the point the bisection converges to).
    All Byzantine clients send m; ``last_param`` is gamma. With one honest client the honest spread is 0,
    so gamma = 0 and m is that client's update.
    """

    DEVIATIONS = ("std", "unit_vec", "sign")
    reads_own = False

    def __init__(self, deviation: str = "std") -> None:
        super().__init__()
        if deviation not in self.DEVIATIONS:
            raise ValueError(
                f"{self.name}: deviation={deviation!r} is unknown; valid: {', '.join(self.DEVIATIONS)}"
            )
        self.deviation = deviation

    def _gamma(self, sq_norms: Tensor, dots: Tensor, p_sq: float, dist: Tensor) -> float:
        raise NotImplementedError

    def send(self, honest: Tensor, own: Tensor, server: Server) -> Tensor:
        mean, sigma = _mean_std(honest)
        if self.deviation == "std":
            p = sigma
        elif self.deviation == "unit_vec":
            p = mean / mean.norm().clamp_min(torch.finfo(mean.dtype).tiny)
        else:
            p = mean.sign()
        offsets = mean - honest  # a_i = mu_H - g_i
        sq_norms = offsets.pow(2).sum(1, dtype=torch.float64)
        dots = (offsets @ p).double()  # <a_i, p>
        p_sq = p.pow(2).sum(dtype=torch.float64).item()
        del offsets
        if len(honest) > 1:
            dist = pairwise_sq_distances(honest).double()
        else:  # one honest client: no spread to hide in, so gamma = 0 and m is its update
            dist = torch.zeros((1, 1), dtype=torch.float64, device=honest.device)
        gamma = 0.0 if p_sq == 0 else self._gamma(sq_norms, dots, p_sq, dist)
        self.last_param = gamma
        return (mean - gamma * p).expand(own.shape).clone()


class MinMax(_MinMaxMinSum):
    """Min-Max (Shejwalkar and Houmansadr, NDSS 2021): the largest gamma with max_i norm(m - g_i) <=
    max_{i,j} norm(g_i - g_j) (see `_MinMaxMinSum`).

    Per honest i, q_i(gamma) <= T holds up to gamma_i = (b_i + sqrt(b_i^2 + c (T - norm(a_i)^2))) / c with
    a_i = mu_H - g_i, b_i = <a_i, p>, c = norm(p)^2, T = max pairwise honest squared distance; gamma = min_i.
    """

    name = "minmax"
    display = "Min-Max"

    def _gamma(self, sq_norms: Tensor, dots: Tensor, p_sq: float, dist: Tensor) -> float:
        slack = (dist.max() - sq_norms).clamp_min(0)
        return ((dots + (dots.pow(2) + p_sq * slack).sqrt()) / p_sq).min().item()


class MinSum(_MinMaxMinSum):
    """Min-Sum (Shejwalkar and Houmansadr, NDSS 2021): the largest gamma with sum_i norm(m - g_i)^2 <=
    max_i sum_j norm(g_i - g_j)^2 (see `_MinMaxMinSum`): sum_i q_i(gamma) = A - 2 gamma B + h c gamma^2 <= T,
    solved for its larger root.
    """

    name = "minsum"
    display = "Min-Sum"

    def _gamma(self, sq_norms: Tensor, dots: Tensor, p_sq: float, dist: Tensor) -> float:
        h = sq_norms.shape[0]
        slack = (dist.sum(1).max() - sq_norms.sum()).clamp_min(0)
        b = dots.sum()
        return ((b + (b.pow(2) + h * p_sq * slack).sqrt()) / (h * p_sq)).item()


def _parameters(candidate: Any) -> tuple | list:
    """A search candidate's parameters: itself when a tuple or list (several), else (candidate,)."""
    return candidate if isinstance(candidate, tuple | list) else (candidate,)


def recorded_param(value: Any) -> float | list[float] | None:
    """An attack's ``last_param`` as a run's record and Flower's metrics keep it: a number, or a list of
    numbers for a search over several parameters (a plug-in's tuple; ALIE-spread keeps z here, rho in
    ``last_rho``)."""
    if value is None:
        return None
    return [float(v) for v in value] if isinstance(value, tuple | list) else float(value)


_LINE_MOVES = torch.tensor([[[-1.0, 1.0]]], dtype=torch.float64)  # a line's (1 - t) p0 + t p1 (`affine`)
_UNTRUSTED_SPANS: set[type] = set()  # classes whose line/affine a warning said is not used (once each)


class LineSearchAttack(Attack):
    """An attack with one parameter chosen per round by maximising norm(server(cat[byzantine, honest]) - mu_H)
    over a grid, through the real server (``peek`` when present). Subclasses give the grid, the per-round
    statistics and the Byzantine rows for a parameter (``rows`` must work on column slices of the
    statistics). The search scores all the candidates from one Gram matrix as one batch when the pipeline
    gives weights (`_damages`), runs a coordinate-wise pipeline on all of them at once (`_batched_damages`),
    else runs the pipeline once per candidate. With a line (`line`), or more generally the points whose
    affine combinations the rows are (`affine`), defined by the class that defines ``rows`` (a subclass's own
    rows need not lie on its parent's line), ``last_gram`` is the chosen candidate's Gram matrix, for the
    server's own aggregation. A plug-in's rows are checked against the points it declares at its first craft
    (`_check_rows`). A candidate may be a tuple of parameters; ``last_param`` is then the chosen tuple
    (a list per round in a run's record).
    """

    # False: a non-finite aggregate counts as infinite damage (this package); True: the damage as computed,
    # so a NaN never wins the ``damage > best`` comparison (the authors' code, `ALIE` under ``authors``).
    raw_damage: bool = False
    # True: ``rows`` also takes a column of parameters (C, 1) and returns every candidate's row (C, d) (ALIE,
    # FOE), so the batched search forms all the candidates' rows at once. Read from the class that defines
    # ``rows``: a subclass that overrides ``rows`` says it again, or its rows are formed one by one.
    column_rows: bool = False
    reads_own = False

    def grid(self, n: int, f: int) -> list[Any]:
        raise NotImplementedError

    def _start(self, n: int, f: int) -> tuple[Any, float]:
        """The choice and damage a candidate must beat: none, -inf (the first candidate always wins)."""
        return None, -math.inf

    def statistics(self, honest: Tensor, f: int) -> dict[str, Tensor]:
        # population std (Baruch et al.); the mean is honest.mean(0) itself, so FOE sends exactly -eps* mu_H
        mean, sigma = _mean_std(honest)
        return {"mean": mean, "sigma": sigma}

    def rows(self, param: Any, stats: dict[str, Tensor]) -> Tensor:
        """The Byzantine rows for ``param``: (d,) when all f clients send the same vector, else (f, d)
        (with ``column_rows``, a column (C, 1) of parameters gives (C, d))."""
        raise NotImplementedError

    def line(self, stats: dict[str, Tensor]) -> tuple[Tensor, Tensor] | None:
        """End points (p0, p1) when every candidate sends the one vector (1 - param) p0 + param p1."""
        return None

    def affine(self, stats: dict[str, Tensor]) -> tuple[Tensor, Tensor] | None:
        """The candidates' rows as affine combinations of k points, when they are: (P, S) with P (k, d) the
        points and S (m, f or 1, k) float64 how each of the m parameters moves the rows' weights on them.
        Byzantine row j of the candidate with parameters t = (t_1 .. t_m) is (e_1 + sum_l t_l S[l, j]) P,
        P[0] at t = 0 (each row of S sums to 0, so the weights sum to 1). By default the line's: P = [p0; p1],
        S = [[-1, 1]]."""
        line = self.line(stats)
        return None if line is None else (torch.stack(line), _LINE_MOVES.clone())  # a copy: S is the caller's

    def send(self, honest: Tensor, own: Tensor, server: Server) -> Tensor:
        f, (h, d) = own.shape[0], honest.shape
        stats = self.statistics(honest, f)
        grid = self.grid(f + h, f)
        grams = self._candidate_grams(honest, f, stats, server, grid)
        if isinstance(server, Pipeline) and server.coordinatewise and (grams is not None or not server.pre):
            damages = self._batched_damages(honest, f, stats, server, grams, grid)
        else:
            damages = self._damages(honest, f, stats, server, grams, grid)
        best, best_damage = self._start(f + h, f)
        for param, damage in zip(grid, damages, strict=True):
            self.last_search.append((param, damage))
            if damage > best_damage:
                best, best_damage = param, damage
        self._record(best)
        if grams is not None and best is not None:
            gram = grams.gram_at(best)
            # a sent row whose squared norm leaves the dtype's range may have overflowed to inf, where the
            # float64 Gram matrix stays finite: the server then computes its own (on the host: no wait). Any
            # point's (not only the sent rows'): one op fewer; an honest row past 1.8e19 in float32 then
            # makes the server compute its own too, which costs time, never a wrong aggregate.
            if float(gram.diagonal().max()) <= torch.finfo(honest.dtype).max:
                self.last_gram = gram
        return self.rows(best, stats).expand(f, d).clone()

    def _damages(
        self,
        honest: Tensor,
        f: int,
        stats: dict[str, Tensor],
        server: Server,
        grams: _AffineGeometry | None,
        grid: list[Any],
    ) -> Iterator[float]:
        """Each candidate's damage: from the points' Gram matrix alone when the pipeline gives weights
        (`Pipeline.weights`), all candidates as one batch (C, N+1, N+1) on the host; else by running the
        pipeline on the candidate (with its Gram matrix when there is one: a leading NNM takes its distances
        from it)."""
        h, d = honest.shape
        evaluate = server.peek if hasattr(server, "peek") else server
        candidates = damages = None
        if grams is not None and grid:
            weights = server.weights(grams.grams(grid))
            if weights is not None:
                damages = grams.damages(weights).tolist()  # on the host: no wait
        for c, param in enumerate(grid):
            if damages is not None and not math.isnan(damages[c]):  # NaN: this candidate gives no weights
                yield damages[c]
                continue
            if candidates is None:
                candidates = torch.empty((f + h, d), dtype=honest.dtype, device=honest.device)
                candidates[f:] = honest
            candidates[:f] = self.rows(param, stats)
            if grams is None:
                aggregate = evaluate(candidates)
            else:
                aggregate = evaluate(candidates, gram=grams.gram_at(param))
            yield _damage(aggregate, stats["mean"], self.name, raw=self.raw_damage)

    def _batched_damages(
        self,
        honest: Tensor,
        f: int,
        stats: dict[str, Tensor],
        server: Pipeline,
        grams: _AffineGeometry | None,
        grid: list[Any],
    ) -> list[float]:
        """Every candidate's damage at once, for a coordinate-wise rule (median, trimmed mean) alone or after
        one NNM (`Pipeline.coordinatewise`): the same values as running the pipeline on each candidate, to
        float rounding (the column chunks may sum in another order).

        Why: such a rule has no Gram-matrix shortcut, and one by one each candidate costs a pass of the rule
        over its (N, d) input, its kernel launches and a wait for the device to read its damage. Here the C
        candidates' inputs X (C, N, d) go through the rule together (`Rule.coordinatewise`), after NNM as
        A_c X_c with each candidate's mixing matrix A_c from the points' Gram matrix (`Pipeline.mixing`, on
        the host). X is built chunk by chunk of columns, bounding memory (C = 9, N = 20, d = 1.69M would be
        1.2 GB in float32); the C aggregates (C, d) are kept, and their distances to mu_H are taken as
        `_damage` takes them, in their dtype (float32 rounding makes exact ties, which must fall the same
        way). One wait per craft, to read the C damages."""
        C, (h, d) = len(grid), honest.shape
        n = f + h
        server.check_n(n)
        if C == 0:
            return []
        mixing = None
        if server.pre:  # the NNM's mixing matrices, from the candidates' Gram matrices on the host, at once
            mixing = server.mixing(grams.grams(grid)).to(honest.device, honest.dtype, non_blocking=True)
        rows = None
        if vars(self._owner("rows")).get("column_rows", False):  # every row (C, d) from a column (C, 1)
            column = torch.tensor(grid, dtype=torch.float64)[:, None]
            rows = self.rows(column.to(honest.device, honest.dtype, non_blocking=True), stats)  # pageable
        aggregates = torch.empty((C, d), dtype=honest.dtype, device=honest.device)
        step = column_step(C * n, d, honest.device)
        for start in range(0, d, step):
            columns = slice(start, start + step)
            if rows is not None:  # one write of the batch: [each candidate's row f times; honest]
                w = rows[:, columns].shape[-1]
                byzantine = rows[:, None, columns].expand(C, f, w)
                X = torch.cat([byzantine, honest[None, :, columns].expand(C, h, w)], dim=1)
            else:
                part = {k: v[..., columns] for k, v in stats.items()}
                X = torch.empty((C, n, part["mean"].shape[-1]), dtype=honest.dtype, device=honest.device)
                X[:, f:] = honest[:, columns]
                for c, param in enumerate(grid):
                    X[c, :f] = self.rows(param, part)
            if mixing is not None:
                X = torch.bmm(mixing, X)
            aggregates[:, columns] = server.rule.aggregate(X)
        damages = torch.linalg.vector_norm(aggregates - stats["mean"], dim=-1).tolist()  # the one wait
        return damages if self.raw_damage else [x if math.isfinite(x) else math.inf for x in damages]

    def _candidate_grams(
        self, honest: Tensor, f: int, stats: dict[str, Tensor], server: Server, grid: list[Any]
    ) -> _AffineGeometry | None:
        # the rows' own class must give their points: a subclass's rows need not lie on its parent's line
        (declares, where), rows = self._declared(), self._owner("rows")
        if rows is not declares:
            if issubclass(declares, rows) and declares not in _UNTRUSTED_SPANS:  # points newer than the rows
                _UNTRUSTED_SPANS.add(declares)
                name = declares.__name__
                warnings.warn(f"{name}.{where} is not used: its rows are {rows.__name__}'s; define rows in "
                              f"{name} too (the search runs the pipeline on each candidate meanwhile)",
                              RuntimeWarning, stacklevel=4)  # fmt: skip
            return None
        if not grid or not (isinstance(server, Pipeline) and server.takes_gram):
            return None
        span = self.affine(stats) if where == "affine" else LineSearchAttack.affine(self, stats)
        if span is None:
            return None
        plugin = not packaged(rows)  # a plug-in's points are checked against its rows
        points, moves = self._checked_span(*span, f) if plugin else span
        reference = server.reference(honest)
        extra = points if reference is None else torch.cat([points, reference[None]])
        K = geometry(honest, extra=extra, origin=reference is None).K
        if not torch.isfinite(K).all():
            return None
        grams = _AffineGeometry(K, f, moves)
        if plugin and not getattr(self, "_rows_checked", False):
            self._check_rows(grams, points, stats, [grid[0], grid[-1]])
        return grams

    def _declared(self) -> tuple[type, str]:
        """The class whose points the search reads and the method that declares them: the later of
        ``affine`` and ``line`` in the MRO (a subclass's own line replaces an inherited affine)."""
        affine, line = self._owner("affine"), self._owner("line")
        if affine is LineSearchAttack or (line is not affine and issubclass(line, affine)):
            return line, "line"
        return affine, "affine"

    def _checked_span(self, points: Any, moves: Any, f: int) -> tuple[Tensor, Tensor]:
        """A plug-in's `affine` (or `line`) as tensors, checked: S's shape and rows of S summing to 0."""
        points = points if isinstance(points, Tensor) else torch.stack(list(points))
        given = moves.dtype if isinstance(moves, Tensor) and moves.is_floating_point() else torch.float64
        moves = torch.as_tensor(moves, dtype=torch.float64)
        k = len(points)
        if moves.dim() != 3 or moves.shape[1] not in (1, f) or moves.shape[2] != k:
            raise ValueError(f"{self.name}.affine: S must be (m, f or 1, k) = (m, {f} or 1, {k}) for its "
                             f"{k} points, got {tuple(moves.shape)}")  # fmt: skip
        scale = max(1.0, float(moves.abs().max()))
        if float(moves.sum(dim=-1).abs().max()) > 64 * torch.finfo(given).eps * scale:  # S's own rounding
            raise ValueError(f"{self.name}.affine: each row of S must sum to 0 (the rows' weights on the "
                             "points then sum to 1: an affine combination)")  # fmt: skip
        return points, moves

    def _check_rows(
        self, grams: _AffineGeometry, points: Tensor, stats: dict[str, Tensor], params: list[Any]
    ) -> None:
        """A plug-in's rows at each of ``params`` (the grid's ends) equal to the combination of its points
        that the geometry reads from its S (`_AffineGeometry.placement`), else the search would score other
        rows than those sent, and the server aggregate the sent ones with their Gram matrix. Once."""
        where = self._declared()[1]
        for param in params:
            if len(_parameters(param)) != grams.m:
                raise ValueError(f"{self.name}.affine: S has {grams.m} parameters' moves, but a candidate of "
                                 f"its grid has {len(_parameters(param))} ({param!r})")  # fmt: skip
            declared = grams.placement(param).to(points.device, points.dtype) @ points
            size = max(float(torch.linalg.vector_norm(declared.double())), 1e-300)
            gap = float(torch.linalg.vector_norm((self.rows(param, stats) - declared).double())) / size
            if not gap <= max(1e-3, 8 * torch.finfo(points.dtype).eps):
                name = type(self).__name__
                raise ValueError(f"{name}: rows({param!r}) are not the combination of points that its "
                                 f"{where} declares (relative difference {gap:.3g}): fix {where}, or remove "
                                 "it (the search then runs the pipeline on each candidate)")  # fmt: skip
        self._rows_checked = True

    def _record(self, best: Any) -> None:
        self.last_param = best


class _AffineGeometry:
    """Every candidate's Gram matrix from one Gram matrix K of the h + k + 1 base points B = [honest; P; r]:
    P the attack's k points (`LineSearchAttack.affine`; a line's p0 and p1), r the pipeline's reference point
    (`Pipeline.reference`: the origin, or CClip's start).

    Candidate t puts Byzantine client j at (e_1 + sum_l t_l S[l, j]) P (on a line: (1 - t) p0 + t p1), so its
    points [byzantine; honest; r] are C_t B for a coefficient matrix C_t = C_0 + sum_l t_l S_l (N + 1,
    h + k + 1) and their Gram matrix is C_t K C_t^T. A pipeline's weights w on them give the aggregate
    w^T C_t B, an affine combination of B (w sums to 1) like the honest mean m^T B, so the damage is
    sqrt((w^T C_t - m^T) K (C_t^T w - m)): O(N^2 h) per candidate, no pass over the d coordinates. float64
    throughout, as the pipeline's own Gram matrix."""

    def __init__(self, K: Tensor, f: int, moves: Tensor) -> None:
        m, k = moves.shape[0], moves.shape[-1]
        h = K.shape[0] - k - 1
        self.K, self.f, self.n, self.m, self.h, self.k = K, f, f + h, m, h, k
        # C_0: the Byzantine clients at P[0], the honest clients and the reference point themselves; S_l: the
        # parameter l's moves of the Byzantine rows' weights on P
        eye, kept = torch.eye(h + k + 1, dtype=K.dtype, device=K.device), list(range(h)) + [h + k]
        self.C = eye[[h] * f + kept]
        self.S = F.pad(moves.to(K.device).expand(m, f, k), (h, 1, 0, h + 1)).flatten(1)  # (m, (N+1)(h+k+1))
        self.mean = self.C[f : f + h].mean(dim=0)  # 1/h on each honest client
        self.ts: list[Any] = []  # the candidates of the last `grams`, their coefficients and Gram matrices
        self.coefficients: Tensor | None = None
        self.batch: Tensor | None = None

    def grams(self, ts: list[Any]) -> Tensor:
        """The Gram matrices C_t K C_t^T (len(ts), N+1, N+1) of [byzantine; honest; r] for each candidate t
        of ``ts`` (a number, or a tuple of the m parameters), as one batch (kept for `gram_at`)."""
        self.ts, self.coefficients = list(ts), self._coefficients(ts)
        self.batch = self._sandwich(self.coefficients)
        return self.batch

    def gram_at(self, t: Any) -> Tensor:
        """The Gram matrix of one candidate t: its matrix of the last `grams` when t was one of them."""
        return self.batch[self.ts.index(t)] if t in self.ts else self._sandwich(self._coefficients([t]))[0]

    def placement(self, t: Any) -> Tensor:
        """The Byzantine rows' weights (f, k) on the attack's points P at candidate t: the rows are these
        weights times P."""
        return self._coefficients([t])[0, : self.f, self.h : self.h + self.k]

    def damages(self, weights: Tensor) -> Tensor:
        """norm(aggregate - honest mean) (C,) for the candidates of the last `grams`, whose aggregates are
        the weights (C, N+1) on their points (NaN where a row of weights is NaN)."""
        c = torch.bmm(weights.unsqueeze(-2), self.coefficients) - self.mean  # (C, 1, h+k+1)
        return self._sandwich(c).flatten().clamp(min=0).sqrt()

    def _coefficients(self, ts: list[Any]) -> Tensor:
        """C_t for each t of ``ts``, (len(ts), N+1, h+k+1) (on a line: 1 - t and t exactly where the Byzantine
        rows weigh p0 and p1, as t S_1 is exact)."""
        columns = [_parameters(t) for t in ts]  # (C, m), built here: no op
        t = torch.tensor(columns, dtype=self.K.dtype, device=self.K.device)
        return torch.addmm(self.C.flatten(), t, self.S).view(len(ts), *self.C.shape)

    def _sandwich(self, X: Tensor) -> Tensor:
        """X K X^T for each matrix of the batch X (C, P, h+k+1), by batched products over K repeated for each
        (a view): each candidate's product alone, as one product over all of them would round rows by
        where they fall, so equal candidates keep equal bits and ties among damages stay ties."""
        return torch.bmm(torch.bmm(X, self.K.expand(len(X), *self.K.shape)), X.mT)


class ALIE(LineSearchAttack):
    """A Little Is Enough (Baruch, Baruch and Goldberg, NeurIPS 2019): every Byzantine client sends
    mu_H - z* sigma_H (honest mean and per-coordinate population std), z* from `alie_grid` (multiples of
    0.25 z_max up to 2, z_max from `alie_z_max`) chosen against the real defense (ProDiGy paper).

    ``variant="authors"`` (the authors' ``ALIE_optim``, malicious.py lines 44-72): z is `alie_authors_z`
    (hand-typed, or ``z`` if given), the candidates `alie_authors_grid` (``arange(0.25 z, 2.01, 0.25 z)``),
    and a candidate wins when its damage is ``> max_dist``, starting from max_dist = 0 with z itself chosen:
    ties keep the first, a NaN damage never wins (an infinite one does), and z is sent when no candidate's
    damage exceeds 0. With z = 0 the Byzantine clients send their honest update (their early return).
    """

    name = "alie"
    display = "ALIE"
    symbol = "z"
    column_rows = True
    reads_own = False

    def __init__(self, variant: str = "paper", z: float | None = None) -> None:
        super().__init__()
        self.variant = check_variant("alie", variant)
        if z is not None and variant != "authors":
            raise ValueError(f"alie: z={z} is the authors' typed z; it needs variant='authors'")
        self.z = None if z is None else check_authors_z(float(z))
        self.raw_damage = variant == "authors"
        self.reads_own = variant == "authors"  # z = 0 sends the honest update (`send`)

    def authors_z(self, n: int, f: int) -> float:
        """The z the authors' code would use at (n, f): ``z`` if given, else `alie_authors_z`."""
        return alie_authors_z(n, f) if self.z is None else self.z

    def grid(self, n: int, f: int) -> list[float]:
        if self.variant == "authors":
            return alie_authors_grid(self.authors_z(n, f))
        return alie_grid(n, f)

    def _start(self, n: int, f: int) -> tuple[Any, float]:
        if self.variant == "authors":
            return self.authors_z(n, f), 0.0  # malicious.py lines 57-58: max_dist = 0, best_z = z
        return super()._start(n, f)

    def send(self, honest: Tensor, own: Tensor, server: Server) -> Tensor:
        f = own.shape[0]
        if self.variant == "authors" and self.authors_z(f + honest.shape[0], f) == 0:
            self.last_param = 0.0  # malicious.py lines 52-53: no attack, the honest update goes out
            return own
        return super().send(honest, own, server)

    def rows(self, z: float | Tensor, stats: dict[str, Tensor]) -> Tensor:
        return stats["mean"] - z * stats["sigma"]

    def line(self, stats: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        return stats["mean"], stats["mean"] - stats["sigma"]


class FOE(LineSearchAttack):
    """Fall of Empires / inner-product manipulation (Xie, Koyejo and Gupta, UAI 2019): every Byzantine client
    sends -eps* mu_H, eps* in {0.1 eps, 0.2 eps, ..., eps} chosen against the real defense (ProDiGy paper:
    eps = 0.1 and eps = 100, the attacks ``foe_0.1`` and ``foe_100``).

    ``variant="authors"`` (the authors' ``FOE_optim``, malicious.py lines 119-127): a candidate wins when its
    damage is ``> max_dist``, starting from max_dist = 0 with eps itself chosen, as their ALIE (`ALIE`): ties
    keep the first, a NaN damage never wins (an infinite one does), and eps is sent when no candidate's
    damage exceeds 0. (``paper``: the first candidate always wins at first, a non-finite damage counts as
    +inf.)
    """

    name = "foe"
    display = "FOE"
    symbol = "ε"
    presets = {"foe_0.1": ("FOE ε=0.1", {"eps": 0.1}), "foe_100": ("FOE ε=100", {"eps": 100.0})}
    column_rows = True

    def __init__(self, eps: float, variant: str = "paper") -> None:
        super().__init__()
        if not eps > 0:
            raise ValueError(f"foe: eps={eps} must be > 0")
        self.eps, self.variant = float(eps), check_variant("foe", variant)
        self.raw_damage = variant == "authors"

    def grid(self, n: int, f: int) -> list[float]:
        return [k * self.eps / FOE_STEPS for k in range(1, FOE_STEPS + 1)]

    def _start(self, n: int, f: int) -> tuple[Any, float]:
        if self.variant == "authors":
            return self.eps, 0.0  # malicious.py lines 119-120: max_dist = 0, best_eps = epsilon
        return super()._start(n, f)

    def rows(self, eps: float | Tensor, stats: dict[str, Tensor]) -> Tensor:
        return -eps * stats["mean"]

    def line(self, stats: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        return torch.zeros_like(stats["mean"]), -stats["mean"]


class ALIESpread(LineSearchAttack):
    """ALIE with spread, aimed at ProDiGy's dissimilarity score s_d (this package's attack; no peer has it).

    ProDiGy scores a client by how dissimilar its nearest neighbours are (s_d = sigma / norm(mu) of N_f(k)),
    and identical ALIE rows give the colluders s_d = 0. Here Byzantine client j sends
    mu_H - z sigma_H + rho * (xi_j * sigma_H) with xi_j ~ N(0, I) independent per client (drawn once per
    craft, shared by all candidates), (z, rho) chosen by the same damage-maximising search over
    `alie_grid` x ``rhos``. ``last_param`` is z*, ``last_rho`` rho*; ``last_search`` holds ((z, rho), damage).

    References: the ALIE it extends, Baruch, Baruch and Goldberg, "A Little Is Enough: Circumventing Defenses
    For Distributed Learning", NeurIPS 2019; the score it targets, the ProDiGy paper (arXiv:2509.09534).
    """

    name = "alie_spread"
    display = "ALIE (spread)"
    symbol = "(z, ρ)"

    def __init__(
        self, rhos: tuple[float, ...] = (0.25, 0.5, 1.0), generator: torch.Generator | None = None
    ) -> None:
        super().__init__()
        try:
            numbers = tuple(float(r) for r in rhos)
        except (TypeError, ValueError):
            numbers = ()
        if not numbers or min(numbers) < 0:
            raise ValueError(f"alie_spread: rhos={rhos!r} must be a non-empty tuple of numbers >= 0")
        self.rhos, self.generator = numbers, generator
        self.last_rho: float | None = None

    def craft(self, honest: Tensor, own: Tensor, server: Server, honest_finite: bool = False) -> Tensor:
        self.last_rho = None
        return super().craft(honest, own, server, honest_finite)

    def grid(self, n: int, f: int) -> list[tuple[float, float]]:
        return [(z, rho) for z in alie_grid(n, f) for rho in self.rhos]

    def statistics(self, honest: Tensor, f: int) -> dict[str, Tensor]:
        stats = super().statistics(honest, f)
        stats["spread"] = _randn((f, honest.shape[1]), honest, self.generator) * stats["sigma"]
        return stats

    def rows(self, param: tuple[float, float], stats: dict[str, Tensor]) -> Tensor:
        z, rho = param
        return torch.add(stats["mean"] - z * stats["sigma"], stats["spread"], alpha=rho)

    def affine(self, stats: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Row j at (z, rho) is (1 - z - rho) mu + z (mu - sigma) + rho (mu + xi_j sigma): the points
        P = [mu; mu - sigma; mu + xi_1 sigma; ...; mu + xi_f sigma], so the search scores every (z, rho)
        from one Gram matrix, as ALIE's line."""
        mean, sigma, spread = stats["mean"], stats["sigma"], stats["spread"]
        f = spread.shape[0]
        moves = torch.zeros((2, f, f + 2), dtype=torch.float64)
        moves[:, :, 0] = -1.0  # z and rho both move weight off mu: onto mu - sigma, onto row j's own point
        moves[0, :, 1] = 1.0
        moves[1, :, 2:] = torch.eye(f, dtype=torch.float64)
        return torch.cat([torch.stack([mean, mean - sigma]), mean + spread]), moves

    def _record(self, best: tuple[float, float]) -> None:
        self.last_param, self.last_rho = best


# The paper's attacks first, in its tables' order (names, menus and did-you-mean lists follow it).
for _cls in (NoAttack, ALIE, FOE, SignFlip, LabelFlip, Mimic, MinMax, MinSum, GaussianNoise, ALIESpread):
    ATTACKS.register(_cls)
contract("attack", Attack)


def normalise_attack(name: str) -> str:
    """An attack name as stored: lower case, except a plug-in's path and class (``my_attacks.py:Mine``)."""
    if not isinstance(name, str):  # str(None) is "none", no attack
        raise ValueError(f"attack must be a name such as 'alie' or 'foe_0.1', got {name!r}")
    name = name.strip()
    return name if is_plugin(name) else name.lower()


def idle_byzantine(name: str, f: int, variant: str = "paper", params: dict[str, Any] | None = None) -> int:
    """How many of a run's f Byzantine clients (ids 0..f-1) take no local step under attack `name`: all f
    when its rows never read their honest updates (`Attack.needs_own` False: ALIE, FOE, ...), else 0
    (`training.RunState.idle`). Builds the attack: a plug-in's code runs."""
    if f == 0 or name == NO_ATTACK:
        return 0
    return 0 if make_attack(name, variant=variant, params=params).needs_own() else f


def _known(name: str) -> str:
    """The stored form of a registered attack's name or of a plug-in spec; a did-you-mean error otherwise."""
    given, name = name, normalise_attack(name)
    if not is_plugin(name) and name not in ATTACKS:
        hint = did_you_mean(name, ATTACKS)
        if not hint.startswith("; valid"):
            hint += f"; valid: {', '.join(ATTACKS)}"
        raise ValueError(f"unknown attack {given!r}{hint}{spec_hint(given)}")
    return name


def canonical_attack(name: str, params: dict[str, Any] | None = None) -> tuple[str, Settings]:
    """(name, settings) as a result key stores them (`Registry.canonical`: ``foe`` with eps=0.1 is
    ``foe_0.1``)."""
    return ATTACKS.canonical(_known(name), dict(params or {}))


def make_attack(
    name: str, variant: str = "paper", params: dict[str, Any] | None = None, **run: Any
) -> Attack:
    """Build the attack called ``name`` (a name of `ATTACKS`, e.g. ``alie`` or ``foe_0.1``, or a plug-in
    ``my_attacks.py:MyAttack``) with its settings ``params`` (its ``__init__`` keywords, e.g. ``{"eps": 1}``
    for FOE) and the run's own keywords (``generator``). ``variant``: ``paper`` (the text) or ``authors``
    (the authors' code; a class that differs takes a ``variant`` keyword, as SF and ALIE)."""
    name = _known(name)
    check_variant(f"attack {name!r}", variant)
    if params is not None and not isinstance(params, Mapping):
        raise ValueError(
            f"attack {name!r}: params must be a mapping of settings, e.g. {{'eps': 1}}, got {params!r}"
        )
    entry = ATTACKS.lookup(name)
    accepts, valid = inspect.signature(entry.cls.__init__).parameters, settings_of(entry.cls)
    unknown = sorted(set(run) - set(accepts))
    if unknown:
        hint = did_you_mean(unknown[0], valid) if valid else ""
        raise ValueError(f"attack {name!r} has no setting {', '.join(unknown)}{hint}")
    settings = {k: run.pop(k) for k in list(run) if k in valid}  # make_attack("foe", eps=1)
    params = {**entry.params, **(params or {}), **settings}
    check_settings(f"attack {name!r}", entry.cls, params)
    if "variant" in accepts:
        run = {**run, "variant": variant}
    try:
        attack = entry.cls(**params, **run)
    except TypeError as e:
        raise ValueError(f"attack {name!r}: {entry.cls.__name__} cannot be built: {e}") from None
    attack.name = name
    return attack


def _check_sent(name: str, sent: Any, own: Tensor) -> None:
    """What ``send`` returned must be one row per Byzantine client, on their device: a wrong count of rows
    would train the run with another N (and be stored as valid)."""
    if not isinstance(sent, Tensor) or sent.shape != own.shape or sent.device != own.device:
        raise ValueError(f"attack {name!r}: send returned {shape_of(sent)}; it must return one row per "
                         f"Byzantine client, (f, d) = {tuple(own.shape)} on {own.device}")  # fmt: skip


def _check_shapes(name: str, honest: Tensor, own: Tensor) -> None:
    if not (isinstance(honest, Tensor) and isinstance(own, Tensor)):
        raise ValueError(f"{name}: honest and own must be torch tensors, got {type(honest)} and {type(own)}")
    if honest.dim() != 2 or own.dim() != 2 or honest.shape[1] != own.shape[1]:
        raise ValueError(
            f"{name}: expected honest (h, d) and own (f, d) with the same d, got honest "
            f"{tuple(honest.shape)} and own {tuple(own.shape)}"
        )
    if honest.device != own.device or honest.dtype != own.dtype:
        raise ValueError(
            f"{name}: honest ({honest.dtype}, {honest.device}) and own ({own.dtype}, {own.device}) must "
            f"share dtype and device"
        )
    if not honest.dtype.is_floating_point:
        raise ValueError(f"{name}: updates must be floating point, got {honest.dtype}")


def _check_honest(name: str, honest: Tensor, known_finite: bool = False) -> None:
    if honest.shape[0] == 0:
        raise ValueError(f"{name}: no honest client (honest has shape {tuple(honest.shape)}); need h >= 1")
    if known_finite:  # checked by the caller: reading it again would be a second wait for the device
        return
    finite = torch.isfinite(honest).all(dim=1)
    if not finite.all():
        bad = torch.nonzero(~finite).flatten().tolist()
        raise ValueError(f"{name}: honest updates {bad[:10]} (rows of honest) contain NaN or Inf")


def _mean_std(honest: Tensor) -> tuple[Tensor, Tensor]:
    """Per-coordinate honest mean and population std (spelled out: faster than torch.std along dim 0 on a
    CPU)."""
    mean = honest.mean(0)
    return mean, (honest - mean).square_().mean(0).sqrt_()


def _damage(aggregate: Tensor, honest_mean: Tensor, name: str, raw: bool = False) -> float:
    """norm(aggregate - mu_H); a non-finite aggregate is infinite damage (``raw``: NaN stays NaN)."""
    if aggregate.shape != honest_mean.shape:
        raise ValueError(
            f"{name}: the server returned shape {tuple(aggregate.shape)}, expected {tuple(honest_mean.shape)}"
        )
    damage = torch.linalg.vector_norm(aggregate.to(honest_mean.dtype) - honest_mean).item()
    return damage if math.isfinite(damage) or raw else math.inf


def _randn(shape: tuple[int, ...] | torch.Size, like: Tensor, generator: torch.Generator | None) -> Tensor:
    """Standard normal draws on ``like``'s device and dtype, from ``generator`` (any device) if given."""
    device = like.device if generator is None else generator.device
    return torch.randn(tuple(shape), generator=generator, device=device, dtype=like.dtype).to(like.device)
