"""Is bf16 the same distribution as fp32? The quickstart's seed grid at both precisions (issue 33 item 4).

    python scripts/precision_check.py [--seeds 3] [--jobs auto] [--results-dir DIR] [--out DIR] [--smoke]

Trains (or reads from the store: `prodigy-fl quickstart --seeds 3` made the fp32 runs) the quickstart grid
(digits, Dirichlet 0.1, N=10, f=3, FedAVG E=10, beta 0.9; 7 defenses x 6 attacks) for seeds 0..S-1 at fp32
and at bf16 (CPU autocast; their own keys in the same results folder), and writes precision_check.md and
.csv into --out (default figures/): per cell the mean over seeds of the paired difference bf16 - fp32 (same
seed: same split, initial model and batches) against twice its standard error (sd of the differences /
sqrt(S)); per row whether the worst-case attack (lowest mean accuracy) is the same at both precisions.
--smoke: the smoke grid with the same seeds, in seconds (the test). Both grids show a progress bar.

Cost (--jobs auto): on a 2-core AVX-512 CPU the fp32 half about 14 minutes (126 runs), the bf16 half
15 minutes (bf16 autocast 1.05x fp32's training time); on a 2-core AVX2 CPU about 32 minutes and 1.8
hours (bf16 3.1x slower there, without native bf16). `python
scripts/check_committed_quickstart.py --keep DIR` makes the fp32 half as it checks the committed tables;
`--results-dir DIR` here then trains only bf16.
Stop and rerun at will: finished runs are read back, an interrupted one resumes from its checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def experiments(seeds: int, smoke: bool, rounds: int | None = None) -> tuple:
    """The fp32 and the bf16 grid of the quickstart over seeds 0..seeds-1."""
    from prodigy_core.experiments import load_experiment

    exp = load_experiment("quickstart_digits", smoke=smoke, overrides={"seeds": list(range(seeds))})
    configs = exp.configs
    if smoke:  # the smoke profile keeps the first seed only
        configs = [c.replace(seed=s) for s in range(seeds) for c in configs if c.seed == 0]
    if rounds is not None:
        configs = [c.replace(rounds=rounds, eval_every=min(c.eval_every, rounds)) for c in configs]
    fp32 = dataclasses.replace(exp, configs=configs)
    return fp32, dataclasses.replace(exp, configs=[c.replace(precision="bf16") for c in configs])


def compare(fp32: pd.DataFrame, bf16: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(cells, rows): per (defense, attack) the means, the paired mean difference and its standard error;
    per defense the worst-case attack at each precision."""
    keys = ["defense", "attack", "seed"]
    both = fp32[keys + ["final_accuracy"]].merge(bf16[keys + ["final_accuracy"]], on=keys,
                                                  suffixes=("_fp32", "_bf16"))  # fmt: skip
    both["diff"] = both["final_accuracy_bf16"] - both["final_accuracy_fp32"]
    cells = both.groupby(["defense", "attack"], sort=False).agg(
        fp32=("final_accuracy_fp32", "mean"), bf16=("final_accuracy_bf16", "mean"),
        diff=("diff", "mean"), sd=("diff", "std"), seeds=("diff", "size"),
    ).reset_index()  # fmt: skip
    cells["two_se"] = 2 * cells["sd"] / cells["seeds"].map(math.sqrt)
    # a cell of one seed has no standard error: neither within nor outside (None, "n/a")
    cells["within"] = (
        (cells["diff"].abs() <= cells["two_se"]).astype(object).where(cells["two_se"].notna(), None)
    )
    attacked = cells[cells["attack"] != "none"]
    rows = []
    for defense, part in attacked.groupby("defense", sort=False):
        worst = {p: part.loc[part[p].idxmin(), "attack"] for p in ("fp32", "bf16")}
        rows.append({"defense": defense, "worst_fp32": worst["fp32"], "worst_bf16": worst["bf16"],
                     "same": worst["fp32"] == worst["bf16"]})  # fmt: skip
    return cells, pd.DataFrame(rows)


def within_share(seeds: int) -> float:
    """The share of cells with |diff| <= 2 SE if both precisions drew from one distribution: the paired t
    statistic of `seeds` normal differences has seeds - 1 degrees of freedom (0.82 for 3 seeds, not 0.95)."""
    from scipy.stats import t

    return float(2 * t.cdf(2, seeds - 1) - 1)


