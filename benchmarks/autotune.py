"""The start of a GPU window (issue 33 item 3): time every precision x engine on a real local step (breadth
first, then the group sizes of the fastest), gate the fastest candidates against full float32 on 3 rounds of
two attacked runs, pick the fastest one the gate accepts. Used by `gpu_run.py` (its `autotune.json`);
`time_step` also by `throughput.py`.

    from benchmarks.autotune import autotune, time_step

The gate: the reference (`fp32`, batched, alone) and the two fastest other candidates (each in a group of its
fastest size, at most `PROBE_SIZE`) train ProDiGy + ALIE and NNM + Trimmed mean + ALIE for `GATE_ROUNDS`
rounds from the same state (same seed: same initial model, batches and dropout masks); a candidate is accepted
only if every measure in `TOLERANCES` stays within its bound against the reference in both runs. The bound of
a measure is max(its tolerance, 2 x its noise floor): the same measure between the reference and a second fp32
trajectory that differs only in a stream the paper leaves free, the clients' batches and dropout masks (issue
41 item 4). `autotune.json` records the floor.

One autotune per GPU and software (issue 41 item 3): a report whose `fingerprint` (GPU, torch, CUDA, cuDNN,
the hash of `TUNED_CODE`) equals this machine's, whose fields are as `autotune` writes them (`invalid_field`)
and whose entries are not `PARTIAL`, is reused as it is (`mismatch`; the driver also refuses one whose choice
its --engines leaves out).
"""

from __future__ import annotations

import copy
import hashlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils import parameters_to_vector
from torch.utils.flop_counter import FlopCounterMode

from prodigy_core import evaluation, local_training, step_variants, training
from prodigy_core.config import RunConfig
from prodigy_core.data import Federation
from prodigy_core.models import make_model
from prodigy_core.names import ENGINES, PRECISIONS
from prodigy_core.results import finite_number, short_repr
from prodigy_core.seeding import precision_mode, resolve_device
from prodigy_core.streams import ClientStreams

ROOT = Path(__file__).resolve().parents[1]


def engine_candidates(device_type: str) -> tuple[str, ...]:
    """Issue 44: the engines that can be timed on `device_type`: batched, its variants that run there
    (`step_variants.ENGINE_VARIANTS`; cuda_graphs only on CUDA), compiled last (it pays its compilation, so it
    goes last and only while the budget lasts). Each is the batched computation to float rounding; the gate
    judges the fastest ones like any precision."""
    cuda_only = () if device_type == "cuda" else step_variants.CUDA_ONLY
    variants = [v for v in step_variants.ENGINE_VARIANTS if v not in cuda_only]
    variants.sort(key=lambda v: VARIANT_ORDER.index(v) if v in VARIANT_ORDER else len(VARIANT_ORDER))
    return ("batched", *variants, "compiled")


# The variants most likely to pay first, while the budget lasts: the third H200 window of 2026-11-27 timed a
# FEMNIST step alone at bf16 at 201k images/s under channels_last, 145k batched, 126k cuda_graphs and 43k
# bmm_conv, and its profile put 56% of the channels_last step in cuDNN's per-client weight-gradient kernels,
# which bmm_wgrad replaces.
# Its profile spent more host time than CUDA time on a channels_last step (194 ms against 140 ms over 3
# rounds: launches), which a captured step replays without: the captured folded variants come first.
VARIANT_ORDER = ("bmm_wgrad_graphs", "channels_last_graphs", "channels_last", "bmm_wgrad", "cuda_graphs",
                 "bmm_conv")  # fmt: skip


