"""The `prodigy-fl` command line: run one config, run a params grid, report it, quickstart, data, reproduce.

    prodigy-fl run [PARAMS.yaml] [--set key=value ...] [--json]
    prodigy-fl grid PARAMS.yaml [--smoke | --mini] [--dry-run] [--executor local|ray] [--jobs N|auto]
        [--force] [--batch-runs K]
    prodigy-fl report PARAMS.yaml [--smoke | --mini] [--set key=value ...]
    prodigy-fl quickstart [--smoke] [--jobs N|auto] [--seeds N]
    prodigy-fl data cifar10 [DIR] [--from JPEG_COPY] | prodigy-fl data femnist [PATH]
    prodigy-fl reproduce [--scale smoke|mini|paper] [--only NAME ...]
    prodigy-fl init [DIR]

Entry point: `main` (the console script; each command is a `cmd_*` function). It reproduces the ProDiGy
paper's tables and figures from params/ (docs/usage.md's table of paper items).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import prodigy_core
from prodigy_core import paths
from prodigy_core.config import (
    SETTINGS_FIELDS,
    ConfigError,
    RunConfig,
    SettingsUpdate,
    as_row,
    field_names,
    parse_value,
)
from prodigy_core.registry import records_are_data

EXIT_USAGE = 2
# JupyterLab and ipywidgets are the `lab` extra: a plain install has neither.
LAB_HINT = "pip install 'prodigy-fl[lab]' && jupyter lab notebooks/"
# The full quickstart's wall time as the README states it ("Wall time of ..."; from docs/timings.md).
QUICKSTART_TIME = "about 3 minutes on a 2-core AVX-512 CPU"


def main(argv: list[str] | None = None) -> int:
    """Run one `prodigy-fl` command; returns its exit status.

    Outputs go to the project folder (`prodigy_core.paths`): the nearest ancestor of the working directory
    that holds params/, else the working directory; env PRODIGY_RESULTS_DIR, PRODIGY_FIGURES_DIR,
    PRODIGY_DATA_DIR win. Bad input (an unknown field, an impossible config, a missing file, a results
    folder that cannot be written, a full disk) ends with one line `prodigy-fl: error: ...` and exit status
    2, never a traceback; warnings (an invalid record moved aside, an unreadable checkpoint) are one line
    `prodigy-fl: warning: ...`.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warning_line
            return args.command(args) or 0
    except (ConfigError, ValueError, FileNotFoundError, ImportError) as e:
        print(f"prodigy-fl: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # a full disk, a read-only or missing folder: what and where, not a traceback
        where = f": {e.filename}" if e.filename else ""
        print(f"prodigy-fl: error: {e.strerror or e}{where}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(
            "prodigy-fl: interrupted; finished runs are stored, rerun the same command to resume",
            file=sys.stderr,
        )
        return 130


def _warning_line(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
    print(f"prodigy-fl: warning: {message}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prodigy-fl",
        description="Byzantine-robust federated learning experiments (ProDiGy reproduction).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {prodigy_core.__version__}")
    sub = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")

    def results_dir(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--results-dir",
            type=Path,
            help=f"results folder (default: {paths.describe(paths.ENV_RESULTS, 'results')})",
        )

    def scale(p: argparse.ArgumentParser, smoke_help: str) -> None:
        group = p.add_mutually_exclusive_group()
        group.add_argument("--smoke", action="store_true", help=smoke_help)
        group.add_argument(
            "--mini", action="store_true",
            help="the mini scale: the paper's settings, the params file's `mini` rounds, one seed",
        )  # fmt: skip

    figures_help = f"tables and figures (default: {paths.describe(paths.ENV_FIGURES, paths.OUTPUTS)})"

    p = sub.add_parser("run", help="run one config (defaults, a params file, --set overrides)")
    p.add_argument("params", nargs="?", help="params file or name; it must come down to one run after --set")
    p.add_argument("--set", dest="fields", action="append", default=[], metavar="KEY=VALUE",
                   help="set a run field, e.g. --set rounds=50 (repeatable)")  # fmt: skip
    p.add_argument(
        "--smoke", action="store_true", help="the smoke profile: a few rounds on a stand-in dataset"
    )
    p.add_argument("--json", action="store_true", help="print the result record as JSON on stdout")
    p.add_argument("--force", action="store_true", help="rerun even when a record for this config exists")
    results_dir(p)
    p.set_defaults(command=cmd_run)

    p = sub.add_parser("grid", help="run every config of a params file (resumable)")
    p.add_argument("params", help="params file, or a name in the project's params/ or the package's")
    p.add_argument("--set", dest="fields", action="append", default=[], metavar="KEY=VALUE",
                   help="pin a run field in every run, e.g. --set device=cuda (repeatable)")  # fmt: skip
    scale(p, "the smoke profile: seconds, stand-in datasets (CI)")
    p.add_argument(
        "--dry-run", action="store_true", help="print the runs it would make and their count; run none"
    )
    p.add_argument("--only", action="append", default=[], metavar="KEY=V1,V2",
                   help="run only the runs whose field KEY takes one of these values, e.g. --only "
                        "defense=prodigy,nnm+trimmed_mean (repeatable: every condition holds)")  # fmt: skip
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="local: this machine (see --jobs, default); ray: a Ray cluster")  # fmt: skip
    p.add_argument("--jobs", type=jobs_arg, default=1,
                   help="local: worker processes (default 1; auto: one per CPU core, one thread each); "
                   "ray: CPUs of a local runtime")  # fmt: skip
    p.add_argument("--force", action="store_true",
                   help="rerun runs that have a record, from round 0 (checkpoints ignored)")  # fmt: skip
    p.add_argument("--address", help="ray: join this cluster (e.g. auto, ray://head:10001)")
    p.add_argument("--num-cpus", type=float, default=1, help="ray: CPUs per run (default 1)")
    p.add_argument(
        "--num-gpus", type=float, default=0, help="ray: GPUs per run, fractions allowed (0.25: 4 per GPU)"
    )
    p.add_argument(
        "--batch-runs", type=batch_runs, default="auto", metavar="K",
        help="train up to K compatible runs as one batched group (auto: where faster; 1: one at a time)",
    )  # fmt: skip
    results_dir(p)
    p.set_defaults(command=cmd_grid)

    p = sub.add_parser("report", help="tables and figures from the stored results of a params file")
    p.add_argument("params", help="params file or name")
    p.add_argument("--set", dest="fields", action="append", default=[], metavar="KEY=VALUE",
                   help="pin a run field as the grid did, e.g. --set variant=authors")  # fmt: skip
    scale(p, "report the smoke results")
    p.add_argument("--out-dir", type=Path, help=figures_help)
    results_dir(p)
    p.set_defaults(command=cmd_report)

    about = f"the digits grid (all defenses x all attacks, 42 runs; {QUICKSTART_TIME}), then its report"
    p = sub.add_parser("quickstart", help=about, description=about[0].upper() + about[1:] + ".")
    p.add_argument(
        "--smoke", action="store_true", help=f"a shrunk grid on 6 runs: seconds instead of {QUICKSTART_TIME}"
    )
    p.add_argument("--jobs", type=jobs_arg, default="auto",
                   help="worker processes running the grid (default auto: one per CPU core, one thread "
                   "each, so that its numbers do not depend on the core count)")  # fmt: skip
    p.add_argument("--seeds", type=seeds_arg, default=1,
                   help="seeds 0..N-1, each its own Dirichlet split: the table as mean ± std, written as "
                   "quickstart_digits_<N>seeds.* (default 1: quickstart_digits.*; 3: the README's table, "
                   "3x the time)")  # fmt: skip
    p.add_argument("--out-dir", type=Path, help=figures_help)
    results_dir(p)
    p.set_defaults(command=cmd_quickstart)

    p = sub.add_parser(
        "data", help="get CIFAR-10 (download, or decode the JPEG copy) or check a LEAF FEMNIST directory"
    )
    p.add_argument("dataset", choices=("cifar10", "femnist"))
    p.add_argument(
        "path", nargs="?", type=Path,
        help=f"cifar10: the data folder (default: {paths.describe(paths.ENV_DATA, 'data')}); femnist: the "
        "LEAF directory (default: the folders found, env PRODIGY_FEMNIST_DIR and ../shared/data)",
    )  # fmt: skip
    p.add_argument("--from", dest="source", type=Path, metavar="JPEG_COPY",
                   help="cifar10: decode the JPEG copy (cifar10-jpeg.tar.gz or its unpacked folder) "
                   "instead of downloading")  # fmt: skip
    p.set_defaults(command=cmd_data)

    p = sub.add_parser("reproduce", help="every paper table and figure, then the reports")
    p.add_argument("--scale", choices=("smoke", "mini", "paper"), default="smoke",
                   help="smoke: minutes, stand-in datasets (default); mini: the paper's grids with fewer "
                   "rounds and one seed; paper: the full grids")  # fmt: skip
    p.add_argument("--only", nargs="+", metavar="NAME",
                   help="only these notebooks, by name or file (e.g. table1_cifar10 or "
                   "notebooks/00_quickstart.ipynb)")  # fmt: skip
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="where the notebooks run their grids: local or ray (default local)")  # fmt: skip
    p.add_argument("--jobs", type=jobs_arg,
                   help="worker processes of each grid (default: 1 at smoke scale, else auto: one "
                   "single-threaded process per CPU core, one on a GPU), as `grid --jobs`")  # fmt: skip
    p.set_defaults(command=cmd_reproduce)

    p = sub.add_parser("init", help="make a project folder: notebooks, params, empty results/ outputs/ data/")
    p.add_argument("dir", nargs="?", type=Path, default=Path("."), help="the folder (default: the current)")
    p.set_defaults(command=cmd_init)

    about = "once per clone: nbstripout for notebooks and JupyterLab's post-save hook (a clean git status)"
    p = sub.add_parser("git-setup", help=about, description=about[0].upper() + about[1:] + ".")
    p.set_defaults(command=cmd_git_setup)
    return parser