def machine(fp32: pd.DataFrame, bf16: pd.DataFrame) -> str:
    """Where the runs trained (the records' environment: `report.machine`, and the engine) and what bf16
    cost: the ratio of the summed round times."""
    from prodigy_core import report

    both = pd.concat([fp32, bf16])
    found = report.machine(both)
    engine = found["engine"]
    seconds = {
        name: float(frame["round_times"].map(sum).sum()) for name, frame in (("fp32", fp32), ("bf16", bf16))
    }
    return (
        f"Trained on {found['device']} ({found['cpu_capability']}), torch {found['torch']}, "
        f"{found['threads']} thread(s) a run, engine {engine}; training time (the runs' "
        f"summed round times) bf16 / fp32 = {seconds['bf16'] / seconds['fp32']:.2f}x."
    )


def markdown(cells: pd.DataFrame, rows: pd.DataFrame, seeds: int, about: str = "") -> str:
    within, total = int((cells["within"] == True).sum()), int(cells["two_se"].notna().sum())  # noqa: E712
    equal = int(((cells["sd"] == 0) & (cells["diff"] == 0)).sum())
    expected = (
        f"{within_share(seeds):.0%} would if both precisions drew from one distribution (the paired t "
        f"statistic over {seeds} seeds has {seeds - 1} degrees of freedom)."
        if seeds > 1
        else "one seed has no standard error: no cell is within or outside 2 SE (n/a)."
    )
    lines = [
        f"# bf16 vs fp32 on the quickstart grid ({seeds} seeds)\n",
        "Test accuracy (%), mean over seeds; diff: the mean of the paired differences bf16 - fp32 (same "
        "seed: same split, initial model, batches and dropout masks), 2 SE: twice its standard error. "
        f"{within} of {total} cells have |diff| <= 2 SE ({equal} of them equal seed for seed); {expected} "
        f"{int(rows['same'].sum())} of {len(rows)} rows keep their worst-case attack.\n",
        *([about + "\n"] if about else []),
        "| defense | attack | fp32 | bf16 | diff | 2 SE | within |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in cells.itertuples():
        two_se = "n/a" if math.isnan(c.two_se) else f"{c.two_se:.2f}"
        within = "n/a" if c.within is None else "yes" if c.within else "no"
        lines.append(f"| {c.defense} | {c.attack} | {c.fp32:.2f} | {c.bf16:.2f} | {c.diff:+.2f} | {two_se} "
                     f"| {within} |")  # fmt: skip
    lines += ["", "| defense | worst attack, fp32 | worst attack, bf16 | same |", "|---|---|---|---|"]
    lines += [f"| {r.defense} | {r.worst_fp32} | {r.worst_bf16} | {'yes' if r.same else 'no'} |"
              for r in rows.itertuples()]  # fmt: skip
    return "\n".join(lines) + "\n"


def paired_seeds(text: str) -> int:
    """--seeds: a number of seeds >= 2 (the standard error of a paired difference needs two)."""
    from prodigy_core.cli import seeds_arg

    if seeds_arg(text) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 2 seeds (a standard error needs two), e.g. 3")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    from prodigy_core import report
    from prodigy_core import results as store
    from prodigy_core.cli import check_out, check_results_dir, jobs_arg, rounds_arg
    from prodigy_core.experiments import run_grid

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=paired_seeds, default=3, help="seeds 0..S-1, S >= 2")
    p.add_argument("--jobs", type=jobs_arg, default="auto", help="worker processes (auto: one per core)")
    p.add_argument("--results-dir", type=Path, default=None, help="the store (default: results/)")
    p.add_argument("--out", type=Path, default=ROOT / "figures")
    p.add_argument("--smoke", action="store_true", help="the smoke grid: seconds")
    p.add_argument("--rounds", type=rounds_arg, default=None, help=argparse.SUPPRESS)  # tests: fewer rounds
    args = p.parse_args(argv)
    check_results_dir(p, args.results_dir)  # before the training, not after
    check_out(p, args.out, "figures", folder=True)  # before hours of training, not after
    frames, grids = [], experiments(args.seeds, args.smoke, args.rounds)
    for exp in grids:
        run_grid(exp, jobs=args.jobs, results_dir=args.results_dir, progress=True)
        frames.append(store.load(exp, args.results_dir))
    cells, rows = compare(*frames)
    cells.merge(rows, on="defense", how="left").to_csv(args.out / "precision_check.csv", index=False)
    provenance = "; ".join(
        f"{p} {report.provenance(e)}" for p, e in zip(("fp32", "bf16"), grids, strict=True)
    )
    text = markdown(cells, rows, args.seeds, machine(*frames)) + f"\n<!-- provenance: {provenance} -->\n"
    (args.out / "precision_check.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
