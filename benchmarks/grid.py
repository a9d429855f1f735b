"""Batched groups of runs (`prodigy_core.groups`) against one run at a time, measured in one process.

CPU: the quickstart grid (params/quickstart_digits.yaml: 42 digits runs) three ways, in one run: one run at
a time in this process (`training.run`, torch's threads as they are), in batched groups of `--batch-runs`
(default 8) in this process, and as `prodigy-fl quickstart` trains it (`run_grid(jobs="auto")`: one
single-threaded process per core); prints the wall times, their ratios to one at a time and whether every
run's final accuracy agrees. `--rounds` and `--runs` shrink the grid. These measurements chose the CPU
defaults: `--batch-runs auto` = 1 and the quickstart's `--jobs auto`.

GPU (only where CUDA is available): Table I's FedAVG block shapes (CIFAR-10 CNN, N=10, E=10, b=64, 42 runs:
7 defenses x 6 attacks) on synthetic CIFAR-10-shaped data, a group of K runs (K: as many of the 42 as
`groups.batch_size_for` allows in free memory, or `--gpu-runs`) against one run alone; prints training
images/s of each and the projection for all the paper's runs (every params file, full scale) at the
batched throughput.

    python benchmarks/grid.py                          # the whole quickstart on this machine's CPU (+ GPU)
    python benchmarks/grid.py --rounds 2 --runs 4      # a check that it works, in seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time

import torch

from prodigy_core import groups, training
from prodigy_core.cli import count_arg
from prodigy_core.experiments import PARAMS_DIR, load_experiment, run_grid


def cpu_quickstart(rounds: int | None, runs: int | None, batch_runs: int) -> None:
    fields = {"device": "cpu"} | ({"rounds": rounds} if rounds else {})
    experiment = load_experiment("quickstart_digits", fields=fields)
    configs = experiment.configs[:runs]
    made = groups.make_groups(configs, batch_runs)
    print(f"CPU quickstart ({os.cpu_count()} cores): {len(configs)} runs x {configs[0].rounds} rounds; "
          f"{torch.get_num_threads()} threads here; groups of {[len(g) for g in made]}")  # fmt: skip
    training.run(configs[0].replace(rounds=1), progress=False)  # warm-up (data, imports), not timed
    list(groups.iter_group(configs[:2]))
    tic = time.perf_counter()
    alone = {c.key(): training.run(c, progress=False) for c in configs}
    t_alone = time.perf_counter() - tic
    tic = time.perf_counter()
    batched = {}
    for group in made:
        for i, outcome in groups.iter_group(group):
            batched[group[i].key()] = outcome.final_accuracy
    t_batched = time.perf_counter() - tic
    with tempfile.TemporaryDirectory() as tmp:
        tic = time.perf_counter()  # worker start-up included, as a user waits for it
        df = run_grid(dataclasses.replace(experiment, configs=configs), jobs="auto", results_dir=tmp,
                      progress=False, batch_runs=1)  # fmt: skip
        t_jobs = time.perf_counter() - tic
    jobs = dict(zip(df["key"], df["final_accuracy"], strict=True))
    for name, seconds, accuracy in [("one at a time", t_alone, None), (f"groups of {batch_runs}", t_batched,
                                    batched), ("jobs auto", t_jobs, jobs)]:  # fmt: skip
        equal = 0 if accuracy is None else sum(accuracy[k] == r.final_accuracy for k, r in alone.items())
        same = "" if accuracy is None else f"   (final accuracy equal in {equal}/{len(configs)})"
        print(f"  {name:<14}: {seconds:8.1f} s  {t_alone / seconds:5.2f}x{same}")


def gpu_table1_fedavg(rounds: int, runs: int | None) -> None:
    import importlib

    synthetic_federation = importlib.import_module("training").synthetic_federation  # benchmarks/training.py
    device = torch.device("cuda")
    table = load_experiment("table1_cifar10", fields={"device": "cuda", "engine": "batched"})
    block = [c for c in table.configs if (c.local_steps, c.distribution, c.local_momentum) == (10, "iid", 0)]
    fed = synthetic_federation("cifar10", 10, 640, device)
    training.run_federation = lambda cfg, dev: fed  # synthetic data of the right shape for every run
    k = runs or min(len(block), groups.batch_size_for(block[0]))
    configs = [c.replace(rounds=rounds + 1, eval_every=rounds + 1) for c in block[:k]]
    images_per_round = configs[0].n_clients * configs[0].local_steps * configs[0].batch_size
    gib = groups.memory_per_run(block[0]) / 2**30
    print(
        f"GPU {torch.cuda.get_device_name(device)}: Table I FedAVG block (CIFAR-10 CNN, N=10, E=10, b=64), "
        f"{len(block)} runs; group of {k} (estimated {gib:.2f} GiB per run)"
    )

    solo = training.run(configs[0], progress=False, sync_timing=True).round_times[1:]  # first round: warm-up
    solo_ips = images_per_round / statistics.median(solo)
    records = groups.run_group(configs, sync_timing=True)
    steps = [sum(r.round_times[j] for r in records) for j in range(1, rounds + 1)]
    group_ips = k * images_per_round / statistics.median(steps)
    print(f"  one at a time  : {solo_ips:10.0f} images/s ({statistics.median(solo):.3f} s per round)")
    print(f"  group of {k:<5} : {group_ips:10.0f} images/s ({statistics.median(steps):.3f} s per step)")
    print(f"  speed-up       : {group_ips / solo_ips:10.2f}x")

    paper = [c for p in sorted(PARAMS_DIR.glob("*.yaml")) if p.stem != "quickstart_digits"
             for c in load_experiment(p).configs]  # fmt: skip
    total = sum(c.rounds * c.n_clients * c.local_steps * c.batch_size for c in paper)
    print(
        f"  projection     : {len(paper)} paper runs, {total / 1e9:.1f} G training images: "
        f"{total / group_ips / 3600:.1f} h batched, {total / solo_ips / 3600:.1f} h one at a time "
        f"(CIFAR-10 throughput for every run; FEMNIST's CNN is of similar cost)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=count_arg, help="CPU: rounds per run (default: the grid's)")
    parser.add_argument("--runs", type=count_arg, help="CPU: the first RUNS runs only")
    parser.add_argument("--batch-runs", type=count_arg, default=8, help="CPU: group size (default 8)")
    parser.add_argument("--gpu-rounds", type=count_arg, default=3, help="GPU: timed rounds (after a warm-up)")
    parser.add_argument("--gpu-runs", type=count_arg, help="GPU: group size (default: memory cap)")
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU section")
    args = parser.parse_args()
    if not args.no_cpu:
        cpu_quickstart(args.rounds, args.runs, args.batch_runs)
    if torch.cuda.is_available():
        gpu_table1_fedavg(args.gpu_rounds, args.gpu_runs)


if __name__ == "__main__":
    main()
