"""Many runs as one batched computation: R compatible runs' clients stacked (R x N models) in one vmapped
local step, each run's record the one it gets alone.

Runs of one grid block share the dataset, the model, N, E and b and differ in defense, attack, seed, momentum
and schedule; on a GPU one run's step (N=10 clients) is far too small for the card. Entry points:
`make_groups` (a grid's runs in groups of compatible ones: `group_key`, sized by `batch_size_for`),
`iter_group` / `run_group` (train one group). The ProDiGy paper's Algorithm 1 itself is `training.run`'s;
`experiments.run_grid` calls this module (batch_runs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from prodigy_core import evaluation, local_training, step_variants, training
from prodigy_core.config import SPLIT_FIELDS, RunConfig
from prodigy_core.seeding import precision_mode, resolve_device

# Fields that must be equal for runs to share one stacked local step.
GROUP_FIELDS = (*SPLIT_FIELDS, "local_steps", "batch_size", "weight_decay", "device", "precision")
CUDA_MEMORY_FRACTION = 0.6  # of the free memory a group may plan for


def group_key(config: RunConfig) -> tuple | None:
    """Runs with equal keys can share a group; None: the run trains alone (its engine is `sequential`).

    Compatible: same data split (dataset, distribution, alpha, N, resolved data seed, i.e. the seed when
    data_seed is None, data_dir), E, batch size, weight decay, device and precision, and runs that would use
    the same engine alone (a stacked engine: `batched`, `compiled` or a variant,
    `local_training.pick_engine`). `variant` is part of the key only where it changes the split (iid and
    dirichlet: the ``authors`` split is numpy's draw, `data.dirichlet_split_numpy`); otherwise it changes the
    clients' batches (each ``authors`` member's own `local_training.AuthorsBatchStream`),
    the server side (rules, SF written into the momentum, CClip from theta_t), the evaluation (train mode)
    and the diverged accuracy, all of which run per member. Runs with different splits are not stacked (it
    would need per-run index tables and width groups); they go to other groups.

    Every precision: the stacked step's kernels round differently from one run's (a local round's
    pseudo-gradients 1e-8 to 2e-6 apart, relative, in fp32 and bf16 on a CPU), as another engine's do, and the
    key leaves both out (docs/usage.md; the GPU autotune gates each candidate in a group)."""
    resolved = config.resolved()
    try:
        device = resolve_device(resolved.device)
    except ValueError:  # the run alone reports it
        return None
    engine = local_training.pick_engine(resolved.engine, device, resolved.dataset)
    if engine not in step_variants.STACKED_ENGINES:
        return None
    # which RNG draws the split (`data.load_federation`): numpy's under ``authors``, except FEMNIST's writers
    split_rng = "numpy" if resolved.variant == "authors" and resolved.distribution != "natural" else "torch"
    return (*(getattr(resolved, name) for name in GROUP_FIELDS), split_rng, engine)


def make_groups(configs: Sequence[RunConfig], size: int | str = "auto") -> list[list[RunConfig]]:
    """The configs in groups of at most `size` compatible runs, in grid order (runs that cannot be stacked
    form groups of one). size="auto": `batch_size_for` the first run of each kind."""
    if size != "auto" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(f"batch_runs={size!r} must be 'auto' or an integer >= 1 (1: one run at a time)")
    groups: list[list[RunConfig]] = []
    open_groups: dict[tuple, list[RunConfig]] = {}
    limits: dict[tuple, int] = {}
    for config in configs:
        key = group_key(config) if size != 1 else None
        if key is not None and key not in limits:
            limits[key] = batch_size_for(config) if size == "auto" else int(size)
        group = open_groups.get(key) if key is not None else None
        if group is None or len(group) >= limits[key]:
            group = []
            groups.append(group)
            if key is not None:
                open_groups[key] = group
        group.append(config)
    return groups


def batch_size_for(config: RunConfig) -> int:
    """batch_runs="auto": how many runs like `config` to stack. CPU: 1, never stacked. A CPU step is compute-
    bound, not overhead-bound, so stacking only adds its copies (benchmarks/grid.py, docs/usage.md "Many runs
    as one batched computation"); the CIFAR-10 and FEMNIST CNNs run the sequential engine on a CPU anyway. A
    CPU's cores are used by `run_grid(jobs="auto")` instead. CUDA: as many as `CUDA_MEMORY_FRACTION` of the
    free memory holds, by `memory_per_run`."""
    resolved = config.resolved()
    device = resolve_device(resolved.device)
    if group_key(resolved) is None:
        return 1
    if device.type != "cuda":
        return 1
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, int(CUDA_MEMORY_FRACTION * free // memory_per_run(resolved)))


def memory_per_run(config: RunConfig) -> int:
    """Bytes one member needs, estimated: its N clients' weights, gradients and momentum (4 copies of d
    floats each) and the activations of N x b samples kept for the backward pass (every module's output,
    measured by one forward pass of one sample, twice for the backward's temporaries)."""
    from prodigy_core.data import load_federation
    from prodigy_core.models import count_parameters, make_model

    resolved = config.resolved()
    model = make_model(resolved.dataset)
    d = count_parameters(model)
    shape = {"cifar10": (3, 32, 32), "femnist": (1, 28, 28)}.get(resolved.dataset)
    if shape is None:
        shape = load_federation(resolved.dataset, 2, distribution="iid").image_shape
    sizes: list[int] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: sizes.append(out.numel())) for m in model.modules()]
    with torch.no_grad():
        model.eval()(torch.zeros(1, *shape))
    for h in hooks:
        h.remove()
    return 4 * (4 * resolved.n_clients * d + 2 * resolved.n_clients * resolved.batch_size * sum(sizes))