# What is tried, per device type: engines cheapest first (`engine_candidates`); tf32 exists only on CUDA. The
# CPU of `--simulate` times batched alone (tests give it `engine_candidates("cpu")` to choose among them).
CANDIDATES = {
    "cuda": {
        "precision": ("fp32", "tf32", "bf16"),
        "engine": engine_candidates("cuda"),
        "size": (1, 2, 4, 8, 16),  # 2: the window's end packs a pair where a group of 4 no longer fits
    },
    "cpu": {"precision": ("fp32", "bf16"), "engine": ("batched",), "size": (1, 2)},
}
REFERENCE = ("fp32", "batched")  # today's exact mode; accepted by definition
# The group size each candidate is timed at first: 4 (the size with the most images/s of fp32 in both
# 2026-11-27 windows, FEMNIST and CIFAR-10), or the largest size below it (`probe_size`)
PROBE_SIZE = 4
BUDGET_S = 45.0  # the whole autotune, timing and gate, of a dataset the window trains (issue 41: 45 s)
# Of the budget for the timings; the gate gets the rest: its references always run (the floor, the server
# side), a candidate's trajectory only while the budget lasts (one left out is not accepted)
TIMING_SHARE = 0.55
TIMED_STEPS = 3  # timed local steps per configuration, after the warm-up steps
# Untimed steps first: compiled's compilation is its first step, a captured engine's (`step_variants.GRAPHED`)
# eager warm-up and CUDA-graph capture its first two. With one, the 2026-11-27 H200 window timed cuda_graphs'
# capture as one of its 3 steps: 10.2 ms a step against batched's 8.8 (bf16, FEMNIST, alone).
WARMUP_STEPS = 2
COMPILE_S = 40.0  # torch.compile's warm-up step, about: a compiled size starts only with this much left
# After the window's runs (`time_left_out`), compiled starts only with this much more left: no window has
# compiled yet, and a compilation past the --deadline's slack gets the command killed by its `timeout`.
COMPILE_MARGIN_S = 20.0
# An entry `autotune` hands to its `saved` callback once its timings are made, before the gate: a command
# killed in the gate still brings its timings home; never reused (`mismatch`).
PARTIAL = "timings only: the autotune stopped before its gate and choice"
NOT_TIMED = "not timed: the timing budget was spent"  # a candidate's row then (`time_left_out` times it)
GATE_ROUNDS = 3
SERVER_ROUNDS = 3  # a kind's server side (`server_costs`): its rounds after the first, in steady state
GATE_DEFENSES = ("prodigy", "nnm+trimmed_mean")  # each under ALIE: the paper's central pair
FLOOR_FACTOR = 2.0  # a measure's bound: max(its tolerance, this x the measure between the two references)
# The code whose speed and numbers the autotune measures: a report is reused only while their hash is equal.
TUNED_CODE = ("prodigy_core/training.py", "prodigy_core/groups.py", "prodigy_core/aggregators.py",
              "prodigy_core/attacks.py", "prodigy_core/models.py", "prodigy_core/seeding.py",
              "prodigy_core/streams.py", "prodigy_core/step_variants.py", "prodigy_core/data.py",
              "prodigy_core/local_training.py", "prodigy_core/config.py", "prodigy_core/evaluation.py",
              "prodigy_core/names.py", "benchmarks/autotune.py")  # fmt: skip
TEST_IMAGES = 2000  # the gate's test accuracy: the first 2,000 test images
LOSS_SAMPLES = 256  # a client's loss: the final server model on its first 256 training samples
# The gate's bounds, candidate vs fp32 after GATE_ROUNDS rounds from the same state. They ask for "the same
# distribution", not the same bits: the paper's cells are 3-seed means with spreads of 0.4-9 points, and a
# reordered dropout-mask stream alone moves the parameters 10-25x more than TF32 does (issue 33).
TOLERANCES = {
    # ||theta_c - theta_ref|| / ||theta_ref - theta_0||: the distance between the two runs as a share of the
    # distance the reference travelled. bf16 on the CPU (digits, measured): 2% after 4 local steps.
    "param_rel": 0.10,
    # max over clients of |loss_c - loss_ref| / loss_ref (the final model on each client's own samples)
    "client_loss_rel": 0.05,
    # mean over rounds of |z_c - z_ref| / |z_ref|: ALIE's line search picks from a grid, and a rounding
    # difference can move it one grid point (about 8% of z on digits); a systematic shift cannot pass
    "attack_param_rel": 0.25,
    # ProDiGy's zeroed clients: the symmetric difference of the zeroed sets, summed over the rounds (one
    # borderline client flipping in and out of the zeroed set in 2 of 3 rounds)
    "zeroed_diff": 2,
    # test accuracy on TEST_IMAGES images, points: under the smallest spread of a paper cell (0.4) would
    # refuse seed noise; 2 points is well under a typical one
    "accuracy_points": 2.0,
}


def probe_size(space: dict[str, Any]) -> int:
    """The group size every candidate is timed at first: `PROBE_SIZE`, or the largest size below it."""
    return max((z for z in space["size"] if z <= PROBE_SIZE), default=space["size"][0])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(
    config: RunConfig, fed: Federation, precision: str, engine: str, size: int, steps: int = TIMED_STEPS
) -> float:
    """Seconds of one local SGD step (all N clients, batch b) of `size` runs like `config` stacked in one
    group, at `precision` with `engine` (any stacked engine): the mean of `steps` steps in steady state,
    after `WARMUP_STEPS` untimed ones, timed with CUDA events on CUDA and perf_counter on a CPU."""
    device = resolve_device(config.device)
    resolved = config.resolved()
    torch.manual_seed(0)
    models = [make_model(resolved.dataset).to(device).train() for _ in range(size)]
    grad_fn = local_training.per_client_grad(models[0], engine=engine)
    streams = [ClientStreams(i, resolved.n_clients) for i in range(size)]

    def step() -> None:
        with precision_mode(precision, device):
            local_training.local_steps_stacked(
                models, [fed] * size, 1, [resolved.lr] * size, resolved, streams, grad_fn
            )

    for _ in range(WARMUP_STEPS):
        step()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sync(device)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        sync(device)
        return start.elapsed_time(end) / 1000 / steps
    tic = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - tic) / steps


