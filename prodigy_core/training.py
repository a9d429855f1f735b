"""Federated training of one run: the ProDiGy paper's Algorithm 1 with local momentum, all N clients' local
steps as one batched computation.

Entry points: `run` (a `RunConfig` trained to its `RunResult`; its docstring states one round, the spec of
Algorithm 1), `evaluate` / `evaluate_runs` (test accuracy and loss). `run`'s steps, `start_run`,
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
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from tqdm.auto import tqdm

import prodigy_core
from prodigy_core import step_variants
from prodigy_core.aggregators import Pipeline, ProDiGy, make_aggregator, pairwise_sq_distances
from prodigy_core.attacks import Attack, idle_byzantine, make_attack
from prodigy_core.config import ConfigError, RunConfig
from prodigy_core.data import Federation, load_federation
from prodigy_core.models import make_model
from prodigy_core.registry import label, loaded_hash
from prodigy_core.safe_io import atomic_write, quarantine
from prodigy_core.seeding import precision_flags, precision_mode, resolve_device, seed_everything
from prodigy_core.streams import ClientStreams, dropout_mask

# engine="auto" on a CPU, per dataset: the faster engine by benchmarks/training.py (its numbers:
# benchmarks/README.md, "training.py: the `auto` engine on a CPU"). Tests pin engine="batched" where they test
# that path.
AUTO_CPU_ENGINE = {"digits": "channels_last", "femnist": "sequential", "cifar10": "sequential"}
# Test batch size of the paper variant: eval mode gives every batch size the same numbers. (The authors' test
# loader takes the clients' batch size: `eval_settings`.)
EVAL_BATCH_SIZE = 1000
# Training-mode evaluation (``authors``): test images per stacked forward pass, over all the models evaluated
# together (`evaluate_runs`): 10,000 (one CIFAR-10 test set) is about 2.7 GB of CIFAR-10 activations.
EVAL_PASS_IMAGES = 10_000


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
    attack_params: list[float | None] = field(default_factory=list)  # attack.last_param per round
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
        local_steps = functools.partial(_local_steps_sequential, idle=st.idle)
    else:  # one gradient function for the whole run (a compiled one: for every run of this process)
        grad_fn = per_client_grad(st.model, engine=engine)
        local_steps = functools.partial(_local_steps_batched, grad_fn=grad_fn, idle=st.idle)

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
    hits: int = 0  # ProDiGy: zeroed clients that are Byzantine, summed over rounds
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
    keep_freed_memory()
    fed = loaded = _load_federation(resolved, device) if fed is None else fed
    stream = make_batch_stream(resolved, fed)  # before anything else: a too small authors client stops here
    seed_everything(resolved.seed)
    model = make_model(resolved.dataset).to(device).train()
    pipeline = make_aggregator(resolved.defense, f, n, resolved.variant, resolved.defense_params)
    attack, streams = None, ClientStreams(resolved.seed, n)
    if f > 0 and resolved.attack != "none":
        attack = make_attack(resolved.attack, variant=resolved.variant, params=resolved.attack_params)
        if getattr(attack, "generator", False) is None:  # its draws (gaussian): the run's CPU stream
            attack.generator = streams.attack
        if attack.flips_labels:
            fed = copy.copy(fed)  # flip_labels replaces the copy's label tensor, never the shared one
            fed.flip_labels(range(f))
    momentum = torch.zeros(n, sum(p.numel() for p in model.parameters()), device=device)
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
            st.hits = int(state["hits"])
            _set_rng_states(state["rng"])
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
    result.attack_params.append(None if st.attack is None else _as_float(st.attack.last_param))
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
        st.hits += sum(k < f for k in zeroed)
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
                 "pipeline": st.pipeline.state_dict(), "result": result.to_dict(), "hits": st.hits,
                 "rng": _get_rng_states(), "streams": st.streams.state_dict()}  # fmt: skip
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
        result.detection_precision = st.hits / flagged if flagged else None
        result.detection_recall = st.hits / (len(result.zeroed_clients) * f)
    if st.ckpt is not None and not keep_checkpoint:
        st.ckpt.unlink(missing_ok=True)
    return result


def pick_engine(engine: str, device: torch.device, dataset: str) -> str:
    """Resolve engine="auto": batched on CUDA, the measured faster one on CPU (`AUTO_CPU_ENGINE`).

    Engines (same semantics; the same batches, augmentation and dropout masks, from the clients' streams,
    `prodigy_core.streams`, on any device):
    - ``batched``: `torch.func.vmap` of `grad` of a `functional_call` over the clients' stacked parameters
      and BatchNorm buffers, elementwise SGD on the stacked tensors. Every client's dropout masks are made
      before the step (`FunctionalNet.masks`) and passed in (`ClientGrad`); `prodigy_core.groups` stacks
      several runs' clients in the same step this way. Clients smaller than batch_size (``paper`` only)
      are vmapped in groups of equal batch width, so every client's loss and BatchNorm batch statistics use
      exactly its own b_k samples.
    - ``sequential``: the reference, one model copy trained client after client on exactly its valid
      entries, its dropout layers multiplying by the same masks.
    - ``compiled``: the batched engine with its vmapped gradient step under `torch.compile`, built once per
      process and architecture (`cached_compiled_grad`: the first run pays the compilation,
      later runs of the same shapes reuse it; a new batch width, e.g. a small client's, may recompile).
      It takes the same dropout masks as `batched`, so the two agree to float32 rounding (tested with
      dropout). Opt-in: `auto` never picks it (see benchmarks/README.md's notes for where it pays).
    - ``channels_last``, ``bmm_conv``, ``bmm_wgrad``, ``cuda_graphs``, ``channels_last_graphs``,
      ``bmm_wgrad_graphs``: variants of batched's kernels, the same computation, for the GPU window's
      autotune (`prodigy_core.step_variants`; the captured ones, ``*_graphs``, are refused off CUDA).
    - ``auto``: batched on CUDA; on a CPU the faster one as measured by `benchmarks/training.py`
      (`AUTO_CPU_ENGINE`).
    """
    if engine != "auto":
        return engine
    return "batched" if device.type == "cuda" else AUTO_CPU_ENGINE[dataset]


def local_momentum(momentum: Tensor, pseudo_grads: Tensor, beta: float) -> Tensor:
    """Every client's local momentum m_t = beta m_{t-1} + (1 - beta) g_t, (N, d); m_t = g_t when beta = 0."""
    return pseudo_grads if beta == 0 else beta * momentum + (1 - beta) * pseudo_grads


def server_input(momentum: Tensor, f: int, attack: Any, pipeline: Any) -> Tensor:
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


# ---------------------------------------------------------------------------------------------- local steps
class ClientTooSmallError(ConfigError):
    """An ``authors`` run with a client smaller than batch_size: the authors' code would never return."""


class AuthorsBatchStream:
    """The authors' client batch stream (``variant="authors"``), for all N clients at once.

    The authors' client (senaergisi/prodigy client.py:46-47) holds ``DataLoader(data_set, batch_size,
    shuffle=True, drop_last=True)`` and one ``iter(cycle(train_loader))`` made in ``__init__`` and kept
    across rounds; each of its local steps takes ``next`` of it (client.py:68-73; every client steps every
    round, server.py:38-40). ``cycle`` (client.py:11-14) re-enters the loader when an epoch is exhausted,
    which draws a new shuffle of the client's own samples; ``drop_last`` leaves out the last |D_k| mod b
    samples of each epoch. A client with fewer than b samples has an empty loader, on which ``cycle`` loops
    forever without yielding (the ``except StopIteration`` there never fires): `ClientTooSmallError` here.

    Here client k keeps its current epoch order (global row indices, the first |D_k| entries of row k of
    `perms`) and the position `pos[k]` of its next batch. `next(gens)` gives one local step's (idx (N, b),
    mask (N, b) all True): first, a client whose epoch cannot give a full batch (pos[k] + b > |D_k|) starts
    a new one, ``client_indices[k][torch.randperm(|D_k|, generator=gens[k])]`` (its own CPU generator,
    `streams.ClientStreams`), at position 0; then row k is the epoch's entries pos[k] .. pos[k] + b - 1 and
    pos[k] grows by b. Every client starts "exhausted" (pos[k] = |D_k|), so the first step draws every
    client's first epoch. Client k's augmentation draws from gens[k] after its shuffle. The random numbers
    cannot be the authors' own (their RandomSampler seeds a fresh generator from torch's global one, which
    their dropout and augmentation also draw from); the structure of the batch sequence is theirs.
    `state_dict` (tensors) goes into the checkpoint."""

    def __init__(self, fed: Federation, batch_size: int) -> None:
        sizes = [len(ix) for ix in fed.client_indices]
        small = [k for k, n in enumerate(sizes) if n < batch_size]
        if small:
            k, others = small[0], len(small) - 1
            more = f" (and {others} more client{'s' * (others > 1)})" if others else ""
            raise ClientTooSmallError(
                f"variant: authors: client {k} has {sizes[k]} samples, fewer than batch_size={batch_size}"
                f"{more}: its DataLoader(drop_last=True) yields no batch and the authors' code would never "
                "return here (client.py cycles an empty loader); use variant: paper (batches of "
                "min(batch_size, client size)), or fewer clients (n_clients) or a smaller batch_size"
            )
        self.fed, self.batch_size, self.sizes = fed, batch_size, sizes
        self.perms = torch.zeros(fed.n_clients, max(sizes), dtype=torch.int64, device=fed.device)
        self.pos = list(sizes)
        self._width = torch.arange(batch_size, device=fed.device)
        self._mask = torch.ones(fed.n_clients, batch_size, dtype=torch.bool, device=fed.device)

    def next(self, gens: list[torch.Generator]) -> tuple[Tensor, Tensor]:
        """One local step's (idx (N, b), mask (N, b) all True), drawing client k's new epochs from its CPU
        generator `gens[k]` (see above)."""
        b = self.batch_size
        for k, n in enumerate(self.sizes):
            if self.pos[k] + b > n:
                order = torch.randperm(n, generator=gens[k]).to(self.fed.device)
                self.perms[k, :n] = self.fed.client_indices[k][order]
                self.pos[k] = 0
        offsets = torch.tensor(self.pos, device=self.fed.device)
        idx = self.perms.gather(1, offsets[:, None] + self._width)
        self.pos = [p + b for p in self.pos]
        return idx, self._mask

    def state_dict(self) -> dict[str, Tensor]:
        return {"perms": self.perms.clone(), "pos": torch.tensor(self.pos, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        perms, pos = state["perms"], [int(p) for p in state["pos"]]
        if tuple(perms.shape) != tuple(self.perms.shape) or len(pos) != len(self.sizes):
            raise ValueError(
                f"batch stream of shape {tuple(perms.shape)} does not fit {tuple(self.perms.shape)}"
            )
        if any(not 0 <= p <= n for p, n in zip(pos, self.sizes, strict=True)):
            raise ValueError(f"batch stream positions {pos} do not fit the client sizes {self.sizes}")
        self.perms, self.pos = perms.to(self.fed.device, torch.int64).clone(), pos


def make_batch_stream(resolved: RunConfig, fed: Federation) -> AuthorsBatchStream | None:
    """The run's batch stream: `AuthorsBatchStream` under ``authors`` (raises `ClientTooSmallError` for a
    client smaller than batch_size), None under ``paper`` (every step draws `Federation.sample_batch`)."""
    return AuthorsBatchStream(fed, resolved.batch_size) if resolved.variant == "authors" else None


def _draw_batch(
    fed: Federation, batch_size: int, rng: ClientStreams, stream: AuthorsBatchStream | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """One local step's data for all clients: images (N,B,C,H,W), labels (N,B), mask (N,B); the indices from
    `stream` when given (``authors``), else `Federation.sample_batch` (``paper``), client k's indices and
    augmentation from its own generator `rng.gens[k]`."""
    idx, mask = fed.sample_batch(batch_size, rng.gens) if stream is None else stream.next(rng.gens)
    return fed.train_batch(idx, rng.gens), fed.train_labels[idx], mask


def _train_masks(net: FunctionalNet, rng: ClientStreams, clients: list[int], x: Tensor, step: int) -> dict:
    """Dropout masks of `clients`' forward passes on x (len(clients), width, C, H, W) at local step `step`."""
    return net.masks(x, lambda layer: rng.keys([rng.client_keys[k] for k in clients], step, layer, x.device))


class _MaskedDropout(nn.Module):
    """nn.Dropout with its mask given from outside (`mask`, already scaled by 1 / (1 - p)): see
    `FunctionalNet`."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p, self.mask, self.shape = p, None, None

    def forward(self, x: Tensor) -> Tensor:
        self.shape = self.shape or tuple(x.shape[1:])  # recorded by FunctionalNet's shape probe
        return x if self.mask is None else x * self.mask


class FunctionalNet:
    """`model`'s architecture as a function (params, buffers, dropout masks, x) -> scores for torch.func.

    Dropout: its layers multiply by masks made beforehand by `masks`, the counter-based draws of
    `prodigy_core.streams` (keep with probability 1 - p, scaled by 1 / (1 - p)), one (rows, width, ...)
    tensor per dropout layer. Every client's masks then depend on its key alone, not on the device, the
    engine, or the other runs sharing a vmapped computation (`prodigy_core.groups`), and a compiled step uses
    the same masks as an eager one. `template` with its masks set is also the sequential engine's client.
    """

    def __init__(self, model: nn.Module) -> None:
        self.template = copy.deepcopy(model)  # its weights are never used: functional_call supplies them
        for name, m in list(self.template.named_modules()):
            if isinstance(m, nn.Dropout) and m.p > 0:
                self.template.set_submodule(name, _MaskedDropout(m.p))
        self.dropouts = {f"{name}.mask": m for name, m in self.template.named_modules()
                         if isinstance(m, _MaskedDropout)}  # fmt: skip

    def probe(self, x: Tensor) -> None:
        """Learn the dropout layers' input shapes from a forward pass of x[0, :1] (x: rows, width, ...)."""
        if any(m.shape is None for m in self.dropouts.values()):
            training = self.template.training
            with torch.no_grad():
                self.template.eval()(x[0, :1])
            self.template.train(training)

    def masks(self, x: Tensor, keys: Callable[[int], Tensor]) -> dict[str, Tensor]:
        """Dropout masks for a forward pass of x (rows, width, C, H, W) row by row: layer l's (rows,) int64
        keys are keys(l) (`streams.dropout_mask`)."""
        self.probe(x)
        width = x.shape[1]
        return {name: dropout_mask(keys(layer), (width, *m.shape), m.p, x.dtype)
                for layer, (name, m) in enumerate(self.dropouts.items())}  # fmt: skip

    def __call__(self, params: dict, buffers: dict, masks: dict, x: Tensor) -> Tensor:
        return functional_call(self.template, (params, buffers, masks), (x,))


def _client_loss(model: nn.Module, params: dict, buffers: dict, masks: dict, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(functional_call(model, (params, buffers, masks), (x,)), y)


class ClientGrad:
    """(params, buffers, x, y, dropout masks), each stacked over clients -> every client's gradient of its
    loss; BatchNorm buffers are updated in place. ``compiled``: the vmapped step under torch.compile. The
    masks come from `FunctionalNet.masks` of `net`."""

    def __init__(self, model: nn.Module, compiled: bool = False) -> None:
        self.net = FunctionalNet(model)
        fn = vmap(grad(functools.partial(_client_loss, self.net.template)), randomness="error")
        self.fn, self.compiled = (torch.compile(fn) if compiled else fn), compiled

    def __call__(self, params: dict, buffers: dict, x: Tensor, y: Tensor, masks: dict) -> dict:
        if not self.compiled:
            return self.fn(params, buffers, masks, x, y)
        try:
            return self.fn(params, buffers, masks, x, y)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            raise RuntimeError(
                "engine='compiled': torch.compile could not build the training step (on a CPU it needs a "
                "working C++ compiler, on a GPU Triton). Run with engine='batched': the same computation, "
                f"uncompiled. The compiler said: {str(e.inner_exception).strip().splitlines()[0]}"
            ) from e


_COMPILED_STEPS: dict[tuple, Callable] = {}


def cached_compiled_grad(model: nn.Module) -> Callable:
    """The ``compiled`` engine's gradient function for `model`'s architecture, one per process: every run
    and every timing of the same architecture (the module tree, the parameters' and buffers' names, shapes,
    dtypes and device, the training mode) shares one torch.compile'd step, whose compiled graphs torch keeps
    per input shape, so compilation is paid once per process and shape. Its template's weights are never
    read: every call passes the run's own parameters and buffers."""
    named = [*model.named_parameters(), *model.named_buffers()]
    shapes = tuple((n, tuple(t.shape), t.dtype, str(t.device)) for n, t in named)
    key = (repr(model), model.training, shapes)
    if key not in _COMPILED_STEPS:
        _COMPILED_STEPS[key] = ClientGrad(model, compiled=True)
    return _COMPILED_STEPS[key]


def per_client_grad(model: nn.Module, compiled: bool = False, engine: str | None = None) -> ClientGrad:
    """The batched engine's gradient function for `model` (see `ClientGrad`); `engine` (a stacked engine):
    ``compiled`` (or `compiled`) the process's compiled one for this architecture (`cached_compiled_grad`),
    an engine variant its own (`step_variants.make_grad`)."""
    if compiled or engine == "compiled":
        return cached_compiled_grad(model)
    if engine in step_variants.VARIANTS:
        return step_variants.make_grad(engine, ClientGrad(model))
    return ClientGrad(model)


def draw_group(
    feds: list, batch_size: int, rngs: list, streams: list, net
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """One local step's images (R N, B, C, H, W), labels (R N, B) and dropout masks of R runs, the values
    `_draw_batch` and `_train_masks` give run by run, drawn for all runs at once where
    they share their federation's tensors: the indices on the host (every client's own CPU generator, in
    its own order), one copy to the device and one gather; the augmentation in one call; each layer's
    masks in one call from the R N clients' keys. Runs with their own label table (label flipping), image
    store or batch stream (``authors``) are drawn run by run. Every run's step counter then advances."""
    first, device = feds[0], feds[0].device
    shared = all(f._index_table is first._index_table and f.train_images is first.train_images for f in feds)
    if shared and all(s is None for s in streams):
        pos = torch.cat([f.sample_positions(batch_size, r.gens)[0] for f, r in zip(feds, rngs, strict=True)])
        n, length = first.n_clients, first._index_table.shape[1]
        flat = pos + (torch.arange(len(pos)) % n * length)[:, None]
        idx = first._index_table.view(-1)[flat.to(device)]
        x = first.train_batch(idx, [g for r in rngs for g in r.gens])
        labels = {id(f.train_labels): f.train_labels for f in feds}
        if len(labels) == 1:
            y = first.train_labels[idx]
        else:  # label-flipped members: one gather per run
            y = torch.cat([f.train_labels[idx[i * n : (i + 1) * n]] for i, f in enumerate(feds)])
    else:
        parts = [_draw_batch(f, batch_size, r, s)[:2] for f, r, s in zip(feds, rngs, streams, strict=True)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def keys(layer: int) -> Tensor:
        return torch.cat([ClientStreams.keys(r.client_keys, r.step, layer, device) for r in rngs])

    masks = net.masks(x, keys)
    for r in rngs:
        r.step += 1
    return x, y, masks


def _width_groups(fed: Federation, batch_size: int) -> list[tuple[int, Tensor | None]]:
    """Clients grouped by their batch width b_k = min(batch_size, |D_k|): [(b, client ids or None = all)]."""
    widths = torch.tensor([min(batch_size, len(ix)) for ix in fed.client_indices])
    if bool((widths == widths[0]).all()):
        return [(int(widths[0]), None)]
    return [(int(w), torch.nonzero(widths == w).flatten().to(fed.device)) for w in torch.unique(widths)]


def _trained_groups(
    fed: Federation, widths: list[tuple[int, Tensor | None]], idle: list[int]
) -> list[tuple[int, list[Tensor] | None, Tensor | None]]:
    """The clients that train in `local_steps_stacked`, by batch width (`widths`: `_width_groups`): [(width,
    each run's client ids in it, their rows in the run-major (R N) stack)]; (width, None, None) when every
    client of every run trains at that one width (no indexing). ``idle[i]``: run i's clients 0..idle[i]-1
    train in no group. A group where no client trains is left out."""
    n, device = fed.n_clients, fed.device
    if widths[0][1] is None and not any(idle):
        return [(widths[0][0], None, None)]
    out = []
    for w, ids in widths:
        ids = torch.arange(n, device=device) if ids is None else ids
        per_run = [ids[ids >= k] for k in idle]
        if any(len(c) for c in per_run):
            out.append((w, per_run, torch.cat([c + i * n for i, c in enumerate(per_run)])))
    return out


def _local_steps_batched(
    model: nn.Module,
    fed: Federation,
    steps: int,
    lr: float,
    resolved: RunConfig,
    rng: ClientStreams,
    grad_fn: ClientGrad | None = None,
    stream: AuthorsBatchStream | None = None,
    idle: int = 0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """All N clients' E local SGD steps as one vmapped computation; returns the pseudo-gradients (N, d) and
    the clients' BatchNorm buffers {name: (N, ...)}. ``grad_fn``: `per_client_grad(model)` built once by the
    caller (compiled or not); None builds an eager one. ``stream``: the run's `AuthorsBatchStream`
    (``authors``), None: `Federation.sample_batch` (``paper``). ``idle``: clients 0..idle-1 do not train
    (`RunState.idle`)."""
    step = grad_fn or per_client_grad(model)
    ((pseudo_grads, buffers),) = local_steps_stacked(
        [model], [fed], steps, [lr], resolved, [rng], step, streams=[stream], idle=[idle]
    )
    return pseudo_grads, buffers


def local_steps_stacked(
    models: list[nn.Module],
    feds: list[Federation],
    steps: int,
    lrs: list[float],
    resolved: RunConfig,
    rngs: list[ClientStreams],
    grad_fn: ClientGrad,
    streams: list[AuthorsBatchStream | None] | None = None,
    idle: list[int] | None = None,
) -> list[tuple[Tensor, dict[str, Tensor]]]:
    """The E local SGD steps of R runs' N clients each (R = len(models), same architecture, same client
    data sizes, same E, batch size and weight decay: `resolved`'s) as one vmapped computation over R x N
    clients; returns every run's (pseudo-gradients (N, d), BatchNorm buffers {name: (N, ...)}).

    Run i draws its batches, augmentation and dropout masks from its clients' streams `rngs[i]` (batches
    through its `streams[i]` when it has one: ``authors``), so its numbers do not depend on the other runs,
    the engine or the device (`prodigy_core.streams`). Clients with fewer than batch_size samples
    form one vmapped group per batch width, so that every client trains on exactly its b_k valid samples
    (padding would enter BatchNorm's batch statistics); with IID data or large clients there is a single
    group and no indexing, and the R runs' batches and masks are drawn at once (`draw_group`:
    the same values, device kernels per step independent of R).

    ``idle[i]``: run i's clients 0..idle[i]-1 do not train (`RunState.idle`): they are left out of every
    step, so they end where they started (pseudo-gradient 0, the server's BatchNorm buffers). Their batches
    are still drawn and dropped, so every client's generator stays where it would be."""
    runs, n = len(models), feds[0].n_clients
    streams = streams or [None] * runs
    idle = idle or [0] * runs
    solo = _width_groups(feds[0], resolved.batch_size)
    groups = _trained_groups(feds[0], solo, idle)
    stacked = [rows for _, _, rows in groups]
    counts = [None if ids is None else [len(c) for c in ids] for _, ids, _ in groups]  # each run's rows

    def stack(tensors: list[Tensor]) -> Tensor:  # (R, ...) -> (R N, ...), run-major
        return torch.stack([t.detach() for t in tensors]).repeat_interleave(n, dim=0)

    named = [dict(m.named_parameters()) for m in models]
    params = {name: stack([p[name] for p in named]) for name in named[0]}
    named = [dict(m.named_buffers()) for m in models]
    buffers = {name: stack([b[name] for b in named]) for name in named[0]}
    # each group's rows of the weights and buffers, taken once a round (the clients train independently)
    rows_state = [(params, buffers) if ids is None else ({name: v[ids] for name, v in params.items()},
                   {name: v[ids] for name, v in buffers.items()}) for ids in stacked]  # fmt: skip

    def draw_one_width() -> tuple[Tensor, Tensor, dict[str, Tensor]]:  # every run's at once, same values
        x, y, masks = draw_group(feds, resolved.batch_size, rngs, streams, grad_fn.net)
        rows = stacked[0]  # the rows that train (None: all)
        return (x, y, masks) if rows is None else (x[rows], y[rows], {k: m[rows] for k, m in masks.items()})

    members = [None if ids is None else [c.tolist() for c in ids] for _, ids, _ in groups]  # for the masks
    if solo[0][1] is None and hasattr(grad_fn, "local_steps"):  # `step_variants.StaticSteps`' own loop
        grad_fn.local_steps(*rows_state[0], steps, lrs, resolved.weight_decay, counts[0], draw_one_width)
    else:
        for _ in range(steps):
            if solo[0][1] is None:
                batches = [draw_one_width()]
            else:
                batches = _draw_width_groups(
                    feds, resolved.batch_size, rngs, streams, groups, members, grad_fn.net
                )
            for g, (p, b) in enumerate(rows_state):
                xs, ys, ms = batches[g]
                grads = list(grad_fn(p, b, xs, ys, ms).values())
                step_variants.sgd_update(grads, list(p.values()), lrs, resolved.weight_decay, counts[g])
    for ids, (p, b) in zip(stacked, rows_state, strict=True):  # each group's weights and buffers written back
        if ids is not None:
            for name, v in p.items():
                params[name][ids] = v
            for name, v in b.items():
                buffers[name][ids] = v
    end = torch.cat([p.reshape(runs * n, -1) for p in params.values()], dim=1)
    out = []
    for i, model in enumerate(models):
        start = parameters_to_vector(model.parameters()).detach()
        rows = slice(i * n, (i + 1) * n)
        out.append(((start - end[rows]) / lrs[i], {name: v[rows] for name, v in buffers.items()}))
    return out


def _draw_width_groups(
    feds: list[Federation],
    batch_size: int,
    rngs: list[ClientStreams],
    streams: list[AuthorsBatchStream | None],
    groups: list[tuple[int, list[Tensor], Tensor]],
    members: list[list[list[int]]],
    net: FunctionalNet,
) -> list[tuple[Tensor, Tensor, dict[str, Tensor]]]:
    """One local step's (images, labels, dropout masks) of every width group of `_trained_groups` (clients
    of several batch widths), its runs joined: each run draws its own batch (`_draw_batch`), each group
    takes its clients' first `width` samples and their masks (`_train_masks`; `members`: each group's
    client ids per run, on the host)."""
    parts = []  # per run, per width group; None: the run has no client in it
    for i, (fed, rng, stream) in enumerate(zip(feds, rngs, streams, strict=True)):
        x, y, _ = _draw_batch(fed, batch_size, rng, stream)
        parts.append([(x[ids[i], :w], y[ids[i], :w], _train_masks(net, rng, clients[i], x[ids[i], :w],
                       rng.step)) if clients[i] else None
                      for (w, ids, _), clients in zip(groups, members, strict=True)])  # fmt: skip
        rng.step += 1
    return [_cat_runs([run[g] for run in parts if run[g] is not None]) for g in range(len(groups))]


def _cat_runs(parts: list[tuple[Tensor, Tensor, dict[str, Tensor]]]) -> tuple[Tensor, Tensor, dict]:
    """Runs' (images, labels, masks) joined along the client axis (no copy for a single run)."""
    if len(parts) == 1:
        return parts[0]
    xs, ys, ms = zip(*parts, strict=True)
    return torch.cat(xs), torch.cat(ys), {k: torch.cat([m[k] for m in ms]) for k in ms[0]}


def _round_masks(net: FunctionalNet, rng: ClientStreams, batches: list, n_clients: int) -> list[dict]:
    """Every client's dropout masks for the round's local steps, row e * N + k for client k at local step
    e (each cut to that client's batch width), in one counter-based draw per layer instead of one per step
    and client: entry i of a row depends on its key and i alone (`streams.uniforms`), so the widest row's
    draw cut to a client's width is, bit for bit, `_train_masks` of that client and step."""
    x = batches[0][0]
    net.probe(x[:1])
    widths = [mask.sum(dim=1).tolist() for _, _, mask in batches]
    widest = max(max(w) for w in widths)
    drawn = {}
    for layer, (name, m) in enumerate(net.dropouts.items()):
        keys = torch.cat([ClientStreams.keys(rng.client_keys, rng.step + e, layer, x.device)
                          for e in range(len(batches))])  # fmt: skip
        drawn[name] = dropout_mask(keys, (widest, *m.shape), m.p, x.dtype)
    return [{name: masks[e * n_clients + k, : widths[e][k]] for name, masks in drawn.items()}
            for e in range(len(batches)) for k in range(n_clients)]  # fmt: skip


def _local_steps_sequential(
    model: nn.Module,
    fed: Federation,
    steps: int,
    lr: float,
    resolved: RunConfig,
    rng: ClientStreams,
    stream: AuthorsBatchStream | None = None,
    idle: int = 0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Reference: the same E local steps on the same batches and dropout masks, one client after another on
    one model copy. ``idle``: clients 0..idle-1 do not train (`RunState.idle`): they keep the server's model.

    The copy runs in channels-last memory format (1.2-1.5x faster convolutions on a CPU, native for cuDNN);
    flattening by reshape keeps the logical (N, C, H, W) order of every update vector."""
    batches = [_draw_batch(fed, resolved.batch_size, rng, stream) for _ in range(steps)]
    server_state = copy.deepcopy(model.state_dict())
    net = FunctionalNet(model)  # its template, masks set before every forward pass, is the client
    client = net.template.train().to(memory_format=torch.channels_last)
    weights = list(client.parameters())
    start = parameters_to_vector(model.parameters()).detach()
    masks = _round_masks(net, rng, batches, fed.n_clients)
    rows, reports = [], []
    for k in range(fed.n_clients):
        client.load_state_dict(server_state)
        for e, (x, y, mask) in enumerate(batches if k >= idle else []):
            xk = x[k][mask[k]].contiguous(memory_format=torch.channels_last)
            for name, m in masks[e * fed.n_clients + k].items():
                net.dropouts[name].mask = m
            loss = F.cross_entropy(client(xk), y[k][mask[k]])
            grads = list(torch.autograd.grad(loss, weights))
            with torch.no_grad():
                if resolved.weight_decay:
                    torch._foreach_add_(grads, weights, alpha=resolved.weight_decay)
                torch._foreach_add_(weights, grads, alpha=-lr)
        rows.append((start - torch.cat([w.detach().reshape(-1) for w in weights])) / lr)
        reports.append({name: b.detach().clone() for name, b in client.named_buffers()})
    buffers = {name: torch.stack([rep[name] for rep in reports]) for name in reports[0]} if reports[0] else {}
    rng.step += steps
    return torch.stack(rows), buffers


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


# ---------------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(
    model: nn.Module,
    fed: Federation,
    batch_size: int = EVAL_BATCH_SIZE,
    train_mode: bool = False,
    key: int = 0,
) -> tuple[float, float, float]:
    """`evaluate_runs` of [model]: (accuracy %, mean cross-entropy, the authors' test loss)."""
    return evaluate_runs([model], fed, train_mode, [key], batch_size=batch_size)[0]


def evaluate_runs(
    models: list[nn.Module],
    fed: Federation,
    train_mode: bool = False,
    keys: list[int] | None = None,
    batch_size: int = EVAL_BATCH_SIZE,
    net: FunctionalNet | None = None,
) -> list[tuple[float, float, float]]:
    """Test accuracy (percent), mean cross-entropy (sum over the test samples / M) and the authors' test loss
    (sum over the test batches of the batch's mean cross-entropy / M, what their server prints,
    server.py:63-67) over test batches of `batch_size` of R models of one architecture (M test samples), as
    one forward pass per test batch (vmapped over the models when R > 1); in train mode as stacked passes
    over up to `EVAL_PASS_IMAGES` images' batches (`_train_mode_pass`: the authors' 157 test batches of 64 in
    one pass instead of a loop of 157, with the loop's numbers).

    Eval mode (dropout off, each model's BatchNorm running statistics), or with ``train_mode`` as the authors'
    code evaluates: dropout on and BatchNorm normalising each test batch with that batch's own mean and
    (biased) variance; the models' buffers are left as they were. Model i's dropout masks for test batch j
    and layer l are the counter-based draws of key (keys[i], j, l) (`ClientStreams.eval_key`; None: 0 for
    every model), so its numbers do not depend on the other models or the device. ``net``:
    `FunctionalNet(models[0])`, built once by a caller that evaluates often."""
    net = net or FunctionalNet(models[0])
    runs = len(models)
    keys = [0] * runs if keys is None else keys
    params = [{k: v.detach() for k, v in m.named_parameters()} for m in models]
    buffers = [
        {k: v.detach().clone() for k, v in m.named_buffers()} for m in models
    ]  # train mode writes them
    if runs == 1:
        forward, params, buffers = net, params[0], buffers[0]
    else:
        forward = vmap(net, in_dims=(0, 0, 0, None), randomness="error")
        params, buffers = ({k: torch.stack([d[k] for d in ds]) for k in ds[0]} for ds in (params, buffers))
    correct = torch.zeros(runs, device=fed.test_labels.device)
    loss = torch.zeros(runs, device=fed.test_labels.device)
    batch_means = torch.zeros(runs, device=fed.test_labels.device)
    net.template.train(train_mode)
    total = len(fed.test_labels)
    if train_mode:  # every test batch its own BatchNorm statistics: the full batches in stacked passes
        batches = list(enumerate(fed.test_batches(batch_size)))  # (j, (x, y)): j keys batch j's masks
        full = [b for b in batches if len(b[1][1]) == batch_size]
        per_pass = max(1, EVAL_PASS_IMAGES // (runs * batch_size))
        passes = [full[i : i + per_pass] for i in range(0, len(full), per_pass)]
        passes += [[b] for b in batches if len(b[1][1]) != batch_size]  # the last, partial batch
        try:
            for part in passes:
                scores = _train_mode_pass(net, params, buffers, keys, part)
                correct, loss, batch_means = correct + scores[0], loss + scores[1], batch_means + scores[2]
        finally:
            net.template.train()
        rows = zip(*torch.stack([correct, loss, batch_means]).tolist(), strict=True)  # one wait
        return [(100.0 * c / total, v / total, m / total) for c, v, m in rows]
    try:
        with torch.no_grad():
            for j, (x, y) in enumerate(fed.test_batches(batch_size)):
                masks: dict[str, Tensor] = {}
                if train_mode and net.dropouts:  # (R, B, ...)
                    row_keys = functools.partial(ClientStreams.keys, keys, j, device=x.device)
                    masks = net.masks(x[None], row_keys)
                    masks = {k: v[0] for k, v in masks.items()} if runs == 1 else masks
                out = forward(params, buffers, masks, x).reshape(runs, len(y), -1)
                summed = F.cross_entropy(out.transpose(1, 2), y.expand(runs, -1), reduction="none").sum(dim=1)
                loss += summed
                batch_means += summed / len(y)
                correct += (out.argmax(dim=2) == y).sum(dim=1)
    finally:
        net.template.train()
    rows = zip(*torch.stack([correct, loss, batch_means]).tolist(), strict=True)  # one wait for the three
    return [(100.0 * c / total, v / total, m / total) for c, v, m in rows]


@torch.no_grad()
def _train_mode_pass(
    net: FunctionalNet,
    params: dict[str, Tensor],
    buffers: dict[str, Tensor],
    keys: list[int],
    batches: list[tuple[int, tuple[Tensor, Tensor]]],
) -> tuple[Tensor, Tensor, Tensor]:
    """(correct, summed loss, summed batch means) per model over P test batches (j, (x, y)) of one size in
    training mode, as one forward pass vmapped over the batches (each normalised by its own BatchNorm
    statistics, as a loop over them would) and over the R models when R > 1 (`params`, `buffers` stacked
    then). Model i's masks for batch j are the draws of key (keys[i], j, layer), as in the loop."""
    runs, n_batches = len(keys), len(batches)
    xs = torch.stack([x for _, (x, _) in batches])  # (P, B, ...)
    ys = torch.stack([y for _, (_, y) in batches])
    masks: dict[str, Tensor] = {}
    if net.dropouts:
        per_batch = [net.masks(x[None], functools.partial(ClientStreams.keys, keys, j, device=x.device))
                     for j, (x, _) in batches]  # each (R, B, ...)  # fmt: skip
        masks = {k: torch.stack([m[k] for m in per_batch], dim=1) for k in per_batch[0]}  # (R, P, B, ...)
    lead = (runs, n_batches) if runs > 1 else (n_batches,)
    # train mode writes the running statistics: every batch gets its own copy, thrown away after
    stacked = {k: (v if runs > 1 else v[None])[:, None].expand(runs, n_batches, *v.shape[runs > 1 :])
               .clone().reshape(*lead, *v.shape[runs > 1 :]) for k, v in buffers.items()}  # fmt: skip
    forward = vmap(net, in_dims=(None, 0, 0, 0), randomness="error")  # over the batches
    if runs > 1:
        forward = vmap(forward, in_dims=(0, 0, 0, None), randomness="error")  # over the models
    else:
        masks = {k: v[0] for k, v in masks.items()}
    width = ys.shape[1]
    out = forward(params, stacked, masks, xs).reshape(runs, n_batches * width, -1)
    y = ys.reshape(-1).expand(runs, -1)
    per_sample = F.cross_entropy(out.transpose(1, 2), y, reduction="none")  # (R, P B)
    return (out.argmax(dim=2) == y).sum(dim=1), per_sample.sum(dim=1), per_sample.sum(dim=1) / width


def eval_settings(resolved: RunConfig) -> tuple[bool, int]:
    """(train_mode, batch size) of a run's test evaluation: eval mode in batches of `EVAL_BATCH_SIZE`
    (``paper``), or as the authors' server tests (``authors``): training mode over DataLoader(test_set,
    batch_size=<the clients' batch size>, shuffle=False) (server.py l.29, l.51-68), where each test batch's
    own BatchNorm statistics make the batch size and the test set's order matter."""
    return (True, resolved.batch_size) if resolved.variant == "authors" else (False, EVAL_BATCH_SIZE)


def eval_due(resolved: RunConfig, r: int) -> bool:
    """Whether round r ends with an evaluation: every `eval_every` rounds and after the last."""
    return r % resolved.eval_every == 0 or r == resolved.rounds


def diverged_accuracy(fed: Federation, variant: str) -> float:
    """The accuracy (percent) recorded for a diverged run: chance level 100 / num_classes (``paper``), or the
    share of class 0 in the test set (``authors``: NaN logits, whose argmax is class 0)."""
    if variant == "authors":
        return 100.0 * (fed.test_labels == 0).sum().item() / len(fed.test_labels)
    return 100.0 / fed.num_classes


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


def _load_federation(resolved: RunConfig, device: torch.device) -> Federation:
    """The run's federation from `config.resolved()`: the data source its key was computed with (the one
    already loaded inside `shared_federations`)."""
    if _SHARED is None:
        return _read_federation(resolved, device)
    fields = ("dataset", "n_clients", "distribution", "dirichlet_alpha", "data_seed", "data_dir",
              "femnist_min_writer_samples", "data_source", "variant")  # fmt: skip
    key = (*(getattr(resolved, name) for name in fields), str(device))
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


def _get_rng_states() -> dict[str, Any]:
    """Every global RNG state as tensors and plain Python values (what `torch.load(weights_only=True)`
    reads)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    states = {"torch": torch.get_rng_state(), "python": random.getstate(),
              "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)]}  # fmt: skip
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"].cpu())
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in states["cuda"]])


def _as_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


__all__ = [
    "RunResult",
    "run",
    "evaluate",
    "evaluate_runs",
    "eval_due",
    "eval_settings",
    "FunctionalNet",
    "diverged_accuracy",
    "local_momentum",
    "server_input",
    "pick_engine",
    "AUTO_CPU_ENGINE",
    "cached_compiled_grad",
    "draw_group",
]
