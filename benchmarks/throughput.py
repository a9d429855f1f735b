"""Training throughput per dataset, precision, engine and group size on whatever device this machine has.

    python benchmarks/throughput.py [--datasets digits femnist cifar10] [--sizes 1 4] [--steps 3] [--smoke]

One local SGD step (all N clients of the dataset's paper setting, batch 64) of R stacked runs, timed as the
GPU window's autotune times it (`autotune.time_step`: a warm-up step, then CUDA events or perf_counter),
printed as training images/s, TFLOP/s and the share of the device's peak, for every engine: batched, its
variants (`prodigy_core.step_variants`; one the device cannot run is printed as refused, with its reason)
and, on CUDA, compiled. The peak is measured in the same run: a large matrix product (bf16 8192^3 on CUDA,
fp32 on a CPU). "first s" is the warm-up step's seconds (compilation, graph capture), from the wall clock
less the timed steps. FLOPs per image: torch.utils.flop_counter's count of one forward and backward pass of
the model on a batch, divided by the batch (convolutions and matmuls; the elementwise rest is not counted).
A dataset whose data is not on this machine is skipped with a line saying so. `--smoke`: digits, one group
size, one timed step, a small product (the CPU test of this script).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.autotune import CANDIDATES, flops_per_image, peak_tflops, time_step  # noqa: E402
from prodigy_core.config import RunConfig  # noqa: E402

SETTINGS = {  # the paper's client side (digits: the quickstart's)
    "digits": dict(dataset="digits", distribution="iid", n_clients=10, n_byzantine=3),
    "femnist": dict(dataset="femnist", distribution="natural", n_clients=20, n_byzantine=6,
                    femnist_min_writer_samples=350),
    "cifar10": dict(dataset="cifar10", distribution="iid", n_clients=10, n_byzantine=3),
}  # fmt: skip


def engines_for(device: torch.device) -> tuple[str, ...]:
    """batched, every variant (a CPU refuses the CUDA-only ones: printed as refused), compiled on CUDA."""
    from prodigy_core import step_variants

    return ("batched", *step_variants.VARIANTS, *(("compiled",) if device.type == "cuda" else ()))


def main(argv: list[str] | None = None) -> int:
    from prodigy_core import training
    from prodigy_core.seeding import resolve_device

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument(
        "--sizes", nargs="+", type=int, help="group sizes (default: the autotune's for the device)"
    )
    p.add_argument("--precisions", nargs="+", help="default: those of the device (no tf32 on a CPU)")
    p.add_argument("--engines", nargs="+", help="default: batched, its variants (and compiled on CUDA)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    p.add_argument(
        "--peak-size", type=int, help="the peak's matrix size (default 8192 on CUDA, 2048 on a CPU)"
    )
    p.add_argument("--smoke", action="store_true", help="digits, group size 1, fp32, 1 step, a small product")
    args = p.parse_args(argv)
    if args.smoke:
        args.datasets, args.sizes, args.steps = ["digits"], args.sizes or [1], 1
        args.precisions, args.peak_size = args.precisions or ["fp32"], args.peak_size or 128
    device = resolve_device("auto")
    space = CANDIDATES["cuda" if device.type == "cuda" else "cpu"]
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU, {torch.get_num_threads()} threads"
    )
    peak, what = peak_tflops(device, args.peak_size or (8192 if device.type == "cuda" else 2048))
    print(f"device: {name}; torch {torch.__version__}; peak {peak:.3g} TFLOP/s ({what})")
    print("dataset | precision | engine | group | images/s | TFLOP/s | % of peak | first s")
    for dataset in args.datasets:
        config = RunConfig(**SETTINGS[dataset], device=str(device), batch_size=64)
        try:
            fed = training._load_federation(config.resolved(), device)
        except Exception as e:  # noqa: BLE001 - data absent: this dataset is skipped, the others run
            print(f"{dataset}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
            continue
        flops = flops_per_image(dataset, fed.image_shape)
        for engine in args.engines or engines_for(device):
            for precision in args.precisions or space["precision"]:
                for size in args.sizes or space["size"]:
                    row = f"{dataset} | {precision} | {engine} | {size}"
                    tic = time.perf_counter()
                    try:
                        seconds = time_step(config, fed, precision, engine, size, args.steps)
                    except Exception as e:  # noqa: BLE001 - refused (no CUDA, no compiler): said, not fatal
                        print(f"{row} | refused: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                        break
                    first = time.perf_counter() - tic - args.steps * seconds
                    images = size * config.n_clients * config.batch_size / seconds
                    rate = images * flops / 1e12
                    print(f"{row} | {images:,.0f} | {rate:.3g} | {100 * rate / peak:.2g}% | {first:.3g}",
                          flush=True)  # fmt: skip
        print(f"{dataset}: {flops / 1e9:.4f} GFLOP per training image (forward + backward)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