class BrokenDevice(BaseException):
    """The CUDA context stopped working after something failed: a sticky error (an illegal address in a
    captured graph, say) fails every later kernel of the process, so every run after it would fail too.
    A BaseException, like a kill, so that the `except Exception` that leave a candidate's failure to that
    candidate let it through to the driver, which goes on in a fresh process without what broke it
    (`gpu_run.Driver.restart`). ``engine``: the engine that failed, or the driver's step that did (the
    probe, the check, the profiler); ``runs``: the keys of the group whose runs failed, if it was one."""

    def __init__(self, precision: str, engine: str, error: str, runs: Sequence[str] = ()) -> None:
        what = f"{precision}/{engine}" if engine in ENGINES else engine
        super().__init__(f"the CUDA context stopped working after {what} failed ({error})")
        self.precision, self.engine, self.error, self.runs = precision, engine, error, tuple(runs)


def device_works(device: torch.device) -> bool:
    """Whether a trivial kernel still runs on `device` and the device syncs (always on a CPU)."""
    if device.type != "cuda":
        return True
    try:
        torch.ones(1, device=device).add_(1).cpu()
        torch.cuda.synchronize(device)
        return True
    except Exception:  # noqa: BLE001 - any error here is the answer
        return False


def check_device(
    device: torch.device, precision: str, engine: str, error: str, runs: Sequence[str] = ()
) -> None:
    """After `precision`/`engine` (or the `runs` of a group) failed with `error`: `BrokenDevice` when the
    device no longer works."""
    if not device_works(device):
        raise BrokenDevice(precision, engine, error, runs)


def time_row(
    timer: Callable[..., float], resolved: RunConfig, fed: Federation, precision: str, engine: str, size: int
) -> dict[str, Any]:
    """One row of the autotune's `timings`: `timer`'s seconds of a local step of `size` stacked runs, the
    wall seconds of the whole timing (warm-up included: compiled's compilation, a graph's capture) and
    training images/s; or the error of a candidate that cannot run (no compiler, no bf16 kernels)."""
    row: dict[str, Any] = {"precision": precision, "engine": engine, "size": size}
    try:
        started = time.perf_counter()
        row["step_s"] = timer(resolved, fed, precision, engine, size)
        row["wall_s"] = time.perf_counter() - started
        row["images_per_s"] = size * resolved.n_clients * resolved.batch_size / row["step_s"]
    except Exception as e:  # noqa: BLE001 - a candidate that cannot run is not chosen
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        check_device(resolve_device(resolved.device), precision, engine, row["error"])
    return row


def trajectory(
    config: RunConfig,
    fed: Federation,
    precision: str,
    engine: str,
    rounds: int,
    other_stream: bool = False,
    size: int = 1,
) -> dict[str, Any]:
    """`rounds` rounds of `config` at `precision` with `engine`, the run's own step functions (`training`);
    returns what the gate compares and the server side's seconds per round in steady state (the rounds
    after the first, which pays the start-up). `other_stream`: the clients' batches and dropout masks from
    the streams of seed + 1, the same initial model (the gate's noise floor). `size`: the run's local steps
    stacked with size - 1 others (the runs of seeds + 1, + 2, ..., whose steps are only computed), as in a
    group of that size, whose kernels round differently from one run's."""
    device = resolve_device(config.device)
    st = training.start_run(config.replace(precision=precision), device, "batched", fed=fed)
    if other_stream:
        st.streams = ClientStreams(st.resolved.seed + 1, st.resolved.n_clients)
    others = [training.start_run(config.replace(precision=precision, seed=st.resolved.seed + i), device,
                                 "batched", fed=fed) for i in range(1, size)]  # fmt: skip
    theta0 = parameters_to_vector(st.model.parameters()).detach().clone()
    grad_fn = local_training.per_client_grad(st.model, engine=engine)
    members = [st, *others]
    server: list[float] = []
    for r in range(1, rounds + 1):
        gamma = st.resolved.lr_at(r - 1)
        with precision_mode(precision, device):
            (grads, buffers), *_ = local_training.local_steps_stacked(
                [m.model for m in members], [st.fed] * size, st.resolved.local_steps, [gamma] * size,
                st.resolved, [m.streams for m in members], grad_fn, streams=[m.stream for m in members],
            )  # fmt: skip
        if not timed_server_round(st, r, gamma, grads, buffers, server):
            break
    model = st.model
    losses = []
    with torch.no_grad():
        model.eval()
        for ix in fed.client_indices:
            ix = ix[:LOSS_SAMPLES]
            x = fed.normalise(fed.train_images[ix]).view(len(ix), *fed.image_shape)
            losses.append(float(F.cross_entropy(model(x), fed.train_labels[ix])))
        model.train()
    test = copy.copy(fed)
    test.test_images, test.test_labels = fed.test_images[:TEST_IMAGES], fed.test_labels[:TEST_IMAGES]
    train_mode, batch_size = evaluation.eval_settings(st.resolved)
    with precision_mode(precision, device):
        accuracy = evaluation.evaluate(model, test, batch_size, train_mode)[0]
    return {"theta0": theta0, "theta": parameters_to_vector(model.parameters()).detach(), "losses": losses,
            "attack_params": st.result.attack_params, "zeroed": st.result.zeroed_clients,
            "accuracy": accuracy, "server_s": steady_state(server),
            "diverged": st.result.diverged}  # fmt: skip