def scale_of(args: argparse.Namespace) -> str:
    return "smoke" if getattr(args, "smoke", False) else "mini" if getattr(args, "mini", False) else "paper"


def scale_flag(scale: str) -> str:
    return "" if scale == "paper" else f" --{scale}"


def parse_fields(pairs: list[str]) -> dict[str, Any]:
    """`["rounds=50", "defense=prodigy"]` -> {"rounds": 50, "defense": "prodigy"}, typed like RunConfig;
    ``defense_params.tau=5`` sets one setting of the rule (``attack_params.eps=1`` of the attack), the
    params file's other settings kept (`config.SettingsUpdate`)."""
    fields: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep:
            raise ConfigError(f"--set {pair!r}: expected KEY=VALUE, e.g. --set rounds=50")
        name, dot, setting = name.strip().partition(".")
        if dot and name in SETTINGS_FIELDS and setting:  # merged into the params file's settings
            fields.setdefault(name, SettingsUpdate())[setting] = parse_value(name, text)
        elif dot:
            raise ConfigError(
                f"--set {pair!r}: only {' and '.join(SETTINGS_FIELDS)} take a dotted setting "
                "(e.g. --set defense_params.tau=5)"
            )
        else:
            fields[name] = parse_value(name, text)
    return fields


def parse_only(pairs: list[str]) -> dict[str, list[Any]]:
    """`["defense=prodigy,nnm+krum"]` -> {"defense": ["prodigy", "nnm+krum"]}, values typed like RunConfig."""
    only: dict[str, list[Any]] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not text:
            raise ConfigError(f"--only {pair!r}: expected KEY=V1,V2, e.g. --only defense=prodigy,nnm+krum")
        name = name.strip()
        only.setdefault(name, []).extend(parse_value(name, v.strip()) for v in text.split(","))
    return only


