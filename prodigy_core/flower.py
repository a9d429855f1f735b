"""Every rule and attack of the library inside Flower (https://flower.ai): a server strategy and, for
experiments, a simulated federation.

Needs the optional extra ``flower`` (``pip install -e ".[flower]"``, which pins flwr); nothing else in
``prodigy_core`` imports this module or flwr.

- `RobustStrategy`: a Flower strategy (message API, ``flwr.serverapp.strategy``) that aggregates the clients'
  updates with any defense `make_aggregator` accepts and takes the server step of `prodigy_core.training`.
- Byzantine behaviour, FOR EXPERIMENTS ONLY: the omniscient attacks (ALIE, FOE, SF) are applied by the
  strategy to the replies of the clients chosen as Byzantine (`byzantine_ids`); label flipping happens on
  the client (`client_app`). A deployed server must leave ``attack`` at ``"none"``.
- `simulate`: `RunConfig` runs under Flower's own simulation engine (`flwr.simulation.run_simulation`, Ray),
  one `FlowerRun` each, comparable with `prodigy_core.training.run`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
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
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, Result
from torch import Tensor

from prodigy_core.aggregators import ProDiGy, make_aggregator
from prodigy_core.attacks import make_attack, recorded_param
from prodigy_core.config import RunConfig
from prodigy_core.data import Federation
from prodigy_core.evaluation import diverged_accuracy, eval_due, evaluate
from prodigy_core.local_training import local_steps_sequential
from prodigy_core.models import make_model
from prodigy_core.names import NO_ATTACK
from prodigy_core.seeding import precision_mode, seed_everything
from prodigy_core.streams import ClientStreams
from prodigy_core.training import RunResult, local_momentum, median_report, run_federation

# Keys of the records a client's reply holds (besides Flower's "metrics").
UPDATE_KEY, BUFFERS_KEY = "arrays", "buffers"
# The reply metric naming the client (the simulation's partition id); the node id where it is absent.
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

    Round t (Flower's server_round r = t + 1): every sampled client gets theta_t and, in its train config,
    ``lr`` = gamma_t = `lr_at(t)`; it replies with its update (record ``arrays``: the server model's
    trainable parameters, ``parameters``, e.g. the local momentum of (theta_t - theta^(E)) / gamma_t, as
    `client_app` sends) and may report its BatchNorm buffers (record ``buffers``). The strategy stacks the
    updates in the order of the clients' ids (reply metric ``partition-id``, else the node id), aggregates
    them with ``make_aggregator(defense, n_byzantine, variant=variant, params=defense_params)`` and sets
    theta_{t+1} = theta_t - gamma_t Agg(g^1..g^N) and each buffer to the coordinate-wise median of the
    clients' reports, as `prodigy_core.training.server_round` does.

    Hostile replies (docs/semantics.md, "Flower strategy"): the parameters and buffers are the server
    model's, never a reply's. A reply is dropped (counted in ``dropped``, logged) when its id is not an
    integer or repeats an id already seen (replies taken in node-id order), or its update lacks a parameter
    or has one of another shape or a complex dtype. A reply with a NaN, an Inf or an entry beyond float32's
    range is a Byzantine row (ids in ``non-finite``): the rule gives it no say. A buffer report that is
    missing, of another shape or not finite is left out of that buffer's median (counted in
    ``dropped-buffers``); a buffer changes only when more than half the round's rows report it. A round
    with fewer rows than the rule needs, or whose step is not finite, is skipped with a warning (``skipped``
    = 1): the model stays theta_t and the next round goes on.

    ``parameters``: the server model's trainable parameters (``[n for n, _ in model.named_parameters()]``,
    as `from_config` passes); None: every entry of theta_t but the BatchNorm statistics
    (`BATCHNORM_STATISTICS`), which are its buffers.

    Unweighted: a robust rule sees one update per client, whatever its number of examples (Flower's FedAvg
    weights by ``num-examples``; weighting by a self-reported count would hand a Byzantine client the vote).

    Each round's metrics (Flower's history, ``Result.train_metrics_clientapp``) carry ``lr``, ``clients``
    and, for ProDiGy, ``zeroed`` (the clients given weight 0); with an attack also ``byzantine`` (the
    attacked ids), ``zeroed-byzantine`` (the zeroed ones among them) and ``attack-param`` (the searched
    parameter, e.g. ALIE's z).

    EXPERIMENTS ONLY: ``attack`` other than ``"none"`` (with f > 0) makes the clients `byzantine` (default
    `byzantine_ids(N, f, seed)`) send what `make_attack(attack, variant, attack_params)` crafts from every
    honest reply, through the same line search against this pipeline; label flipping (``lf``) is done by
    the clients (`client_app`), so the strategy leaves their replies as they are. Only then does the
    strategy know which rows are honest: when one of them is not finite, or the step is not, the run has
    diverged (``diverged_at``) and the model stays frozen, as in `training.run`.
    """

    def __init__(
        self,
        defense: str,
        n_byzantine: int,
        n_clients: int,
        lr_at: Callable[[int], float],
        variant: str = "paper",
        defense_params: dict[str, Any] | None = None,
        attack: str = "none",
        attack_params: dict[str, Any] | None = None,
        byzantine: Sequence[int] | None = None,
        seed: int = 0,
        parameters: Sequence[str] | None = None,
        **fedavg: Any,
    ) -> None:
        fedavg = {"min_train_nodes": n_clients, "min_available_nodes": n_clients, **fedavg}
        fixed = {"fraction_train": 1.0, "min_train_nodes": n_clients, "arrayrecord_key": UPDATE_KEY}
        for name, value in fixed.items():  # what every round of the paper and `training.run` do
            if fedavg.get(name, value) != value:
                raise ValueError(
                    f"RobustStrategy: {name}={fedavg[name]!r} is not supported: every round trains all "
                    f"n_clients={n_clients} clients and reads their updates from record {UPDATE_KEY!r} "
                    f"(leave {name} at {value!r})"
                )
        super().__init__(**fedavg)
        self.n_clients = n_clients
        self.pipeline = make_aggregator(defense, n_byzantine, n_clients, variant, defense_params)
        self.lr_at = lr_at
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
        self.parameters = None if parameters is None else list(parameters)
        self.zeroed: list[list[int]] = []  # ProDiGy: the weight-0 clients of every round
        self.diverged_at: int | None = None  # the first round whose step was not finite
        self._arrays: ArrayRecord | None = None
        self._warned: set[str] = set()  # the once-a-run warnings (and checks) already given

    @classmethod
    def from_config(
        cls, config: RunConfig, byzantine: Sequence[int] | None = None, **fedavg: Any
    ) -> RobustStrategy:
        """The strategy of a `RunConfig`: its defense, attack, settings, variant, N, f and lr schedule
        (`RunConfig.lr_at`), its model's parameters; Byzantine ids drawn from its seed unless given."""
        c = config.resolved()
        parameters = [name for name, _ in make_model(c.dataset).named_parameters()]
        return cls(c.defense, c.n_byzantine, c.n_clients, c.lr_at, c.variant, c.defense_params, c.attack,
                   c.attack_params, byzantine, c.seed, parameters, **fedavg)  # fmt: skip

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        missing = [k for k in self.parameters or [] if k not in arrays]
        if missing:
            raise ValueError(f"RobustStrategy: parameters {missing} are not in the server model's arrays")
        connected = len(list(grid.get_node_ids()))
        if connected > self.n_clients:  # FedAvg would sample them all: more rows than f and the ids assume
            raise ValueError(
                f"RobustStrategy: {connected} nodes connected but n_clients={self.n_clients}: start exactly "
                "n_clients nodes, or make the strategy with n_clients equal to the nodes"
            )
        self._arrays = arrays  # theta_t, for the server step
        config["lr"] = float(self.lr_at(server_round - 1))
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, _ = self._check_and_log_replies(replies, is_train=True, validate=False)
        if self._arrays is None:
            return None, None
        theta = self._arrays.to_torch_state_dict()
        names = [k for k in theta if _is_parameter(k, self.parameters)]
        rows, kept, dropped = _read_updates(valid, {k: theta[k] for k in names})
        gamma = float(self.lr_at(server_round - 1))
        metrics = MetricRecord({"lr": gamma, "clients": len(rows)})
        if dropped:
            metrics["dropped"] = dropped
        if self.attack is not None and self.diverged_at is not None:
            return self._arrays, metrics  # an experiment's diverged run stays frozen, as in `training.run`
        try:
            if not rows:
                raise ValueError("no reply to aggregate")
            self.pipeline.check_n(len(rows))
        except ValueError as e:
            return self._skip(server_round, metrics, f"{len(rows)} usable replies: {e}")
        ids = sorted(rows)
        G = torch.stack([rows[k] for k in ids])
        finite = torch.isfinite(G).all(dim=1)
        if not bool(finite.all()):
            metrics["non-finite"] = [k for k, ok in zip(ids, finite.tolist(), strict=True) if not ok]
        honest = torch.tensor([k not in self.byzantine for k in ids]) if self.attack else finite
        if not bool(finite[honest].all()):  # experiments only: an honest row blew up
            self.diverged_at = server_round
            return self._arrays, metrics
        start = _flat(theta, names)
        self._warn_if_weights(server_round, G[finite], start)
        self.pipeline.new_round(start)  # CClip (authors) starts from theta_t, in the attack's search too
        aggregate = self.pipeline(self.server_input(G, ids, metrics))
        self._diagnostics(ids, metrics)
        new = start - gamma * aggregate
        if not bool(torch.isfinite(new).all()):
            self.diverged_at = self.diverged_at or server_round
            if self.attack is not None:
                return self._arrays, metrics
            return self._skip(server_round, metrics, "the step is not finite")
        out = dict(theta)
        out.update(_unflat(new, {k: theta[k] for k in names}))
        buffers = {k: t for k, t in theta.items() if k not in names}
        medians, bad_reports = _median_buffers([kept[k] for k in ids], buffers)
        out.update(medians)
        if bad_reports:
            metrics["dropped-buffers"] = bad_reports
        unreported = [name for name in buffers if name not in medians]
        if unreported:
            self._warn_once("buffers", f"round {server_round}: half the replies or fewer report the buffers "
                            f"{unreported} (record {BUFFERS_KEY!r}): they keep their values")  # fmt: skip
        return ArrayRecord(out), metrics

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


