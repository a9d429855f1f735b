"""Federated training of one run: the ProDiGy paper's Algorithm 1 with local momentum, its server side here,
the clients' local steps in `prodigy_core.local_training`, the test in `prodigy_core.evaluation`.

Entry points: `run` (a `RunConfig` trained to its `RunResult`; its docstring states one round, the spec of
Algorithm 1). `run`'s steps, `start_run`,
`server_round`, `end_round` and `finish_run`, are shared with `prodigy_core.groups`, which trains several
runs in one batched step. ``variant="authors"`` follows the authors' public code where it departs from the
paper's text (docs/semantics.md).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import platform
import random
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from tqdm.auto import tqdm

import prodigy_core
from prodigy_core.aggregators import Pipeline, ProDiGy, make_aggregator, pairwise_sq_distances
from prodigy_core.attacks import Attack, idle_byzantine, make_attack, recorded_param
from prodigy_core.config import SPLIT_FIELDS, ConfigError, RunConfig
from prodigy_core.data import Federation, load_federation
from prodigy_core.evaluation import diverged_accuracy, eval_due, eval_settings, evaluate
from prodigy_core.local_training import (
    AuthorsBatchStream,
    local_steps_batched,
    local_steps_sequential,
    make_batch_stream,
    per_client_grad,
    pick_engine,
)
from prodigy_core.models import count_parameters, make_model
from prodigy_core.names import NO_ATTACK
from prodigy_core.registry import label, loaded_hash
from prodigy_core.results import check_writable
from prodigy_core.safe_io import atomic_write, quarantine
from prodigy_core.seeding import precision_flags, precision_mode, resolve_device, seed_everything
from prodigy_core.streams import ClientStreams


@dataclass
class RunResult:
    """Everything a run reports; `to_dict()` is JSON-safe (non-finite floats become None)."""

    config: dict[str, Any]
    final_accuracy: float  # percent, 0-100
    final_loss: float | None  # mean test cross-entropy; None when diverged
    accuracy_curve: list[list[float]] = field(default_factory=list)  # [round, accuracy %]
    round_times: list[float] = field(default_factory=list)  # seconds per round (training + aggregation)
    # seconds of local steps, attack craft, aggregation, evaluation, the rest, over all rounds (`PhaseTimer`)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    attack_params: list[float | list[float] | None] = field(default_factory=list)  # last_param per round
    zeroed_clients: list[list[int]] = field(default_factory=list)  # ProDiGy: weight-0 clients per round
    detection_precision: float | None = None
    detection_recall: float | None = None
    diverged: bool = False
    diverged_at: int | None = None  # round at which the model became non-finite
    rounds_completed: int = 0
    distance_matrices: dict[int, list[list[float | None]]] = field(default_factory=dict)  # {round: N x N}
    environment: dict[str, Any] = field(default_factory=dict)
    stand_in: str | None = None  # set by callers that ran a stand-in for the paper's setting
    plugins: dict[str, str] = field(default_factory=dict)  # plug-in spec -> its file's hash (in the key too)
    # ``authors``: the test loss their server prints at the last evaluation, sum of the test batches' mean
    # cross-entropies / test-set size (server.py:63-67; about final_loss / b); None under ``paper``.
    authors_test_loss: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return _json_safe(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunResult:
        d = dict(d)
        if d.get("final_accuracy") is None:  # JSON-safe None: not evaluated yet (or diverged)
            d["final_accuracy"] = float("nan")
        d["distance_matrices"] = {int(r): m for r, m in d.get("distance_matrices", {}).items()}
        return cls(**d)


PHASES = ("local", "craft", "aggregate", "eval", "rest")  # `RunResult.phase_seconds`


class PhaseTimer:
    """Where a run's rounds go (issue 41): the seconds of its local steps, attack craft, aggregation,
    evaluation and the rest of its rounds, each summed over the rounds into `totals` (`phase_seconds`).

    `lap(phase)` adds the span since the last mark to `phase`, so the laps of a round tile it. On a GPU a mark
    is a CUDA event and the spans are read only by `settle` (before a checkpoint or the record), after the
    waits those already make: timing adds no wait for the device. On a CPU a mark is `time.perf_counter()`.
    `add(..., share)` counts a share of a span that several runs of a group shared (`prodigy_core.groups`).
    No number of the run depends on it."""

    def __init__(self, device: torch.device, totals: dict[str, float]) -> None:
        self.cuda = device.type == "cuda"
        self.totals = totals
        for phase in PHASES:
            totals.setdefault(phase, 0.0)
        self.pending: list[tuple[str, Any, Any, float]] = []  # (phase, start event, end event, share)
        self.last = self.mark()

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def restart(self) -> None:
        """The next lap starts now."""
        self.last = self.mark()

    def add(self, phase: str, start: Any, end: Any, share: float = 1.0) -> None:
        if not self.cuda:
            self.totals[phase] += (end - start) * share
            return
        self.pending.append((phase, start, end, share))
        if len(self.pending) >= 1024:  # read the spans already done (`query` does not wait), free them
            done = 0
            while done < len(self.pending) and self.pending[done][2].query():
                phase, start, end, share = self.pending[done]
                self.totals[phase] += start.elapsed_time(end) / 1000 * share
                done += 1
            del self.pending[:done]

    def lap(self, phase: str) -> None:
        now = self.mark()
        self.add(phase, self.last, now)
        self.last = now

    def settle(self) -> dict[str, float]:
        """The totals, the pending CUDA spans read in (a wait for the last of them only)."""
        if self.pending:
            self.pending[-1][2].synchronize()
            for phase, start, end, share in self.pending:
                self.totals[phase] += start.elapsed_time(end) / 1000 * share
            self.pending.clear()
        return self.totals


# Tests only: `run` returns after this round (`groups.iter_group` after this step of its group) without
# finishing, as if the process had been killed there, its checkpoint left as it was (`killed_after`).
_KILLED_AFTER: int | None = None


@contextlib.contextmanager
def killed_after(r: int) -> Iterator[None]:
    """Tests only: inside the block, a run stops after round r (a group after step r) as if killed."""
    global _KILLED_AFTER
    before, _KILLED_AFTER = _KILLED_AFTER, r
    try:
        yield
    finally:
        _KILLED_AFTER = before


def run(
    config: RunConfig,
    *,
    progress: bool = True,
    checkpoint_dir: str | Path | None = None,
    resume: bool = True,
    on_round: Callable[..., None] | None = None,
    keep_checkpoint: bool = False,
    sync_timing: bool = False,
) -> RunResult:
    """Train one federated run described by `config` and return its `RunResult`.

    One round t (0-indexed internally; round r = t + 1 everywhere in `RunResult` and in
    `config.record_distances_at`, so round 1 is the first server step):

    1. every client k starts from the server model theta_t and runs E local SGD steps at lr gamma_t on
       batches of b = min(batch_size, |D_k|) samples drawn anew without replacement at every step
       (``paper``; ``authors``: `AuthorsBatchStream`), with weight decay in the step
       (g <- grad + wd * theta; theta <- theta - gamma_t g) and no client-side SGD momentum;
    2. it forms the pseudo-gradient g_t^k = (theta_t - theta_t^{k,(E)}) / gamma_t and its local momentum
       m_t^k = beta m_{t-1}^k + (1 - beta) g_t^k, m_{-1}^k = 0 (beta = `local_momentum`; m_t = g_t when
       beta = 0), kept for ALL clients: a sign-flipping client keeps its honest momentum, the attack negates
       what is sent;
    3. Byzantine clients are ids 0..f-1: the attack replaces their rows, `attack.craft(m[f:], m[:f],
       pipeline)` (label flipping instead trains them on y' = C-1-y and sends their honest-looking
       momentum), see `server_input`; the pipeline is first told theta_t (`Pipeline.new_round`: CClip's
       start under the ``authors`` variant, in the attack's search too). Under an attack that never reads
       m[:f] (`Attack.needs_own`: ALIE, FOE, ...) the Byzantine clients skip step 1: they keep theta_t, so
       their pseudo-gradient is 0 and they report the server's BatchNorm buffers (`RunState.idle`);
    4. the server computes theta_{t+1} = theta_t - gamma_t Agg(m_t^1..m_t^N) with gamma_t =
       `config.lr_at(t)`, and sets its BatchNorm buffers to the median of the clients' reports
       (`_set_server_buffers`).

    The update vector holds the trainable parameters only (BatchNorm buffers and `num_batches_tracked` are
    not part of it). Step 1 is `local_steps_stacked` (or the sequential reference, see `pick_engine`),
    2-4 `server_round`; `end_round` evaluates and checkpoints, `finish_run` makes the record (divergence,
    ProDiGy's detection).

    ``variant="authors"`` (the authors' public code) changes, besides the rules and SF (see
    `make_aggregator`, `make_attack`): every client's batches come from its own epoch shuffles, b =
    batch_size consecutive samples per step, the last partial batch of an epoch dropped, the position
    carried across rounds and checkpointed (`AuthorsBatchStream`, client.py's cycled DataLoader with
    drop_last=True), and a client with fewer than batch_size samples stops the run before it starts
    (`ClientTooSmallError`: the authors' code would never return); evaluation runs the network in training
    mode in test batches of b (`eval_settings`), a run stops at the first evaluation whose test loss is NaN
    and keeps that evaluation's accuracy, and a run whose model became non-finite scores the share of class
    0 in the test set (what argmax gives on NaN logits).

    `checkpoint_dir`: save a checkpoint every `config.checkpoint_every` rounds and resume from it when one
    for the same `config.key()` exists (`resume=False`: ignore it and start from round 0, replacing it at
    the next checkpoint; an unreadable one is moved aside and the run starts from round 0; what a
    checkpoint holds: `start_run`). `keep_checkpoint`: leave the checkpoint of a completed run for the
    caller to delete once it has stored the record (`results.save_record` does), so that a record that
    cannot be written loses no work.
    `on_round(r, updates, momentum, pipeline, attack)`, if given, is called every round once the server's
    input `updates` is formed and before it is aggregated
    (`momentum`: what every client would honestly send, 0 for idle Byzantine clients: `RunState.idle`;
    attack None without one); it must not modify them
    (used by `prodigy_core.explorer.explore`).
    `sync_timing`: wait for a GPU at the end of every round, so that each of `round_times` holds its own
    round's device time (benchmarks); otherwise a round's time runs to its last wait for the device (at
    least the momentum check after its local steps) and what is still queued then counts in the next one.
    """
    if not isinstance(config, RunConfig):
        raise TypeError(f"run() takes a RunConfig, got {type(config).__name__}; use RunConfig.from_dict(d)")
    resolved = config.resolved()
    device = resolve_device(resolved.device)
    engine = pick_engine(resolved.engine, device, resolved.dataset)
    st = start_run(config, device, engine, checkpoint_dir, resume=resume)
    if engine == "sequential":
        local_steps = functools.partial(local_steps_sequential, idle=st.idle)
    else:  # one gradient function for the whole run (a compiled one: for every run of this process)
        grad_fn = per_client_grad(st.model, engine=engine)
        local_steps = functools.partial(local_steps_batched, grad_fn=grad_fn, idle=st.idle)

    bar = tqdm(total=resolved.rounds, initial=st.start, disable=not progress, unit="round",
               desc=f"{resolved.dataset} {label(resolved.defense, resolved.defense_params)}/"
                    f"{label(resolved.attack, resolved.attack_params)}")  # fmt: skip
    with bar:  # closed before an error propagates, so that the message starts on a line of its own
        for r in range(st.start + 1, resolved.rounds + 1):
            tic = time.perf_counter()
            st.timer.restart()
            gamma = resolved.lr_at(r - 1)
            with precision_mode(resolved.precision, device):
                pseudo_grads, client_buffers = local_steps(
                    st.model, st.fed, resolved.local_steps, gamma, resolved, st.streams, stream=st.stream
                )
            st.timer.lap("local")
            if not server_round(st, r, gamma, pseudo_grads, client_buffers, on_round):
                break
            if sync_timing and device.type == "cuda":
                torch.cuda.synchronize(device)
            st.result.round_times.append(time.perf_counter() - tic)
            if not end_round(st, r):
                break
            bar.set_postfix(lr=gamma, acc=f"{st.result.final_accuracy:.1f}", refresh=False)
            bar.update(1)
            if r == _KILLED_AFTER:
                return st.result
    return finish_run(st, keep_checkpoint)


# ------------------------------------------------------------------------------------------- one run's state
@dataclass
class RunState:
    """One run between two rounds: what its rounds read and write and what its checkpoint holds. `run` keeps
    one; `prodigy_core.groups` keeps one per run of a group and calls the same step functions."""

    config: RunConfig  # as given: its key names the checkpoint and the record
    resolved: RunConfig  # config.resolved(): the fields every round reads
    fed: Federation  # this run's (label-flipped clients included)
    model: nn.Module  # the server model
    pipeline: Pipeline
    attack: Attack | None
    streams: ClientStreams  # every client's batches, augmentation and dropout masks
    momentum: Tensor  # (N, d) local momentum of every client
    result: RunResult
    ckpt: Path | None
    start: int = 0  # rounds already done (restored from the checkpoint)
    byzantine_zeroed: int = 0  # ProDiGy: zeroed clients that are Byzantine, summed over rounds
    stopped_at_nan_loss: bool = False  # authors: diverged at an evaluation, whose accuracy the record keeps
    stream: AuthorsBatchStream | None = None  # authors: the clients' batch stream (`make_batch_stream`)
    step_finite: Tensor | None = None  # the last server step's all-finite flag, unread (`server_round`)
    timer: PhaseTimer | None = None  # where its rounds go, into result.phase_seconds (set by `start_run`)
    idle: int = 0  # clients 0..idle-1 do not train (`attacks.idle_byzantine`)


# glibc's malloc options (mallopt's parameter numbers) and the values `keep_freed_memory` sets
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEEP_FREED_BYTES = {M_TRIM_THRESHOLD: 512 * 2**20, M_MMAP_THRESHOLD: 32 * 2**20}  # 32 MiB: glibc's maximum


@functools.cache
def keep_freed_memory() -> bool:
    """Have glibc's malloc keep the memory a training step frees, once per process: True where it did.

    By default glibc serves blocks above its mmap threshold (128 KiB, raised only as such blocks are freed)
    from fresh mappings and trims the heap's free top above 128 KiB, so every local step's activations
    page-fault in anew; raising both thresholds (mallopt: the heap keeps up to 512 MiB free, blocks up to
    32 MiB come from it) keeps them (the faults and the time they cost: docs/timings.md). Memory placement
    only: no number changes. Elsewhere than glibc (macOS, Windows, musl) it does nothing."""
    import ctypes
    import ctypes.util

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return all(libc.mallopt(option, value) == 1 for option, value in KEEP_FREED_BYTES.items())
    except (OSError, AttributeError):
        return False


def start_run(
    config: RunConfig,
    device: torch.device,
    engine: str,
    checkpoint_dir: str | Path | None = None,
    fed: Federation | None = None,
    resume: bool = True,
) -> RunState:
    """A run's state before its first round to do: seeded model, pipeline, attack, streams, resumed from
    its checkpoint in `checkpoint_dir` when one exists (not with `resume=False`; an unreadable one is moved
    aside with a warning and the state starts at round 0). `fed`: the run's federation when the caller
    already loaded it (it is not modified: label flipping works on a shallow copy).

    Checkpoints (every `checkpoint_every` rounds when `checkpoint_dir` is given, named `<config.key()>.pt`,
    written by `end_round`) hold the model, the momentum, the pipeline state, every RNG state, the clients'
    streams and
    (``authors``) the batch stream, so a resumed run reproduces the uninterrupted one; the checkpoint is
    deleted when the run completes. They hold tensors and plain Python values only and are read with
    `torch.load(weights_only=True)`, so a crafted file on a shared disk cannot run code; a checkpoint that
    cannot be read or restored (garbage, truncated, crafted, another version's) is named in a warning, moved
    aside (`safe_io.quarantine`) and the run restarts from round 0."""
    resolved = config.resolved()
    n, f = resolved.n_clients, resolved.n_byzantine
    if torch.is_autocast_enabled(device.type):  # it would reach every round, the server side included
        raise ConfigError(
            f"this run is inside torch.autocast on {device.type}: a run sets its own arithmetic from its "
            f"precision={resolved.precision} (part of its key); start it outside the autocast block, and set "
            "precision=bf16 for bfloat16"
        )
    keep_freed_memory()
    fed = loaded = run_federation(resolved, device) if fed is None else fed
    stream = make_batch_stream(resolved, fed)  # before anything else: a too small authors client stops here
    seed_everything(resolved.seed)
    model = make_model(resolved.dataset).to(device).train()
    pipeline = make_aggregator(resolved.defense, f, n, resolved.variant, resolved.defense_params)
    attack, streams = None, ClientStreams(resolved.seed, n)
    if f > 0 and resolved.attack != NO_ATTACK:
        attack = make_attack(resolved.attack, variant=resolved.variant, params=resolved.attack_params)
        if getattr(attack, "generator", False) is None:  # its draws (gaussian): the run's CPU stream
            attack.generator = streams.attack
        if attack.flips_labels:
            fed = copy.copy(fed)  # flip_labels replaces the copy's label tensor, never the shared one
            fed.flip_labels(range(f))
    momentum = torch.zeros(n, count_parameters(model), device=device)
    # the record names the data source used (resolved: same key as `config`)
    recorded = config.replace(data_source=fed.source).to_dict()
    result = RunResult(config=recorded, final_accuracy=float("nan"), final_loss=None)
    try:
        result.environment = _environment(device, engine, resolved.precision)
    except ValueError as e:  # seeding.precision_mode: tf32 on a CPU
        raise ConfigError(str(e)) from None
    result.plugins = plugin_hashes(resolved)  # the code built above: the record's key names it
    key = config.key(code=result.plugins)
    ckpt = Path(checkpoint_dir) / f"{key}.pt" if checkpoint_dir is not None else None
    if ckpt is not None:  # before round 1, not at the first checkpoint or the run's end
        check_writable(ckpt.parent, "checkpoints", "pass checkpoint_dir")
    st = RunState(
        config, resolved, fed, model, pipeline, attack, streams, momentum, result, ckpt, stream=stream,
        idle=idle_byzantine(resolved.attack, f, resolved.variant, resolved.attack_params),
    )  # fmt: skip
    if resume and ckpt is not None and ckpt.exists():
        try:
            state = torch.load(ckpt, map_location=device, weights_only=True)
            if state["key"] != key:
                raise ValueError(f"it belongs to another config ({state['key']} != {key})")
            st.start, saved = int(state["round"]), state["momentum"]
            if not 0 < st.start < resolved.rounds or saved.shape != momentum.shape:
                raise ValueError(f"round {st.start} or momentum shape {tuple(saved.shape)} does not fit")
            st.momentum = saved.to(device)
            model.load_state_dict(state["model"])
            pipeline.load_state_dict(state["pipeline"])
            st.result = RunResult.from_dict(state["result"])
            # the record names this process's environment, and the ones its earlier rounds ran in
            before = dict(st.result.environment or {})
            earlier = [*before.pop("earlier", []), {**before, "until_round": st.start}]
            st.result.environment = {**result.environment, "earlier": earlier}
            st.byzantine_zeroed = int(state["hits"])
            set_rng_states(state["rng"])
            streams.load_state_dict(state["streams"])
            if stream is not None:
                stream.load_state_dict(state["batch_stream"])
        except Exception as e:  # whatever is wrong with it, the run is still there to be done from scratch
            moved, why = quarantine(ckpt, "unreadable"), str(e).split("\n")[0][:200]
            warnings.warn(
                f"checkpoint {ckpt} cannot be resumed ({type(e).__name__}: {why}); "
                f"moved to {moved.name}, the run restarts from round 0",
                RuntimeWarning,
                stacklevel=4,  # the caller of `run` (start_run < _run < run) or of `groups.iter_group`
            )
            return start_run(config, device, engine, checkpoint_dir, loaded, resume=False)
    st.timer = PhaseTimer(device, st.result.phase_seconds)
    return st


def server_round(
    st: RunState,
    r: int,
    gamma: float,
    pseudo_grads: Tensor,
    client_buffers: dict[str, Tensor],
    on_round: Callable[..., None] | None = None,
) -> bool:
    """Steps 2-4 of round r from the clients' pseudo-gradients (N, d) and BatchNorm reports: momentum, attack,
    aggregation, server step. Returns False when the run diverged (recorded in `st.result`).

    Divergence: the run stops at round r when the honest momentum or the new model is not finite. Reading
    either flag is a wait for a GPU, so the model's flag of a round that ends with no evaluation, checkpoint
    or end of the run is read with the next round's momentum check, in one wait; when it is bad, the run is
    recorded exactly as a check at once would have: diverged at that round (its round time dropped), before
    this round's attack. Only the model object differs: it holds the non-finite step instead of the last
    finite one (no record reads it)."""
    resolved, result, f, beta = st.resolved, st.result, st.resolved.n_byzantine, st.resolved.local_momentum
    st.momentum = momentum = local_momentum(st.momentum, pseudo_grads, beta)
    honest_finite = torch.isfinite(momentum[f:]).all()
    if st.step_finite is not None:  # the last round's server step, unread until now
        step_finite, honest_finite = torch.stack([st.step_finite, honest_finite]).tolist()
        st.step_finite = None
        if not step_finite:
            result.round_times.pop()
            result.diverged, result.diverged_at, result.rounds_completed = True, r - 1, r - 1
            return False
    if not honest_finite:  # honest training blew up: the model has diverged
        result.diverged, result.diverged_at, result.rounds_completed = True, r, r
        return False
    st.pipeline.new_round(parameters_to_vector(st.model.parameters()).detach())
    st.timer.lap("rest")
    updates = server_input(momentum, f, st.attack, st.pipeline)
    st.timer.lap("craft")
    result.attack_params.append(None if st.attack is None else recorded_param(st.attack.last_param))
    if r in resolved.record_distances_at:
        result.distance_matrices[r] = pairwise_sq_distances(updates).tolist()
    if on_round is not None:
        on_round(r, updates, momentum, st.pipeline, st.attack)
    st.timer.lap("rest")
    aggregate = st.pipeline(updates, gram=getattr(st.attack, "last_gram", None))  # the search's, if any
    st.timer.lap("aggregate")
    rule = st.pipeline.rule
    if isinstance(rule, ProDiGy) and len(rule.last_scores.weight) == resolved.n_clients:
        zeroed = torch.nonzero(rule.last_scores.weight == 0).flatten().tolist()
        result.zeroed_clients.append(zeroed)
        st.byzantine_zeroed += sum(k < f for k in zeroed)
    theta = parameters_to_vector(st.model.parameters()) - gamma * aggregate
    result.rounds_completed = r
    step_finite = torch.isfinite(theta).all()
    saves = st.ckpt is not None and r % resolved.checkpoint_every == 0
    if not (eval_due(resolved, r) or saves):  # eval_due covers the last round
        st.step_finite = step_finite  # read with the next round's check
    elif not step_finite:
        result.diverged, result.diverged_at = True, r
        return False
    vector_to_parameters(theta, st.model.parameters())
    _set_server_buffers(st.model, client_buffers)
    st.timer.lap("rest")
    return True


def end_round(st: RunState, r: int, scores: tuple[float, float, float] | None = None) -> bool:
    """After round r's server step: evaluate when due (`eval_due`), save the checkpoint when due. Returns
    False when the run diverged (``authors``: a test loss that is not finite; recorded in `st.result`).
    `scores`: the due evaluation's `evaluate_runs` triple when the caller made it (`groups`: all members in
    one pass); None: evaluated here."""
    resolved, result = st.resolved, st.result
    if eval_due(resolved, r):
        if scores is None:
            st.timer.lap("rest")
            train_mode, batch_size = eval_settings(resolved)
            with precision_mode(resolved.precision, st.momentum.device):
                scores = evaluate(st.model, st.fed, batch_size, train_mode, st.streams.eval_key(r))
            st.timer.lap("eval")
        result.final_accuracy, result.final_loss = scores[:2]
        if resolved.variant == "authors":
            result.authors_test_loss = scores[2]
        result.accuracy_curve.append([r, result.final_accuracy])
        # The authors' code stops at a NaN test loss and repeats that evaluation's accuracy (what argmax gave
        # on that network); an infinite loss goes on.
        if resolved.variant == "authors" and math.isnan(result.final_loss):
            result.diverged, result.diverged_at, st.stopped_at_nan_loss = True, r, True
            return False
    if st.ckpt is not None and r % resolved.checkpoint_every == 0 and r < resolved.rounds:
        st.timer.lap("rest")
        st.timer.settle()  # into result.phase_seconds, which the checkpoint keeps
        state = {"key": st.ckpt.stem, "round": r, "model": st.model.state_dict(), "momentum": st.momentum,
                 "pipeline": st.pipeline.state_dict(), "result": result.to_dict(),
                 "hits": st.byzantine_zeroed,  # the checkpoint's name for it
                 "rng": get_rng_states(), "streams": st.streams.state_dict()}  # fmt: skip
        if st.stream is not None:  # authors: every client's epoch order and position
            state["batch_stream"] = st.stream.state_dict()
        try:
            with atomic_write(st.ckpt, "wb") as fh:  # a kill never leaves a half-written checkpoint
                torch.save(state, fh)
        except RuntimeError as e:  # torch reports a failed write (a full disk) as a RuntimeError
            raise OSError(f"cannot write the checkpoint {st.ckpt}: {str(e).splitlines()[0]}") from e
    st.timer.lap("rest")
    return True


def finish_run(st: RunState, keep_checkpoint: bool = False) -> RunResult:
    """The final record once the run completed or diverged; its checkpoint is deleted (kept with
    keep_checkpoint: the caller deletes it once the record is stored).

    A run whose aggregate or model becomes non-finite (under ``authors`` also: whose test loss is NaN) stops
    with its model frozen and is recorded as diverged, with no loss and the accuracy `diverged_accuracy`:
    chance level 100 / num_classes (``paper``), or what a NaN network predicts in the authors' code, class 0
    for every sample (argmax of NaN logits), i.e. the share of class 0 in the test set; an ``authors`` run
    stopped by a NaN test loss keeps the accuracy that evaluation measured.

    ProDiGy detection: when the rule is `ProDiGy` and its scores have one entry per client, the clients with
    weight 0 are logged each round (`server_round`). Precision and recall against the true Byzantine ids
    {0..f-1} are micro-averaged over rounds: precision = sum_t |Z_t & B| / sum_t |Z_t|, recall = sum_t
    |Z_t & B| / (T f)."""
    result, f = st.result, st.resolved.n_byzantine
    st.timer.settle()
    if result.diverged:
        if not st.stopped_at_nan_loss:
            result.final_accuracy = diverged_accuracy(st.fed, st.resolved.variant)
        result.final_loss = result.authors_test_loss = None
    if result.zeroed_clients and f > 0:
        flagged = sum(len(z) for z in result.zeroed_clients)
        result.detection_precision = st.byzantine_zeroed / flagged if flagged else None
        result.detection_recall = st.byzantine_zeroed / (len(result.zeroed_clients) * f)
    if st.ckpt is not None and not keep_checkpoint:
        st.ckpt.unlink(missing_ok=True)
    return result


def local_momentum(momentum: Tensor, pseudo_grads: Tensor, beta: float) -> Tensor:
    """Every client's local momentum m_t = beta m_{t-1} + (1 - beta) g_t, (N, d); m_t = g_t when beta = 0."""
    return pseudo_grads if beta == 0 else beta * momentum + (1 - beta) * pseudo_grads


def server_input(momentum: Tensor, f: int, attack: Attack | None, pipeline: Pipeline) -> Tensor:
    """The (N, d) vectors the server receives: the attack's rows for clients 0..f-1 (crafted from the honest
    clients' momentum[f:] and their own momentum[:f]), then the honest clients' momentum; ``momentum`` when
    there is no attack. An attack with ``sent_is_momentum`` (SF under ``authors``) writes what it sent into
    momentum[:f] in place, so that those clients' next momentum is beta s_t + (1 - beta) g_{t+1}. The honest
    momentum must be finite (`server_round` checks it)."""
    if attack is None:
        return momentum
    byzantine = attack.craft(momentum[f:], momentum[:f], pipeline, honest_finite=True).to(momentum.dtype)
    if attack.sent_is_momentum:
        momentum[:f] = byzantine
    return torch.cat([byzantine, momentum[f:]])


def _set_server_buffers(model: nn.Module, client_buffers: dict[str, Tensor]) -> None:
    """Server BatchNorm statistics = coordinate-wise median of the clients' reports (robust for f < N/2).

    Each client starts a round from the server's buffers and updates its own copy during its local steps
    (per-client buffers, stacked along the client axis in the batched engine). The server then sets each
    floating-point buffer to the coordinate-wise median of the N reported buffers (mean of the two middle
    values for even N). Since f < N/2, the median lies within the range of the honest reports whatever the
    Byzantine clients report (in this simulation they report the statistics of their own honest or
    label-flipped training, or the server's own buffers when their attack lets them skip training:
    `RunState.idle`; the attack model only crafts the update vector). The authors' code never sends
    the buffers and evaluates in training mode; we evaluate in eval mode under `no_grad`
    (``variant="paper"``).
    """
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(median_report(client_buffers[name]))


def median_report(reports: Tensor) -> Tensor:
    """The coordinate-wise median of N clients' reports of one buffer (N, ...): the mean of the two middle
    values for even N when floating point, the lower one for integers (`num_batches_tracked`)."""
    if reports.is_floating_point():
        return torch.quantile(reports, 0.5, dim=0)
    return reports.median(dim=0).values


# ---------------------------------------------------------------------------------------------- helpers
# `shared_federations`: the federations loaded so far in this process, by their split's fields (None: off)
_SHARED: dict[tuple, Federation] | None = None


@contextlib.contextmanager
def shared_federations() -> Iterator[None]:
    """Inside the block, every run and group of this process that needs a federation already loaded gets
    that one (a run never modifies it: label flipping works on a copy), so a GPU window loads each data set
    once (`benchmarks/gpu_run.py`); the loaded ones are dropped after it."""
    global _SHARED
    before, _SHARED = _SHARED, {}
    try:
        yield
    finally:
        _SHARED = before


def run_federation(resolved: RunConfig, device: torch.device) -> Federation:
    """The run's federation from `config.resolved()`: the data source its key was computed with (the one
    already loaded inside `shared_federations`)."""
    if _SHARED is None:
        return _read_federation(resolved, device)
    key = (*(getattr(resolved, name) for name in (*SPLIT_FIELDS, "variant")), str(device))
    if key not in _SHARED:
        _SHARED[key] = _read_federation(resolved, device)
    return _SHARED[key]


def _read_federation(resolved: RunConfig, device: torch.device) -> Federation:
    return load_federation(resolved.dataset, resolved.n_clients, distribution=resolved.distribution,
                           dirichlet_alpha=resolved.dirichlet_alpha, seed=resolved.data_seed, device=device,
                           data_dir=resolved.data_dir, download=resolved.download,
                           min_writer_samples=resolved.femnist_min_writer_samples,
                           source=resolved.data_source, variant=resolved.variant)  # fmt: skip


def plugin_hashes(config: RunConfig) -> dict[str, str]:
    """{spec: code hash} of the run's plug-in defense and attack as built (`registry.loaded_hash`; the
    `registry.plugin_hash` its key takes unless the code changed on disk since it was loaded)."""
    return {spec: loaded_hash(spec, name) for name, spec in config.plugin_specs().items()}


def _environment(device: torch.device, engine: str, precision: str = "fp32") -> dict[str, Any]:
    """The record's `environment`: what a run's last bits depend on besides its config: torch, the thread
    count and the CPU kernels torch picked (`cpu_capability`: e.g. AVX2, AVX512), the GPU, and the precision
    with the flags its local steps and evaluations run under (`seeding.precision_mode`)."""
    env = {"device": str(device), "engine": engine, "torch": str(torch.__version__),
           "prodigy_fl": prodigy_core.__version__, "python": platform.python_version(),
           "threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "precision": precision}  # fmt: skip
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    with precision_mode(precision, device):
        env.update(precision_flags(device))
    return env


def get_rng_states() -> dict[str, Any]:
    """Every global RNG state as tensors and plain Python values (what `torch.load(weights_only=True)`
    reads)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    states = {"torch": torch.get_rng_state(), "python": random.getstate(),
              "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)]}  # fmt: skip
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore the global RNG states that `get_rng_states` took."""
    torch.set_rng_state(states["torch"].cpu())
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in states["cuda"]])


def _json_safe(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


__all__ = ["RunResult", "run", "local_momentum", "server_input"]