@dataclasses.dataclass
class _Member:
    index: int  # position in the group's configs
    st: training.RunState
    rng: dict[str, Any]  # its global RNG states while other runs' code runs
    r: int  # its next round

    @contextlib.contextmanager
    def own_rng(self) -> Iterator[None]:
        """Run this member's code with its own RNG state as the global one."""
        training.set_rng_states(self.rng)
        try:
            yield
        finally:
            self.rng = training.get_rng_states()


Outcome = training.RunResult | Exception


def iter_group(
    configs: Sequence[RunConfig],
    *,
    checkpoint_dir: str | Path | None = None,
    progress: bool = False,
    keep_checkpoints: bool = False,
    sync_timing: bool = False,
) -> Iterator[tuple[int, Outcome]]:
    """Train compatible runs together; yields (index in `configs`, record or the error it raised) as each
    run completes, diverges or fails. `checkpoint_dir`: each run checkpoints and resumes exactly as alone
    (`keep_checkpoints`: a finished run's checkpoint is left for the caller, as `training.run`'s).

    - the client side is `local_training.local_steps_stacked`: one vmapped step over R x N clients, each run
      at its own learning rate, on its own batches (an ``authors`` run's from its own
      `local_training.AuthorsBatchStream`) and dropout masks, all from its own clients' streams
      (`streams.ClientStreams`);
    - the evaluation: the members due evaluate their server models in one vmapped forward pass per test
      batch (`evaluation.evaluate_runs`; one pass per variant);
    - everything else is per run and is `training`'s own code: `start_run` (model, pipeline, attack, label-
      flipped clients, generators, checkpoint resume), `server_round` (momentum, attack, aggregation, CClip
      state, server step, BatchNorm median), `end_round` (recording the evaluation, checkpoint) and
      `finish_run` (record).

    Independence from the group. Each run owns its clients' streams (batches, augmentation, dropout masks)
    and a full global RNG state (torch's CPU and CUDA generators, python's and numpy's), seeded from the run
    alone exactly as `training.run` seeds it; whenever its server side or checkpoint runs, its state is made
    the global one and saved back afterwards. Run i thus consumes the same random numbers in the same order as
    alone, and its record (same key, same fields, same checkpoint file) does not depend on which runs share
    the group or on their order; in float64 the parameters agree with a run alone to rounding
    (tests/test_groups.py), in lower precisions to their rounding of a larger step (`group_key`). Only
    `round_times` differ: a member's round time is its share of the group's local steps plus its own server
    side (`sync_timing` as in `training.run`; without it the local steps' device time falls mostly to the
    first member's server side); `environment.group_size` records R.

    A member that diverges is frozen and recorded as diverged, one whose server side raises is reported with
    its error, an ``authors`` member with a client smaller than a batch with its
    `local_training.ClientTooSmallError` before the group starts; the others go on. Runs may be at different
    rounds (resumed from checkpoints of different ages) or have different `rounds`: each member does its own
    next round every step of the group.
    """
    configs = [c if isinstance(c, RunConfig) else RunConfig.from_dict(c) for c in configs]
    if not configs:
        return
    keys = {group_key(c) for c in configs}
    if None in keys or len(keys) > 1:
        raise ValueError(
            "run_group: these runs cannot share a group (they need the batched engine and the same "
            f"{', '.join(GROUP_FIELDS)}); split them with groups.make_groups"
        )
    first = configs[0].resolved()
    device = resolve_device(first.device)
    engine = local_training.pick_engine(first.engine, device, first.dataset)  # the records' environment
    outside = training.get_rng_states()  # restored when the group is done
    members: list[_Member] = []
    try:
        fed = training.run_federation(first, device)
        for i, config in enumerate(configs):
            try:
                st = training.start_run(config, device, engine, checkpoint_dir, fed=fed)
            except local_training.ClientTooSmallError as e:  # an authors member that cannot start; others can
                yield i, e
                continue
            st.result.environment["group_size"] = len(configs)
            members.append(_Member(i, st, training.get_rng_states(), st.start + 1))
        if not members:
            return
        grad_fn = local_training.per_client_grad(members[0].st.model, engine=engine)
        eval_net = local_training.FunctionalNet(members[0].st.model)
        steps = max(m.st.resolved.rounds - m.st.start for m in members)
        bar = tqdm(total=steps, disable=not progress, unit="step", desc=f"group of {len(configs)}")
        with bar:  # closed before an error propagates
            active = members
            for step in range(1, steps + 1):
                tic = time.perf_counter()
                start = active[0].st.timer.mark()
                lrs = [m.st.resolved.lr_at(m.r - 1) for m in active]
                with precision_mode(first.precision, device):
                    outs = local_training.local_steps_stacked(
                        [m.st.model for m in active], [m.st.fed for m in active], first.local_steps, lrs,
                        first, [m.st.streams for m in active], grad_fn, streams=[m.st.stream for m in active],
                        idle=[m.st.idle for m in active],
                    )  # fmt: skip
                end = active[0].st.timer.mark()
                for m in active:  # the local steps' time, shared equally (`training.PhaseTimer`)
                    m.st.timer.add("local", start, end, 1 / len(active))
                shared = _elapsed(tic, device, sync_timing) / len(active)
                served, still = [], []
                for m, gamma, (pseudo_grads, buffers) in zip(active, lrs, outs, strict=True):
                    try:
                        with m.own_rng():
                            tic = time.perf_counter()
                            m.st.timer.restart()
                            ok = training.server_round(m.st, m.r, gamma, pseudo_grads, buffers)
                            if ok:
                                m.st.result.round_times.append(shared + _elapsed(tic, device, sync_timing))
                        if ok:
                            served.append(m)
                        else:
                            yield m.index, training.finish_run(m.st, keep_checkpoints)
                    except Exception as e:  # this run fails alone; the group goes on
                        yield m.index, e
                scores = _evaluate_due(served, eval_net)
                for m in served:
                    outcome: Outcome | None = None
                    try:
                        with m.own_rng():
                            m.st.timer.restart()
                            ok = training.end_round(m.st, m.r, scores.get(m.index))
                        if not ok or m.r == m.st.resolved.rounds:
                            outcome = training.finish_run(m.st, keep_checkpoints)
                    except Exception as e:
                        outcome = e
                    if outcome is None:
                        m.r += 1
                        still.append(m)
                    else:
                        yield m.index, outcome
                active = still
                bar.update(1)
                if not active or step == training._KILLED_AFTER:
                    break
    finally:
        training.set_rng_states(outside)


