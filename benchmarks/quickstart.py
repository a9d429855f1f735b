"""The quickstart's cost: FLOPs per training image of the digits model (before/after) and the wall time of
`prodigy-fl quickstart` (training and report) on this machine. Run it on an idle machine.

    python benchmarks/quickstart.py [--seeds N] [--flops-only]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from prodigy_core import cli
from prodigy_core.models import DigitsCNN, _conv_bn_relu


def first_digits_model() -> nn.Module:
    """The digits model before the quickstart was made cheaper: both convolutions at the full 8x8."""
    return nn.Sequential(_conv_bn_relu(1, 16), _conv_bn_relu(16, 32), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Dropout(0.25), nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 10))  # fmt: skip


def training_flops_per_image(model: nn.Module, batch: int = 64) -> float:
    """Forward + backward FLOPs of one training step on a batch, per image (torch.utils.flop_counter)."""
    x, y = torch.randn(batch, 1, 8, 8), torch.randint(0, 10, (batch,))
    with FlopCounterMode(display=False) as counter:
        nn.functional.cross_entropy(model.train()(x), y).backward()
    return counter.get_total_flops() / batch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--flops-only", action="store_true")
    args = parser.parse_args(argv)
    before, after = training_flops_per_image(first_digits_model()), training_flops_per_image(DigitsCNN())
    print(
        f"FLOPs per training image: first model {before:,.0f}, DigitsCNN {after:,.0f} ({before / after:.1f}x)"
    )
    if args.flops_only:
        return 0
    with tempfile.TemporaryDirectory(prefix="quickstart-bench-") as tmp:
        argv = ["quickstart", "--seeds", str(args.seeds), "--results-dir", f"{tmp}/results",
                "--out-dir", f"{tmp}/figures"]  # fmt: skip
        tic = time.monotonic()
        code = cli.main(argv)
        seconds = time.monotonic() - tic
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"prodigy-fl quickstart --seeds {args.seeds}: {seconds:.0f} s (training and report), "
          f"{os.cpu_count()} cores, load average {load:.2f} at the end, "
          f"torch {torch.__version__}")  # fmt: skip
    return code


if __name__ == "__main__":
    sys.exit(main())
