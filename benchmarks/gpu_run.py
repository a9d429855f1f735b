"""One GPU session's work as one command whose results come home, then their import here (issue 24).

    python benchmarks/gpu_run.py [--data DIR] [--out DIR] [--deadline S] [--profile paper|mini] [--simulate]
                                 [--resume TARBALL] [--autotune AUTOTUNE_JSON] [--no-profile]
    python benchmarks/gpu_run.py import TARBALL [--results-root DIR] [--figures-root DIR]

The run: preflight (CUDA, both data sets, $OUT writable; else exit 2 with one line), env.txt, a CUDA probe
(a 2-member group x 2 rounds of each dataset; if it fails, one run at a time), the autotune and its gate
(`benchmarks/autotune.py`: the precision and engine every later run uses, `autotune.json`; an earlier one
reused on the same GPU and software), a torch.profiler step (`profile.txt`), then the profile's steps in
priority order as groups (at most --group-size runs) estimated from measurement (`Driver.estimate`), each
started only while it fits the --deadline; when the next planned group does not fit, the most wanted runs
that do, from any later step. A CUDA context a failure left broken (`autotune.BrokenDevice`): the rest in a
fresh process without the engine that broke it (`Driver.restart`). Each data set is loaded once
(`training.shared_federations`); runs write no checkpoints (none could come home). After every group $OUT
holds at most 3 files: results.tar.gz (records, failures, the log, autotune.json, profile.txt, the earlier
commands' log; no checkpoints, no locks), summary.txt (per step: runs planned/done/failed, seconds, status;
what never started; seconds used and unused) and env.txt. Exit 0 when every started step finished without
a failed run, 1 otherwise or when no group trained while runs were left (none fitted the --deadline, or their
data set was not prepared), 2 for a failed preflight (a --resume tarball that cannot be read whole, a --work
that is not a folder, a missing --autotune file). --simulate
runs the same driver on the CPU over a tiny digits grid, either profile's shape (the CI test).

The import unpacks the records into results/gpu/ (apart from the CPU's results/), writes the reports of both
variants beside the paper into figures/gpu/ (one per precision: bf16's named so) and figures/gpu/PROVENANCE.md
(GPU, precision, date); a tarball that cannot be read whole, fails its gzip CRC or length, or expands past
MAX_TOTAL_BYTES, is refused in one line before anything is written (exit 2). Steps and what to commit:
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import bz2
import dataclasses
import datetime
import gzip
import json
import lzma
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The --deadline's origin: the process's start, before torch is imported (13-14 s with the preflight on the
# H200 of 2026-11-27, which a clock started by `Driver` left out of the slack before the outer `timeout`).
# Only stdlib modules are imported above.
PROCESS_START = time.monotonic()
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a source tree, no install needed

EXIT_FAILED, EXIT_PREFLIGHT = 1, 2
PROBE_MARGIN = 2.0  # a group's estimate: the probe's warm round time x this, until a group of the kind ran
# A group's estimate (`Driver.estimate`, from measurements) x this: what is left unmeasured (Python between
# rounds, a record's write) and the spread of a round's time.
GROUP_MARGIN = 1.1
# A group starts only when its estimate x its dataset's overrun fits the time left (`Driver.fits`): after a
# group, what the estimates learned from it still leave unexplained of its seconds (`Driver.overrun`, at
# least 1); before any group of the dataset, this: the third H200 window's worst group took 1.24 x its
# estimate (51.1 s for 41.2 s), and a group killed by the command's `timeout` brings nothing home.
UNMEASURED_OVERRUN = 1.25
# Before a run's evaluations were measured: a run-round's evaluation as a share of its local step (issue
# 41's H200 window: 800 rounds, 80 evaluations, about 3% of a FEMNIST run); replaced by the records'.
EVAL_SHARE = 0.05
PROFILE_ROUNDS, PROFILE_ROWS = 3, 25  # the profiling step: rounds of the first group, rows of each table
PHASES = ("local", "craft", "aggregate", "eval", "rest")  # training.PHASES, the record's `phase_seconds`
PROFILE_S = 10.0  # about what the profiling step costs on a GPU; skipped when the deadline leaves less
# A dataset after the first is made ready (`Driver.prepare`: decode, check, probe, autotune) only with this
# much left: on the H200 that took 10-17 s with a reused autotune (CIFAR-10) and a paper-scale run 35-125 s,
# so with less no run of it could follow.
PREPARE_MIN_S = 60.0
# A command whose CUDA context broke (`autotune.BrokenDevice`) goes on in a fresh process without what broke
# it (`Driver.restart`); these variables tell that process how many restarts came before (at most
# MAX_RESTARTS), the runs it must not start again (their keys) and why.
RESTARTS_ENV, SKIP_RUNS_ENV, REASON_ENV, MAX_RESTARTS = (
    "PRODIGY_GPU_RESTARTS", "PRODIGY_GPU_SKIP_RUNS", "PRODIGY_GPU_RESTART_REASON", 2)  # fmt: skip
CIFAR10_ARCHIVE = Path("cifar10-jpeg") / "cifar10-jpeg.tar.gz"  # under --data
FEMNIST_FOLDER = Path("femnist-leaf-24")
TABLE1_ROWS = ["prodigy", "nnm+trimmed_mean"]
TABLE1_REST = ["none", "nnm+median", "nnm+geomed", "nnm+krum", "nnm+cclip"]
TABLE1_BLOCK = {"distribution": ["dirichlet"], "local_momentum": [0.9], "local_steps": [10]}
TABLE2_CELLS = {"defense": ["prodigy", "nnm+trimmed_mean", "none"], "attack": ["none", "alie", "sf"],
                "local_momentum": [0.9]}  # fmt: skip
TABLE2_ROWS = ["prodigy", "nnm+trimmed_mean", "none"]
TABLE2_REST = ["nnm+median", "nnm+geomed", "nnm+krum", "nnm+cclip"]
TABLE2_BLOCK = {"local_momentum": [0.9], "seed": [0]}  # beta 0.9, seed 0: the paper's cells, one seed


@dataclasses.dataclass
class Step:
    """Some runs of one params file: `only` selects rows and columns (experiments.select)."""

    name: str
    params: str
    scale: str  # "mini", "paper" or "smoke"
    only: dict[str, list[Any]]
    variant: str = "paper"


def plan(profile: str, simulate: bool) -> list[Step]:
    """The steps of a profile, most wanted first (issues 24 and 33's priorities).

    ``paper``: (1) Table II (FEMNIST N=20), beta 0.9, seed 0, `paper` variant, T=800: the ProDiGy, NNM+Trimmed
    mean and no-defense rows x 6 attacks, then the other 4 defenses; (2) Table I's central pair (ProDiGy and
    NNM+Trimmed mean under ALIE, non-IID FedAVG beta 0.9) at T=1000; (3) Table II beta 0.9 `authors`; (4) the
    rest of that Table I block at T=1000 (its step lists the whole block: the pair is done by then).
    ``mini``: issue 24's mini-scale comparisons. --simulate: each profile's shape on the embedded digits."""
    quick = "quickstart_digits"
    if simulate and profile == "paper":  # the smoke grid's defenses: prodigy, nnm+trimmed_mean, none
        return [Step("rows-paper", quick, "smoke", {"defense": TABLE1_ROWS}),
                Step("rest-paper", quick, "smoke", {"defense": ["none"]}),
                Step("rows-authors", quick, "smoke", {"defense": ["prodigy"]}, "authors")]  # fmt: skip
    if simulate:  # the same shape on the embedded digits: two variants, a second table, the rest of a block
        return [
            Step(f"rows-{v}", quick, "smoke", {"defense": ["prodigy"]}, v) for v in ("paper", "authors")
        ] + [
            Step("rest-paper", quick, "smoke", {"defense": ["none", "nnm+trimmed_mean"]}),
        ]
    if profile == "paper":
        femnist = "table2_femnist_n20"
        pair = {**TABLE1_BLOCK, "defense": TABLE1_ROWS, "attack": ["alie"]}
        return [Step("table2-paper-rows", femnist, "paper", {**TABLE2_BLOCK, "defense": TABLE2_ROWS}),
                Step("table2-paper-rest", femnist, "paper", {**TABLE2_BLOCK, "defense": TABLE2_REST}),
                Step("table1-paper-pair", "table1_cifar10", "paper", pair),
                Step("table2-authors", femnist, "paper", TABLE2_BLOCK, "authors"),
                Step("table1-paper-block", "table1_cifar10", "paper", TABLE1_BLOCK)]  # fmt: skip
    steps = [Step(f"table1-rows-{v}", "table1_cifar10", "mini", {**TABLE1_BLOCK, "defense": TABLE1_ROWS}, v)
             for v in ("paper", "authors")]  # fmt: skip
    steps.append(Step("table2-authors", "table2_femnist_n20", "mini", TABLE2_CELLS, "authors"))
    steps += [Step(f"table1-rest-{v}", "table1_cifar10", "mini", {**TABLE1_BLOCK, "defense": TABLE1_REST}, v)
              for v in ("paper", "authors")]  # fmt: skip
    return steps


# ---------------------------------------------------------------------------------------------- precision
def set_precision() -> dict[str, Any]:
    """Full float32 and deterministic kernels, set before any run: TF32 rounds matmul and convolution inputs
    to 10 mantissa bits, and rounding alone moved quickstart cells by up to 11.7 points, so GPU numbers are
    made at the CPU's precision; cuDNN's autotuner picks kernels by timing (other numbers on a rerun), so it
    is off. Returns the flags as recorded in env.txt (every record's `environment` has them too)."""
    import torch

    from prodigy_core.seeding import precision_flags, set_deterministic

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    set_deterministic(True)  # also cudnn.benchmark = False, CUBLAS_WORKSPACE_CONFIG
    return precision_flags()


def environment_text(flags: dict[str, Any], simulate: bool) -> str:
    import torch

    lines = [f"date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
             f"python: {platform.python_version()}", f"torch: {torch.__version__}",
             f"cuda: {torch.version.cuda}", f"cudnn: {torch.backends.cudnn.version()}",
             f"simulate: {simulate}"]  # fmt: skip
    if torch.cuda.is_available():
        lines.append(f"gpu: {torch.cuda.get_device_name(0)}")
        smi = shutil.which("nvidia-smi")
        if smi:
            # compute_mode: in exclusive-process mode a restarted process (`Driver.restart`) gets no context
            query = [
                smi,
                "--query-gpu=name,memory.total,driver_version,compute_mode",
                "--format=csv,noheader",
            ]
            try:  # a hung nvidia-smi must not hold the window
                answer = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout.strip()
            except (OSError, subprocess.SubprocessError) as e:
                answer = f"no answer ({type(e).__name__})"
            lines.append(f"nvidia-smi: {answer}")
    lines += [f"{k}: {v}" for k, v in flags.items()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- the run
class Driver:
    """The steps, the deadline and $OUT; `run_step` trains one step group by group."""

    def __init__(self, args: argparse.Namespace, work: Path, start: float | None = None) -> None:
        """`start`: the deadline's origin on `time.monotonic`'s clock (the script's: PROCESS_START); now when
        None."""
        self.args, self.work, self.out = args, work, args.out
        self.results = work / "results"
        self.log_path = work / "log.txt"
        self.start = time.monotonic() if start is None else start
        self.group_size = args.group_size
        self.rates: dict[str, float] = {}  # dataset -> seconds per run-round, from the last group
        self.tune: dict[str, Any] = {}  # dataset -> the autotune's choice and rates (`autotune.autotune`)
        self.report: dict[str, Any] = {}  # autotune.json: every dataset tuned or reused so far
        self.partial: dict[str, Any] = {}  # dataset -> its timings before the gate (`save_partial`)
        self.ready: dict[str, Any] = {}  # dataset -> a run of it, for the datasets `prepare` made ready
        # The estimates (`estimate`), from measurements, updated after every group: one run's server side per
        # round in steady state, per (dataset, defense, attack), from the gate or the finished runs of that
        # kind; the measured local steps of finished groups / their prediction from the autotune's step_s,
        # per (dataset, trained share) (`local_factor_for`); a run-round's evaluation, per dataset.
        self.server_s: dict[tuple[str, str, str], float] = {}
        self.share_factor: dict[tuple[str, float], float] = {}
        self.eval_s: dict[str, float] = {}
        self.overrun: dict[str, float] = {}  # dataset -> its latest group: seconds / learned estimate, >= 1
        self.group_cap: dict[str, int] = {}  # dataset -> half the size of its last group out of memory
        self.rows: list[dict[str, Any]] = []  # summary rows
        self.left: dict[str, list[Any]] = {}  # step -> its runs no time was left for (so far)
        self.groups_run = 0
        self.failed_keys: set[str] = set()  # runs that failed: not started again
        self.notes: list[str] = []
        self.after_runs = False  # the runs are over (`drive`): a broken device then ends nothing
        # an earlier process's runs that broke the device (`restart`): not started again
        self.skipped_runs = [k for k in os.environ.get(SKIP_RUNS_ENV, "").split(",") if k]
        self.failed_keys.update(self.skipped_runs)
        if os.environ.get(REASON_ENV):
            skipped = len(self.skipped_runs)
            self.notes.append(f"restarted in a fresh process after: {os.environ[REASON_ENV]}"
                              + (f"; {skipped} runs that broke the device not started again" if skipped
                                 else ""))  # fmt: skip

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def log(self, line: str) -> None:
        print(line, flush=True)
        with self.log_path.open("a", encoding="utf-8") as fh:
            fh.write(line + "\n")

    def experiment(self, step: Step) -> Any:
        from prodigy_core.experiments import load_experiment, select

        exp = load_experiment(step.params, scale=step.scale)
        if step.only:
            exp = select(exp, step.only)
        exp = exp.with_variant(step.variant)
        if self.args.simulate:  # a few rounds of CPU work per run
            # iid: the digits' Dirichlet split has clients below b=64, where an authors run cannot start
            configs = [
                c.replace(rounds=4, eval_every=2, device="cpu", distribution="iid") for c in exp.configs
            ]
            exp = dataclasses.replace(exp, configs=configs, stand_ins={})
        tuned = []
        for c in exp.configs:  # the autotune's choice; no checkpoints (none could come home)
            choice = self.tune.get(c.dataset, {}).get("chosen", {})
            tuned.append(c.replace(**choice, checkpoint_every=c.rounds))
        return dataclasses.replace(exp, configs=tuned)

    def autotune(self, dataset: str, config: Any) -> None:
        """Time, gate and choose the precision and engine of `dataset` (`autotune.autotune`, at most
        `autotune.BUDGET_S`), `config` one of its runs; its entry joins `autotune.json` (the tarball). An
        earlier report (--autotune FILE, else the --resume tarball's autotune.json) is reused as it is when it
        was made on the same GPU and software and tuned this dataset (`autotune.mismatch`): then it costs
        nothing."""
        from benchmarks import autotune
        from prodigy_core import training
        from prodigy_core.seeding import resolve_device

        config = config.replace(engine="batched")
        device = resolve_device(config.resolved().device)
        earlier, source, why = self.reusable(dataset, config)
        if source is not None:
            if why is None:
                self.log(f"autotune {dataset}: reused from {source} (same GPU, torch, CUDA, cuDNN and tuned "
                         "code)")  # fmt: skip
                reused = {**self.report.get("reused_from", {}), dataset: str(source)}
                self.use_autotune({**earlier, "datasets": {dataset: earlier["datasets"][dataset]},
                                   "reused_from": reused})  # fmt: skip
                return
            self.log(f"autotune {dataset}: {source} not reused: {why}; tuning here (at most "
                     f"{autotune.BUDGET_S:.0f} s)")  # fmt: skip
        try:
            fed = training.run_federation(config.resolved(), device)
            report = autotune.autotune({dataset: config}, {dataset: fed}, tolerances=self.args.tolerances,
                                       log=self.log, server_kinds={dataset: self.kinds(dataset)},
                                       engines=getattr(self.args, "engines", None),
                                       saved=self.save_partial)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - without it the runs go on at fp32, one group size
            note = f"autotune {dataset} failed ({type(e).__name__}: {e}); fp32, batched, the probe's rates"
            self.notes.append(note)
            self.log(note)
            return
        self.use_autotune(report)

    def reusable(self, dataset: str, config: Any) -> tuple[Any, str | None, str | None]:
        """(the earlier report, where it came from, why it cannot be reused for `dataset` here: None when it
        can) (`earlier_autotune`, `autotune.mismatch`; `config`: one of its runs); (None, None, "none")
        without one."""
        from benchmarks import autotune
        from prodigy_core.seeding import resolve_device

        earlier, source = self.earlier_autotune()
        if source is None:
            return None, None, "none"
        here = autotune.fingerprint(resolve_device(config.resolved().device))
        why = autotune.mismatch(earlier, here, [dataset])  # None: its fields are as `autotune` writes them
        engines = getattr(self.args, "engines", None)
        if why is None and engines is not None:
            chosen = earlier["datasets"][dataset]["chosen"]["engine"]
            if chosen not in (*engines, autotune.REFERENCE[1]):
                why = f"its choice, engine {chosen}, is not among --engines {','.join(engines)}"
        return earlier, source, why

    def run_floor(self, dataset: str, config: Any, runs: list[Any]) -> float:
        """A lower bound of the seconds of the cheapest of `runs` (`config`: one of them): their local steps
        alone, at the fastest step per run an earlier autotune on this GPU timed for `dataset` (any
        candidate and group size; `earlier_autotune`), every idle client's step saved; 0 without one."""
        from benchmarks import autotune
        from prodigy_core.seeding import resolve_device

        earlier, _ = self.earlier_autotune()
        if earlier is None:
            return 0.0
        here = autotune.fingerprint(resolve_device(config.resolved().device))["gpu"]
        try:
            if earlier["fingerprint"]["gpu"] != here:
                return 0.0
            timings = earlier["datasets"][dataset]["timings"]
            per_run = min(r["step_s"] / r["size"] for r in timings if "step_s" in r)
        except (TypeError, KeyError, ValueError, ZeroDivisionError):  # none, or not as `autotune` writes it
            return 0.0
        return min((c.rounds * c.local_steps * per_run * trained_share([c]) for c in runs), default=0.0)

    def earlier_autotune(self) -> tuple[Any, str | None]:
        """(report, where it came from) of --autotune FILE, else of the --resume tarball's autotune.json (as
        `read_tarball` names it: ./autotune.json too); (None, None) when there is none; (None, source) when it
        is not JSON (then it is not reused)."""
        text, source = None, None
        given, resume = getattr(self.args, "autotune", None), getattr(self.args, "resume", None)
        try:
            if given is not None:
                source = str(given)
                text = given.read_text(encoding="utf-8")
            elif resume is not None:
                content = resumed_members(self.args).get("autotune.json")
                if content is not None:
                    source = f"{resume}:autotune.json"
                    text = content.decode("utf-8")
            return (json.loads(text) if text is not None else None), source
        except (OSError, ValueError, RecursionError, Refused):
            return None, source

    def use_autotune(self, report: dict[str, Any]) -> None:
        """The autotune's choice per dataset, its server side per (defense, attack) as the first estimates of
        those kinds (`estimate`); joined to the datasets tuned before in `autotune.json` (`save_autotune`)."""
        self.save_autotune(report)
        for dataset, tune in report["datasets"].items():
            for kind, seconds in (tune.get("server_s") or {}).items():  # a reused one: `autotune.mismatch`
                defense, _, attack = kind.rpartition("/")
                self.server_s[dataset, defense, attack] = float(seconds)

    def save_autotune(self, report: dict[str, Any]) -> None:
        """`report`'s datasets joined to those tuned before, written to autotune.json (the tarball)."""
        datasets = {**self.report.get("datasets", {}), **report["datasets"]}
        self.report = {**self.report, **report, "datasets": datasets}
        self.tune.update(report["datasets"])
        self.write_autotune()

    def save_partial(self, report: dict[str, Any]) -> None:
        """An autotune's timings before its gate (`autotune.PARTIAL`), in $OUT's tarball at once: a command
        killed in the gate, or an autotune failed there, still brings them home. Never used for the runs;
        the dataset's whole report replaces it."""
        self.partial.update(report["datasets"])
        self.report = {"fingerprint": report["fingerprint"], **self.report}
        self.write_autotune()
        self.refresh_out()

    def write_autotune(self) -> None:
        """autotune.json: `report`, with the `partial` entries of the datasets it lacks."""
        datasets = {**self.partial, **self.report.get("datasets", {})}
        (self.work / "autotune.json").write_text(json.dumps({**self.report, "datasets": datasets}, indent=1),
                                                 encoding="utf-8")  # fmt: skip

    def step_s(self, dataset: str) -> dict[int, float]:
        """{group size: seconds of one local step} of the autotune's choice for `dataset` ({} without)."""
        return {int(k): float(v) for k, v in (self.tune.get(dataset) or {}).get("step_s", {}).items()}

    def local_estimate(self, batch: list[Any], rounds: int | None = None) -> float:
        """Seconds of a group's local steps: the autotune's prediction (`local_prediction`) x what finished
        groups measured against that prediction (`local_factor_for`)."""
        predicted, share = self.local_prediction(batch, rounds)
        return self.local_factor_for(batch[0].dataset, share) * predicted

    def local_prediction(self, batch: list[Any], rounds: int | None = None) -> tuple[float, float]:
        """The autotune's seconds of a group's local steps, rounds (its longest run's) x E x the step of the
        smallest measured group at least as large x the share of the group's clients that train, and that
        share (`trained_share`)."""
        first, step_s = batch[0], self.step_s(batch[0].dataset)
        share = trained_share(batch)
        upper = min((s for s in step_s if s >= len(batch)), default=None)
        if upper is None:
            return float("inf"), share
        rounds = max(c.rounds for c in batch) if rounds is None else rounds
        return rounds * first.local_steps * step_s[upper] * share, share

    def local_factor_for(self, dataset: str, share: float) -> float:
        """Measured local seconds / predicted, of the dataset's finished groups with this trained share. Per
        share because idle clients save what the device makes of fewer rows: on a CPU about their share, on
        the H200 of 2026-11-27 nothing for a FEMNIST run alone (0.050-0.068 s a round with 14 of 20 clients
        training, 0.054-0.064 s with all 20); the latest group's factor for an unmeasured share estimated
        ProDiGy + ALIE at 45 s, and it took 62 s.

        A share no finished group had credits its idle clients nothing (an under-estimate gets the command's
        last group killed by its `timeout`, an over-estimate leaves a little time unused): the prediction at
        share 1 (/ share), x the largest measured local seconds per predicted at share 1 (factor x share) of
        a share at least this one (a step of more rows never takes less), else x the largest factor (if time
        per row falls as rows grow, as the prediction assumes, it bounds share 1's), else x 1 (the autotune's
        step, every client training)."""
        key = share_key(dataset, share)
        if key in self.share_factor:
            return self.share_factor[key]
        measured = {s: f for (d, s), f in self.share_factor.items() if d == dataset}
        above = [f * s for s, f in measured.items() if s >= key[1]]
        return (max(above) if above else max(measured.values(), default=1.0)) / share

    def server_estimate(self, config: Any) -> float:
        """One run's server side per round: measured for its (dataset, defense, attack) (the gate, then its
        finished runs), else the slowest kind measured on its dataset (no attack: the cheapest)."""
        kind = (config.dataset, config.defense, config.attack)
        if kind in self.server_s:
            return self.server_s[kind]
        known = [v for (d, _, a), v in self.server_s.items() if d == config.dataset]
        if not known:
            return 0.0
        return min(known) if config.attack == "none" else max(known)

    def estimate(self, batch: list[Any]) -> float:
        """Seconds the group `batch` needs: GROUP_MARGIN x (its local steps + each run's rounds x (its server
        side + a run-round's evaluation)); from the probe's rate without the autotune's step times."""
        first = batch[0]
        if not self.step_s(first.dataset):
            return self.rates.get(first.dataset, 0.0) * sum(c.rounds for c in batch)
        local = self.local_estimate(batch)
        step = self.step_s(first.dataset)[min(self.step_s(first.dataset))] * first.local_steps
        per_eval = self.eval_s.get(first.dataset, EVAL_SHARE * step)
        return GROUP_MARGIN * (local + sum(c.rounds * (self.server_estimate(c) + per_eval) for c in batch))

    def needed(self, batch: list[Any]) -> float:
        """The seconds the group `batch` needs left to start: its estimate x its dataset's overrun
        (`UNMEASURED_OVERRUN` before any group of it)."""
        return self.estimate(batch) * self.overrun.get(batch[0].dataset, UNMEASURED_OVERRUN)

    def fits(self, batch: list[Any], left: float) -> bool:
        return self.needed(batch) <= left

    def choose_group(self, todo: list[Any]) -> tuple[list[Any], float]:
        """The next group of `todo` (most wanted first) and its estimate, in the time left: the planned one,
        the first run's compatible runs in order, sized for the most run-rounds per second among the sizes
        that fit (`fits`); when none fits, the most wanted runs that do fit (the first that fits alone, then
        the next compatible ones while the group still fits). ([], the first run's estimate) when none
        fits."""
        from prodigy_core.groups import group_key

        left = self.args.deadline - self.elapsed()
        largest = max(self.step_s(todo[0].dataset), default=self.group_size)
        cap = min(self.group_size, largest, self.group_cap.get(todo[0].dataset, self.group_size))

        def compatible(first: Any) -> list[Any]:
            key = group_key(first)
            return [c for c in todo if group_key(c) == key][:cap] if key is not None else [first]

        planned = compatible(todo[0])
        fitting = [planned[:r] for r in range(1, len(planned) + 1) if self.fits(planned[:r], left)]
        if fitting:
            best = max(fitting, key=lambda b: sum(c.rounds for c in b) / max(self.estimate(b), 1e-9))
            return best, self.estimate(best)
        for first in todo:
            if not self.fits([first], left):
                continue
            batch = [first]
            for c in compatible(first):
                if c is not first and len(batch) < cap and self.fits([*batch, c], left):
                    batch.append(c)
            return batch, self.estimate(batch)
        return [], self.estimate(todo[:1])

    def learn(self, batch: list[Any], records: list[dict | None], seconds: float | None = None) -> None:
        """Update the estimates from a finished group's records (`phase_seconds`): each kind's server side
        per round, the dataset's local-step factor and evaluation per run-round; then, from the group's
        `seconds`, the dataset's overrun: what the updated estimates leave unexplained of them (`needed`)."""
        done = [(c, r) for c, r in zip(batch, records, strict=True) if r and r.get("phase_seconds")]
        if not done:
            return
        dataset = batch[0].dataset
        for c, r in done:
            p, rounds = r["phase_seconds"], max(r.get("rounds_completed") or c.rounds, 1)
            self.server_s[dataset, c.defense, c.attack] = (p["craft"] + p["aggregate"] + p["rest"]) / rounds
        rounds = sum(max(r.get("rounds_completed") or c.rounds, 1) for c, r in done)
        self.eval_s[dataset] = sum(r["phase_seconds"]["eval"] for _, r in done) / rounds
        # the group's local steps ran for its longest member's rounds (a diverged member stops early)
        ran = max(max(r.get("rounds_completed") or 0, 1) for _, r in done)
        predicted, share = self.local_prediction(batch, ran)
        measured = sum(r["phase_seconds"]["local"] for _, r in done)
        if len(done) == len(batch) and 0 < predicted < float("inf") and measured > 0:
            self.share_factor[share_key(dataset, share)] = measured / predicted
        explained = self.estimate(batch) / GROUP_MARGIN
        if seconds is not None and explained > 0:
            self.overrun[dataset] = max(1.0, seconds / explained)

    def prepare(self, dataset: str, config: Any, first: bool = False, runs: list[Any] = ()) -> bool:
        """Make `dataset` ready when the first step that trains it comes up (`config`: one of its runs,
        `runs`: the step's): the CIFAR-10 JPEG copy decoded, the cross-device check, the probe, the autotune
        (or its reuse); a dataset no step reaches costs nothing (the 2026-11-27 windows paid about 25 s a
        command for a CIFAR-10 that no run of theirs used). False, and nothing done, with less left than
        PREPARE_MIN_S + a lower bound of the cheapest of `runs` (`run_floor`); False before the autotune when
        what is left then no longer covers its budget (none when reused) + that bound. Except for the
        `first` step's dataset (made ready whatever the deadline, as the window's start)."""
        from benchmarks import autotune

        if dataset in self.ready:
            return True
        tic = time.monotonic()
        left = self.args.deadline - (tic - self.start)
        floor = 0.0 if first else self.run_floor(dataset, config, runs)
        cheapest = f" + ~{floor:.0f} s for its cheapest run" if floor else ""
        if left < PREPARE_MIN_S + floor and not first:
            self.log(f"{dataset}: not prepared ({left:.0f} s left, under the {PREPARE_MIN_S:.0f} s it needs"
                     f"{cheapest})")  # fmt: skip
            return False
        if dataset == "cifar10" and not self.args.simulate:
            from prodigy_core.data import decode_cifar10_jpeg, jpeg_copy_source

            decode_cifar10_jpeg(self.args.data / CIFAR10_ARCHIVE, self.work / "data", progress=False)
            # the reference decode's pixels keep the committed records' keys; other pixels get their own
            self.log(f"CIFAR-10 (JPEG copy) decoded in {time.monotonic() - tic:.0f} s: data_source "
                     f"{jpeg_copy_source(self.work / 'data')}")  # fmt: skip
        cross_device_check(self, dataset)
        self.probe(dataset, config)
        if not first:  # what the decode, check and probe left must still cover the autotune and a run
            tuning = 0.0 if self.reusable(dataset, config)[2] is None else autotune.BUDGET_S
            toc = time.monotonic()
            left = self.args.deadline - (toc - self.start)
            if left < tuning + floor:
                self.log(f"{dataset}: not prepared ({left:.0f} s left after {toc - tic:.0f} s of decoding, "
                         f"check and probe, under the autotune's {tuning:.0f} s{cheapest})")  # fmt: skip
                return False
        self.autotune(dataset, config)
        self.ready[dataset] = config
        toc = time.monotonic()
        self.log(f"{dataset}: ready in {toc - tic:.0f} s (t = {toc - self.start:.0f} s)")
        return True

    def time_left_out(self) -> None:
        """After the runs, in the time none of them could use, most useful first, each measure brought home
        (autotune.json, which a `--resume` command on this GPU reuses) as soon as it is made: the server side
        of the kinds each dataset's autotune did not measure (`autotune.server_costs`: the next command's
        estimates start measured), then the candidates its budget left out, timed for the table of every
        engine variant (issue 44; `autotune.time_left_out`: never gated, never chosen), `compiled` last,
        only with its compilation and a margin left (`autotune.COMPILE_MARGIN_S`)."""
        from benchmarks import autotune
        from prodigy_core import training
        from prodigy_core.seeding import resolve_device

        peak = (self.report.get("peak") or {}).get("tflops")
        left = lambda: self.args.deadline - self.elapsed()  # noqa: E731
        feds: dict[str, Any] = {}

        def loaded(dataset: str) -> tuple[Any, Any]:  # the run's data, loaded once (`shared_federations`)
            config = self.ready[dataset].replace(engine="batched")
            if dataset not in feds:
                feds[dataset] = training.run_federation(
                    config.resolved(), resolve_device(config.resolved().device)
                )
            return config, feds[dataset]

        def save(dataset: str, tune: dict[str, Any]) -> None:  # for the next command; this one's estimates
            self.save_autotune({"datasets": {dataset: tune}})  # stay the runs' measures
            self.refresh_out(final=True)

        tuned = {d: self.tune[d] for d in self.ready if self.tune.get(d)}
        for dataset, tune in tuned.items():
            server = tune.setdefault("server_s", {})
            kinds = [k for k in self.kinds(dataset) if "/".join(k) not in server]
            if not kinds or left() <= 0:
                continue
            costs = autotune.server_costs(*loaded(dataset), kinds, left)
            if costs:
                server.update(costs)
                self.log(f"after the runs, {dataset}: the server side of {len(costs)} more kinds measured")
                save(dataset, tune)
        for compiled in (False, True):
            for dataset, tune in tuned.items():
                wanted = [r for r in tune["timings"] if r.get("error") == autotune.NOT_TIMED
                          and (r["engine"] == "compiled") == compiled]  # fmt: skip
                if not wanted or left() <= 0:
                    continue
                rows = autotune.time_left_out(tune, *loaded(dataset), peak, left, compiled=compiled)
                if rows:
                    rates = ", ".join(f"{r['precision']}/{r['engine']} x{r['size']} "
                                      + (f"{r['images_per_s']:,.0f}" if "images_per_s" in r else r["error"])
                                      for r in rows)  # fmt: skip
                    self.log(f"after the runs, {dataset}: images/s {rates} (not gated, not chosen)")
                    save(dataset, tune)

    def kinds(self, dataset: str) -> list[tuple[str, str]]:
        """The (defense, attack) kinds of the plan's runs of `dataset`, most wanted first."""
        runs = [c for step in plan(self.args.profile, self.args.simulate)
                for c in self.experiment(step).configs if c.dataset == dataset]  # fmt: skip
        return list(dict.fromkeys((c.defense, c.attack) for c in runs))

    def probe(self, dataset: str, c: Any) -> None:
        """A 2-member group x 2 rounds of `dataset` (`c`: one of its runs), in a scratch results folder."""
        from prodigy_core import groups

        pair = [
            c.replace(rounds=2, eval_every=1, attack="none", defense=d, engine="batched")
            for d in ("average", "prodigy")
        ]
        tic = time.monotonic()
        try:
            outcomes = groups.run_group(pair, sync_timing=True)  # round times are read below
            bad = [o for o in outcomes if isinstance(o, BaseException)]
            if bad:
                raise bad[0]
        except Exception as e:  # noqa: BLE001 - any failure of the grouped path: go on one at a time
            self.group_size = 1
            note = f"probe {dataset}: the 2-member group failed ({type(e).__name__}: {e}); one run at a time"
            self.notes.append(note)
            self.log(note)
            from benchmarks import autotune
            from prodigy_core.seeding import resolve_device

            autotune.check_device(resolve_device(pair[0].resolved().device), "fp32", "the probe", note)
            return
        seconds = time.monotonic() - tic
        # the group's warm second round (its members' shares add up to it), with a margin for what the
        # probe leaves out (evaluations, an attack's search); the first round pays the start-up
        per_run_round = sum(o.round_times[-1] for o in outcomes) / len(outcomes)
        self.rates.setdefault(dataset, PROBE_MARGIN * per_run_round)
        self.log(f"probe {dataset}: 2-member group x 2 rounds in {seconds:.1f} s "
                 f"(second round {per_run_round * len(outcomes):.2f} s)")  # fmt: skip

    def profile(self) -> None:
        """torch.profiler over PROFILE_ROUNDS rounds of the first step's first group (its planned size among
        its first `autotune.PROBE_SIZE` runs not made yet: a group of 16 would cost 30-50 s, not PROFILE_S),
        then of the step's run with the costliest server side (`server_estimate`: an attack's line search
        against a coordinate-wise rule, on the H200 of 2026-11-27 a third of such a run, which no profile had
        shown) when it is another kind, each in a scratch folder (nothing is recorded): the top PROFILE_ROWS
        CUDA kernels and CPU ops by their own time into profile.txt (the tarball), a section each. On the CPU
        of --simulate: the CPU ops only."""
        import torch

        from benchmarks import autotune
        from prodigy_core import results as store
        from prodigy_core.seeding import resolve_device

        if self.elapsed() + PROFILE_S > self.args.deadline:
            self.log("profile: skipped (deadline)")
            return
        try:
            step = plan(self.args.profile, self.args.simulate)[0]
            exp = self.experiment(step)
            folder = store.experiment_dir(exp.results_name, self.results)
            todo = [c for c in exp.configs if not made(folder, c)] or exp.configs
            batch, _ = self.choose_group(todo[: autotune.PROBE_SIZE])
            batches = [batch or todo[:1]]
            costliest = max(todo, key=self.server_estimate)
            kinds = {(c.defense, c.attack) for c in batches[0]}
            if self.server_estimate(costliest) > 0 and (costliest.defense, costliest.attack) not in kinds:
                batches.append([costliest])
        except Exception as e:  # noqa: BLE001 - the profile informs; the window's runs go on without it
            self.log(f"profile: failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
            return
        cuda = torch.cuda.is_available() and not self.args.simulate
        text = ""
        for i, runs in enumerate(batches):
            what = f"{len(runs)} runs" if len(runs) > 1 else f"{runs[0].defense}/{runs[0].attack}"
            if i and self.elapsed() + PROFILE_S / 2 > self.args.deadline:
                self.log(f"profile: {what} skipped (deadline)")
                break
            tic = time.monotonic()
            try:
                text += self.profiled(step.name, runs, cuda)
            except Exception as e:  # noqa: BLE001 - one section's failure keeps the others
                reason = str(e).splitlines()[0] if str(e) else ""
                self.log(f"profile: {what} failed ({type(e).__name__}: {reason})")
                autotune.check_device(resolve_device(runs[0].resolved().device), "fp32", "profiler", reason)
                continue
            (self.work / "profile.txt").write_text(text, encoding="utf-8")  # each section as it comes
            self.log(f"profile: {what} x {PROFILE_ROUNDS} rounds in {time.monotonic() - tic:.1f} s")

    @staticmethod
    def profiled(name: str, batch: list[Any], cuda: bool) -> str:
        """`batch` (one group, or a run alone) for PROFILE_ROUNDS rounds under torch.profiler: its section of
        profile.txt. A captured engine's runs at its uncaptured twin (`step_variants.GRAPHED`): a CUDA graph
        captured under the profiler risks a sticky CUDA error that would fail every later run of the
        command, and its replay hides the kernels anyway."""
        from torch.profiler import ProfilerActivity, profile

        from prodigy_core import groups, training
        from prodigy_core.step_variants import GRAPHED

        batch = [c.replace(rounds=PROFILE_ROUNDS, eval_every=PROFILE_ROUNDS,
                           engine=GRAPHED.get(c.engine, c.engine)) for c in batch]  # fmt: skip
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            if len(batch) == 1 or groups.group_key(batch[0]) is None:  # a run alone (or sequential engine)
                training.run(batch[0], progress=False)
            else:
                groups.run_group(batch)
        what = ", ".join(f"{c.defense}/{c.attack}" for c in batch)
        text = (f"torch.profiler: {name}, a group of {len(batch)} ({what}), {PROFILE_ROUNDS} rounds, "
                f"{batch[0].precision}/{batch[0].engine}\n")  # fmt: skip
        return text + profile_tables(prof, cuda) + "\n"

    def run_step(self, step: Step) -> None:
        from prodigy_core import results as store

        row = next((r for r in self.rows if r["step"] == step.name), None)  # a step taken up again
        if row is None:
            row = {"step": step.name, "planned": 0, "done": 0, "failed": 0, "seconds": 0.0,
                   "status": "not started"}  # fmt: skip
            self.rows.append(row)
        self.left.pop(step.name, None)
        try:
            exp = self.experiment(step)
            first = exp.configs[0]
            prepared = first.dataset in self.ready
            if not prepared and self.prepare(first.dataset, first, runs=exp.configs):
                prepared, exp = True, self.experiment(step)  # at the autotune's choice
        except Exception as e:  # noqa: BLE001 - a step that cannot even be built fails alone
            row["status"] = f"failed: {type(e).__name__}: {e}"
            self.log(f"== {step.name}: {row['status']}")
            return
        folder = store.experiment_dir(exp.results_name, self.results)
        stored = {c.key() for c in exp.configs if made(folder, c)}
        todo = [c for c in exp.configs if c.key() not in stored and c.key() not in self.failed_keys]
        row["planned"], row["done"] = len(exp.configs), len(stored)
        if not prepared:  # "not started": too little time left to make its data set ready
            self.left[step.name] = todo
            return
        self.log(f"== {step.name}: {len(todo)} runs (t = {self.elapsed():.0f} s)")
        while todo:
            batch, estimate = self.choose_group(todo)
            if not batch:
                if estimate > self.args.deadline:  # not even a fresh command could finish one run
                    row["status"] = "too slow"
                    self.log(f"   too slow: one run of {step.name} needs ~{estimate:.0f} s at the measured "
                             f"rate, more than the whole --deadline {self.args.deadline:.0f} s: not started "
                             "(fewer rounds, a faster precision, or checkpoints across commands)"
                             )  # fmt: skip
                else:
                    row["status"] = f"stopped by the deadline ({self.args.deadline:.0f} s)"
                    self.log(f"   deadline: no run of this step fits (its cheapest ~"
                             f"{self.cheapest(todo):.0f} s), {self.elapsed():.0f} s used")  # fmt: skip
                self.left[step.name] = todo
                break
            todo = [c for c in todo if c not in batch]
            row["status"] = "running"
            tic = time.monotonic()
            records = self.train_group(exp, batch, folder)
            self.groups_run += 1
            seconds = time.monotonic() - tic
            row["seconds"] += seconds
            rounds = sum(c.rounds for c in batch)
            self.rates[batch[0].dataset] = seconds / rounds
            self.learn(batch, records, seconds)
            failed = [c for c, r in zip(batch, records, strict=True) if r is None]
            errors = {c.key(): failure_error(folder, c) for c in failed}
            again = [c for c in batch if OUT_OF_MEMORY in errors.get(c.key(), "")] if len(batch) > 1 else []
            if again:  # the group, not its runs: they go again, first, in groups of at most half its size
                self.group_cap[batch[0].dataset] = len(batch) // 2
                todo = again + todo
                self.log(f"   out of memory in a group of {len(batch)}: its {len(again)} runs again, in "
                         f"groups of at most {len(batch) // 2}")  # fmt: skip
            for c, record in zip(batch, records, strict=True):
                what = f"{c.variant} {c.defense} / {c.attack} beta={c.local_momentum} T={c.rounds}"
                if record is not None:
                    row["done"] += 1
                    self.log(f"   done   {what}: {record['final_accuracy']:.2f}%")
                elif c not in again:
                    row["failed"] += 1
                    self.failed_keys.add(c.key())
                    self.log(f"   FAILED {what}: {errors[c.key()]}")
            self.log(f"   group of {len(batch)} in {seconds:.1f} s (estimated {estimate:.1f} s; t = "
                     f"{self.elapsed():.0f} s); {phase_line(batch, records)}")  # fmt: skip
            self.refresh_out()
            if failed:  # a sticky CUDA error would fail every later run of this process: go on in another
                from benchmarks import autotune
                from prodigy_core.seeding import resolve_device

                first = failed[0].resolved()
                autotune.check_device(resolve_device(first.device), first.precision, first.engine,
                                      errors[failed[0].key()], runs=[c.key() for c in failed])  # fmt: skip
        else:
            row["status"] = "failed" if row["failed"] else "done"
        if row["failed"] and not row["status"].startswith("failed"):
            row["status"] = f"failed ({row['status']})"

    def restart(self, broken: Any) -> int:
        """After `broken` (`autotune.BrokenDevice`): the rest of the command in a fresh process (its own CUDA
        context) without what broke it: --engines less the engine that broke (every captured engine when a
        captured one did: they share one capture path), the runs of a group that broke it not started again,
        --no-profile when the profiler did; --resume from $OUT's tarball (this command's records come
        along), --deadline what is left of this one's, a new --work; its exit code. Not restarted once the
        runs are over (the exit code then as if nothing broke), nor (EXIT_FAILED) when nothing can be left
        out (the reference engine outside a group's runs, the probe, the check), after MAX_RESTARTS
        restarts, or with less than PREPARE_MIN_S left."""
        from benchmarks import autotune
        from prodigy_core.step_variants import GRAPHED

        self.notes.append(str(broken))
        self.log(f"!! {broken}")
        left = self.args.deadline - self.elapsed()
        restarts = int(os.environ.get(RESTARTS_ENV, "0") or 0)
        engines = getattr(self.args, "engines", None) or autotune.CANDIDATES["cuda"]["engine"]
        drop = (set(GRAPHED) if broken.engine in GRAPHED
                else {broken.engine} if broken.engine in engines and broken.engine != autotune.REFERENCE[1]
                else set())  # fmt: skip
        keep, no_profile = [e for e in engines if e not in drop], broken.engine == "profiler"
        why = ("the runs are over" if self.after_runs
               else f"{broken.engine} broke it, and every run needs it"
               if not (drop or broken.runs or no_profile)
               else f"already restarted {restarts} times" if restarts >= MAX_RESTARTS
               else f"{left:.0f} s left, under {PREPARE_MIN_S:.0f} s" if left < PREPARE_MIN_S
               else None)  # fmt: skip
        if why is not None:
            self.log(f"!! not restarted: {why}")
            self.refresh_out(final=True)
            return (EXIT_FAILED if self.failed() else 0) if self.after_runs else EXIT_FAILED
        skip = [*self.skipped_runs, *broken.runs]
        self.log(f"!! restarting in a fresh process: --engines {','.join(keep)}"
                 + (", --no-profile" if no_profile else "") + (f", {len(skip)} runs left out" if skip else "")
                 + f", --resume $OUT's tarball, --deadline {left:.0f}")  # fmt: skip
        self.refresh_out()
        argv = restart_argv(getattr(self.args, "argv", None) or [], keep, self.out / "results.tar.gz", left,
                            no_profile=no_profile)  # fmt: skip
        reason = "; ".join(filter(None, [os.environ.get(REASON_ENV), str(broken)]))
        env = {
            **os.environ,
            RESTARTS_ENV: str(restarts + 1),
            SKIP_RUNS_ENV: ",".join(skip),
            REASON_ENV: reason,
        }
        return subprocess.call([sys.executable, str(Path(__file__).resolve()), *argv], env=env)

    def train_group(self, exp: Any, batch: list[Any], folder: Path) -> list[dict | None]:
        """Train `batch` (one group) of `exp` into the results; each run's record, None where it failed."""
        from prodigy_core import experiments
        from prodigy_core import results as store

        sub = dataclasses.replace(exp, configs=batch)
        experiments.run_grid(sub, results_dir=self.results, batch_runs=len(batch), progress=False)
        return [store.stored_record(folder, c.key()) for c in batch]

    def cheapest(self, todo: list[Any]) -> float:
        """The seconds the cheapest single run of `todo` whose data set is ready needs left to start
        (`needed`; inf when none)."""
        return min((self.needed([c]) for c in todo if c.dataset in self.ready), default=float("inf"))

    # --------------------------------------------------------------------------------- what comes home
    def refresh_out(self, final: bool = False) -> None:
        """Rewrite $OUT's files: summary.txt (`write_summary`, `final` once the runs are over), then the
        tarball, which holds it (written aside, then renamed: a kill never leaves half of one)."""
        self.write_summary(final)
        tmp = self.out / "results.tar.gz.part"
        with tarfile.open(tmp, "w:gz") as tar:
            for path in sorted(self.results.rglob("*.json")):
                tar.add(path, arcname=f"results/{path.relative_to(self.results)}")
            if self.log_path.exists():
                tar.add(self.log_path, arcname="log.txt")
            for name in TOP_FILES[1:]:
                if (self.work / name).exists():
                    tar.add(self.work / name, arcname=name)
        tmp.replace(self.out / "results.tar.gz")

    def write_summary(self, final: bool = False) -> None:
        lines = [f"elapsed: {self.elapsed():.0f} s of a {self.args.deadline:.0f} s deadline; "
                 f"group size {self.group_size}; profile {self.args.profile}"
                 + (" (simulated on the CPU)" if self.args.simulate else "")]  # fmt: skip
        lines += self.notes
        lines.append("step | planned | done | failed | seconds | status")
        fields = ("step", "planned", "done", "failed", "seconds", "status")
        lines += [" | ".join(f"{r[k]:.0f}" if k == "seconds" else str(r[k]) for k in fields)
                  for r in self.rows]  # fmt: skip
        started = {r["step"] for r in self.rows}
        never = [s.name for s in plan(self.args.profile, self.args.simulate) if s.name not in started]
        never += [r["step"] for r in self.rows if self.never_started(r)]
        if final or never:
            lines.append("never started: " + (", ".join(never) if never else "none"))
        if final:
            used = self.elapsed()
            left = [c for todo in self.left.values() for c in todo]
            cheapest = self.cheapest(left)
            cheapest = (
                "none left" if not left
                else f"~{cheapest:.0f} s" if cheapest < float("inf")
                else "not estimated, its data set was not prepared"
            )  # fmt: skip
            lines.append(
                f"used {used:.0f} s of the {self.args.deadline:.0f} s deadline, unused "
                f"{max(self.args.deadline - used, 0.0):.0f} s (the cheapest run left: {cheapest})"
            )
        text = "\n".join(lines) + "\n"
        (self.work / "summary.txt").write_text(text, encoding="utf-8")
        (self.out / "summary.txt").write_text(text, encoding="utf-8")

    def failed(self) -> bool:
        """A run failed, or none could start: no group trained in this command while a step's runs were left
        for want of time (`waiting`)."""
        stuck = any(map(self.waiting, self.rows)) and not any(r["seconds"] > 0 for r in self.rows)
        return stuck or any(r["status"].startswith("failed") for r in self.rows)

    @staticmethod
    def waiting(row: dict[str, Any]) -> bool:
        """A step whose runs were left for want of time: its data set not prepared ("not started"), one run
        needing more than the whole --deadline ("too slow"), or none fitting the time left."""
        status = row["status"]
        return status in ("not started", "too slow") or status.startswith("stopped by the deadline")

    @classmethod
    def never_started(cls, row: dict[str, Any]) -> bool:
        """A step left for want of time (`waiting`) before any of its runs was done, here or in a resumed
        command."""
        return cls.waiting(row) and row["seconds"] == 0 and row["done"] == 0


def throughput(driver: Driver, rounds: int = 5) -> None:
    """Images per second of one CIFAR-10 run alone and of a group of 4 (no attack), written to
    throughput.json and the log; skipped when the deadline leaves no room."""
    from prodigy_core import groups
    from prodigy_core.experiments import load_experiment, select

    exp = select(load_experiment("table1_cifar10", scale="mini"), {**TABLE1_BLOCK, "defense": ["prodigy"],
                                                                  "attack": ["none"]})  # fmt: skip
    c = exp.configs[0].replace(rounds=rounds, eval_every=rounds)
    if driver.args.simulate:
        c = (
            load_experiment("quickstart_digits", scale="smoke")
            .configs[0]
            .replace(rounds=2, eval_every=2, engine="batched")
        )
    rate = driver.rates.get(c.dataset, 1.0) * rounds * 5
    if driver.elapsed() + rate > driver.args.deadline:
        driver.log("throughput: skipped (deadline)")
        return
    images = c.rounds * c.n_clients * c.local_steps * c.batch_size
    found = {}
    for size in (1, 4):
        configs = [c.replace(seed=s, data_seed=0) for s in range(size)]  # one split: one group
        groups.run_group(configs[:1])  # warm-up (kernels, data load)
        tic = time.monotonic()
        groups.run_group(configs)
        found[f"group_of_{size}"] = images * size / (time.monotonic() - tic)
    found["note"] = f"{c.dataset} N={c.n_clients} E={c.local_steps} b={c.batch_size}, {c.rounds} rounds"
    (driver.work / "throughput.json").write_text(json.dumps(found, indent=1), encoding="utf-8")
    driver.log(f"throughput (images/s): {found}")


def phase_line(batch: list[Any], records: list[dict | None]) -> str:
    """The group's seconds per round by phase ("s/round: local a, craft b, aggregate c, eval d, rest e"):
    its members' `phase_seconds` added up (each holds its share of the shared local steps and evaluations)
    over the longest member's rounds."""
    done = [r for r in records if r and r.get("phase_seconds")]
    if not done:
        return "s/round: not recorded"
    pairs = zip(batch, records, strict=True)
    rounds = max(max(r.get("rounds_completed") or c.rounds, 1) for c, r in pairs if r)
    totals = {p: sum(r["phase_seconds"].get(p, 0.0) for r in done) / rounds for p in PHASES}
    return "s/round: " + ", ".join(f"{p} {v:.4f}" for p, v in totals.items())


def cross_device_check(driver: Driver, dataset: str) -> None:
    """A dataset's first check: its committed CPU reference (benchmarks/cross_device/<dataset>.json, made by
    scripts/cross_device_reference.py) rerun on this device; its agreement (to rounding, or within the
    spread of the CPU's two engines on it), or the round where it parts, goes into the summary. None for a
    dataset without one. --simulate: a tiny digits reference made here with the sequential engine, rerun
    with the batched one."""
    import importlib.util

    script = ROOT / "scripts" / "cross_device_reference.py"
    spec = importlib.util.spec_from_file_location("cross_device", script)
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    if not driver.args.simulate and not ref.reference_path(dataset).is_file():
        return
    try:
        if driver.args.simulate:
            fields = dict(dataset="digits", distribution="iid", defense="prodigy", attack="alie",
                          n_clients=6, n_byzantine=2, local_steps=2, local_momentum=0.9, rounds=2,
                          eval_every=1)  # fmt: skip
            reference = ref.summarise(fields, engine="sequential")
            found = ref.summarise(fields, engine="batched")
        else:
            reference = json.loads(ref.reference_path(dataset).read_text(encoding="utf-8"))
            found = ref.summarise(ref.CONFIGS[dataset], device="cuda")
        _, line = ref.compare(found, reference)
    except Exception as e:  # the check reports; the session's runs still go on (on a device that works)
        line = f"failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        driver.notes.append(f"cross-device check vs the CPU reference, {dataset}: {line}")
        driver.log(driver.notes[-1])
        import torch

        from benchmarks import autotune

        device = torch.device("cpu" if driver.args.simulate else "cuda")  # where `summarise` ran it
        autotune.check_device(device, "fp32", "the cross-device check", line)
        return
    driver.notes.append(f"cross-device check vs the CPU reference, {dataset}: {line}")
    driver.log(driver.notes[-1])


def preflight(args: argparse.Namespace) -> str | None:
    """The one-line reason the run cannot start, or None."""
    import torch

    # the data first: a GPU window is started only with its data; --simulate trains on the embedded digits
    missing = [str(args.data / p) for p in (CIFAR10_ARCHIVE, FEMNIST_FOLDER) if not (args.data / p).exists()]
    if missing and not args.simulate:
        return (f"data missing: {', '.join(missing)}; copy ../shared/data/cifar10-jpeg and femnist-leaf-24 "
                f"into {args.data} (benchmarks/README.md)")  # fmt: skip
    if not args.simulate and not torch.cuda.is_available():
        return "no CUDA device here (use --simulate for the CPU rehearsal)"
    if args.resume is not None:  # read whole now: a truncated or oversized one stops before $OUT is written
        try:
            args.resumed = read_tarball(args.resume, who="gpu_run --resume")
        except Refused as e:
            return f"--resume {e}"
    given = getattr(args, "autotune", None)
    if given is not None and not given.is_file():
        return f"--autotune {given}: no such file (an earlier autotune.json; leave it out to tune here)"
    if getattr(args, "work", None) is not None:
        try:
            args.work.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return f"--work {args.work} is not a folder that can be used ({e.strerror or e}); pass a folder"
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        probe = args.out / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        return f"$OUT={args.out} is not writable: {e.strerror or e}"
    return None


def read_data_from(data: Path, scratch: Path) -> None:
    """Point the data loaders at the driver's `data` folder only: FEMNIST's writers are read in place,
    CIFAR-10 from `scratch`, where its JPEG copy is decoded; never this machine's other data folders."""
    os.environ["PRODIGY_DATA_DIR"] = str(scratch)
    os.environ["PRODIGY_FEMNIST_DIR"] = str(data / FEMNIST_FOLDER)


def run(args: argparse.Namespace) -> int:
    reason = preflight(args)
    if reason:
        print(f"gpu_run: error: {reason}", file=sys.stderr)
        return EXIT_PREFLIGHT
    work = Path(args.work or tempfile.mkdtemp(prefix="prodigy-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    read_data_from(args.data, work / "data")
    os.environ["PRODIGY_PROGRESS"] = "text"
    flags = set_precision()
    env = environment_text(flags, args.simulate)
    for folder in (work, args.out):
        (folder / "env.txt").write_text(env, encoding="utf-8")  # first, before any training
    driver = Driver(args, work, start=getattr(args, "started", None))
    driver.log(env.rstrip())
    if args.resume:  # an earlier command's records: its finished runs are not run again
        earlier = {}
        for name, content in resumed_members(args).items():
            if name.startswith("results/"):  # the records, as `import_results` reads them
                target = work / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
            else:
                earlier[name] = content
        if "profile.txt" in earlier:  # kept unless this command profiles anew (--no-profile: it does not)
            (work / "profile.txt").write_bytes(earlier["profile.txt"])
        keep_earlier_commands(work, earlier, args.resume)
        driver.log(f"resumed from {args.resume}: {len(list((work / 'results').rglob('*.json')))} records")
    from benchmarks.autotune import BrokenDevice
    from prodigy_core.training import shared_federations

    try:
        with shared_federations():  # every data set loaded once in this process
            return drive(driver, args, work)
    except BrokenDevice as broken:
        return driver.restart(broken)


def restart_argv(
    argv: list[str], engines: list[str], resume: Path, deadline: float, no_profile: bool = False
) -> list[str]:
    """`argv` (a command's arguments, unabbreviated: the parser allows no abbreviation) without --engines,
    --resume, --deadline, --work and --autotune (either form), then these `engines`, `resume` (whose
    autotune.json holds this command's) and `deadline`, and --no-profile when asked (`Driver.restart`; a
    new --work: a temporary folder)."""
    replaced = ("--engines", "--resume", "--deadline", "--work", "--autotune")
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in replaced:
            skip = True
        elif not arg.startswith(tuple(f"{name}=" for name in replaced)):
            out.append(arg)
    extra = ["--no-profile"] if no_profile and "--no-profile" not in out else []
    return [*out, "--engines", ",".join(engines), "--resume", str(resume), "--deadline", f"{deadline:.0f}",
            *extra]  # fmt: skip


def resumed_members(args: argparse.Namespace) -> dict[str, bytes]:
    """The --resume tarball's members, {name: content} as `read_tarball` names them, read once (`preflight`
    reads it whole before anything is written)."""
    if getattr(args, "resumed", None) is None:
        args.resumed = read_tarball(args.resume, who="gpu_run --resume")
    return dict(args.resumed)


def trained_share(batch: list[Any]) -> float:
    """The share of a group's client rows that train: a run's idle Byzantine clients take no local step
    (`attacks.idle_byzantine`)."""
    from prodigy_core.attacks import idle_byzantine

    idle = [idle_byzantine(c.attack, c.n_byzantine, c.variant, c.attack_params) for c in batch]
    return sum(1 - k / c.n_clients for k, c in zip(idle, batch, strict=True)) / len(batch)


def share_key(dataset: str, share: float) -> tuple[str, float]:
    """`Driver.share_factor`'s key: equal shares of different groups (float sums) fall together."""
    return dataset, round(share, 3)


def guarded(driver: Driver, what: str, call: Callable[[], Any]) -> None:
    """`call()`, an error of it logged and noted in summary.txt instead of ending the command: for the steps
    around the runs, whose failure must not cost the window its runs."""
    try:
        call()
    except Exception as e:  # noqa: BLE001
        note = f"{what} failed ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
        driver.notes.append(note)
        driver.log(note)


def init_profiler_for_cuda_graphs() -> None:
    """torch.profiler started once, on CUDA, before any CUDA graph is captured: profiling the replay of a
    graph captured before the profiler's first use has raised illegal memory accesses, which end the process
    (pytorch/pytorch#75504; torch's workaround, #100441). The captured engines (`step_variants.GRAPHED`)
    capture theirs in the autotune, before the profiling step."""
    import torch

    if torch.cuda.is_available():
        from torch.profiler._utils import _init_for_cuda_graphs

        _init_for_cuda_graphs()


def profile_tables(prof: Any, cuda: bool, rows: int = PROFILE_ROWS) -> str:
    """A finished torch.profiler's top `rows` CUDA kernels (when `cuda`) and CPU ops by their own time."""
    averages = prof.key_averages()
    tables = [("CUDA kernels", "self_cuda_time_total")] if cuda else []
    tables.append(("CPU ops", "self_cpu_time_total"))
    text = ""
    for title, key in tables:
        text += f"\n## top {rows} {title} by {key}\n\n"
        text += averages.table(sort_by=key, row_limit=rows, max_name_column_width=60) + "\n"
    return text


OUT_OF_MEMORY = "OutOfMemoryError"  # torch.OutOfMemoryError, in a failure record's error


def failure_error(folder: Path, config: Any) -> str:
    """The error of `config`'s failure record in `folder` ("no record" without one)."""
    from prodigy_core import results as store

    failure = store.failure_path(folder, config.key())
    try:
        return str(json.loads(failure.read_text(encoding="utf-8")).get("error", "?"))
    except (OSError, ValueError, AttributeError):
        return "no record"


def made(folder: Path, config: Any) -> bool:
    """Whether `config`'s cell has a record in `folder` at any precision: each was the fp32 reference or
    passed the gate of the window that chose it, so each is the same computation statistically, and a
    window whose autotune chooses another precision than an earlier one's does not make the cell again."""
    from prodigy_core import results as store
    from prodigy_core.config import PRECISIONS

    return any(store.stored_record(folder, config.replace(precision=p).key()) is not None for p in PRECISIONS)


def keep_earlier_commands(work: Path, files: dict[str, bytes], tarball: Path) -> None:
    """work/EARLIER_LOG, which the tarball carries home (`Driver.refresh_out`): the resumed tarball's own
    EARLIER_LOG (the commands before it), then its env.txt, summary.txt, autotune.json and log.txt under a
    heading naming it; nothing when it has none of them."""
    parts = [files[EARLIER_LOG].decode("utf-8", "replace").rstrip("\n")] if EARLIER_LOG in files else []
    kept = [name for name in ("env.txt", "summary.txt", "autotune.json", "log.txt") if name in files]
    if kept:
        parts.append(f"===== an earlier command, resumed from {tarball} =====")
        parts += [
            f"----- {name} -----\n" + files[name].decode("utf-8", "replace").rstrip("\n") for name in kept
        ]
    if parts:
        (work / EARLIER_LOG).write_text("\n".join(parts) + "\n", encoding="utf-8")


def drive(driver: Driver, args: argparse.Namespace, work: Path) -> int:
    """The plan's steps, each dataset made ready when its first step comes up (`Driver.prepare`), the first
    step's profiled (`run` after the preflight and the setup)."""
    driver.refresh_out()  # the resumed records, env and log come home even if what follows hangs
    first = driver.experiment(plan(args.profile, args.simulate)[0]).configs[0]
    profiling = getattr(args, "profile_step", True)
    if profiling:
        guarded(driver, "the profiler's start", init_profiler_for_cuda_graphs)  # before any graph's capture
    driver.prepare(first.dataset, first, first=True)
    driver.refresh_out()  # the autotune's measurements
    if profiling:
        driver.profile()
    driver.refresh_out()
    steps = plan(args.profile, args.simulate)
    while steps:  # a step the deadline stopped leaves the time left to the runs of later steps that fit,
        ran = driver.groups_run  # and is taken up again while a pass started something (estimates change)
        for step in steps:
            if args.fail_step == step.name:  # the CI test's failing step
                step = dataclasses.replace(step, only={"defense": ["no-such-rule"]})
            driver.run_step(step)
            driver.refresh_out()
        stopped = {name for name in driver.left if driver.left[name]}
        steps = (
            [s for s in plan(args.profile, args.simulate) if s.name in stopped]
            if driver.groups_run > ran
            else []
        )
    if args.profile == "mini" and not args.fail_step:
        throughput(driver)
    driver.refresh_out(final=True)  # $OUT's and the tarball's: a kill in the timings below keeps them whole
    driver.after_runs = True
    guarded(driver, "the timings left out", driver.time_left_out)
    driver.refresh_out(final=True)
    driver.log((work / "summary.txt").read_text().rstrip())
    return EXIT_FAILED if driver.failed() else 0


# ---------------------------------------------------------------------------------------------- import
MAX_MEMBER_BYTES = 64 * 2**20  # a record is a few KB, the log a few MB: a bigger member is refused unread
# The expanded tarball (every member's declared size and its header), checked before a member is read: what
# $OUT brings home (16 MiB a file) expands to far less; a 2.4 MB tarball of zeros declared 2.5 GB.
MAX_TOTAL_BYTES, MAX_MEMBERS = 512 * 2**20, 200_000
EARLIER_LOG = "log-earlier-commands.txt"  # a --resume command's record of the commands before it
# What `Driver.refresh_out` writes beside the records.
TOP_FILES = (
    "log.txt",
    "env.txt",
    "summary.txt",
    "throughput.json",
    "autotune.json",
    "profile.txt",
    EARLIER_LOG,
)
SCALE_SUFFIXES = ("", "smoke", "mini")  # a results folder: <params name>[-smoke|-mini] (`results_name`)


class Refused(Exception):
    """A results tarball or an import's folders that cannot be used: the message is one line."""


def tar_member_kind(member: tarfile.TarInfo) -> str | None:
    """Why a member of a results tarball is skipped (None: import it): only regular files of the kinds
    `Driver.refresh_out` writes (results/<folder>/<key>[.failed].json, TOP_FILES), at most
    MAX_MEMBER_BYTES, are imported."""
    name = Path(member.name)
    if not member.isfile():
        return "not a regular file"
    if member.size > MAX_MEMBER_BYTES:
        return f"{member.size:,} bytes, over {MAX_MEMBER_BYTES:,}"
    record = (len(name.parts) == 3 and name.parts[0] == "results" and name.suffix == ".json"
              and all(p not in ("", ".", "..") for p in name.parts))  # fmt: skip
    if not record and name.as_posix() not in TOP_FILES:
        return "not a record (results/<folder>/<key>.json) nor one of " + ", ".join(TOP_FILES)
    return None


def expanded_bytes(path: Path, limit: int) -> int:
    """The bytes of `path`'s tar stream decompressed (gzip, bzip2, xz, or none: by its first bytes), counted
    up to `limit` + 1 without parsing a tar header (tarfile reads a pax or long-name header whole, whatever
    size it declares), and read to the compressed stream's end when it fits, so that its CRC and length
    checks run. Corrupted data raises (OSError, EOFError, zlib.error, lzma.LZMAError)."""
    with path.open("rb") as fh:
        magic = fh.read(6)
    openers = {b"\x1f\x8b": gzip.open, b"BZh": bz2.open, b"\xfd7zXZ": lzma.open}
    opener = next((o for m, o in openers.items() if magic.startswith(m)), None)
    if opener is None:
        return path.stat().st_size
    total = 0
    with opener(path, "rb") as stream:
        while total <= limit and (chunk := stream.read(2**20)):
            total += len(chunk)
    return total


def read_tarball(path: Path, who: str = "gpu_run import") -> list[tuple[str, bytes]]:
    """(name, content) of each member of a results tarball to import, read whole before anything is written:
    Refused (one line) when it is missing, not a tar archive, truncated, corrupted (its compressed stream's
    CRC or length), or expands past MAX_TOTAL_BYTES (the decompressed stream, `expanded_bytes`, before tarfile
    reads any header) or MAX_MEMBERS (each member's declared size checked before it is read). A member
    `tar_member_kind` skips, or a second member of a name already read (tar would keep the last copy, a
    listing both), is skipped with a warning naming it."""
    if not path.is_file():
        raise Refused(f"{path}: no such file (an earlier command's results.tar.gz)")
    members: list[tuple[str, bytes]] = []
    seen: set[str] = set()
    total = 0

    def too_big(at: str) -> Refused:
        return Refused(f"{path}: expands past {MAX_TOTAL_BYTES:,} bytes or {MAX_MEMBERS:,} members (at "
                       f"{at}): not a results tarball of gpu_run.py; nothing imported")  # fmt: skip

    try:
        if expanded_bytes(path, MAX_TOTAL_BYTES) > MAX_TOTAL_BYTES:
            raise too_big("its decompressed stream")
        with tarfile.open(path, "r:*") as tar:
            for count, member in enumerate(tar, start=1):  # lazily: a header at a time
                total += tarfile.BLOCKSIZE + -(-max(member.size, 0) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
                if total > MAX_TOTAL_BYTES or count > MAX_MEMBERS:
                    raise too_big(repr(member.name))
                name = Path(member.name).as_posix()
                why = tar_member_kind(member)
                if why is None and name in seen:
                    why = "a second member of this name (the first one is imported)"
                if why is not None:
                    print(f"{who}: skipped {member.name!r}: {why}", file=sys.stderr)
                    continue
                seen.add(name)
                members.append((name, tar.extractfile(member).read()))
    except (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError) as e:  # gzip's CRC: OSError
        why = " ".join(str(e).split())  # tarfile's "could not be opened" lists each method on a line
        raise Refused(
            f"{path}: not a tar archive, or a truncated or corrupted one ({type(e).__name__}: {why}); "
            "nothing read"
        ) from None
    return members


def read_record(content: bytes, file_name: str) -> tuple[dict, bool, str | None]:
    """(record, whether its key is current, None), or ({}, False, why it is skipped): not UTF-8 JSON, not an
    object, no config or an invalid one, or a current key whose record is invalid (`results.check_record`).
    Imports no code: the key comes from the stored fields and plug-in hashes (`results.record_config_key`)."""
    from prodigy_core import results as store
    from prodigy_core.config import ConfigError

    try:
        record = json.loads(content.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError too; nesting past the recursion limit
        return {}, False, f"not JSON ({e})"
    if not isinstance(record, dict):
        return {}, False, f"not a JSON object ({type(record).__name__})"
    try:
        current = store.record_config_key(record) == record.get("key")
    except (ConfigError, TypeError, KeyError) as e:
        return {}, False, f"no config or an invalid one ({e})"
    why = store.check_record(record, Path(file_name)) if current else None
    return record, current, why


def folder_error(folder: str) -> str | None:
    """Why a tarball's results folder is not one a report can be made of (None: it is): its name is
    `<params file>[-smoke|-mini]` (`Experiment.results_name`), the params file one of `paths.params_dirs`'
    (never a file of the current folder)."""
    from prodigy_core import paths

    name, _, scale = folder.partition("-")
    if scale not in SCALE_SUFFIXES:
        return f"results folder {folder!r}: scale {scale!r} is not one of smoke, mini (none: paper)"
    if not any((params / f"{name}.yaml").is_file() for params in paths.params_dirs()):
        return f"results folder {folder!r}: no params file {name!r}"
    return None


def check_roots(*roots: Path) -> None:
    """Refused (one line) when an import's results or figures root, or its gpu/ folder, is not a folder."""
    for root in roots:
        for folder in (root, root / "gpu"):
            if folder.exists() and not folder.is_dir():
                raise Refused(f"{folder} is not a folder; pass --results-root / --figures-root folders")


def import_results(tarball: Path, results_root: Path, figures_root: Path) -> list[Path]:
    """Unpack the records into results_root/gpu/; the reports and PROVENANCE.md into figures_root/gpu/.
    Records are data: their keys are checked from their stored fields and plug-in hashes, no code is
    imported (`results.record_config_key`); a member of another kind, too big, a second copy of a name, a
    record that is not valid JSON with a valid config, or one in a folder no params file makes
    (`folder_error`) is skipped with a warning naming it. The tarball is read whole first (`read_tarball`):
    one that cannot be read or expands too far is Refused before anything is written. One report per
    precision and data source of a folder's records (`report.write_report`: bf16's named as such)."""
    from prodigy_core import results as store
    from prodigy_core.experiments import load_experiment
    from prodigy_core.report import write_report

    check_roots(results_root, figures_root)
    members = read_tarball(tarball)
    results_dir, figures_dir = results_root / "gpu", figures_root / "gpu"
    records: list[tuple[str, dict, bool]] = []  # (results folder, record, its key is current)
    files: list[tuple[Path, bytes]] = []
    for member, content in members:
        name = Path(member)
        if name.parts[0] == "results":
            why = None
            if ".failed" not in name.name:
                record, current, why = read_record(content, name.name)
            why = why or folder_error(name.parent.name)
            if why is not None:
                print(f"gpu_run import: skipped {member!r}: {why}", file=sys.stderr)
                continue
            if ".failed" not in name.name:
                records.append((name.parent.name, record, current))
                if not current:  # e.g. an older AUTHORS_REVISION: listed in PROVENANCE.md, not reported
                    continue
        target = (
            results_dir / name.relative_to("results") if name.parts[0] == "results" else figures_dir / name
        )
        files.append((target, content))
    try:
        figures_dir.mkdir(parents=True, exist_ok=True)
        for target, content in files:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
    except OSError as e:
        raise Refused(f"cannot write {e.filename}: {e.strerror or e}") from None
    stale = sum(not current for _, _, current in records)
    if stale:
        print(
            f"{stale} records of the tarball have keys the current code no longer makes (an older "
            "revision of a variant or of the streams): listed in PROVENANCE.md as not current, left out of "
            "the reports",
            file=sys.stderr,
        )
    written = []
    for folder in sorted({f for f, _, current in records if current}):
        name, _, scale = folder.partition("-")
        # the records' data source and precision, not this machine's (which may have no CIFAR-10): their keys'
        settings = {(r["config"].get("data_source"), r["config"].get("precision", "fp32"))
                    for f, r, current in records if f == folder and current}  # fmt: skip
        for source, precision in sorted(settings, key=str):
            fields = {"precision": precision, **({"data_source": source} if source is not None else {})}
            try:  # the records are in; a report that cannot be made says why in one line
                exp = load_experiment(name, scale=scale or "paper", fields=fields)
                for variant in ("paper", "authors"):
                    v = exp.with_variant(variant)
                    df = store.load(v, results_dir)
                    if df.empty:
                        continue
                    out = figures_dir if variant == "paper" else figures_dir / "authors"
                    written += write_report(v, df, out, results_dir=results_dir)
            except Exception as e:  # noqa: BLE001 - the records are in: one line, then the other reports
                why = " ".join(str(e).split())
                print(f"gpu_run import: no report of {folder} at {fields}: {type(e).__name__}: {why}",
                      file=sys.stderr)  # fmt: skip
    if not records:  # a tarball of logs alone (or the wrong file): its rows would replace PROVENANCE.md's
        print(f"gpu_run import: {tarball} holds no run record (results/<folder>/<key>.json): "
              f"{figures_dir / 'PROVENANCE.md'} left as it is", file=sys.stderr)  # fmt: skip
        return written
    imported = {target for target, _ in files}
    earlier = [p for p in results_dir.rglob("*.json") if p not in imported and ".failed" not in p.name]
    written.append(write_provenance(records, figures_dir, len(earlier)))
    return written


def provenance_cell(value: Any, limit: int = 60) -> str:
    """A value as one Markdown table cell: no pipe or line break of its own, at most `limit` characters."""
    text = " ".join(str(value).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def write_provenance(records: list[tuple[str, dict, bool]], figures_dir: Path, earlier: int = 0) -> Path:
    """figures_dir/PROVENANCE.md: env.txt, summary.txt and one row per record of the tarball, (results
    folder, record, whether its key is current) as `import_results` read them (a record whose key the
    current code no longer makes, e.g. an `authors` record of an older `AUTHORS_REVISION`, is listed with
    "current: no": the reports leave it out), and how many records of results/gpu/ came from `earlier`
    imports (the reports use them too; this file does not describe them). The precision is the config's
    (the key's), not the record's environment; a field a record lacks shows its default, an odd one as text
    (`provenance_cell`); a record that cannot be listed says why in one line and has a row saying so."""
    from prodigy_core.config import field_defaults
    from prodigy_core.results import finite_number

    defaults = field_defaults()

    def text(name: str, missing: str) -> str:  # as the tarball brought it, whatever its bytes
        path = figures_dir / name
        return path.read_text(encoding="utf-8", errors="replace") if path.exists() else missing

    env, summary = text("env.txt", "(no env.txt)\n"), text("summary.txt", "")
    rows = []
    setting = ("variant", "defense", "attack")

    def field(r: dict, k: str) -> Any:  # a stale record is listed as it is, with defaults where it is partial
        return r["config"].get(k, defaults.get(k))

    def cells(folder: str, r: dict, current: bool) -> list[Any]:
        e = r.get("environment") if isinstance(r.get("environment"), dict) else {}
        times = r.get("round_times")
        seconds = (
            f"{sum(float(t) for t in times if finite_number(t)):.1f}" if isinstance(times, list) else "n/a"
        )
        accuracy = r.get("final_accuracy")
        accuracy = f"{accuracy:.2f}" if finite_number(accuracy) else accuracy
        phases = r.get("phase_seconds") if isinstance(r.get("phase_seconds"), dict) else {}
        spent = "/".join(f"{phases[p]:.0f}" if finite_number(phases.get(p)) else "-" for p in PHASES)
        return [folder, *(field(r, k) for k in (*setting, "local_momentum", "rounds")), accuracy, seconds,
                spent, e.get("gpu", e.get("device")), e.get("torch"), field(r, "precision"),
                f"{e.get('tf32_matmul')}/{e.get('tf32_cudnn')}", e.get("deterministic"),
                "yes" if current else "no"]  # fmt: skip

    for folder, r, current in sorted(
        records, key=lambda fr: (fr[0], *(str(field(fr[1], k)) for k in setting))
    ):
        try:
            row = cells(folder, r, current)
        except Exception as e:  # noqa: BLE001 - one odd record never costs PROVENANCE.md the others
            why = f"not listed ({type(e).__name__}: {' '.join(str(e).split())})"
            print(
                f"gpu_run import: PROVENANCE.md: record {r.get('key')!r} of {folder}: {why}", file=sys.stderr
            )
            row = [folder, f"record {r.get('key')!r} {why}"]
        rows.append("| " + " | ".join(provenance_cell(c) for c in row) + " |")
    others = (
        f"\n{earlier} records of results/gpu/ came from earlier imports: the reports of their folders use "
        "them too; this file does not describe them (their env and summary were those imports').\n"
        if earlier
        else ""
    )
    path = figures_dir / "PROVENANCE.md"
    path.write_text(
        "# Provenance of the GPU outputs in this folder\n\n"
        "Made by `benchmarks/gpu_run.py` on the device machine, imported with `gpu_run.py import`. "
        "CIFAR-10 is the JPEG copy. The machine and precision as the run recorded them (env.txt):\n\n"
        "```\n" + env + "```\n\nThe run's summary (summary.txt; a command started with `--resume` counts the "
        f"runs of the commands before it as done; their env, summary, autotune and logs: {EARLIER_LOG}, when "
        "there is one):\n\n```\n" + summary + "```\n\n"
        "## Runs\n\nSeconds: the sum of a run's per-round times (evaluations excluded). Phases: its seconds "
        "of local steps / attack craft / aggregation / evaluation / the rest, summed over its rounds "
        "(`phase_seconds`; a group's members count their share of the shared local steps and evaluations; - "
        "where the record has none). Precision: the run's config (its key).\n\n"
        "| results | variant | defense | attack | beta | rounds | accuracy (%) | seconds | phases (s) | GPU "
        "| torch | precision | TF32 matmul/cudnn | deterministic | current |\n"
        + "|---" * 15
        + "|\n"
        + "\n".join(rows)
        + "\n"
        + others,
        encoding="utf-8",
    )
    return path


def engines_arg(text: str) -> tuple[str, ...]:
    """--engines: names of engines the autotune can time (`autotune.engine_candidates` on CUDA)."""
    from benchmarks import autotune

    known = autotune.engine_candidates("cuda")
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: engines among {', '.join(known)}, comma-separated")
    return names


def group_size_arg(text: str) -> int:
    """--group-size: a whole number of runs >= 1 (0 would train nothing and stop as at the deadline)."""
    from prodigy_core.cli import count_arg

    return count_arg(text.strip(), "a number of runs", ", e.g. --group-size 16")


def seconds_arg(text: str) -> float:
    """--deadline: a finite number of seconds > 0."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: a number of seconds > 0, e.g. --deadline 500")
    return seconds


def main(argv: list[str] | None = None, started: float | None = None) -> int:
    """`started`: the --deadline's origin on `time.monotonic`'s clock (the script passes PROCESS_START; None:
    when the driver starts, as tests with a fake clock want)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["import"]:
        p = argparse.ArgumentParser(prog="gpu_run.py import", description="unpack, report, provenance")
        p.add_argument("tarball", type=Path)
        p.add_argument("--results-root", type=Path, default=ROOT / "results")
        p.add_argument("--figures-root", type=Path, default=ROOT / "figures")
        a = p.parse_args(argv[1:])
        try:
            paths = import_results(a.tarball, a.results_root, a.figures_root)
        except Refused as e:
            print(f"gpu_run import: error: {e}", file=sys.stderr)
            return EXIT_PREFLIGHT
        for path in paths:
            print(path)
        return 0
    # no abbreviations: `restart_argv` replaces options by their full names
    p = argparse.ArgumentParser(prog="gpu_run.py", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument(
        "--data", type=Path, default=ROOT / "gpu-data", help="holds cifar10-jpeg/ and femnist-leaf-24/"
    )
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")), help="default: $OUT")
    p.add_argument("--work", type=Path, help="records, decoded data, log (default: a temporary folder)")
    p.add_argument(
        "--deadline", type=seconds_arg, default=500.0, help="seconds of work before no group starts"
    )
    p.add_argument("--profile", choices=("paper", "mini"), default="paper")
    sizing = "at most this many runs per group (sized from the autotune's rates to fit the deadline)"
    p.add_argument("--group-size", type=group_size_arg, default=16, help=sizing)
    p.add_argument("--simulate", action="store_true", help="the CPU rehearsal over a tiny digits grid")
    p.add_argument("--resume", type=Path, help="an earlier results.tar.gz: skip its cells, at any precision")
    p.add_argument("--autotune", type=Path, help="an earlier autotune.json, reused on the same GPU and "
                   "software (default: the --resume tarball's)")  # fmt: skip
    p.add_argument("--no-profile", dest="profile_step", action="store_false",
                   help="skip the torch.profiler step (profile.txt)")  # fmt: skip
    p.add_argument("--engines", type=engines_arg, help="comma-separated: the only engines the autotune times "
                   "(batched, the reference, always), e.g. batched,channels_last after an engine broke a "
                   "command (default: autotune.engine_candidates)")  # fmt: skip
    p.add_argument("--fail-step", help=argparse.SUPPRESS)  # tests: make this step fail
    p.set_defaults(tolerances=None)  # tests: the gate's tolerances (None: autotune.TOLERANCES)
    args = p.parse_args(argv)
    args.started, args.argv = started, list(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main(started=PROCESS_START))