def _is_parameter(name: str, parameters: list[str] | None) -> bool:
    if parameters is not None:
        return name in parameters
    return name.rsplit(".", 1)[-1] not in BATCHNORM_STATISTICS


def _client_id(message: Message) -> int | None:
    """The reply's ``partition-id`` (an int; None for anything else), else its node id."""
    metrics = message.content.metric_records.get("metrics")
    if metrics is None or CLIENT_ID not in metrics:
        return int(message.metadata.src_node_id)
    value = metrics[CLIENT_ID]
    return value if isinstance(value, int) and not isinstance(value, bool) else None


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


def _read_updates(
    replies: list[Message], params: dict[str, Tensor]
) -> tuple[dict[int, Tensor], dict[int, Message], int]:
    """Each usable reply's update as a float32 row of the server's `params` (in their order), by client
    id; the replies kept, by id; and the number dropped (a non-integer or repeated id, a parameter missing
    or of another shape). Replies are read in node-id order, so the first claim of an id keeps it."""
    rows: dict[int, Tensor] = {}
    kept: dict[int, Message] = {}
    dropped = 0
    for m in sorted(replies, key=lambda m: m.metadata.src_node_id):
        k = _client_id(m)
        record = m.content.array_records.get(UPDATE_KEY)
        parts = {name: _tensor(record, name, p) for name, p in params.items()}
        why = _drop_reason(m, record, parts, k, rows)
        if why is not None:
            log(WARNING, "RobustStrategy: reply of node %s dropped: %s", m.metadata.src_node_id, why)
            dropped += 1
            continue
        rows[k] = torch.cat([t.reshape(-1).to(torch.float32) for t in parts.values()])  # type: ignore[union-attr]
        kept[k] = m
    return rows, kept, dropped