def cmd_run(args: argparse.Namespace) -> int:
    from prodigy_core import results, training
    from prodigy_core.experiments import Experiment, load_experiment, smoke_profile

    fields = parse_fields(args.fields)
    if args.params:
        experiment = load_experiment(args.params, smoke=args.smoke, fields=fields)
    else:
        config = RunConfig.from_dict(fields, source="--set")
        experiment = Experiment(name="runs", title="single runs", paper_table=None, configs=[config])
        experiment = smoke_profile(experiment) if args.smoke else experiment
    if len(experiment.configs) != 1:
        configs = experiment.configs
        varying = [n for n in field_names() if len({getattr(c, n) for c in configs}) > 1]
        raise ConfigError(
            f"{args.params} has {len(configs)} runs (varying: {', '.join(varying)}); pin them with --set, "
            f"e.g. --set {varying[0]}={getattr(configs[0], varying[0])}, or use `prodigy-fl grid`"
        )
    config = experiment.configs[0]
    folder = results.experiment_dir(experiment.results_name, args.results_dir)
    key = config.key()  # once, before training: an edit of a plug-in during the run never renames its record
    path = results.record_path(folder, key)
    stored = None if args.force else results.stored_record(folder, key)
    if stored is None:
        results.check_writable(folder)  # before training, not after
        claims = results.Claims(folder, skip_done=not args.force)  # a grid's lock is respected, and held
        try:
            if claims.claim(key):
                result = training.run(config, progress=True, checkpoint_dir=results.checkpoint_dir(folder),
                                      resume=not args.force, keep_checkpoint=True)  # fmt: skip
                result.stand_in = experiment.stand_in_for(config)
                results.save_record(folder, key, result.to_dict(), experiment.results_name)
            elif (stored := results.stored_record(folder, key)) is None:  # not finished meanwhile
                raise ValueError(f"run {key} not started: {results.lock_state(claims.lock_path(key))}")
        finally:
            claims.release_all()
    if stored is not None:
        record = stored
        print(f"stored result {path} (use --force to rerun)", file=sys.stderr)
    else:
        record = json.loads(path.read_text())
    # this run's label, not the stored record's: a digits run and a CIFAR-10 one on digits share a key
    stand_in_name = experiment.stand_in_for(config)
    stand_in = f" [stand-in: {stand_in_name}]" if stand_in_name else ""
    accuracy = record["final_accuracy"]
    row = as_row(config.to_dict())  # "nnm+cclip(tau=5.0)": the name with its settings
    print(
        f"{row['defense']} vs {row['attack']}: {accuracy:.2f}% final accuracy{stand_in} -> {path}",
        file=sys.stderr,
    )
    if args.json:
        json.dump(record, sys.stdout, indent=1)
        print()
    return 0


