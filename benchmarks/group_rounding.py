"""How far a run moves when it trains in a group, against what else moves it: the GPU gate's measures
(`autotune.compare`) after a few rounds of one digits run, ProDiGy + ALIE, between

- the run alone and the same run stacked among others (a group of 4), fp32 and bf16;
- the run alone under two engines (`batched`, `channels_last`), which the results key leaves out;
- fp32 and bf16 (the precision, which the key holds);
- two fp32 runs on other dropout and batch streams (the gate's noise floor).

    python benchmarks/group_rounding.py [--rounds 3] [--device cpu]

docs/usage.md ("Many runs as one batched computation") quotes its output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.autotune import TOLERANCES, compare, trajectory  # noqa: E402
from prodigy_core import training  # noqa: E402
from prodigy_core.config import RunConfig  # noqa: E402
from prodigy_core.seeding import resolve_device  # noqa: E402

# (reference, candidate): each a (precision, engine, group size, other stream)
PAIRS = {
    "a group of 4, fp32": (("fp32", "batched", 1, False), ("fp32", "batched", 4, False)),
    "a group of 4, bf16": (("bf16", "batched", 1, False), ("bf16", "batched", 4, False)),
    "the engine, fp32": (("fp32", "batched", 1, False), ("fp32", "channels_last", 1, False)),
    "the engine, bf16": (("bf16", "batched", 1, False), ("bf16", "channels_last", 1, False)),
    "the precision (bf16 vs fp32)": (("fp32", "batched", 1, False), ("bf16", "batched", 1, False)),
    "another stream, fp32 (the floor)": (("fp32", "batched", 1, False), ("fp32", "batched", 1, True)),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds of the run (the gate's: 3)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: give 1 or more")
    config = RunConfig(dataset="digits", defense="prodigy", attack="alie", device=args.device,
                       rounds=args.rounds, eval_every=args.rounds)  # fmt: skip
    device = resolve_device(args.device)
    fed = training.run_federation(config.resolved(), device)
    runs: dict[tuple, dict] = {}
    for pair in PAIRS.values():
        for precision, engine, size, other in pair:
            if (precision, engine, size, other) not in runs:
                runs[precision, engine, size, other] = trajectory(
                    config, fed, precision, engine, args.rounds, other_stream=other, size=size
                )
    capability = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"CPU ({torch.backends.cpu.get_cpu_capability()})")  # fmt: skip
    print(f"digits, ProDiGy + ALIE, {args.rounds} rounds, {capability}, torch {torch.__version__}")
    print(f"| what moves the run | {' | '.join(TOLERANCES)} |")
    print(f"|---|{'---|' * len(TOLERANCES)}")
    for what, (reference, candidate) in PAIRS.items():
        measures = compare(runs[reference], runs[candidate])
        print(f"| {what} | {' | '.join(f'{measures[name]:.2g}' for name in TOLERANCES)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