def server_costs(
    config: RunConfig, fed: Federation, kinds: list[tuple[str, str]], seconds_left: Callable[[], float]
) -> dict[str, float]:
    """Issue 41 item 2: one run's server side per round (momentum, the attack's craft, aggregation, the
    server step: `training.server_round`) in steady state, for each (defense, attack) of `kinds` in order
    while `seconds_left()` is positive: `SERVER_ROUNDS` rounds of a run of that kind, the first (start-up)
    not counted. Every kind is fed the same clients' pseudo-gradients, one local round of `config` computed
    once: the crafts and the rules take as long whatever the values. {"<defense>/<attack>": seconds}."""
    device = resolve_device(config.device)
    if not kinds or seconds_left() <= 0:
        return {}
    base = training.start_run(config, device, "batched", fed=fed)
    ((grads, buffers),) = local_training.local_steps_stacked(
        [base.model], [fed], base.resolved.local_steps, [base.resolved.lr], base.resolved, [base.streams],
        local_training.per_client_grad(base.model, engine="batched"), streams=[base.stream],
    )  # fmt: skip
    costs: dict[str, float] = {}
    for defense, attack in kinds:
        if seconds_left() <= 0:
            break
        st = training.start_run(config.replace(defense=defense, attack=attack), device, "batched", fed=fed)
        seconds = []
        for r in range(1, SERVER_ROUNDS + 1):
            # diverged (FOE against no defense): what it measured so far
            if not timed_server_round(st, r, st.resolved.lr_at(r - 1), grads.clone(), buffers, seconds):
                break
        costs[f"{defense}/{attack}"] = steady_state(seconds)
    return costs


def timed_server_round(
    st: training.RunState,
    r: int,
    gamma: float,
    grads: Tensor,
    buffers: dict[str, Tensor],
    seconds: list[float],
) -> bool:
    """`training.server_round`, its seconds (the device synchronised on both sides) appended to `seconds`;
    False when the run diverged."""
    device = st.momentum.device
    sync(device)
    tic = time.perf_counter()
    ok = training.server_round(st, r, gamma, grads, buffers)
    sync(device)
    seconds.append(time.perf_counter() - tic)
    return ok


def steady_state(seconds: list[float]) -> float:
    """The mean of a run's per-round seconds after the first (which pays the start-up); the first alone
    when there is no other."""
    kept = seconds[1:] or seconds
    return sum(kept) / len(kept)


def compare(ref: dict[str, Any], cand: dict[str, Any]) -> dict[str, float]:
    """The measures of `TOLERANCES`, candidate trajectory vs reference."""
    travelled = float((ref["theta"] - ref["theta0"]).norm())
    param = float((cand["theta"] - ref["theta"]).norm()) / max(travelled, 1e-12)
    loss = max(abs(c - r) / max(abs(r), 1e-12) for c, r in zip(cand["losses"], ref["losses"], strict=True))
    pairs = [
        (c, r) for c, r in zip(cand["attack_params"], ref["attack_params"], strict=False) if r is not None
    ]
    attack = sum(abs(c - r) / max(abs(r), 1e-12) for c, r in pairs) / len(pairs) if pairs else 0.0
    zeroed = sum(len(set(c) ^ set(r)) for c, r in zip(cand["zeroed"], ref["zeroed"], strict=False))
    zeroed += abs(len(cand["zeroed"]) - len(ref["zeroed"]))  # a run that stopped early differs in its rounds
    if cand["diverged"] != ref["diverged"]:
        param = float("inf")
    return {"param_rel": param, "client_loss_rel": loss, "attack_param_rel": attack, "zeroed_diff": zeroed,
            "accuracy_points": abs(cand["accuracy"] - ref["accuracy"])}  # fmt: skip


def bounds(tolerances: dict[str, float], floor: dict[str, float]) -> dict[str, float]:
    """Each measure's bound: max(its fixed tolerance, FLOOR_FACTOR x the same measure between the two fp32
    references, `floor`)."""
    return {name: max(bound, FLOOR_FACTOR * floor.get(name, 0.0)) for name, bound in tolerances.items()}