def auto_or_count(auto: str, one: str) -> Callable[[str], int | str]:
    """An argparse type: 'auto' (meaning `auto`) or an integer >= 1 (1 meaning `one`)."""

    def parse(text: str) -> int | str:
        if text == "auto":
            return text
        if not text.isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: use 'auto' ({auto}) or an integer >= 1 (1: {one})")
        return int(text)

    return parse


jobs_arg = auto_or_count("a single-threaded process per CPU core", "in this process")  # --jobs
batch_runs = auto_or_count("stacked where faster", "one run at a time")  # --batch-runs


def cmd_grid(args: argparse.Namespace) -> int:
    from prodigy_core.experiments import load_experiment, run_grid, select, undone

    if args.dry_run:  # imports no plug-in: a dry run runs no code of the params file's
        with records_are_data():
            experiment = load_experiment(args.params, scale=scale_of(args), fields=parse_fields(args.fields))
            experiment = select(experiment, parse_only(args.only)) if args.only else experiment
            print("\n".join(dry_run(experiment, args.results_dir)))
        return 0
    experiment = load_experiment(args.params, scale=scale_of(args), fields=parse_fields(args.fields))
    if args.only:
        experiment = select(experiment, parse_only(args.only))
    if args.executor == "local":  # a Ray cluster's devices are its own
        problem = device_problem(experiment.configs if args.force else undone(experiment, args.results_dir))
        if problem:
            raise ConfigError(problem)
    df = run_grid(
        experiment, executor=args.executor, jobs=args.jobs, force=args.force, results_dir=args.results_dir,
        address=args.address, num_cpus=args.num_cpus, num_gpus=args.num_gpus, batch_runs=args.batch_runs,
    )  # fmt: skip
    del df
    return 1 if undone(experiment, args.results_dir) else 0  # failed, or left to another process


