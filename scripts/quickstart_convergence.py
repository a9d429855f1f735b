"""The quickstart's rounds from a measured convergence curve (docs/results.md "The quickstart's rounds").

    python scripts/quickstart_convergence.py [--rounds 150] [--out figures/quickstart_convergence.csv]

Trains the quickstart's setting without attack (ProDiGy, params/quickstart_digits.yaml's base, seed 0)
for --rounds rounds evaluated every 5, writes the curve (round, test accuracy, lr) and prints the criterion:
the run has converged at the first evaluation from which three consecutive evaluations are within 1 point
of its final accuracy; the quickstart's rounds R are the smallest multiple of 10 whose learning-rate drop
(the paper's: after 2R/3 rounds) comes after that point. Chosen before any defense is compared. A run that
has not converged writes its curve beside --out (`<name>.unconverged.csv`) and leaves --out as it is.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from prodigy_core.cli import check_out, rounds_arg
from prodigy_core.config import RunConfig, decay_round
from prodigy_core.experiments import load_experiment
from prodigy_core.training import run

OUT = Path(__file__).resolve().parents[1] / "figures" / "quickstart_convergence.csv"
WITHIN, CONSECUTIVE, EVERY = 1.0, 3, 5


def converged_at(curve: list[tuple[int, float]]) -> int | None:
    """The first round from which CONSECUTIVE evaluations are within WITHIN points of the final accuracy;
    None when there is none (not converged, or fewer than CONSECUTIVE evaluations)."""
    if len(curve) < CONSECUTIVE:
        return None
    final = curve[-1][1]
    return next((curve[i][0] for i in range(len(curve) - CONSECUTIVE + 1)
                 if all(abs(a - final) <= WITHIN for _, a in curve[i : i + CONSECUTIVE])), None)  # fmt: skip


def rounds_for(converged: int) -> int:
    """The smallest multiple of 10 whose paper lr drop (first decayed round t = decay_round, 0-indexed)
    comes after the converged round."""
    rounds = 10
    while decay_round(rounds) < converged:
        rounds += 10
    return rounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=rounds_arg, default=150)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    check_out(parser, args.out, "figures/quickstart_convergence.csv")  # before the training, not after
    base = load_experiment("quickstart_digits").configs[0]
    config = RunConfig.from_dict({**base.to_dict(), "defense": "prodigy", "attack": "none", "seed": 0,
                                  "rounds": args.rounds, "eval_every": EVERY})  # fmt: skip
    tic = time.monotonic()
    result = run(config, progress=False)
    seconds = time.monotonic() - tic
    curve = [(int(r), float(a)) for r, a in result.accuracy_curve]
    lines = ["round,test_accuracy_percent,lr"]
    lines += [f"{r},{a:.2f},{config.lr_at(r - 1):g}" for r, a in curve]
    text = "\n".join(lines) + "\n"
    converged = converged_at(curve)
    if converged is None:  # the curve beside --out, which keeps the last converged one
        partial = args.out.with_name(f"{args.out.stem}.unconverged{args.out.suffix}")
        partial.write_text(text, encoding="utf-8")
        print(
            f"quickstart_convergence: not converged within {args.rounds} rounds ({len(curve)} evaluation(s) "
            f"in {partial}; {args.out} left as it is): rerun with more --rounds",
            file=sys.stderr,
        )
        return 1
    args.out.write_text(text, encoding="utf-8")
    print(f"{args.out}: {len(curve)} evaluations in {seconds:.0f} s; final {curve[-1][1]:.2f}%; converged at "
          f"round {converged}; quickstart rounds: {rounds_for(converged)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