def fingerprint(device: torch.device) -> dict[str, Any]:
    """What a report's timings and gate depend on besides the data: the GPU (on a CPU, its kernels), torch,
    CUDA, cuDNN and the hash of `TUNED_CODE`."""
    digest = hashlib.sha256()
    for name in TUNED_CODE:
        digest.update(name.encode() + b"\0" + (ROOT / name).read_bytes())
    gpu = (torch.cuda.get_device_name(device) if device.type == "cuda"
           else f"cpu ({torch.backends.cpu.get_cpu_capability()})")  # fmt: skip
    return {"gpu": gpu, "torch": str(torch.__version__), "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "code": digest.hexdigest()[:12]}  # fmt: skip


def mismatch(report: Any, here: dict[str, Any], datasets: list[str]) -> str | None:
    """Why an earlier `autotune.json` cannot be reused here (None: it can): another GPU, torch, CUDA, cuDNN or
    tuned code (`fingerprint`), a dataset it did not tune, an entry that holds only the timings (`PARTIAL`),
    or a field the driver reads that is not what `autotune` writes (`invalid_field`)."""
    if not isinstance(report, dict) or not isinstance(report.get("datasets"), dict):
        return "not an autotune report"
    theirs = report.get("fingerprint") if isinstance(report.get("fingerprint"), dict) else {}
    differ = [f"{k} {theirs.get(k)!r} (here {v!r})" for k, v in here.items() if theirs.get(k) != v]
    if differ:
        return "another " + ", ".join(differ)
    missing = [d for d in datasets if not isinstance(report["datasets"].get(d), dict)]
    if missing:
        return f"no {', '.join(missing)} in it"
    partial = [d for d in datasets if "partial" in report["datasets"][d]]
    if partial:
        return f"its {', '.join(partial)} entry holds {PARTIAL}"
    return invalid_field(report, datasets)


def positive(value: Any, zero: bool = False) -> bool:
    """A finite number (`results.finite_number`) > 0, or >= 0 with `zero`."""
    return finite_number(value) and (value >= 0 if zero else value > 0)


def invalid_field(report: dict[str, Any], datasets: list[str]) -> str | None:
    """What the driver (`gpu_run.Driver`) would trip on in a report's fields (None: nothing), the datasets'
    as `autotune` writes them: timings, a list of rows (a row's wall_s seconds >= 0; a not-timed row's
    precision and engine as chosen's, its size a whole number >= 1); chosen {precision: one of PRECISIONS,
    engine: one of ENGINES}; step_s {group size >= 1: seconds > 0}; server_s {"<defense>/<attack>": seconds
    >= 0}; gflop_per_image >= 0; the report's peak {tflops: > 0 or null}. Each but timings may be absent."""
    peak = report.get("peak")
    tflops = peak.get("tflops") if isinstance(peak, dict) else None
    if peak is not None and (not isinstance(peak, dict) or not (tflops is None or positive(tflops))):
        return f"peak={short_repr(peak)} is not {{tflops: a number > 0 or null}}"
    for dataset in datasets:
        why = invalid_tune(report["datasets"][dataset])
        if why is not None:
            return f"its {dataset} entry's {why}"
    return None


def invalid_tune(tune: dict[str, Any]) -> str | None:
    """`invalid_field` of one dataset's entry: "<field>=<value> is not <what it should be>", or None."""
    choices = {"precision": PRECISIONS, "engine": ENGINES}
    timings, chosen = tune.get("timings"), tune.get("chosen", {})
    step_s, server_s = tune.get("step_s", {}), tune.get("server_s", {})
    if not isinstance(timings, list) or not all(map(valid_row, timings)):
        return f"timings={short_repr(timings)} is not a list of timing rows"
    if not isinstance(chosen, dict) or any(v not in choices.get(k, ()) for k, v in chosen.items()):
        return f"chosen={short_repr(chosen)} is not {{precision: one of PRECISIONS, engine: one of ENGINES}}"
    if not isinstance(step_s, dict) or not all(
        str(k).isdecimal() and int(k) >= 1 and positive(v) for k, v in step_s.items()
    ):
        return f"step_s={short_repr(step_s)} is not {{group size >= 1: seconds > 0}}"
    if not isinstance(server_s, dict) or not all(positive(v, zero=True) for v in server_s.values()):
        return f'server_s={short_repr(server_s)} is not {{"<defense>/<attack>": seconds >= 0}}'
    if not positive(tune.get("gflop_per_image", 0), zero=True):
        return f"gflop_per_image={short_repr(tune['gflop_per_image'])} is not a number >= 0"
    return None


def valid_row(row: Any) -> bool:
    """A row of `timings` as `time_left_out` reads it: its wall_s seconds >= 0, a not-timed row's precision
    and engine known, its size a whole number >= 1."""
    if not isinstance(row, dict) or ("wall_s" in row and not positive(row["wall_s"], zero=True)):
        return False
    size = row.get("size")
    return row.get("error") != NOT_TIMED or (
        row.get("precision") in PRECISIONS and row.get("engine") in ENGINES
        and isinstance(size, int) and not isinstance(size, bool) and size >= 1
    )  # fmt: skip


def autotune(
    configs: dict[str, RunConfig],
    feds: dict[str, Federation],
    budget_s: float = BUDGET_S,
    tolerances: dict[str, float] | None = None,
    timer: Callable[..., float] = time_step,
    log: Callable[[str], None] = print,
    server_kinds: dict[str, list[tuple[str, str]]] | None = None,
    engines: Sequence[str] | None = None,
    saved: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Per dataset (`configs`: one run of each dataset the window trains, `feds`: their loaded data): the
    timings, the gate and the choice, then the server side of each (defense, attack) of `server_kinds`
    (the window's runs of that dataset, most wanted first) the gate did not measure, while the budget lasts
    (`server_costs`), as `autotune.json` holds them:

    {dataset: {"timings": [{precision, engine, size, step_s, wall_s, images_per_s, tflops, peak_share}
                           or {precision, engine, size, error}],
               "gate": [{precision, engine, size, defense, measures, bounds, accepted}],
               "floor": {defense: the measures between the two fp32 references},
               "chosen": {precision, engine},
               "step_s": {size: seconds of one local step of the chosen candidate},
               "server_s": {"<defense>/<attack>": one run's server side per round in steady state},
               "gflop_per_image"},
     "fingerprint": `fingerprint`, "peak": {tflops, measured}} (`add_rates`: TFLOP/s and share of the peak)

    A candidate that raises (no compiler, no bf16 kernels) is left out with its error. `timer`: the timing
    function (tests give a fake one to make a candidate fastest). `engines`: the only engines timed (the
    reference's always; None: every one of `CANDIDATES`). `saved`: given each dataset's timings as a report
    whose entry is marked `PARTIAL` before its gate starts (the driver writes it to $OUT)."""
    tolerances = TOLERANCES if tolerances is None else tolerances
    tic = time.perf_counter()
    report: dict[str, Any] = {"budget_s": budget_s, "tolerances": tolerances, "datasets": {}}
    for dataset, config in configs.items():
        device = resolve_device(config.device)
        report["fingerprint"] = fingerprint(device)
        space = CANDIDATES["cuda" if device.type == "cuda" else "cpu"]
        fed, resolved = feds[dataset], config.resolved()
        timings: list[dict[str, Any]] = []
        budget = budget_s * TIMING_SHARE * (list(configs).index(dataset) + 1) / len(configs)

        # Breadth first (the 2026-11-27 windows: precision by precision, the timing share ran out before
        # any engine variant and before CIFAR-10's tf32 and bf16): every candidate once at its probe size,
        # then the other sizes of the grouped candidates, the reference first, then the fastest: the smaller
        # ones, and the larger ones up to the size whose rate stops rising. A candidate the budget leaves out
        # is listed as not timed.
        def room(engine: str, budget: float = budget) -> bool:
            """Time left for one more timing (compiled's needs its compilation)."""
            needed = COMPILE_S if engine == "compiled" else 0.0
            return time.perf_counter() - tic + needed <= budget

        rate: dict[tuple[str, str], float] = {}
        for engine in [e for e in space["engine"] if engines is None or e in (*engines, REFERENCE[1])]:
            for precision in space["precision"]:
                size = probe_size(space)
                # the reference's first size is always timed: without it nothing can be chosen
                if (precision, engine) != REFERENCE and not room(engine):
                    timings.append({"precision": precision, "engine": engine, "size": size,
                                    "error": NOT_TIMED})  # fmt: skip
                    continue
                timings.append(row := time_row(timer, resolved, fed, precision, engine, size))
                if "step_s" in row:
                    rate[precision, engine] = row["images_per_s"]
        for precision, engine in sorted(rate, key=lambda k: (k != REFERENCE, -rate[k])):
            probe = probe_size(space)
            # every smaller group (the driver's estimate of a small group needs its own step time)
            for size in [z for z in space["size"] if z < probe]:
                if not room(engine):
                    break
                timings.append(time_row(timer, resolved, fed, precision, engine, size))
            # then larger ones while the rate still rises
            last = rate[precision, engine]
            for size in [z for z in space["size"] if z > probe]:
                if not room(engine):
                    break
                timings.append(row := time_row(timer, resolved, fed, precision, engine, size))
                if "step_s" not in row or row["images_per_s"] < last:
                    break  # failed, or past the fastest size
                last = row["images_per_s"]
        if saved is not None:
            entry = {"timings": timings, "partial": PARTIAL}
            saved({"fingerprint": report["fingerprint"], "datasets": {dataset: entry}})
        best: dict[tuple[str, str], float] = {}
        best_size: dict[tuple[str, str], int] = {}  # where it is fastest (the gate's group, up to the probe)
        for row in timings:
            key = (row["precision"], row["engine"])
            if "step_s" in row and row["images_per_s"] > best.get(key, 0.0):
                best[key], best_size[key] = row["images_per_s"], row["size"]
        others = sorted((k for k in best if k != REFERENCE), key=lambda k: -best[k])
        fastest = others[:2]
        # and the fastest of the reference's own precision when faster than it (an engine variant, the same
        # computation to rounding): where the two fastest are tensor-core precisions the gate refuses (as
        # CIFAR-10's were on 2026-11-27), the window still runs faster than the reference
        same = next((k for k in others if k[0] == REFERENCE[0]), None)
        if same is not None and same not in fastest and best[same] > best.get(REFERENCE, 0.0):
            fastest.append(same)
        gate: list[dict[str, Any]] = []
        accepted = {REFERENCE}
        server: dict[str, float] = {}
        floors: dict[str, dict[str, float]] = {}
        for defense in GATE_DEFENSES:
            base = config.replace(defense=defense, attack="alie", rounds=GATE_ROUNDS, eval_every=GATE_ROUNDS)
            try:
                ref = trajectory(base, fed, *REFERENCE, GATE_ROUNDS)
                twin = trajectory(base, fed, *REFERENCE, GATE_ROUNDS, other_stream=True)
            except Exception as e:  # noqa: BLE001 - no reference, no candidate accepted; the timings kept
                error = f"the fp32 reference failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                gate += [{"precision": cand[0], "engine": cand[1], "defense": defense,
                          "measures": {"error": error}, "accepted": False} for cand in fastest]  # fmt: skip
                log(f"autotune {dataset}: gate {defense}: {error}")
                continue
            floors[defense] = floor = compare(ref, twin)
            bound = bounds(tolerances, floor)
            server[f"{defense}/alie"] = (ref["server_s"] + twin["server_s"]) / 2
            for precision, engine in fastest:
                if time.perf_counter() - tic > budget_s:
                    gate.append({"precision": precision, "engine": engine, "defense": defense,
                                 "measures": {"error": "not gated: the autotune's budget was spent"},
                                 "accepted": False})  # fmt: skip
                    continue
                # in a group (its kernels round as a group's), of at most the probe size: a group of 16 would
                # cost the gate 16 runs' local steps, and a gate out of budget falls back to the reference
                size = min(best_size[precision, engine], probe_size(space))
                try:
                    measures = compare(ref, trajectory(base, fed, precision, engine, GATE_ROUNDS, size=size))
                    ok = all(measures[name] <= limit for name, limit in bound.items())
                except Exception as e:  # noqa: BLE001
                    measures, ok = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}, False
                    check_device(device, precision, engine, measures["error"])
                gate.append({"precision": precision, "engine": engine, "size": size, "defense": defense,
                             "measures": measures, "bounds": bound, "accepted": ok})  # fmt: skip
        kinds = [k for k in (server_kinds or {}).get(dataset, []) if "/".join(k) not in server]
        try:
            server.update(server_costs(config, fed, kinds, lambda: budget_s - (time.perf_counter() - tic)))
        except Exception as e:  # noqa: BLE001 - the driver then estimates those kinds from its runs
            log(f"autotune {dataset}: server side not measured ({type(e).__name__}: {str(e)[:160]})")
        for key in fastest:
            if all(g["accepted"] for g in gate if (g["precision"], g["engine"]) == key):
                accepted.add(key)
        chosen = max(accepted, key=lambda k: best.get(k, 0.0))
        steps = {row["size"]: row["step_s"] for row in timings
                 if (row["precision"], row["engine"]) == chosen and "step_s" in row}  # fmt: skip
        report["datasets"][dataset] = {
            "timings": timings, "gate": gate, "floor": floors,
            "chosen": {"precision": chosen[0], "engine": chosen[1]}, "step_s": steps, "server_s": server,
        }  # fmt: skip
        speeds = ", ".join(f"{p}/{e} {v:,.0f}" for (p, e), v in best.items())
        verdicts = ", ".join(f"{g['precision']}/{g['engine']} {g['defense']}: "
                             + ("ok" if g["accepted"] else "refused") for g in gate)  # fmt: skip
        floor = ", ".join(f"{d} {m['param_rel']:.3f}" for d, m in floors.items())
        left_out = [f"{r['precision']}/{r['engine']}" for r in timings if "step_s" not in r]
        failed = f"; not timed or failed: {', '.join(left_out)}" if left_out else ""
        log(f"autotune {dataset}: images/s {speeds}{failed}; gate {verdicts or 'nothing to gate'} (param_rel "
            f"floor {floor}); chosen {chosen[0]}/{chosen[1]}; server side of {len(server)} kinds measured"
            )  # fmt: skip
    try:
        add_rates(report, configs, feds)
    except Exception as e:  # noqa: BLE001 - the rates are for reading; the choice stands without them
        log(f"autotune: TFLOP/s and peak share not added ({type(e).__name__}: {str(e)[:160]})")
    report["seconds"] = time.perf_counter() - tic
    return report


# ------------------------------------------------------------------ rates (issue 44): TFLOP/s, share of peak
PEAK_SIZE = {"cuda": 8192, "cpu": 512}  # the peak's matrix size per device type (a CPU's is indicative)


def flops_per_image(dataset: str, image_shape: tuple[int, ...], batch: int = 64) -> float:
    """FLOPs of one training pass (forward + backward) per image, as torch.utils.flop_counter counts them."""
    model = make_model(dataset).train()
    x = torch.randn(batch, *image_shape)
    y = torch.zeros(batch, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x), y).backward()
    return counter.get_total_flops() / batch


def peak_tflops(device: torch.device, size: int) -> tuple[float, str]:
    """The device's dense rate, measured: TFLOP/s of a size^3 matrix product, bf16 on CUDA (tensor cores),
    fp32 on a CPU; the best of 5 after a warm-up. Returns (TFLOP/s, what was measured)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    a @ b
    best = float("inf")
    for _ in range(5):
        sync(device)
        tic = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - tic)
    return 2 * size**3 / best / 1e12, f"{str(dtype).split('.')[-1]} {size}^3 matrix product"


def add_rates(report: dict[str, Any], configs: dict[str, RunConfig], feds: dict[str, Federation]) -> None:
    """Into `autotune`'s report: the device's measured peak (`peak_tflops`, report["peak"]) and, in every
    timed row, its TFLOP/s (images/s x `flops_per_image`) and share of that peak, as throughput.py prints
    them."""
    if not configs:
        return
    device = resolve_device(next(iter(configs.values())).device)
    peak, what = peak_tflops(device, PEAK_SIZE["cuda" if device.type == "cuda" else "cpu"])
    report["peak"] = {"tflops": peak, "measured": what}
    for dataset, tune in report["datasets"].items():
        tune["gflop_per_image"] = flops_per_image(dataset, feds[dataset].image_shape) / 1e9
        for row in tune["timings"]:
            add_row_rates(row, tune["gflop_per_image"], peak)


def add_row_rates(row: dict[str, Any], gflop_per_image: float, peak: float | None) -> None:
    """A timed row's TFLOP/s and share of the measured `peak` (None: not measured)."""
    if "images_per_s" in row:
        row["tflops"] = row["images_per_s"] * gflop_per_image / 1e3
        if peak:
            row["peak_share"] = row["tflops"] / peak


# ------------------------------------------------------------------ after the runs (issue 44): every variant
def time_left_out(
    tune: dict[str, Any],
    config: RunConfig,
    fed: Federation,
    peak: float | None,
    seconds_left: Callable[[], float],
    timer: Callable[..., float] = time_step,
    compiled: bool = False,
) -> list[dict[str, Any]]:
    """The candidates of a dataset's autotune (`tune`, its entry in the report) that its budget left out
    ("not timed"), the compiled ones when `compiled`, else the others (the driver times compiled last),
    timed after the window's runs in the time none of them could use: each while `seconds_left()` holds its
    need (the longest wall of a row timed, warm-up included; compiled's: COMPILE_S + COMPILE_MARGIN_S more).
    A row timed replaces its "not timed" one, marked `after_runs`: never gated, never chosen (the runs are
    over), there for the table of every variant. Returns the rows timed."""
    resolved = config.resolved()
    walls = [row["wall_s"] for row in tune["timings"] if "wall_s" in row]
    need = max(walls, default=COMPILE_S)
    rows = tune["timings"]
    left_out = [i for i, row in enumerate(rows)
                if row.get("error") == NOT_TIMED and (row["engine"] == "compiled") == compiled]  # fmt: skip
    timed = []
    for i in left_out:
        old = rows[i]
        if seconds_left() < need + (COMPILE_S + COMPILE_MARGIN_S if compiled else 0.0):
            continue
        row = time_row(timer, resolved, fed, old["precision"], old["engine"], old["size"])
        row["after_runs"] = True
        add_row_rates(row, tune.get("gflop_per_image", 0.0), peak)
        rows[i] = row
        timed.append(row)
    return timed


__all__ = ["CANDIDATES", "TOLERANCES", "add_rates", "autotune", "bounds", "compare",
           "engine_candidates", "fingerprint", "flops_per_image", "mismatch", "peak_tflops", "probe_size",
           "server_costs", "time_left_out", "time_step", "trajectory"]  # fmt: skip