def device_problem(configs: list[RunConfig]) -> str | None:
    """Why some runs cannot train on this machine (a device it lacks, tf32 off CUDA), in one line naming
    how many and the fix; None when all can."""
    from prodigy_core.seeding import resolve_device

    problems: dict[str, int] = {}
    for config in configs:
        try:
            device = resolve_device(config.device)
        except ValueError as e:
            problems[str(e)] = problems.get(str(e), 0) + 1
            continue
        if config.precision == "tf32" and device.type != "cuda":
            why = (f"precision=tf32 exists only on CUDA and this machine trains on {device.type}: use "
                   "--set precision=fp32 or bf16, or --executor ray on a cluster with GPUs")  # fmt: skip
            problems[why] = problems.get(why, 0) + 1
    if not problems:
        return None
    why, count = next(iter(problems.items()))
    return f"{count} of the {len(configs)} runs cannot train here: {why}"


# What a dry run prints of each run (with its key and whether it is stored).
DRY_RUN_FIELDS = ("dataset", "distribution", "n_clients", "n_byzantine", "local_steps", "local_momentum",
                  "rounds", "defense", "attack", "variant", "seed")  # fmt: skip


def dry_run(experiment: Any, results_dir: Path | None = None) -> list[str]:
    """One line per run of the grid (key fields, run key, stored or not), then the count. Writes nothing."""
    from prodigy_core import results

    folder = results.experiment_dir(experiment.results_name, results_dir)
    lines = [f"{experiment.title} ({experiment.scale} scale)"]
    stored, todo = 0, []
    for config in experiment.configs:
        record, why = results.judge_record(folder, config.key())  # as the grid and the report judge it
        stored += record is not None
        todo += [config] if record is None else []
        row = as_row(config.to_dict())  # defense and attack with their settings: "nnm+cclip(tau=5.0)"
        what = " ".join(f"{n}={row[n]}" for n in DRY_RUN_FIELDS)
        flag = " [stored]" if record is not None else f" [invalid record, redone: {why}]" if why else ""
        lines.append(f"{config.key()} {what}{flag}")
    total = len(experiment.configs)
    runs = "1 run" if total == 1 else f"{total} runs"
    lines.append(f"{runs} ({stored} stored, {total - stored} to run) -> {folder}")
    problem = device_problem(todo)
    if problem:
        lines.append(f"but {problem} (`prodigy-fl grid` refuses them with --executor local)")
    return lines


def cmd_report(args: argparse.Namespace) -> int:
    from prodigy_core import results
    from prodigy_core.experiments import load_experiment

    with records_are_data():  # a report reads records and a params file: it runs no plug-in's code
        experiment = load_experiment(args.params, scale=scale_of(args), fields=parse_fields(args.fields))
        df = results.load(experiment, args.results_dir)
        if df.empty:
            raise ValueError(_no_results(experiment, args))
        for path in _write_report(experiment, df, args.out_dir, args.results_dir):
            print(path)
    return 0


