"""ProDiGy and NNM + trimmed mean inside Flower: the quickstart's digits setting
(params/quickstart_digits.yaml: Dirichlet(0.1), N=10, f=3, FedAVG E=10, beta=0.9) trained under Flower's own
simulation engine, without an attack and under ALIE, printed as `prodigy-fl report` prints a table.

    pip install -e ".[flower]"
    python examples/flower/run.py              # the quickstart's 100 rounds
    python examples/flower/run.py --rounds 30  # shorter

The ALIE runs are experiments: the strategy itself plays the Byzantine clients (`prodigy_core.flower`).
"""

import argparse

import pandas as pd

from prodigy_core.experiments import load_experiment
from prodigy_core.flower import simulate
from prodigy_core.report import to_markdown

DEFENSES, ATTACKS = ("prodigy", "nnm+trimmed_mean"), ("none", "alie")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rounds", type=int, default=None, help="rounds per run (default: the params file's)"
    )
    args = parser.parse_args()
    experiment = load_experiment("quickstart_digits")
    configs = [c for c in experiment.configs if c.defense in DEFENSES and c.attack in ATTACKS and c.seed == 0]
    if args.rounds:
        configs = [c.replace(rounds=args.rounds) for c in configs]
    runs = simulate(configs)
    rows = []
    for run in runs:
        r = run.result
        rows.append({**r.config, "final_accuracy": r.final_accuracy, "diverged": r.diverged})
        line = f"{r.config['defense']}/{r.config['attack']}: Byzantine clients {run.byzantine}"
        if r.zeroed_clients:
            exact = sum(sorted(z) == run.byzantine for z in r.zeroed_clients)
            line += f", ProDiGy zeroed exactly them in {exact} of {len(r.zeroed_clients)} rounds"
        print(line)
    title = f"{experiment.title}, under Flower's simulation"
    print(to_markdown(pd.DataFrame(rows), experiment.report, title))


if __name__ == "__main__":
    main()
