"""Every rule and attack of the library inside Flower (https://flower.ai): a server strategy and, for
experiments, a simulated federation.

Needs the optional extra ``flower`` (``pip install -e ".[flower]"``, which pins flwr); nothing else in
``prodigy_core`` imports this module or flwr.

- `RobustStrategy`: a Flower strategy (message API, ``flwr.serverapp.strategy``) that aggregates the clients'
  updates with any defense `make_aggregator` accepts and takes the server step of `prodigy_core.training`.
- Byzantine behaviour, FOR EXPERIMENTS ONLY: the omniscient attacks (ALIE, FOE, SF) are applied by the
  strategy to the replies of the clients chosen as Byzantine (`byzantine_ids`); label flipping happens on
  the client (`client_app`). A deployed server must leave ``attack`` at ``"none"``.
- `simulate`: `RunConfig` runs under Flower's own simulation engine (`flwr.simulation.run_simulation`, Ray;
  deprecated by flwr 1.42, which still runs it), one `FlowerRun` each, comparable with
  `prodigy_core.training.run`.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import os
import statistics
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any

import numpy as np
import torch

try:
    import flwr  # noqa: F401
except ImportError as e:
    raise ImportError(
        'prodigy_core.flower needs Flower: pip install -e ".[flower]" (or "prodigy-fl[flower]")'
    ) from e
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, Result
from torch import Tensor

from prodigy_core.aggregators import Pipeline, ProDiGy, make_aggregator
from prodigy_core.attacks import make_attack, recorded_param
from prodigy_core.config import RunConfig
from prodigy_core.data import Federation
from prodigy_core.evaluation import diverged_accuracy, eval_due, evaluate
from prodigy_core.local_training import local_steps_sequential
from prodigy_core.models import make_model
from prodigy_core.names import NO_ATTACK
from prodigy_core.results import finite_number
from prodigy_core.seeding import precision_mode, seed_everything
from prodigy_core.streams import ClientStreams
from prodigy_core.training import RunResult, local_momentum, median_report, run_federation

# Keys of the records a client's reply holds (besides Flower's "metrics").
UPDATE_KEY, BUFFERS_KEY = "arrays", "buffers"
# The reply metric labelling a row (the simulation's partition id); the node id where it is absent. A label
# only names and orders the rows: each replying node has one row, whatever id it claims.
CLIENT_ID = "partition-id"
# The state-dict entries that are BatchNorm statistics, not parameters (`RobustStrategy`'s default split).
BATCHNORM_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def byzantine_ids(n_clients: int, n_byzantine: int, seed: int) -> list[int]:
    """The clients an experiment makes Byzantine: the first f of a permutation of 0..N-1 drawn from `seed`
    (sorted). Fixed by the seed, so the strategy and the clients agree without telling each other."""
    perm = torch.randperm(n_clients, generator=torch.Generator().manual_seed(seed))
    return sorted(perm[:n_byzantine].tolist())


class RobustStrategy(FedAvg):
    """Flower's FedAvg with its averaging replaced by a robust rule, and the paper's server step.

    Round t (Flower's server_round r = t + 1): every sampled node gets theta_t and, in its train config,
    ``lr`` = gamma_t = `lr_at(t)`; it replies with its update (record ``arrays``: the server model's
    trainable parameters, ``parameters``, e.g. the local momentum of (theta_t - theta^(E)) / gamma_t, as
    `client_app` sends) and may report its BatchNorm buffers (record ``buffers``). The strategy makes one
    row per replying node, stacks the rows in the order of (label, node id), where the label is the reply's
    metric ``partition-id`` (else the node id), aggregates them with ``make_aggregator(defense, n_byzantine,
    variant=variant, params=defense_params)`` and sets theta_{t+1} = theta_t - gamma_t Agg(g^1..g^N) (per
    tensor, in the tensor's own dtype) and each buffer to the coordinate-wise median of the clients'
    reports, as `prodigy_core.training.server_round` does.

    Sampling: every connected node trains (``fraction_train`` = 1), up to N = ``n_clients``; with more than
    N connected, N of them are drawn each round from (``seed``, round) and a warning (once a run) says so.
    ``min_train_nodes`` (default N, as in the paper: every round trains all N) may be set anywhere from the
    fewest rows the rule runs on (median with f = 3: 7) to N, so that a node lost for good does not make
    Flower wait forever; ``min_available_nodes`` defaults to it.

    Hostile replies (docs/semantics.md, "Flower strategy"): the parameters and buffers are the server
    model's, never a reply's. A label is only a label: a node claiming another's ``partition-id`` still gets
    a row of its own (labels claimed by more than one node: round metric ``repeated-ids``, logged). A reply
    is dropped (counted in ``dropped``, logged) when its node replied already this round, its label is not
    an integer, or its update lacks a parameter or has one of another shape or a complex dtype. A reply with
    a NaN, an Inf or an entry beyond float32's range is a Byzantine row (labels in ``non-finite``): the rule
    gives it no say. A buffer report that is missing, of another shape or not finite is left out of that
    buffer's median (counted in ``dropped-buffers``); a buffer changes only when more than half the round's
    rows report it. A round with fewer rows than the rule needs, or whose step is not finite, is skipped
    with a warning (``skipped`` = 1, round in `skipped_rounds`): the model stays theta_t and the next round
    goes on. Federated evaluation (`aggregate_evaluate`): each metric's unweighted median over the replies.

    ``parameters``: the server model's trainable parameters (``[n for n, _ in model.named_parameters()]``,
    as `from_config` passes); None: every entry of theta_t but the BatchNorm statistics
    (`BATCHNORM_STATISTICS`), which are its buffers. ``lr_at``: round t -> gamma_t, or a number (a constant
    rate).

    Unweighted: a robust rule sees one update per client, whatever its number of examples (Flower's FedAvg
    weights by ``num-examples``; weighting by a self-reported count would hand a Byzantine client the vote).

    Each round's metrics (Flower's history, ``Result.train_metrics_clientapp``) carry ``lr``, ``clients``
    and, for ProDiGy, ``zeroed`` (the labels given weight 0); with an attack also ``byzantine`` (the
    attacked labels), ``zeroed-byzantine`` (the zeroed ones among them) and ``attack-param`` (the searched
    parameter, e.g. ALIE's z).

    EXPERIMENTS ONLY: ``attack`` other than ``"none"`` (with f > 0) makes the clients `byzantine` (default
    `byzantine_ids(N, f, seed)`) send what `make_attack(attack, variant, attack_params)` crafts from every
    honest reply, through the same line search against this pipeline; label flipping (``lf``) is done by
    the clients (`client_app`), so the strategy leaves their replies as they are. ``honest_known`` (what
    `simulate` sets, whose clients are all the package's own) says every row whose label is not in
    `byzantine` is honest, as an attack does. Only then does the strategy know which rows are honest: when
    one of them is not finite, or the step is not, the run has diverged (``diverged_at``) and the model
    stays frozen, as in `training.run`.
    """

    def __init__(
        self,
        defense: str,
        n_byzantine: int,
        n_clients: int,
        lr_at: Callable[[int], float] | float,
        variant: str = "paper",
        defense_params: dict[str, Any] | None = None,
        attack: str = "none",
        attack_params: dict[str, Any] | None = None,
        byzantine: Sequence[int] | None = None,
        seed: int = 0,
        parameters: Sequence[str] | None = None,
        *,
        honest_known: bool = False,
        **fedavg: Any,
    ) -> None:
        for name, value in {"fraction_train": 1.0, "arrayrecord_key": UPDATE_KEY}.items():
            if fedavg.get(name, value) != value:
                raise ValueError(
                    f"RobustStrategy: {name}={fedavg[name]!r} is not supported: every round trains every "
                    f"connected node (up to n_clients={n_clients}) and reads their updates from record "
                    f"{UPDATE_KEY!r} (leave {name} at {value!r})"
                )
        self.pipeline = make_aggregator(defense, n_byzantine, n_clients, variant, defense_params)
        fewest = _fewest_rows(self.pipeline, n_clients)
        least = fedavg.setdefault("min_train_nodes", n_clients)
        if isinstance(least, bool) or not isinstance(least, int) or not fewest <= least <= n_clients:
            raise ValueError(
                f"RobustStrategy: min_train_nodes={least!r} is outside {fewest}..{n_clients}: {defense} with "
                f"n_byzantine={n_byzantine} needs {fewest} updates a round and a round trains at most "
                f"n_clients={n_clients} nodes (default {n_clients}: all of them, as in the paper)"
            )
        fedavg.setdefault("min_available_nodes", least)
        super().__init__(**fedavg)
        self.n_clients, self.seed = n_clients, seed
        if isinstance(lr_at, numbers.Real) and not isinstance(lr_at, bool):
            rate = float(lr_at)
            self.lr_at: Callable[[int], float] = lambda t: rate
        elif callable(lr_at):
            self.lr_at = lr_at
        else:
            raise TypeError(
                f"RobustStrategy: lr_at={lr_at!r:.60} is neither a callable (round t -> learning rate, e.g. "
                "RunConfig.lr_at) nor a number (a constant learning rate)"
            )
        self.attack = None
        if attack != NO_ATTACK and n_byzantine == 0:  # RunConfig's rule
            raise ValueError(f"attack={attack!r} with n_byzantine=0: set n_byzantine > 0 or attack='none'")
        if attack != NO_ATTACK:
            self.attack = make_attack(attack, variant=variant, params=attack_params)
            if self.attack.sent_is_momentum:
                raise ValueError(
                    f"attack {attack!r} under variant={variant!r} writes what it sends into the client's "
                    "momentum, which lives on the Flower client; use variant='paper'"
                )
        ids = byzantine_ids(n_clients, n_byzantine, seed) if byzantine is None else sorted(byzantine)
        if len(set(ids)) != n_byzantine or any(not 0 <= k < n_clients for k in ids):
            raise ValueError(f"byzantine={list(ids)}: need {n_byzantine} distinct ids in 0..{n_clients - 1}")
        self.byzantine: list[int] = ids
        self.honest_known = honest_known or self.attack is not None  # every row not in `byzantine` is honest
        self.parameters = None if parameters is None else list(parameters)
        self.zeroed: list[list[int]] = []  # ProDiGy: the weight-0 labels of every round
        self.diverged_at: int | None = None  # the first round whose step was not finite
        self.skipped_rounds: list[int] = []  # the rounds `_skip` skipped
        self._arrays: ArrayRecord | None = None
        self._warned: set[str] = set()  # the once-a-run warnings (and checks) already given

    @classmethod
    def from_config(
        cls, config: RunConfig, byzantine: Sequence[int] | None = None, **options: Any
    ) -> RobustStrategy:
        """The strategy of a `RunConfig`: its defense, attack, settings, variant, N, f and lr schedule
        (`RunConfig.lr_at`), its model's parameters; Byzantine ids drawn from its seed unless given.
        ``options``: ``honest_known`` and FedAvg's keywords."""
        c = config.resolved()
        parameters = [name for name, _ in make_model(c.dataset).named_parameters()]
        return cls(c.defense, c.n_byzantine, c.n_clients, c.lr_at, c.variant, c.defense_params, c.attack,
                   c.attack_params, byzantine, c.seed, parameters, **options)  # fmt: skip

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's (every connected node, once at least ``min_train_nodes`` are), with ``lr`` in the config;
        with more than N nodes connected, N of them drawn from (seed, round)."""
        missing = [k for k in self.parameters or [] if k not in arrays]
        if missing:
            raise ValueError(f"RobustStrategy: parameters {missing} are not in the server model's arrays")
        self._arrays = arrays  # theta_t, for the server step
        config["lr"] = float(self.lr_at(server_round - 1))
        nodes = sorted(grid.get_node_ids())
        if len(nodes) <= self.n_clients:
            return super().configure_train(server_round, arrays, config, grid)
        self._warn_once("extra-nodes", f"{len(nodes)} nodes connected but n_clients={self.n_clients}: each "
                        f"round trains {self.n_clients} of them, drawn from (seed, round)")  # fmt: skip
        rng = np.random.default_rng([self.seed % 2**63, server_round])
        drawn = sorted(rng.choice(len(nodes), self.n_clients, replace=False).tolist())
        config["server-round"] = server_round
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._construct_messages(record, [nodes[i] for i in drawn], MessageType.TRAIN)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, _ = self._check_and_log_replies(replies, is_train=True, validate=False)
        if self._arrays is None:
            return None, None
        theta = self._arrays.to_torch_state_dict()
        names = [k for k in theta if _is_parameter(k, self.parameters)]
        read = _read_updates(valid, {k: theta[k] for k in names})
        gamma = float(self.lr_at(server_round - 1))
        metrics = MetricRecord({"lr": gamma, "clients": len(read.rows)})
        if read.dropped:
            metrics["dropped"] = read.dropped
        if read.repeated:
            metrics["repeated-ids"] = read.repeated
            log(WARNING, "RobustStrategy: round %s: ids %s are each claimed by more than one node, each of "
                "which keeps its own row", server_round, read.repeated)  # fmt: skip
        if self.honest_known and self.diverged_at is not None:
            return self._arrays, metrics  # an experiment's diverged run stays frozen, as in `training.run`
        try:
            if not read.rows:
                raise ValueError("no usable reply" + _common_lack(read.lacking))
            self.pipeline.check_n(len(read.rows))
        except ValueError as e:
            return self._skip(server_round, metrics, f"{len(read.rows)} usable replies: {e}")
        keys = sorted(read.rows)  # (label, node id)
        ids = [label for label, _ in keys]
        G = torch.stack([read.rows[k] for k in keys])
        finite = torch.isfinite(G).all(dim=1)
        if not bool(finite.all()):
            metrics["non-finite"] = [k for k, ok in zip(ids, finite.tolist(), strict=True) if not ok]
        honest = torch.tensor([k not in self.byzantine for k in ids]) if self.honest_known else finite
        if not bool(finite[honest].all()):  # experiments only: an honest row blew up
            self.diverged_at = server_round
            return self._arrays, metrics
        start = _flat(theta, names)
        self._warn_if_weights(server_round, G[finite], start)
        self.pipeline.new_round(start)  # CClip (authors) starts from theta_t, in the attack's search too
        aggregate = self.pipeline(self.server_input(G, ids, metrics))
        self._diagnostics(ids, metrics)
        new = _step(theta, names, gamma, aggregate)
        if not all(bool(torch.isfinite(t).all()) for t in new.values()):
            self.diverged_at = self.diverged_at or server_round
            if self.honest_known:
                return self._arrays, metrics
            return self._skip(server_round, metrics, "the step is not finite")
        out = dict(theta)
        out.update(new)
        buffers = {k: t for k, t in theta.items() if k not in names}
        medians, bad_reports = _median_buffers([read.kept[k] for k in keys], buffers)
        out.update(medians)
        if bad_reports:
            metrics["dropped-buffers"] = bad_reports
        unreported = [name for name in buffers if name not in medians]
        if unreported:
            self._warn_once("buffers", f"round {server_round}: half the replies or fewer report the buffers "
                            f"{unreported} (record {BUFFERS_KEY!r}): they keep their values")  # fmt: skip
        return ArrayRecord(out), metrics

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Each metric's unweighted median (`statistics.median`) over the replies that give it as a finite
        int or float (one reply a node); a reply lacking it, or giving a list, a bool or a non-finite value,
        does not count for it. None when no reply gives any. Flower's FedAvg weights by the self-reported
        ``num-examples`` (one client claiming 1e9 examples set the result) and raised on a reply lacking it;
        here nothing a reply sends raises, and while the honest replies give more than half a metric's
        values, its median lies within their range."""
        valid, _ = self._check_and_log_replies(replies, is_train=False, validate=False)
        values: dict[str, list[int | float]] = {}
        for m in _one_per_node(valid)[0]:
            given: dict[str, Any] = {}
            for record in m.content.metric_records.values():
                for key, value in record.items():
                    given.setdefault(key, value)  # a key in two records counts once
            for key, value in given.items():
                if finite_number(value):
                    values.setdefault(key, []).append(value)
        return MetricRecord({k: statistics.median(v) for k, v in values.items()}) if values else None

    def _warn_if_weights(self, server_round: int, G: Tensor, start: Tensor) -> None:
        """Flower's own FedAvg clients reply with their trained weights under the same record name and
        shapes: the server step would then shrink theta towards 0, silently. Warn when the replies'
        coordinate-wise median lies within 10% of theta_t (an update that close to the weights themselves is
        no update). Checked in the first round with replies only: a client app sends one kind throughout,
        and a median over (N, d) every round would cost the strategy a sort per coordinate."""
        scale = float(start.norm())
        if "weights-checked" in self._warned or not len(G) or scale == 0:
            return
        self._warned.add("weights-checked")
        if float((G.median(dim=0).values - start).norm()) < 0.1 * scale:
            message = (
                f"round {server_round}: the replies lie within 10% of the server model: they look like model "
                f"weights, not updates; record {UPDATE_KEY!r} must hold each client's update "
                "(theta_t - theta_local) / lr, as the server steps theta_t - lr * Agg"
            )
            self._warn_once("weights", message)

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log(WARNING, "RobustStrategy: %s", message)

    def _skip(self, server_round: int, metrics: MetricRecord, why: str) -> tuple[None, MetricRecord]:
        log(WARNING, "RobustStrategy: round %s skipped, the model stays as it was (%s)", server_round, why)
        self.skipped_rounds.append(server_round)
        metrics["skipped"] = 1
        return None, metrics

    def server_input(self, G: Tensor, ids: list[int], metrics: MetricRecord) -> Tensor:
        """G (N, d) with the Byzantine clients' rows replaced by what the attack crafts from the others
        (EXPERIMENTS ONLY); G itself without an attack and under label flipping, which the clients do."""
        if self.attack is None:
            return G
        bad = torch.tensor([k in self.byzantine for k in ids])
        metrics["byzantine"] = [k for k in ids if k in self.byzantine]
        if self.attack.flips_labels:
            return G
        G = G.clone()
        G[bad] = self.attack.craft(G[~bad], G[bad], self.pipeline).to(G.dtype)
        if self.attack.last_param is not None:
            metrics["attack-param"] = recorded_param(self.attack.last_param)
        return G

    def _diagnostics(self, ids: list[int], metrics: MetricRecord) -> None:
        rule = self.pipeline.rule
        if (
            isinstance(rule, ProDiGy)
            and rule.last_scores is not None
            and len(rule.last_scores.weight) == len(ids)
        ):
            zeroed = [ids[i] for i in torch.nonzero(rule.last_scores.weight == 0).flatten().tolist()]
            self.zeroed.append(zeroed)
            metrics["zeroed"] = zeroed
            if self.attack is not None:
                metrics["zeroed-byzantine"] = [k for k in zeroed if k in self.byzantine]


def _fewest_rows(pipeline: Pipeline, n_clients: int) -> int:
    """The fewest rows `pipeline` runs on (make_aggregator has checked it runs on `n_clients`)."""
    for n in range(1, n_clients + 1):
        try:
            pipeline.check_n(n)
            return n
        except ValueError:
            continue
    return n_clients


def _is_parameter(name: str, parameters: list[str] | None) -> bool:
    if parameters is not None:
        return name in parameters
    return name.rsplit(".", 1)[-1] not in BATCHNORM_STATISTICS


def _label(message: Message) -> int | None:
    """The reply's ``partition-id`` (an int; None for anything else), else its node id: what names its row in
    the round's metrics and orders the rows, never what makes it one (any node may claim any id)."""
    metrics = message.content.metric_records.get("metrics")
    if metrics is None or CLIENT_ID not in metrics:
        return int(message.metadata.src_node_id)
    value = metrics[CLIENT_ID]
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _one_per_node(replies: Iterable[Message]) -> tuple[list[Message], int]:
    """The first reply of each node (in node-id order, then arrival) and the number of later ones, which are
    logged and ignored."""
    first: dict[int, Message] = {}
    later = 0
    for m in sorted(replies, key=lambda m: m.metadata.src_node_id):
        node = int(m.metadata.src_node_id)
        if node in first:
            log(
                WARNING, "RobustStrategy: a second reply of node %s dropped: a node has one say a round", node
            )
            later += 1
        else:
            first[node] = m
    return list(first.values()), later


def _tensor(record: Any, name: str, like: Tensor) -> Tensor | None:
    """``record[name]`` as a tensor of `like`'s shape, or None when the record is not an ArrayRecord, lacks
    the entry, or holds one that cannot be read, of another shape or a complex dtype."""
    if not isinstance(record, ArrayRecord) or name not in record:
        return None
    try:
        t = torch.from_numpy(record[name].numpy())
    except (ValueError, TypeError, RuntimeError):  # bytes that are no array of a dtype torch knows
        return None
    return t if t.shape == like.shape and not t.is_complex() else None


@dataclass
class _Updates:
    """A round's replies as `_read_updates` reads them."""

    rows: dict[tuple[int, int], Tensor]  # each usable update as a float32 row, by (label, node id)
    kept: dict[tuple[int, int], Message]  # the replies that gave them
    dropped: int  # the replies dropped
    lacking: list[tuple[str, ...]]  # per dropped reply, the parameters absent from its update record
    repeated: list[int]  # the labels of more than one row


def _read_updates(replies: list[Message], params: dict[str, Tensor]) -> _Updates:
    """Each usable reply's update as a float32 row of the server's `params` (in their order), one a node, by
    (label, node id); a reply is dropped (logged, counted) when its node replied already, it lacks a
    parameter or has one of another shape, or its label is not an integer."""
    first, later = _one_per_node(replies)
    read = _Updates({}, {}, later, [], [])
    for m in first:
        label, record = _label(m), m.content.array_records.get(UPDATE_KEY)
        parts = {name: _tensor(record, name, p) for name, p in params.items()}
        why = _drop_reason(m, record, parts, label)
        if why is not None:
            log(WARNING, "RobustStrategy: reply of node %s dropped: %s", m.metadata.src_node_id, why)
            read.dropped += 1
            absent = [n for n in params if n not in record] if isinstance(record, ArrayRecord) else []
            read.lacking.append(tuple(absent))
            continue
        key = (label, int(m.metadata.src_node_id))
        read.rows[key] = torch.cat([t.reshape(-1).to(torch.float32) for t in parts.values()])  # type: ignore[union-attr]
        read.kept[key] = m
    labels = Counter(label for label, _ in read.rows)
    read.repeated = sorted(label for label, count in labels.items() if count > 1)
    return read


def _drop_reason(m: Message, record: Any, parts: dict[str, Tensor | None], label: int | None) -> str | None:
    """Why `_read_updates` drops a reply (its update record, its parameters as read, its label), or None
    when it is usable."""
    if record is None:
        return f"no ArrayRecord {UPDATE_KEY!r} (it has {sorted(m.content.array_records)})"
    missing = [name for name, t in parts.items() if t is None]
    if missing:
        return f"its update lacks {missing} or has them of another shape"
    if label is None:
        return f"client id {label!r} is not an integer"
    return None


def _common_lack(lacking: list[tuple[str, ...]]) -> str:
    """When every dropped reply lacks the same parameters: which, and the likely fix; else ''."""
    if len(set(lacking)) != 1 or not lacking[0]:
        return ""
    return (
        f"; every reply's update lacks {list(lacking[0])}: if they are not trainable parameters "
        "(parameters=None counts every entry but the BatchNorm statistics, a step counter too), pass "
        "parameters=[n for n, _ in model.named_parameters()] (or make the strategy with "
        "RobustStrategy.from_config)"
    )


def _median_buffers(replies: list[Message], buffers: dict[str, Tensor]) -> tuple[dict[str, Tensor], int]:
    """Each server buffer set to the `median_report` of the replies' reports of it that have its shape
    and are finite in its dtype, when more than half the replies give one (else it keeps its value); with
    the number of reports missing or left out."""
    out, bad = {}, 0
    for name, like in buffers.items():
        reports = []
        for m in replies:
            t = _tensor(m.content.array_records.get(BUFFERS_KEY), name, like)
            if t is not None and like.is_floating_point():
                t = t.to(like.dtype)
                t = t if bool(torch.isfinite(t).all()) else None
            elif t is not None:
                t = None if t.is_floating_point() else t.to(like.dtype)
            if t is None:
                bad += 1
            else:
                reports.append(t)
        if 2 * len(reports) > len(replies):
            out[name] = median_report(torch.stack(reports))
    return out, bad


def _flat(state: dict[str, Tensor], names: list[str]) -> Tensor:
    """The entries `names` of a state dict as one float32 vector, in that order."""
    return torch.cat([state[k].reshape(-1).to(torch.float32) for k in names])


def _step(theta: dict[str, Tensor], names: list[str], gamma: float, aggregate: Tensor) -> dict[str, Tensor]:
    """The server step theta_k - gamma Agg_k of each parameter k in `names` (Agg: their float32 vector, in
    that order), in the parameter's own dtype: a float64 model is not rounded to float32 each round, and a
    float32 one steps as the flat vector would, bit for bit. A parameter that is no float steps in float32
    and is cast back."""
    out, start = {}, 0
    for k in names:
        t = theta[k]
        a = aggregate[start : start + t.numel()].reshape(t.shape)
        start += t.numel()
        out[k] = t - gamma * a.to(t.dtype) if t.is_floating_point() else (t.float() - gamma * a).to(t.dtype)
    return out


def _unflat(vector: Tensor, like: dict[str, Tensor]) -> dict[str, Tensor]:
    """A vector cut back into the shapes and dtypes of `like` (in its order)."""
    out, start = {}, 0
    for k, t in like.items():
        out[k] = vector[start : start + t.numel()].reshape(t.shape).to(t.dtype)
        start += t.numel()
    return out


# ------------------------------------------------------------------------------------ the simulated clients
@functools.lru_cache(maxsize=8)
def _client_data(config: RunConfig, k: int, flipped: bool) -> Federation:
    """Client k's own view of the run's federation (its samples only; labels flipped for label flip)."""
    fed = run_federation(config, torch.device("cpu"))
    own = dataclasses.replace(fed, client_indices=[fed.client_indices[k]], flipped_clients=[])
    if flipped:  # the label-flip wrapper: this client trains honestly on y' = C-1-y (EXPERIMENTS ONLY)
        own.flip_labels([0])
    return own


def _stream_seed(seed: int, client: int, server_round: int) -> int:
    """A seed of its own for every client and round: the client's batches and dropout masks."""
    return int(np.random.SeedSequence([seed % 2**63, client, server_round]).generate_state(1)[0])


def client_app(configs: Sequence[RunConfig], byzantine: Sequence[Sequence[int]]) -> ClientApp:
    """The Flower clients of `simulate`: the train config's ``run`` picks ``configs[run]``; client k (the
    node's ``partition-id``) trains the run's model from theta_t for E local SGD steps at the config's
    ``lr`` on its own samples of the run's split (`prodigy_core.training`'s local steps, batches and dropout
    masks from a seed of the run's seed, k and the round), keeps its local momentum in the node's state and
    replies with it (``arrays``) and its BatchNorm buffers (``buffers``). A client in ``byzantine[run]`` of
    a label-flip run trains on flipped labels (EXPERIMENTS ONLY)."""
    resolved = [c.resolved() for c in configs]
    flips = [make_attack(c.attack).flips_labels and c.n_byzantine > 0 for c in resolved]
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        run, lr = int(msg.content["config"]["run"]), float(msg.content["config"]["lr"])
        server_round = int(msg.content["config"]["server-round"])
        config, k = resolved[run], int(context.node_config[CLIENT_ID])
        fed = _client_data(config, k, flips[run] and k in byzantine[run])
        model = make_model(config.dataset)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        streams = ClientStreams(_stream_seed(config.seed, k, server_round), 1)  # batches and dropout masks
        with precision_mode(config.precision, torch.device("cpu")):  # as `training.run`'s local steps
            grads, buffers = local_steps_sequential(model, fed, config.local_steps, lr, config, streams)
        key = f"momentum-{run}"  # m_{t-1}, kept by the node between rounds; m_{-1} = 0
        before = context.state[key]["m"].numpy() if key in context.state else np.zeros(grads.shape[1], "f4")
        m = local_momentum(torch.from_numpy(before.copy()), grads[0], config.local_momentum)
        context.state[key] = ArrayRecord({"m": m.clone()})
        names = [name for name, _ in model.named_parameters()]
        update = _unflat(m, {n: p for n, p in model.named_parameters()})
        reply = RecordDict({
            UPDATE_KEY: ArrayRecord({n: update[n].contiguous() for n in names}),
            BUFFERS_KEY: ArrayRecord({n: b[0].clone() for n, b in buffers.items()}),
            "metrics": MetricRecord({CLIENT_ID: k, "num-examples": len(fed.train_labels)}),
        })  # fmt: skip
        return Message(reply, reply_to=msg)

    return app


# ------------------------------------------------------------------------------------------------ simulate
@dataclass
class FlowerRun:
    """One `RunConfig` trained under Flower: its `RunResult` (accuracy curve, ProDiGy's zeroed clients per
    round; a diverged run recorded as `training.run` records one), the Byzantine ids, Flower's own `Result`
    (per-round metrics) and the rounds the strategy skipped (too few usable replies: a client failed; the
    model stayed as it was), which are no divergence."""

    result: RunResult
    byzantine: list[int]
    history: Result
    skipped_rounds: list[int] = field(default_factory=list)


def simulate(
    configs: Sequence[RunConfig],
    byzantine: Sequence[int] | None = None,
    num_cpus: int | None = None,
) -> list[FlowerRun]:
    """Train `configs` one after the other in one Flower simulation (`flwr.simulation.run_simulation`: one
    Ray start for all; flwr 1.42 marks it deprecated in favour of the ``flwr run`` CLI, and it works at that
    pinned version) of N = ``configs[0].n_clients`` clients (`client_app`, `RobustStrategy` with
    ``honest_known``: every client is the package's own, so an honest client's non-finite update is the
    run's divergence, as in `training.run`); the configs must share N and the data split. The server model
    starts as `prodigy_core.training.run`'s (``seed_everything(seed)`` then the dataset's model) and is
    evaluated as there (`evaluate` every ``eval_every`` rounds and after the last, on the whole test set).
    ``byzantine``: the attacked ids (default `byzantine_ids(N, f, seed)` per config). ``num_cpus``: Ray's
    CPUs, one client at a time per CPU (default: all of them). A round the strategy skipped is listed in
    its run's `FlowerRun.skipped_rounds`, with a warning at the end."""
    from flwr.simulation import run_simulation

    if not configs:
        return []
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    resolved = [c.resolved() for c in configs]
    if any(c.variant == "authors" for c in resolved):
        raise ValueError("simulate: variant='authors' is not simulated (the Flower clients draw the paper's "
                         "batches and the server evaluates in eval mode); use variant='paper', or "
                         "training.run for the authors' semantics")  # fmt: skip
    if any(c.precision == "tf32" for c in resolved):
        raise ValueError("simulate: precision=tf32 exists only on CUDA and the Flower clients train on the "
                         "CPU; use precision=fp32 or bf16")  # fmt: skip
    n = resolved[0].n_clients
    if any(
        (c.n_clients, c.dataset, c.data_seed) != (n, resolved[0].dataset, resolved[0].data_seed)
        for c in resolved
    ):
        raise ValueError("simulate: every config must have the same n_clients, dataset and data split")
    strategies = [
        RobustStrategy.from_config(c, byzantine, honest_known=True, fraction_evaluate=0.0) for c in resolved
    ]
    runs: list[FlowerRun] = []
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        for i, (config, strategy) in enumerate(zip(configs, strategies, strict=True)):
            runs.append(_serve(grid, i, config, strategy))

    apps = client_app(resolved, [s.byzantine for s in strategies])
    _start_ray(num_cpus or os.cpu_count() or 1)  # Flower's backend uses a Ray already started (and stops it)
    backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}}
    run_simulation(server, apps, num_supernodes=n, backend_config=backend)
    if len(runs) != len(configs):
        raise RuntimeError(
            f"the Flower simulation stopped after {len(runs)} of {len(configs)} runs (see its log)"
        )
    for i, flower_run in enumerate(runs):
        if flower_run.skipped_rounds:
            warnings.warn(
                f"simulate: run {i} ({resolved[i].defense}, attack {resolved[i].attack}) skipped rounds "
                f"{flower_run.skipped_rounds}: too few usable replies (a client failed, see Flower's log); "
                "the model stayed as it was in those rounds",
                RuntimeWarning,
                stacklevel=2,
            )
    return runs