def _no_results(experiment: Any, args: argparse.Namespace) -> str:
    """Why `report` found nothing, naming the folder it read, and the grid command that stores there."""
    from prodigy_core import results
    from prodigy_core.experiments import SCALES, scale_folder

    def folder(scale: str) -> Path:
        return results.experiment_dir(scale_folder(experiment.name, scale), args.results_dir)

    here = folder(experiment.scale)
    if here.is_dir():
        why = f"{here} holds {len(list(here.glob('*.json')))} record file(s), none of this grid's runs"
    else:
        why = f"{here} is {'a file' if here.exists() else 'not there'}"
    others = [s for s in SCALES if s != experiment.scale and any(folder(s).glob("*.json"))]
    if others:
        scales = (f"{s} ({scale_flag(s).strip() or 'no scale flag'})" for s in others)
        why += f"; records at another scale: {', '.join(scales)}"
    given = f" --results-dir {args.results_dir}" if args.results_dir else ""
    return (
        f"no stored results for {experiment.results_name}: {why}; run `prodigy-fl grid {args.params}"
        f"{scale_flag(experiment.scale)}{given}` (runs made with --set are reported with the same --set)"
    )


def cmd_quickstart(args: argparse.Namespace) -> int:
    from prodigy_core.experiments import load_experiment, run_grid

    seeds = {"seeds": list(range(args.seeds))} if args.seeds > 1 else None
    experiment = load_experiment("quickstart_digits", smoke=args.smoke, overrides=seeds)
    df = run_grid(experiment, jobs=args.jobs, results_dir=args.results_dir)
    named = experiment if seeds is None else dataclasses.replace(experiment, name=quickstart_name(args.seeds))
    paths = _write_report(named, df, args.out_dir, args.results_dir)
    table = next((p.read_text(encoding="utf-8") for p in paths if p.suffix == ".md"), "")
    print(table)
    print("files: " + ", ".join(str(p) for p in paths))
    if not args.smoke and args.seeds == 1:
        print(reference_comparison(table))
    return 0


REFERENCE_SEEDS = 3  # the committed table a one-seed quickstart is compared with (the README's)


def reference_comparison(table: str) -> str:
    """A one-seed quickstart table against the committed mean ± std over REFERENCE_SEEDS seeds, with a
    heading: its accuracy cells (`report.compare_with_reference`), then ProDiGy's detection in a table of
    its own (`report.compare_detection_with_reference`, when both have a detection section); a line saying
    why not when there is no such file (an installed package: the reference is in a clone's figures/)."""
    from prodigy_core.report import compare_detection_with_reference, compare_with_reference

    reference = paths.COMMITTED_FIGURES / f"{quickstart_name(REFERENCE_SEEDS)}.md"
    if not reference.is_file():
        return f"(no committed {reference.name} to compare with: it is in a clone's figures/)"
    committed = reference.read_text(encoding="utf-8")
    text, _, _ = compare_with_reference(table, committed)
    out = f"\nThis run (seed 0) against the committed {REFERENCE_SEEDS}-seed table ({reference}):\n\n{text}"
    detection, _, compared = compare_detection_with_reference(table, committed)
    if compared:
        out += f"\n\nProDiGy's detection of this run against the same table's:\n\n{detection}"
    return out


def quickstart_name(seeds: int) -> str:
    """The report's name of a quickstart over `seeds` seeds (its files: <name>.md, .png, ...)."""
    return "quickstart_digits" if seeds == 1 else f"quickstart_digits_{seeds}seeds"