def _evaluate_due(
    members: list[_Member], net: local_training.FunctionalNet
) -> dict[int, tuple[float, float, float]]:
    """{member index: `evaluation.evaluate_runs` triple} of the members whose round ends with an evaluation,
    evaluated together: one pass per variant (`evaluation.eval_settings`: the ``authors`` ones in training
    mode), each member's dropout masks from its own key (`streams.ClientStreams.eval_key`)."""
    due = [m for m in members if evaluation.eval_due(m.st.resolved, m.r)]
    scores: dict[int, tuple[float, float, float]] = {}
    for variant in sorted({m.st.resolved.variant for m in due}):  # members share batch_size (GROUP_FIELDS)
        part = [m for m in due if m.st.resolved.variant == variant]
        train_mode, batch_size = evaluation.eval_settings(part[0].st.resolved)
        models, keys = [m.st.model for m in part], [m.st.streams.eval_key(m.r) for m in part]
        start = part[0].st.timer.mark()
        with precision_mode(part[0].st.resolved.precision, part[0].st.momentum.device):
            found = evaluation.evaluate_runs(models, part[0].st.fed, train_mode, keys, batch_size, net)
        end = part[0].st.timer.mark()
        for m in part:  # the evaluation's time, shared equally
            m.st.timer.add("eval", start, end, 1 / len(part))
        scores.update({m.index: score for m, score in zip(part, found, strict=True)})
    return scores


def run_group(
    configs: Sequence[RunConfig],
    *,
    checkpoint_dir: str | Path | None = None,
    progress: bool = False,
    sync_timing: bool = False,
) -> list[Outcome]:
    """`iter_group` collected: every run's record (or error) in the order of `configs`."""
    outcomes: list[Outcome | None] = [None] * len(configs)
    group = iter_group(configs, checkpoint_dir=checkpoint_dir, progress=progress, sync_timing=sync_timing)
    for i, outcome in group:
        outcomes[i] = outcome
    return outcomes  # type: ignore[return-value]


def _elapsed(tic: float, device: torch.device, sync: bool) -> float:
    if sync and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - tic


__all__ = ["GROUP_FIELDS", "group_key", "make_groups", "batch_size_for", "memory_per_run", "iter_group",
           "run_group"]  # fmt: skip