def _start_ray(num_cpus: int, attempts: int = 3) -> None:
    """Start a local Ray for the simulation, retried: Ray gives its raylet a fixed 30 s to register, which a
    loaded machine can exceed ("The current node timed out during startup")."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    for attempt in range(attempts):
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
            return
        except Exception as e:  # Ray raises a bare Exception on a startup timeout
            ray.shutdown()
            if "existing cluster" in str(e):  # `ray start` ran here: ray.init joins it and refuses num_cpus
                raise RuntimeError(
                    "Flower's simulation starts a Ray of its own, and a Ray cluster runs on this machine "
                    "(ray start): stop it (ray stop), or unset RAY_ADDRESS"
                ) from e
            if attempt == attempts - 1:
                raise RuntimeError(
                    f"Flower's simulation needs a local Ray, which did not start in {attempts} tries (Ray: "
                    f"{e}); on a loaded machine retry when it is quieter"
                ) from e


def _serve(grid: Grid, run: int, config: RunConfig, strategy: RobustStrategy) -> FlowerRun:
    """One config's rounds on the simulation's grid, recorded as `prodigy_core.training.run` records them."""
    resolved = config.resolved()
    seed_everything(resolved.seed)
    model = make_model(resolved.dataset).train()
    fed = run_federation(resolved, torch.device("cpu"))
    environment = {"engine": "flower", "precision": resolved.precision}
    result = RunResult(config=config.replace(data_source=fed.source).to_dict(), final_accuracy=float("nan"),
                       final_loss=None, environment=environment)  # fmt: skip

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round == 0 or not eval_due(resolved, server_round) or strategy.diverged_at is not None:
            return None
        model.load_state_dict(arrays.to_torch_state_dict())
        with precision_mode(resolved.precision, torch.device("cpu")):  # as `training.end_round`'s
            accuracy, loss = evaluate(model, fed)[:2]
        result.final_accuracy, result.final_loss = accuracy, loss
        result.accuracy_curve.append([server_round, accuracy])
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    history = strategy.start(grid, ArrayRecord(model.state_dict()), num_rounds=resolved.rounds,
                             train_config=ConfigRecord({"run": run}), evaluate_fn=evaluate_fn)  # fmt: skip
    result.rounds_completed, result.zeroed_clients = resolved.rounds, strategy.zeroed
    if strategy.diverged_at is not None:  # as `training.run` records a run that diverged at round r
        result.diverged, result.diverged_at = True, strategy.diverged_at
        result.rounds_completed = strategy.diverged_at
        result.final_accuracy, result.final_loss = diverged_accuracy(fed, resolved.variant), None
    return FlowerRun(result, strategy.byzantine, history, list(strategy.skipped_rounds))


__all__ = ["RobustStrategy", "byzantine_ids", "client_app", "simulate", "FlowerRun"]