def count_arg(text: str, what: str = "a whole number", example: str = "") -> int:
    """A count argument (seeds, rounds, group size, steps, clients, repeats): a whole number >= 1; `what` and
    `example` name it in the error."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: {what} >= 1{example}")
    return int(text)


def seeds_arg(text: str) -> int:
    return count_arg(text, "a number of seeds", ", e.g. --seeds 3")


def rounds_arg(text: str) -> int:
    return count_arg(text, "a number of rounds", ", e.g. --rounds 5")


def parse_study_args(parser: argparse.ArgumentParser, argv: list[str] | None, out: Path) -> Any:
    """The scripts that rerun quickstart runs (alie_z_sensitivity.py, no_attack_f0.py): their --rounds,
    --seeds, --results-dir and --out (default `out`, under figures/) added, parsed and checked before any
    training."""
    parser.add_argument("--rounds", type=rounds_arg, help="fewer rounds than the quickstart's (smoke check)")
    parser.add_argument("--seeds", type=seeds_arg, default=3)
    parser.add_argument("--results-dir", help="where the runs are stored (default: results/)")
    parser.add_argument("--out", type=Path, default=out)
    args = parser.parse_args(argv)
    check_results_dir(parser, args.results_dir)
    check_out(parser, args.out, f"figures/{out.name}")
    return args


def check_results_dir(parser: argparse.ArgumentParser, folder: str | Path | None) -> None:
    """A script's --results-dir as `check_out` checks a folder; None (the default) is checked where the runs
    start."""
    if folder is not None:
        check_out(parser, Path(folder), "results", folder=True, option="--results-dir")


def check_out(
    parser: argparse.ArgumentParser, out: Path, example: str, folder: bool = False, option: str = "--out"
) -> None:
    """A script's --out (or another ``option``), refused in one usage line before any training: a folder where
    a file goes, a file where a folder goes (``folder``), or a place nothing can be written (``example``:
    what to give instead)."""
    from prodigy_core.results import check_writable

    if not folder and out.is_dir():
        parser.error(f"{option} {out}: a folder; give the file to write, e.g. {example}")
    if folder and out.exists() and not out.is_dir():
        parser.error(f"{option} {out}: a file; give the folder to write into, e.g. {example}")
    try:
        check_writable(out if folder else out.parent)
    except OSError as e:
        parser.error(f"{option} {out}: cannot write there ({os.strerror(e.errno) if e.errno else e})")


def _write_report(
    experiment: Any, df: Any, out_dir: Path | None, results_dir: Path | None = None
) -> list[Path]:
    from prodigy_core.report import write_report

    if out_dir is None:
        return list(write_report(experiment, df, results_dir=results_dir))
    return list(write_report(experiment, df, out_dir, results_dir=results_dir))


def _check_data_folder(root: Path, named_by: str) -> None:
    """The data folder can hold a download or a decoded copy: a folder (or none yet), writable."""
    existing = next((p for p in (root, *root.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ValueError(f"data folder {root} ({named_by}): {existing} is a file, not a folder")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"data folder {root} ({named_by}): {existing} is not writable")


def cmd_data(args: argparse.Namespace) -> int:
    from prodigy_core import data

    if args.dataset == "cifar10":
        root = args.path or data.data_root()
        _check_data_folder(Path(root), "the path given" if args.path else "env PRODIGY_DATA_DIR or data/")
        if args.source is not None:
            path = data.decode_cifar10_jpeg(args.source, root)
            binary_first = data.cifar10_source(Path(root)) == data.CIFAR10_BINARY
            note = " (torchvision's binary batches there come first)" if binary_first else ""
            print(f"CIFAR-10 (JPEG copy): 50,000 train and 10,000 test images decoded into {path}{note}")
            decoded = data.jpeg_copy_source(Path(root))
            if decoded != data.CIFAR10_JPEG:
                print(f"note: not the reference decode's pixels (another archive, or a Pillow whose JPEG "
                      f"decoder rounds otherwise): its runs are keyed data_source={decoded}, never sharing "
                      "results with cifar10-jpeg")  # fmt: skip
            return 0
        try:
            data.load_federation("cifar10", n_clients=1, distribution="iid", data_dir=root, download=True,
                                 source=data.CIFAR10_BINARY)  # fmt: skip
        except OSError as e:  # offline: urllib's URLError, a socket error
            shared = data.CIFAR10_JPEG_ARCHIVE
            copy = str(shared) if shared.exists() else "PATH/cifar10-jpeg.tar.gz"
            raise ValueError(
                f"cannot download CIFAR-10 ({getattr(e, 'reason', None) or e}); offline, decode the JPEG "
                f"copy with `prodigy-fl data cifar10 --from {copy}`, or copy torchvision's "
                f"cifar-10-batches-py folder from a machine with internet into {root}"
            ) from None
        print(f"CIFAR-10 (torchvision binary batches) is in {root}")
        return 0
    if args.source is not None:
        raise ValueError("--from is for cifar10 (the JPEG copy); femnist reads a LEAF directory in place")
    folders = [args.path] if args.path is not None else data.femnist_dirs()
    if not folders:
        raise ValueError(
            "no LEAF FEMNIST directory found (env PRODIGY_FEMNIST_DIR, ../shared/data/femnist-leaf-24 or "
            f"femnist-leaf); pass one: prodigy-fl data femnist PATH; LEAF makes one: {data.LEAF_COMMAND}"
        )
    for folder in folders:
        counts = data.leaf_writer_counts(folder)
        if not counts:
            raise ValueError(
                f"LEAF directory {folder}: no writers in its train/ and test/ JSON files (an empty LEAF "
                f"directory); LEAF makes one: {data.LEAF_COMMAND}"
            )
        fed = data.load_federation("femnist", n_clients=len(counts), distribution="natural", data_dir=folder)
        k = data.PAPER_MIN_WRITER_SAMPLES
        eligible = len(data.eligible_writers(counts, k))
        train, test = len(fed.train_labels), len(fed.test_labels)
        print(
            f"{folder}: a valid LEAF FEMNIST directory with {len(counts)} writers ({train:,} train / "
            f"{test:,} test samples); {eligible} have >= {k} samples (train + test, the paper's LEAF "
            f"-k {k}): enough for N <= {eligible}"
        )
        if eligible < 100:
            print(f"  Table III (N=100) needs 100 such writers; LEAF makes them: {data.LEAF_COMMAND}")
    return 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    from prodigy_core.reproduce import reproduce

    return reproduce(scale=args.scale, only=args.only, executor=args.executor, jobs=args.jobs)


def cmd_git_setup(args: argparse.Namespace) -> int:
    from prodigy_core.lab import setup_git

    for line in setup_git(Path.cwd()):
        print(line)
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    """Copy the package's notebooks and params files into DIR and make its empty results/ outputs/ data/;
    files already there are kept (a user's edits are never overwritten)."""
    import shutil

    root = args.dir.resolve()
    inside = paths.package_containing(root)
    if inside is not None:
        raise ValueError(
            f"{root} is inside the installed package ({inside}): a project folder must be outside it, "
            "e.g. prodigy-fl init ~/prodigy-project"
        )
    made, kept = [], []
    for name, pattern in (("notebooks", "*.ipynb"), ("params", "*.yaml")):
        (root / name).mkdir(parents=True, exist_ok=True)
        for source in sorted(paths.package_folder(name).glob(pattern)):
            target = root / name / source.name
            if target.exists():
                kept.append(target)
            else:
                shutil.copyfile(source, target)
                made.append(target)
    for name in ("results", paths.OUTPUTS, "data"):
        (root / name).mkdir(exist_ok=True)
    kept_note = f", {len(kept)} kept as they were" if kept else ""
    print(f"project folder {root}: {len(made)} files copied{kept_note}")
    print(f"next: cd {root} && prodigy-fl quickstart")
    print(f"  or, for the notebooks and the attack explorer: {LAB_HINT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