def _drop_reason(
    m: Message, record: Any, parts: dict[str, Tensor | None], k: int | None, rows: dict[int, Tensor]
) -> str | None:
    """Why `_read_updates` drops a reply (its update record, its parameters as read, its client id), or
    None when it is usable."""
    if record is None:
        return f"no ArrayRecord {UPDATE_KEY!r} (it has {sorted(m.content.array_records)})"
    missing = [name for name, t in parts.items() if t is None]
    if missing:
        return f"its update lacks {missing} or has them of another shape"
    if k is None:
        return f"client id {k!r} is not an integer"
    return f"client id {k} came already" if k in rows else None


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
    round), the Byzantine ids and Flower's own `Result` (per-round metrics)."""

    result: RunResult
    byzantine: list[int]
    history: Result


def simulate(
    configs: Sequence[RunConfig],
    byzantine: Sequence[int] | None = None,
    num_cpus: int | None = None,
) -> list[FlowerRun]:
    """Train `configs` one after the other in one Flower simulation (`flwr.simulation.run_simulation`: one
    Ray start for all) of N = ``configs[0].n_clients`` clients (`client_app`, `RobustStrategy`); the
    configs must share N and the data split. The server model starts as `prodigy_core.training.run`'s
    (``seed_everything(seed)`` then the dataset's model) and is evaluated as there (`evaluate` every
    ``eval_every`` rounds and after the last, on the whole test set). ``byzantine``: the attacked ids
    (default `byzantine_ids(N, f, seed)` per config). ``num_cpus``: Ray's CPUs, one client at a time per
    CPU (default: all of them)."""
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
    strategies = [RobustStrategy.from_config(c, byzantine, fraction_evaluate=0.0) for c in resolved]
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
    if strategy.diverged_at is not None:
        result.diverged, result.diverged_at = True, strategy.diverged_at
        result.final_accuracy, result.final_loss = diverged_accuracy(fed, resolved.variant), None
    return FlowerRun(result, strategy.byzantine, history)


__all__ = ["RobustStrategy", "byzantine_ids", "client_app", "simulate", "FlowerRun"]
